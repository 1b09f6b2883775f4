#!/usr/bin/env bash
# The kernel table (scripts/kernels_table.py) on the GPU machine, in one call: installs the carried
# FlashInfer wheels into folders of their own, runs every kernel on every dump, copies
# kernels-h200.md / .json to OUTDIR and packs the per-run logs and reports into
# OUTDIR/kernels-logs.tgz (3 files back). Carry (ignored paths, 64 MiB in all):
#   build-gpu/kvaudit        the portable CUDA build (docs/gpu.md)
#   build/peer-kernels       vLLM's and SGLang's kernel files (scripts/fetch-peer-kernels.sh)
#   .whl                     FlashInfer 0.6.18 and its three dependencies (docs/gpu.md)
#   .whl-fi07                optional: FlashInfer 0.7.4's wheels (else its rows say "not run"),
#                            or .gpu/flashinfer-0.7.4.tar.gz (scripts/flashinfer/pack_074.sh);
#                            with 0.6.18's wheels and the binary that is over 64 MiB: an earlier
#                            call on the same warm machine may unpack it into /tmp/fi074/site,
#                            which this script then uses
#   .gpu/flashmla-dense-fp8.tar.gz  optional: FlashMLA dense FP8's sources
#                            (scripts/flashmla/pack_dense_fp8.sh), built here first
# and run, from the checkout's root:
#   bash scripts/gpu-kernels.sh "$OUT"
# Env: KVAUDIT (default build-gpu/kvaudit), KERNELS_DEADLINE (seconds after which no new run
# starts, default 270: with runs of at most 120 s the table ends within 400 s, the whole call
# under 7 minutes), KERNELS_TIMEOUT (seconds per kvaudit run, default 120), KERNELS_JOBS
# (default 6), KERNELS_MERGE (an earlier table's JSON whose rows of the kernels not run now are
# kept, marked as that run's), KERNELS_ARGS (more arguments for
# kernels_table.py, e.g. "--kernels cuda-fp8 vllm-triton-mla").
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:?usage: gpu-kernels.sh OUTDIR}
mkdir -p "$out"
kvaudit=${KVAUDIT:-build-gpu/kvaudit}
work=$(mktemp -d /tmp/kernels-table.XXXXXX)
started=$(date +%s)
log="$work/gpu-kernels.log"
exec > >(tee "$log") 2>&1

echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1)"
python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
ls -la build/peer-kernels/*/ 2>&1 | head -20
pythonpath=()
install() {  # install <wheel folder> <target> <key>
  if ls "$1"/*.whl >/dev/null 2>&1; then
    python3 -m pip install --quiet --no-index --no-deps --target "$2" "$1"/*.whl &&
      pythonpath+=(--pythonpath "$3=$2") && echo "installed $(ls "$1" | tr '\n' ' ') into $2"
  else
    echo "no wheels in $1: the $3 rows say not run"
  fi
}
install .whl /tmp/site-fi06 flashinfer-0.6
# FlashInfer's JIT cache: FLASHINFER_WORKSPACE_BASE if set (a call before this one on the same
# machine may have compiled into it), else a folder of this run.
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$work/flashinfer-workspace}
if [[ -f .gpu/flashinfer-0.7.4.tar.gz ]]; then  # the trimmed tree scripts/flashinfer/pack_074.sh packs
  mkdir -p /tmp/fi074 && tar -xzf .gpu/flashinfer-0.7.4.tar.gz -C /tmp/fi074 &&
    pythonpath+=(--pythonpath flashinfer-0.7=/tmp/fi074/site) &&
    echo "unpacked FlashInfer 0.7.4 (trimmed) into /tmp/fi074/site"
elif [[ -f /tmp/fi074/site/flashinfer/__init__.py ]]; then
  # Unpacked by an earlier call on this (still warm) machine: the 64 MiB a call carries do not
  # hold FlashInfer 0.7.4 and 0.6.18 together.
  pythonpath+=(--pythonpath flashinfer-0.7=/tmp/fi074/site)
  echo "FlashInfer 0.7.4 (trimmed): /tmp/fi074/site, unpacked by an earlier call on this machine"
else
  install .whl-fi07 /tmp/site-fi07 flashinfer-0.7
fi
adapter_args=()
if [[ -f .gpu/flashmla-dense-fp8.tar.gz ]]; then  # scripts/flashmla/pack_dense_fp8.sh
  tar -xzf .gpu/flashmla-dense-fp8.tar.gz -C "$work"
  export FLASHMLA_BUILD_DIR=$work/flashmla-build
  FLASHMLA_DENSE_SRC=$work/flashmla-dense-fp8 MAX_JOBS=$(nproc) timeout 300 \
    bash scripts/flashmla/build_dense_fp8.sh > "$work/flashmla-build.log" 2>&1
  so=$FLASHMLA_BUILD_DIR/flashmla_dense_fp8_sm90.so
  if [[ -f $so ]]; then
    adapter_args+=(--adapter-args "flashmla-dense-fp8=--flashmla-module $so")
    echo "built FlashMLA dense FP8 after $(( $(date +%s) - started )) s"
  else
    echo "FlashMLA dense FP8 build failed: $(grep -m3 -E 'error|Error' "$work/flashmla-build.log" | cut -c1-300)"
  fi
fi


# shellcheck disable=SC2086 # KERNELS_ARGS is a list of words
timeout 400 python3 scripts/kernels_table.py --kvaudit "$kvaudit" --python python3 \
  "${pythonpath[@]}" "${adapter_args[@]}" --work "$work/runs" --out "$work/kernels-h200" \
  --jobs "${KERNELS_JOBS:-6}" --timeout "${KERNELS_TIMEOUT:-120}" --deadline "${KERNELS_DEADLINE:-270}" \
  ${KERNELS_ARGS:-} ${KERNELS_MERGE:+--merge-with "$KERNELS_MERGE"}
echo "kernels_table.py exit $? after $(( $(date +%s) - started )) s"
cp "$work/kernels-h200.md" "$work/kernels-h200.json" "$out"/ 2>/dev/null
tar czf "$out/kernels-logs.tgz" -C "$work" --exclude='*.h5' . 2>/dev/null
echo "== done in $(( $(date +%s) - started )) s: $(ls "$out" | tr '\n' ' ')"
