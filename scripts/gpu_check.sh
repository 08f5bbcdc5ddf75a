#!/usr/bin/env bash
# The GPU-path checks, for a machine with a CUDA device and torch (run from the
# repository root). Nothing in `make test` needs it: there the CUDA tests skip.
#
#   1. tests/kv/test_gpu_tier.py and tests/engines/test_cuda.py (GpuTier, the
#      staging pool, CUDA tensors through client.kv, safetensors to the GPU,
#      a Distributed Checkpoint of CUDA tensors);
#   2. bench/gpu_kv.py (copies, GpuTier, TierFS <-> HBM, prefill recomputed).
#
# A machine without network access takes TierFS's Python dependencies as
# wheels in .whl/ (scripts/gpu_check.sh wheels VERSION, run where pip can
# download, fetches them for CPython VERSION, e.g. 3.12). Output goes to
# $OUT (default /tmp/gpu-check): tests.log, bench.log, gpu_kv.{json,md}.
set -u
cd "$(dirname "$0")/.."

if [ "${1:-}" = wheels ]; then
    py=${2:?python version, e.g. 3.12}
    mkdir -p .whl
    plat=()
    for p in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 \
             manylinux_2_34; do plat+=(--platform "${p}_x86_64"); done
    # pyproject.toml's pins; cffi and pycparser for cryptography; pysyncobj has no wheel: built here
    for req in grpcio==1.85.1 protobuf==7.36.2 uvloop==0.23.0 crc32c==2.9.post0 liburing==2026.3.30 \
               pyeclib==1.8.0 xxhash==4.1.0 cryptography==50.0.2 cffi==2.1.1 pycparser rich==15.0.0 \
               prometheus-client==0.26.0 fsspec==2026.9.0; do
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
            "${plat[@]}" -d .whl "$req" || exit 1
    done
    python3 -m pip wheel -q --no-deps -w .whl pysyncobj==0.3.17 || exit 1
    exit 0
fi

OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
WHEELS=${WHEELS:-.whl}  # WHEELS=none: use what python3 has
if [ -d "$WHEELS" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
"available", torch.cuda.is_available())'
rc=0
timeout 180 python3 -m pytest -q -p no:cacheprovider -p no:randomly --timeout 150 \
    tests/kv/test_gpu_tier.py tests/engines/test_cuda.py 2>&1 | tee "$OUT/tests.log"
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
timeout 220 python3 -m bench.gpu_kv --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
exit $rc
