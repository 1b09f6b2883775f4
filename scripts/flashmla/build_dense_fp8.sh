#!/usr/bin/env bash
# Builds FlashMLA's dense FP8 decode (fwd_kvcache_mla_fp8, FlashMLA PR 54, sm90a) as a torch
# extension for the flashmla-dense-fp8 adapter (python/kvdump/backends/flashmla_dense_fp8.py):
#     FLASHMLA_DENSE_SRC=DIR bash scripts/flashmla/build_dense_fp8.sh
# DIR: the unpacked tarball of scripts/flashmla/pack_dense_fp8.sh (its flashmla-dense-fp8/
# folder). It compiles with the cutlass FlashMLA pins (DIR/cutlass); if that fails (cutlass 3.9
# under a newer nvcc), once more with DIR/cutlass-newer, and says which one built. Output:
# $FLASHMLA_BUILD_DIR/flashmla_dense_fp8_sm90.so (default /tmp/flashmla_dense_fp8_build), for
#     kvaudit check DUMP --backend exec:flashmla-dense-fp8 --backend-command \
#       "python3 -m kvdump.backends flashmla-dense-fp8 --flashmla-module SO"
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
: "${FLASHMLA_DENSE_SRC:?set FLASHMLA_DENSE_SRC to the unpacked flashmla-dense-fp8/ folder}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
BASE_BUILD_DIR="${FLASHMLA_BUILD_DIR:-/tmp/flashmla_dense_fp8_build}"
export PYTHONUNBUFFERED=1
command -v nvcc >/dev/null || export PATH="/usr/local/cuda/bin:$PATH"
PYBIN="$(python3 -c 'import os,sys; print(os.path.dirname(sys.executable))')"
NINJA_BIN="$(python3 -c 'import ninja; print(ninja.BIN_DIR)' 2>/dev/null || true)"
export PATH="$PYBIN${NINJA_BIN:+:$NINJA_BIN}:$PATH"
echo "[build_dense_fp8.sh] $(date -u +%FT%TZ) nvcc $(nvcc --version | grep -o 'release [0-9.]*') MAX_JOBS=$MAX_JOBS"
cat "$FLASHMLA_DENSE_SRC/UPSTREAM" 2>/dev/null | sed 's/^/[build_dense_fp8.sh] /' || true
t0=$(date +%s)
for cutlass in cutlass cutlass-newer; do
  export FLASHMLA_CUTLASS="$FLASHMLA_DENSE_SRC/$cutlass"
  export FLASHMLA_BUILD_DIR="$BASE_BUILD_DIR"
  if python3 "$HERE/build_dense_fp8.py"; then
    mkdir -p "$BASE_BUILD_DIR"
    echo "$cutlass" > "$BASE_BUILD_DIR/CUTLASS_USED"
    echo "[build_dense_fp8.sh] built with $cutlass in $(( $(date +%s) - t0 )) s: $BASE_BUILD_DIR/flashmla_dense_fp8_sm90.so"
    exit 0
  fi
  echo "[build_dense_fp8.sh] build with $cutlass failed after $(( $(date +%s) - t0 )) s" >&2
  rm -rf "$BASE_BUILD_DIR"
done
exit 1
