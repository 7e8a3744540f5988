#!/usr/bin/env bash
# Session 29 (issue 36), three parts on one warm machine, each its own call, back to back:
#   te    after te.00..te.03 were copied to /tmp/stage (one call each: `mkdir -p /tmp/stage && cp
#         .te-stage/te.0N /tmp/stage/`): `cp .te-stage/te.04 /tmp/stage/ && bash bench/device_runs/s29.sh te`
#         (carry .te-stage/te.04, .whl/mc, .whl/pyd): TE 2.20.2 unpacked to /tmp/te_site, megatron-core to
#         /tmp/site; bench/te_gpu.py parity (fp32 + bf16, five cases, the compiled row) and Super-width bench.
#   pack  `bash bench/device_runs/s29.sh pack` (after te or mtp: megatron-core in /tmp/site; no carry): bench/packing_gpu.py --trainer megatron, padded vs
#         packed at a DAPO-like length distribution: Qwen2-1.5B's shape with the local spec (TE not on the
#         path) and, where the te part staged it, with TE's linears (te_site on the path: spec.uses_local_spec
#         picks TE), then Gemma 4 31B's
#         layers (2 of them; local spec only: sliding windows packed).
#   mtp   after part.00..part.04 (as s28_mtp.sh says): `cp .device-vllm/part.05 /tmp/stage/ && bash
#         bench/device_runs/s29.sh mtp` (carry part.05, .whl/mc, .whl/antlr4...whl): bench/mtp_gpu.py with
#         routes recorded (vllm_compat.bind_router_capture on vLLM 0.26).
set -u
T0=$SECONDS
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case "${1:?te, te-qwen, pack or mtp}" in
te)
  [ -d /tmp/te_site/transformer_engine ] || { cat /tmp/stage/te.* | xz -d | tar x -C /tmp || exit 3; }
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/mc/*.whl 2>&1 | grep -v WARN
  python3 -m pip install -q --no-index --no-deps --target /tmp/te_site .whl/pyd/*.whl 2>&1 | grep -v WARN
  echo "== staged at $((SECONDS - T0)) s"
  PYTHONPATH=/tmp/te_site PTIME=${PTIME:-300} BTIME=${BTIME:-200} bash bench/device_runs/s28_te.sh parity bench
  ;;
te-qwen)  # after te.00-te.03 as for te: Qwen3-MoE bf16, padded and packed, after Fp32Router's own GEMM
  [ -d /tmp/te_site/transformer_engine ] || { cat /tmp/stage/te.* | xz -d | tar x -C /tmp || exit 3; }
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/mc/*.whl 2>&1 | grep -v WARN
  python3 -m pip install -q --no-index --no-deps --target /tmp/te_site .whl/pyd/*.whl 2>&1 | grep -v WARN
  echo "== staged at $((SECONDS - T0)) s"
  PYTHONPATH=$PWD:/tmp/site:/tmp/te_site PYTHONUNBUFFERED=1 timeout -k 10 "${PTIME:-150}" python3 bench/te_gpu.py \
    --parity --cases "qwen3_moe,qwen3_moe packed" --precisions bfloat16 > "$OUT/te_qwen.log" 2>&1
  echo "== parity rc=$? at $((SECONDS - T0)) s"
  grep -E "^parity|Error" "$OUT/te_qwen.log" | cut -c1-700
  ;;
pack)
  run() {  # run NAME SECONDS EXTRA_PYTHONPATH ARGS...
    local name=$1 limit=$2 extra=$3; shift 3
    PYTHONPATH=$PWD:/tmp/site${extra:+:$extra} PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
      timeout -k 10 "$limit" python3 bench/packing_gpu.py --trainer megatron --max-new 3840 --steps 2 \
      --out "$OUT/pack_$name.json" "$@" > "$OUT/pack_$name.log" 2>&1
    echo "== $name rc=$? at $((SECONDS - T0)) s"
    grep -E "^(batch|padded|packed|best|\||[a-z0-9_]+: planner)|layers on|Error|Traceback" "$OUT/pack_$name.log" | cut -c1-300
  }
  run q15_local "${QTIME:-170}" "" --model qwen2_1p5b --seqs 64 --mbs 4
  [ -d /tmp/te_site/transformer_engine ] && run q15_te "${QTIME:-170}" /tmp/te_site --model qwen2_1p5b --seqs 64 --mbs 4
  run gemma4 "${GTIME:-200}" "" --model gemma4_31b --layers 2 --seqs 32 --mbs 2
  ;;
mtp)
  bash bench/device_runs/s28_mtp.sh
  ;;
esac
echo "== done $((SECONDS - T0)) s"
