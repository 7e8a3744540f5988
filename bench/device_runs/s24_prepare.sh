#!/usr/bin/env bash
# Here, once (issue 36 item 5): what bench/device_runs/s24_kernels.sh carries in .whl/kernels/ (git-ignored):
#   causal_conv1d-1.7.0.tar.gz       its PyPI sdist, built there for sm_90 (nvcc 13)
#   mamba_ssm-2.3.2.post1-*.whl      built here from its PyPI sdist with MAMBA_SKIP_CUDA_BUILD (pure Python:
#                                    Mamba-2's Triton kernels; no CUDA selective scan), its __init__ made to
#                                    import without that scan (it imports selective_scan_cuda at the top)
#   megatron_core-0.19.2-cp312-*.whl the GPU's megatron-core (the megatron mixer's rows)
# The sdists come from PyPI's JSON urls (`pip download` of them runs setup.py, which needs nvcc). Run from the repository root: `bash bench/device_runs/s24_prepare.sh`.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
k=.whl/kernels
mkdir -p $k
for pv in causal-conv1d/1.7.0 mamba-ssm/2.3.2.post1; do
  f=$(echo "${pv%/*}" | tr - _)-${pv#*/}.tar.gz
  [ -f $k/$f ] || curl -sSfL -o $k/$f "$(curl -sSfL "https://pypi.org/pypi/${pv%/*}/json" | python3 -c "import json,sys
r = json.load(sys.stdin)['releases'][sys.argv[1]]
print(next(u['url'] for u in r if u['packagetype'] == 'sdist'))" "${pv#*/}")"
done
ls $k/causal_conv1d-1.7.0.tar.gz $k/mamba_ssm-2.3.2.post1.tar.gz > /dev/null
ls $k/megatron_core-0.19.2-*.whl > /dev/null 2>&1 || python3 -m pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 -d $k megatron-core==0.19.2
if ! ls $k/mamba_ssm-*.whl > /dev/null 2>&1; then
  work=$(mktemp -d); tar xzf $k/mamba_ssm-2.3.2.post1.tar.gz -C "$work"; src=$work/mamba_ssm-2.3.2.post1
  python3 - "$src/mamba_ssm/__init__.py" <<'PY'
import sys
p = sys.argv[1]
head, rest = open(p).read().split("\n\n", 1)
body = "".join("    " + line + "\n" for line in rest.strip().splitlines())
open(p, "w").write(head + "\n\n# hpcrl: built without the CUDA selective scan (MAMBA_SKIP_CUDA_BUILD); Mamba-2's Triton"
                   "\n# kernels (ops.triton) need none of these imports.\ntry:\n" + body + "except ImportError:\n    pass\n")
PY
  # FORCE_BUILD too: without it setup.py first downloads a prebuilt wheel
  root=$PWD
  (cd "$src" && MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE "$root/.venv/bin/python" -m pip wheel -q \
    --no-build-isolation --no-deps -w "$root/$k" .)
  rm -rf "$work"
fi
ls $k/einops-* > /dev/null 2>&1 || python3 -m pip download -q --no-deps --only-binary=:all: -d $k einops==0.8.2  # mamba_ssm imports it
ls -la $k; du -sh $k
