#!/usr/bin/env bash
# Packs what building FlashMLA's dense FP8 decode (fwd_kvcache_mla_fp8, FlashMLA PR 54) needs on
# a machine without network into one tarball, for scripts/flashmla/build_dense_fp8.sh:
#     FLASHMLA_GIT=DIR CUTLASS_GIT=DIR bash scripts/flashmla/pack_dense_fp8.sh [OUT.tar.gz]
# FLASHMLA_GIT: a git directory (or clone) of vllm-project/FlashMLA; CUTLASS_GIT: one of
# NVIDIA/cutlass (FlashMLA's csrc/cutlass is a submodule, so its files come from there).
# Default output: .gpu/flashmla-dense-fp8.tar.gz (ignored by git). The tarball holds
#   flashmla-dense-fp8/LICENSE                        FlashMLA's MIT licence
#   flashmla-dense-fp8/csrc/params.h                  the DecodingParams the kernel extends
#   flashmla-dense-fp8/csrc/extension/sm90/dense_fp8/ the kernel, its metadata and its binding
#   flashmla-dense-fp8/cutlass/include/, LICENSE.txt  cutlass at FlashMLA's submodule commit
#   flashmla-dense-fp8/cutlass-newer/include/, ...     cutlass 4.3 (147f5673, the one the sparse
#                                                     build compiles with under nvcc 13): the
#                                                     build's fallback if the pinned one fails
#   flashmla-dense-fp8/UPSTREAM                       the commits and where the licences are
set -euo pipefail
FLASHMLA_COMMIT="${FLASHMLA_COMMIT:-46d64a8ebef03fa50b4ae74937276a5c940e3f95}"
CUTLASS_FALLBACK_COMMIT="${CUTLASS_FALLBACK_COMMIT:-147f5673d0c1c3dcf66f78d677fd647e4a020219}"
: "${FLASHMLA_GIT:?set FLASHMLA_GIT to a git directory of vllm-project/FlashMLA}"
: "${CUTLASS_GIT:?set CUTLASS_GIT to a git directory of NVIDIA/cutlass}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${1:-$ROOT/.gpu/flashmla-dense-fp8.tar.gz}"
mkdir -p "$(dirname "$OUT")"
STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
DEST="$STAGE/flashmla-dense-fp8"
mkdir -p "$DEST/cutlass" "$DEST/cutlass-newer"

# The submodule commit FlashMLA pins (a gitlink in its tree).
CUTLASS_COMMIT="$(git -C "$FLASHMLA_GIT" ls-tree "$FLASHMLA_COMMIT" csrc/cutlass | awk '{print $3}')"
[ -n "$CUTLASS_COMMIT" ] || { echo "pack_dense_fp8: no csrc/cutlass gitlink at $FLASHMLA_COMMIT" >&2; exit 2; }

git -C "$FLASHMLA_GIT" archive "$FLASHMLA_COMMIT" LICENSE csrc/params.h csrc/extension/sm90/dense_fp8 |
  tar -x -C "$DEST"
git -C "$CUTLASS_GIT" archive "$CUTLASS_COMMIT" include LICENSE.txt | tar -x -C "$DEST/cutlass"
git -C "$CUTLASS_GIT" archive "$CUTLASS_FALLBACK_COMMIT" include LICENSE.txt |
  tar -x -C "$DEST/cutlass-newer"

cat > "$DEST/UPSTREAM" <<INFO
FlashMLA  vllm-project/FlashMLA $FLASHMLA_COMMIT
          files: csrc/params.h, csrc/extension/sm90/dense_fp8/* (FlashMLA PR 54, @endurehero)
          licence: MIT, flashmla-dense-fp8/LICENSE
cutlass   NVIDIA/cutlass $CUTLASS_COMMIT (FlashMLA's csrc/cutlass submodule at that commit)
          files: include/; licence: BSD-3-Clause, flashmla-dense-fp8/cutlass/LICENSE.txt
cutlass   NVIDIA/cutlass $CUTLASS_FALLBACK_COMMIT (fallback, cutlass-newer/)
          licence: BSD-3-Clause, flashmla-dense-fp8/cutlass-newer/LICENSE.txt
INFO
tar -C "$STAGE" -czf "$OUT" flashmla-dense-fp8
echo "pack_dense_fp8: $OUT $(du -k "$OUT" | cut -f1) KiB (FlashMLA ${FLASHMLA_COMMIT:0:10}, cutlass ${CUTLASS_COMMIT:0:10} + ${CUTLASS_FALLBACK_COMMIT:0:10})"
