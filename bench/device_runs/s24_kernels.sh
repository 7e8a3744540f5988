#!/usr/bin/env bash
# Session 24 (issue 36 item 5): on a bare device machine (torch 2.11+cu130, nvcc 13, ninja, no network), build
# causal-conv1d 1.7.0 from its PyPI sdist for sm_90 only, install it with mamba-ssm 2.3.2.post1 (built here
# from its sdist with MAMBA_SKIP_CUDA_BUILD: Mamba-2 needs only its Triton SSD kernels) and megatron-core
# 0.19.2, copy the built wheel to $OUT (<= 16 MiB), then bench/kernels_gpu.py: --parity (kernels vs torch
# paths, both backends' Mamba mixers, packed and unpacked) and --bench (Super's 8-layer shape per layer kind).
# Here first: bash bench/device_runs/s24_prepare.sh (fills .whl/kernels, 2.8 MB). There, carry [.whl]:
#   bash bench/device_runs/s24_kernels.sh [parity] [bench]   (both by default; BUDGET=530 s; DRY_RUN=1: print only)
# A second call on the same warm machine skips the build and install ($TMP/site/causal_conv1d is there); a
# wheel in .whl/kernels_built (session 27: built there in 335 s, sent back split in 15 MiB parts, joined here
# with cat) skips the build on a fresh machine too (carry .whl/kernels and .whl/kernels_built).
set -u
T0=$SECONDS
BUDGET=${BUDGET:-530}
DRY=${DRY_RUN:-0}
TMP=${TMPDIR:-/tmp}
OUT=${OUT:-$TMP/out}
K=.whl/kernels
left() { echo $((BUDGET - (SECONDS - T0))); }
run() {  # run CMD...: echoed; under DRY_RUN=1 only echoed
  echo "+ $*"
  [ "$DRY" = 1 ] || "$@"
}
for f in $K/causal_conv1d-1.7.0.tar.gz $K/mamba_ssm-2.3.2.post1-py3-none-any.whl $K/megatron_core-0.19.2-*.whl; do
  [ -f "$f" ] || { echo "== missing $f: run bench/device_runs/s24_prepare.sh here and carry .whl"; exit 2; }
done
PARTS=${*:-parity bench}
mkdir -p "$OUT" "$TMP/wheels" "$TMP/site"
BUILT=$(ls .whl/kernels_built/causal_conv1d-1.7.0-cp312-*.whl 2>/dev/null | head -1)
if [ -d "$TMP/site/causal_conv1d" ] && [ "$DRY" != 1 ]; then
  echo "== kernels already installed in $TMP/site"
elif [ -n "$BUILT" ]; then  # a wheel an earlier call built (sent back in parts, joined here): no build
  echo "== causal-conv1d from $BUILT (sha256 $(sha256sum "$BUILT" | cut -c1-16))"
  run python3 -m pip install -q --no-index --no-deps --target "$TMP/site" "$BUILT" \
    $K/mamba_ssm-2.3.2.post1-py3-none-any.whl $K/megatron_core-0.19.2-*.whl $K/einops-*.whl
else
SRC=$TMP/causal_conv1d-1.7.0
run tar xzf $K/causal_conv1d-1.7.0.tar.gz -C "$TMP"
# sm_90 only: setup.py ignores TORCH_CUDA_ARCH_LIST and lists every arch from sm_75 to sm_121 (9 on CUDA 13)
run sed -i 's/^    if FORCE_CXX11_ABI:/    cc_flag = ["-gencode", "arch=compute_90,code=sm_90"]\n    if FORCE_CXX11_ABI:/' \
  "$SRC/setup.py"
[ "$DRY" = 1 ] || grep -q 'arch=compute_90,code=sm_90"\]' "$SRC/setup.py" || { echo "== sm_90 patch missed"; exit 3; }
echo "== build causal-conv1d at $((SECONDS - T0)) s"
( { cd "$SRC" 2>/dev/null || [ "$DRY" = 1 ]; } && run env TORCH_CUDA_ARCH_LIST=9.0 CAUSAL_CONV1D_FORCE_BUILD=TRUE MAX_JOBS=16 NVCC_THREADS=2 \
    timeout -k 10 $(($(left) - 200)) python3 -m pip wheel -q --no-build-isolation --no-deps -w "$TMP/wheels" . \
    > "$OUT/causal_conv1d_build.log" 2>&1 )
rc=$?
echo "== causal-conv1d rc=$rc at $((SECONDS - T0)) s"; tail -5 "$OUT/causal_conv1d_build.log" 2>/dev/null
[ "$DRY" = 1 ] || ls -la "$TMP/wheels"
[ "$DRY" = 1 ] || ls "$TMP"/wheels/causal_conv1d-*.whl > /dev/null 2>&1 || { echo "== no causal-conv1d wheel: stop"; exit 4; }
for w in "$TMP"/wheels/*.whl; do
  [ -f "$w" ] && [ "$(stat -c %s "$w")" -le $((16 * 1024 * 1024)) ] && cp "$w" "$OUT/"
done
run python3 -m pip install -q --no-index --no-deps --target "$TMP/site" "$TMP"/wheels/causal_conv1d-*.whl \
  $K/mamba_ssm-2.3.2.post1-py3-none-any.whl $K/megatron_core-0.19.2-*.whl $K/einops-*.whl  # einops: mamba_ssm imports it
fi
export PYTHONPATH=$PWD:$TMP/site PYTHONUNBUFFERED=1
run python3 -c "from hpcrl.trainer import kernels; print('==', kernels.installed().describe())"
if [[ " $PARTS " == *" parity "* ]]; then
echo "== parity at $((SECONDS - T0)) s"
[[ " $PARTS " == *" bench "* ]] && share=$(($(left) / 2)) || share=$(($(left) - 10))
run timeout -k 10 "$share" python3 bench/kernels_gpu.py --parity > "$OUT/parity.log" 2>&1
echo "== parity rc=$? at $((SECONDS - T0)) s"; grep -E "^parity|Error|Traceback" "$OUT/parity.log" | cut -c1-300
[ -f "$OUT/kernels_gpu.json" ] && mv "$OUT/kernels_gpu.json" "$OUT/kernels_parity.json"
fi
if [[ " $PARTS " == *" bench "* ]]; then
echo "== bench at $((SECONDS - T0)) s"
run timeout -k 10 $(($(left) - 10)) python3 bench/kernels_gpu.py --bench > "$OUT/bench.log" 2>&1
echo "== bench rc=$? at $((SECONDS - T0)) s"; grep -vE "^\{|Warning|warn" "$OUT/bench.log" | tail -14 | cut -c1-300
fi
[ "$DRY" = 1 ] || nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
echo "== done $((SECONDS - T0)) s"
