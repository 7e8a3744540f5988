#!/usr/bin/env bash
# Session 24, one call (the device came late): the kernels (s24_kernels.sh: build causal-conv1d for sm_90,
# parity, Super's shape per layer kind) in KBUDGET seconds, then varlen packing against padded
# (bench/packing_gpu.py) on a light site: torch/transformers of the image plus .whl/varlen (dill, tabulate,
# psutil), no vLLM parts. Carry [.whl]. Run: `bash bench/device_runs/s24.sh`.
set -u
T0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader
BUDGET=${KBUDGET:-330} bash bench/device_runs/s24_kernels.sh
echo "== varlen at $((SECONDS - T0)) s"
KBUDGET= VBUDGET=${VBUDGET:-210} bash bench/device_runs/s25.sh  # varlen only (no KBUDGET): one copy of that run
