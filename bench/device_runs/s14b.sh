#!/usr/bin/env bash
# Session 14, device call 3 of the second staging: engine knobs for RL batches (issue 19 item 4). Each
# PYSPY: the py-spy the stage tool installed into its site (its bin/ folder).
# arm is its own process; one compile cache for all (later starts reuse the compiled graphs).
set -u
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$HOME/.cache/hpcrl-s14-vllm}  # shared by the calls while the machine stays up
T0=$SECONDS
SCRATCH=$(mktemp -d)  # the raw profile is hundreds of MB: summarised, not sent back
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -lms 250 > "$OUT/smi.csv" &
smi=$!
ROWS="now: one seed per call, no logprobs|now, no logprobs"
arm() {  # name timeout args...
  local name=$1 t=$2; shift 2
  echo "== $name start $((SECONDS - T0)) s"; date +%s > "$OUT/$name.t0"
  timeout "$t" python3 bench/vllm_gpu.py --rollout-only --no-two-engines --iters 3 --start-timeout 150 \
    --out "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$? end $((SECONDS - T0)) s"; date +%s > "$OUT/$name.t1"
  grep -A8 "^rollout " "$OUT/$name.log" | head -9
}
arm default 250 --only "$ROWS"
echo "== profile start $((SECONDS - T0)) s"
timeout 150 "${PYSPY:-py-spy}" record --subprocesses --threads --nonblocking --rate 200 --format raw -o "$SCRATCH/prof.raw" -- \
  python3 bench/vllm_gpu.py --rollout-only --no-two-engines --skip-hf --iters 4 --start-timeout 120 \
  --only "now: one seed per call, no logprobs" --out "$OUT/profile.json" > "$OUT/profile.log" 2>&1
echo "== profile rc=$? end $((SECONDS - T0)) s"
python3 bench/pyspy_summary.py "$SCRATCH/prof.raw" --top 40 > "$OUT/profile_summary.txt" 2>&1
head -c 1500 "$OUT/profile_summary.txt"
arm noprefix_bs64 150 --skip-hf --only "$ROWS" --set rollout.enable_prefix_caching=false rollout.block_size=64
if [ $((SECONDS - T0)) -lt 440 ]; then
  arm bs64 140 --skip-hf --only "$ROWS" --set rollout.block_size=64
fi
kill $smi
