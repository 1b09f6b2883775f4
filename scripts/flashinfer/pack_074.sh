#!/usr/bin/env bash
# Packs FlashInfer 0.7.4, trimmed to what its paged MLA path (BatchMLAPagedAttentionWrapper,
# backends fa3 and fa2 on SM90) needs at import and JIT time, with the few wheels it imports,
# as one tarball for a Python 3.12 GPU machine without network:
#     bash scripts/flashinfer/pack_074.sh [WHEEL_DIR] [OUT.tar.gz]
# WHEEL_DIR (default .whl/flashinfer-0.7.4) holds flashinfer_python-0.7.4-py3-none-any.whl and
# the cp312 / pure wheels listed in DEPS, fetched once with network by
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#         --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d WHEEL_DIR flashinfer-python==0.7.4 \
#         apache-tvm-ffi cuda-tile packaging requests urllib3 idna certifi tqdm nvidia-ml-py \
#         einops tabulate click
# (0.7.4's METADATA also names cuda-python, nccl4py, nccl-extensions, nvidia-cudnn-frontend and
# nvidia-cutlass-dsl: `import flashinfer, flashinfer.mla` runs without them, so they stay out.)
# Output (default .gpu/flashinfer-0.7.4.tar.gz): a folder site/ to put on PYTHONPATH (pip's
# --target tree: nothing to install there). Trimmed: every JIT source under flashinfer/data/csrc
# except the MLA family (batch_mla_*.cu, batch_mla_config.jinja, the shared headers of csrc/),
# every .cu/.cuh/.h/.c/.jinja under flashinfer/ outside data/ (the kernel families generated
# from Python, none of them MLA), and __pycache__. Kept whole: every .py file (flashinfer's
# __init__ imports most of them) but flashinfer/moe_ep/; data/include, data/cutlass, data/cccl
# (the vendored CCCL takes precedence over the CUDA toolkit's, so it stays), data/spdlog.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WHEELS="${1:-$ROOT/.whl/flashinfer-0.7.4}"
OUT="${2:-$ROOT/.gpu/flashinfer-0.7.4.tar.gz}"
DEPS="apache_tvm_ffi cuda_tile packaging requests urllib3 idna certifi tqdm nvidia_ml_py einops tabulate click"
STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT

wheels=("$WHEELS"/flashinfer_python-0.7.4-*.whl)
for dep in $DEPS; do
  found=("$WHEELS"/${dep}-*.whl)
  [ -e "${found[0]}" ] || { echo "pack_074: no $dep wheel in $WHEELS" >&2; exit 2; }
  wheels+=("${found[0]}")
done
python3 -m pip install --quiet --no-deps --no-compile --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any \
  --implementation cp \
  --target "$STAGE/site" "${wheels[@]}" 2>&1 | grep -v 'Running pip as the' || true
FI="$STAGE/site/flashinfer"
[ -f "$FI/__init__.py" ] || { echo "pack_074: flashinfer did not install" >&2; exit 2; }
before=$(du -sm "$STAGE/site" | cut -f1)

# The MLA JIT sources (flashinfer/jit/attention/modules.py gen_batch_mla_module) and csrc's
# shared headers (tvm_ffi_utils.h and the like); every other csrc entry goes.
find "$FI/data/csrc" -mindepth 1 -maxdepth 1 \
  ! -name 'batch_mla_*.cu' ! -name 'batch_mla_config.jinja' ! -name '*.h' ! -name '*.cuh' \
  -exec rm -rf {} +
find "$FI" -path "$FI/data" -prune -o -type f \
  \( -name '*.cu' -o -name '*.cuh' -o -name '*.h' -o -name '*.c' -o -name '*.jinja' \) -print0 |
  xargs -0 -r rm -f
# The one Python package `import flashinfer, flashinfer.mla` does not import and the paged MLA
# path does not reach (checked by importing the trimmed tree with Python 3.11 and the cp311
# tvm_ffi): the MoE expert-parallel package (17 MiB). flashinfer/experimental is imported in
# part at import time, so it stays whole.
rm -rf "$FI/moe_ep"
find "$STAGE/site" -name __pycache__ -type d -prune -exec rm -rf {} +
after=$(du -sm "$STAGE/site" | cut -f1)

python3 - "$FI" > "$STAGE/site/FLASHINFER-0.7.4-TRIMMED" <<'PY'
import os, sys
fi = sys.argv[1]
csrc = sorted(os.listdir(os.path.join(fi, "data", "csrc")))
print("flashinfer-python 0.7.4 (PyPI wheel), trimmed by kvaudit scripts/flashinfer/pack_074.sh")
print("data/csrc kept:", " ".join(csrc))
PY
mkdir -p "$(dirname "$OUT")"
tar -C "$STAGE" -czf "$OUT" site
echo "pack_074: $OUT $(du -k "$OUT" | cut -f1) KiB compressed; installed tree ${before} MiB -> ${after} MiB after trimming"
