#!/usr/bin/env bash
# Session 14: the colocated refit of an 8B shape cut to fit one H200 (Qwen3-8B width, 16 of 36 layers)
# beside today's safetensors path, and one colocated GRPO step (issue 19 item 5).
set -u
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -lms 500 > "$OUT/smi8b.csv" &
smi=$!
timeout 560 python3 bench/colocated_gpu.py --model qwen3_8b --layers 16 --share 0.3 --refits 5 \
  --out "$OUT/colocated_8b.json" > "$OUT/colocated_8b.log" 2>&1
echo "rc=$?"
kill $smi
grep -v "it/s\]\|^\s*$" "$OUT/colocated_8b.log" | tail -40
