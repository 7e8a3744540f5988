#!/usr/bin/env bash
# Session 15, device call 3 (after the stage tool's install): where one vLLM engine's step goes, again
# (issue 19 item 4). Qwen2-1.5B shape, 256 x (128 + 256), no logprobs, block 64 (the planner's GPU
# default). Arms alternate in their own processes, one compile cache for all:
#   base (with the hf baseline), gc20k (Python's GC threshold 20000 in the engine core and the
#   front-end), the base under py-spy (summary only), base again, gc20k again.
# Every arm times Python's GC per call (--gc). PYSPY: the py-spy installed into the staged site.
# At most 8 files come back: JSONs and the summary in $OUT, the logs in one tarball.
set -u
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$HOME/.cache/hpcrl-s15-vllm}
T0=$SECONDS
SCRATCH=$(mktemp -d)
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -lms 250 > "$SCRATCH/smi.csv" &
smi=$!
ROW="now: one seed per call, no logprobs"
arm() {  # name timeout args...
  local name=$1 t=$2; shift 2
  echo "== $name start $((SECONDS - T0)) s"
  timeout "$t" python3 bench/vllm_gpu.py --rollout-only --no-two-engines --iters 4 --start-timeout 150 \
    --only "$ROW" --out "$OUT/$name.json" "$@" > "$SCRATCH/$name.log" 2>&1
  echo "== $name rc=$? end $((SECONDS - T0)) s"
  grep -E "^rollout |^(hf|now)|gc over|gc_threshold|ERROR" "$SCRATCH/$name.log" | head -8
}
arm base 260 --gc 0 --set rollout.block_size=64
arm gc20k 110 --skip-hf --gc 20000 --set rollout.block_size=64
echo "== profile start $((SECONDS - T0)) s"
timeout 130 "${PYSPY:-py-spy}" record --subprocesses --threads --nonblocking --rate 200 --format raw \
  -o "$SCRATCH/prof.raw" -- python3 bench/vllm_gpu.py --rollout-only --no-two-engines --skip-hf --iters 4 \
  --start-timeout 100 --only "$ROW" --set rollout.block_size=64 --out "$SCRATCH/profile.json" \
  > "$SCRATCH/profile.log" 2>&1
echo "== profile rc=$? end $((SECONDS - T0)) s"
timeout 60 python3 bench/pyspy_summary.py "$SCRATCH/prof.raw" --top 40 > "$OUT/profile_summary.txt" 2>&1
head -c 2500 "$OUT/profile_summary.txt"
if [ $((SECONDS - T0)) -lt 400 ]; then arm base2 100 --skip-hf --gc 0 --set rollout.block_size=64; fi
if [ $((SECONDS - T0)) -lt 460 ]; then arm gc20k_2 100 --skip-hf --gc 20000 --set rollout.block_size=64; fi
kill $smi
cp "$SCRATCH/profile.json" "$OUT/" 2>/dev/null
tar -C "$SCRATCH" -czf "$OUT/logs.tgz" --exclude=prof.raw .
echo "== done $((SECONDS - T0)) s"
