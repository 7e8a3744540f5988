#!/usr/bin/env bash
# Session 31 (issue 36 items 1 + 5): the megatron packing rows again, now that each decoder layer keeps the
# forward's bf16 autocast in megatron-core's recompute (model.keep_autocast_in_recompute; session 30 found the
# recompute ran fp32: TE padded 3,627 tok/s). One TE window on one warm machine, each part its own call:
#   te.00..te.03 copied to /tmp/stage, one call each (`mkdir -p /tmp/stage && cp .te-stage/te.0N /tmp/stage/`);
#   q15   `cp .te-stage/te.04 /tmp/stage/ && bash bench/device_runs/s31.sh q15` (carry .te-stage/te.04, .whl/mc,
#         .whl/pyd): stages TE 2.20.2 to /tmp/te_site and megatron-core to /tmp/site, then bench/packing_gpu.py
#         --trainer megatron padded vs packed at Qwen2-1.5B's shape, DAPO-like lengths (64 sequences up to 3,840
#         new tokens), local spec then TE's linears;
#   more  `bash bench/device_runs/s31.sh more` (no carry): Gemma 4 31B's layers (2, local spec, sliding windows
#         packed), TE's whole-model Super-width step at batch 2 (4 x 2048 ran out of 80 GB), and the 1.5B local
#         rows without recompute (what recompute costs now: ~1.3x is a recompute's price, 10x was fp32).
#   gemma4  on a bare machine (carry .whl/mc, .whl/pyd): the Gemma 4 rows again after packed attention sends
#         heads over 256 (its global layers: 512; FlashAttention refused them in `more`) to SDPA per sequence.
set -u
T0=$SECONDS
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
pack() {  # pack NAME SECONDS EXTRA_PYTHONPATH ARGS...
  local name=$1 limit=$2 extra=$3; shift 3
  PYTHONPATH=$PWD:/tmp/site${extra:+:$extra} PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
    timeout -k 10 "$limit" python3 bench/packing_gpu.py --trainer megatron --max-new 3840 --steps 2 \
    --out "$OUT/pack_$name.json" "$@" > "$OUT/pack_$name.log" 2>&1
  echo "== $name rc=$? at $((SECONDS - T0)) s"
  grep -E "^(batch|padded|packed|best|\||[a-z0-9_]+: planner)|layers on|Error|Traceback" "$OUT/pack_$name.log" | cut -c1-300
}
case "${1:?q15, more or gemma4}" in
q15)
  [ -d /tmp/te_site/transformer_engine ] || { cat /tmp/stage/te.* | xz -d | tar x -C /tmp || exit 3; }
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/mc/*.whl 2>&1 | grep -v WARN
  python3 -m pip install -q --no-index --no-deps --target /tmp/te_site .whl/pyd/*.whl 2>&1 | grep -v WARN
  echo "== staged at $((SECONDS - T0)) s"
  pack q15_local "${QTIME:-240}" "" --model qwen2_1p5b --seqs 64 --mbs 4
  pack q15_te "${QTIME:-240}" /tmp/te_site --model qwen2_1p5b --seqs 64 --mbs 4
  ;;
more)
  pack gemma4 "${GTIME:-200}" "" --model gemma4_31b --layers 2 --seqs 32 --mbs 2
  PYTHONPATH=$PWD:/tmp/site:/tmp/te_site PYTHONUNBUFFERED=1 timeout -k 10 "${BTIME:-200}" python3 bench/te_gpu.py \
    --bench --batch 2 > "$OUT/te_bench_b2.log" 2>&1
  echo "== te bench batch 2 rc=$? at $((SECONDS - T0)) s"
  grep -E "^(bench|Super|([ME*]|experts) ms|step_s|tokens_per_s|peak_gb)|Error|Traceback" "$OUT/te_bench_b2.log" | cut -c1-600
  [ -f "$OUT/te_gpu.json" ] && mv "$OUT/te_gpu.json" "$OUT/te_bench_b2.json"
  pack q15_norecompute "${NTIME:-150}" "" --model qwen2_1p5b --seqs 64 --mbs 4 --set trainer.activation_checkpointing=false
  ;;
gemma4)
  [ -d /tmp/site/megatron ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/mc/*.whl \
    .whl/pyd/*.whl 2>&1 | grep -v WARN
  echo "== staged at $((SECONDS - T0)) s"
  pack gemma4 "${GTIME:-260}" "" --model gemma4_31b --layers 2 --seqs 32 --mbs 2
  ;;
esac
echo "== done $((SECONDS - T0)) s"
