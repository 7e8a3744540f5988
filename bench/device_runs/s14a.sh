#!/usr/bin/env bash
# Session 14, device call 3 (after the stage tool's install): where one vLLM engine's step time goes
# PYSPY: the py-spy the stage tool installed into its site (its bin/ folder).
# (py-spy over the engine's processes during 256-sequence generation), then the streamed-rewards figure.
set -u
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -lms 250 > "$OUT/smi.csv" &
smi=$!
date +%s > "$OUT/t0"
timeout 250 "${PYSPY:-py-spy}" record --subprocesses --nonblocking --rate 150 --format raw -o "$OUT/prof.raw" -- \
  python3 bench/vllm_gpu.py --rollout-only --skip-hf --no-two-engines --only "now: one seed per call, no logprobs" \
  --iters 4 --start-timeout 150 --out "$OUT/prof_run.json" > "$OUT/prof_run.log" 2>&1
echo "profile rc=$?" ; date +%s > "$OUT/t1"
timeout 290 python3 bench/stream_rewards_gpu.py --out "$OUT/stream.json" > "$OUT/stream.log" 2>&1
echo "stream rc=$?"; date +%s > "$OUT/t2"
kill $smi
tail -5 "$OUT/prof_run.log"; tail -12 "$OUT/stream.log"
