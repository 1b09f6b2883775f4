#!/usr/bin/env bash
# Builds FlashMLA's sparse FP8 decode (sm90a only: DeepSeek-V3.2 / GLM-5 656-byte slot, 64 or 128
# heads) as a torch extension, for the flashmla-sparse adapter (python/kvdump/backends):
#     FLASHMLA_SRC=/path/to/FlashMLA bash scripts/flashmla/build.sh
# FLASHMLA_SRC is a checkout of deepseek-ai/FlashMLA with its cutlass submodule (checked at
# 9241ae3e with cutlass 147f5673); only its csrc/ is compiled, with our binding
# (sparse_decode_sm90_only.cpp) in place of its setup.py's. Output:
# $FLASHMLA_BUILD_DIR (default /tmp/flashmla_sm90_build)/flashmla_sparse_sm90*.so, for
#     kvaudit check DUMP --backend exec:flashmla-sparse \
#         --backend-command "python3 -m kvdump.backends flashmla-sparse --flashmla-module SO"
# Measured on the H200 machine (16 cores, nvcc 13.0, torch 2.11): 42-46 s from a clean build dir.
# Env: FLASHMLA_WITH_MODEL1=1 also builds the MODEL1 (d_qk=512) kernels; MAX_JOBS (default nproc).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export FLASHMLA_BUILD_DIR="${FLASHMLA_BUILD_DIR:-/tmp/flashmla_sm90_build}"
export PYTHONUNBUFFERED=1
command -v nvcc >/dev/null || export PATH="/usr/local/cuda/bin:$PATH"
# torch's JIT builder shells out to `ninja`: make sure python3's own bin dir (and the pip
# ninja package's binary, if any) are on PATH.
PYBIN="$(python3 -c 'import os,sys; print(os.path.dirname(sys.executable))')"
NINJA_BIN="$(python3 -c 'import ninja; print(ninja.BIN_DIR)' 2>/dev/null || true)"
export PATH="$PYBIN${NINJA_BIN:+:$NINJA_BIN}:$PATH"

t0=$(date +%s.%N)
echo "[build.sh] $(date -u +%FT%TZ) host=$(hostname) nproc=$(nproc) MAX_JOBS=$MAX_JOBS"
echo "[build.sh] nvcc: $(nvcc --version | grep -o 'release [0-9.]*, V[0-9.]*')"
echo "[build.sh] g++: $(g++ --version | head -1)"
echo "[build.sh] ninja: $(ninja --version 2>/dev/null || python3 -c 'import ninja,sys;print(ninja.__version__)' 2>/dev/null || echo MISSING)"
python3 - <<'PY'
import os, sysconfig
inc = sysconfig.get_path("include", scheme="posix_prefix")
ok = os.path.exists(os.path.join(inc, "Python.h"))
print(f"[build.sh] Python.h in {inc}: {'yes' if ok else 'MISSING (pybind11 binding cannot compile)'}")
PY
python3 -c 'import torch; print("[build.sh] torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none", "cc", torch.cuda.get_device_capability(0) if torch.cuda.is_available() else "-")'

set +e
python3 "$HERE/build.py" 2>&1 | tee "$FLASHMLA_BUILD_DIR.log"
rc=${PIPESTATUS[0]}
set -e

t1=$(date +%s.%N)
awk -v a="$t0" -v b="$t1" -v rc="$rc" 'BEGIN{printf "[build.sh] rc=%s total wall %.1f s\n", rc, b-a}'
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then cp "$FLASHMLA_BUILD_DIR.log" "$OUT/flashmla_build.log" || true; fi
exit "$rc"
