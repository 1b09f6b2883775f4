#!/usr/bin/env bash
# Two peer kernels judged on the same dumps, in one call on the SM90 GPU machine (no network):
# FlashMLA's dense FP8 decode (flashmla-dense-fp8) and FlashInfer 0.7.4's paged MLA
# (flashinfer-fp8, fa3 and fa2), each through `kvaudit check` on datasets/glm5_page1.h5 and on
# page-64 dumps made here with `kvaudit synth`.
#     bash scripts/gpu-peers.sh [BUILD_DIR]          (default build-gpu; OUT: where logs go)
# Needs, carried with the working tree: BUILD_DIR/kvaudit, .gpu/flashmla-dense-fp8.tar.gz
# (scripts/flashmla/pack_dense_fp8.sh) and .gpu/flashinfer-0.7.4.tar.gz
# (scripts/flashinfer/pack_074.sh). The machine's python3 must have torch, numpy and h5py.
# Writes $OUT/peers-logs.tar.gz (every log and report) and $OUT/summary.txt (the key lines,
# printed as they come); exits 0 when every step ran, whatever the verdicts.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"
build="${1:-build-gpu}"
kvaudit="$ROOT/$build/kvaudit"
out="${OUT:-/tmp/gpu-peers-out}"
work="$(mktemp -d /tmp/gpu-peers.XXXXXX)"
logs="$work/logs"
mkdir -p "$out" "$logs"
summary="$out/summary.txt"
: >"$summary"
say() { echo "$*" | tee -a "$summary"; }
# The logs go out even when the call's time limit ends the script (TERM) half-way.
pack_logs() { cp "$summary" "$logs/" 2>/dev/null; tar -C "$work" -czf "$out/peers-logs.tar.gz" logs; }
trap pack_logs EXIT
trap 'say "stopped by a signal"; exit 143' TERM INT
elapsed() { echo "$(( $(date +%s) - start ))s"; }
start=$(date +%s)
command -v nvcc >/dev/null || export PATH="/usr/local/cuda/bin:$PATH"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"

say "== gpu-peers $(date -u +%FT%TZ) on $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1)"
say "   $(python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -1), $(nvcc --version | grep -o 'release [0-9.]*')"
[ -x "$kvaudit" ] || { say "no $kvaudit (carry $build)"; exit 2; }

# -- FlashMLA dense FP8: unpack, build -----------------------------------------------------------
say "== [$(elapsed)] FlashMLA dense FP8: build"
tar -xzf .gpu/flashmla-dense-fp8.tar.gz -C "$work"
export FLASHMLA_BUILD_DIR="$work/flashmla-build"
FLASHMLA_DENSE_SRC="$work/flashmla-dense-fp8" timeout 420 bash scripts/flashmla/build_dense_fp8.sh \
  >"$logs/flashmla-build.log" 2>&1
so="$FLASHMLA_BUILD_DIR/flashmla_dense_fp8_sm90.so"
if [ -f "$so" ]; then
  say "   built $(basename "$so") with $(cat "$FLASHMLA_BUILD_DIR/CUTLASS_USED") ($(grep -o 'built with .* in [0-9]* s' "$logs/flashmla-build.log"))"
else
  say "   BUILD FAILED: $(grep -m3 -E 'error|Error' "$logs/flashmla-build.log" | cut -c1-300)"
fi

# -- FlashInfer 0.7.4: unpack the trimmed target tree ----------------------------------------------
say "== [$(elapsed)] FlashInfer 0.7.4: unpack"
mkdir -p "$work/flashinfer"
tar -xzf .gpu/flashinfer-0.7.4.tar.gz -C "$work/flashinfer"
export FLASHINFER_WORKSPACE_BASE="$work/flashinfer-workspace"
export PYTHONPATH="$work/flashinfer/site:$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
say "   $(python3 -c 'import flashinfer, flashinfer.mla; print("import flashinfer", flashinfer.__version__, "ok")' 2>&1 | tail -1)"

# -- dumps ---------------------------------------------------------------------------------------
say "== [$(elapsed)] dumps"
dumps=("$ROOT/datasets/glm5_page1.h5")
synth() {
  local name="$1"; shift
  if "$kvaudit" synth --out "$work/$name.h5" --model GLM-5 --layers 0,1 --page-size 64 \
    --with-source "$@" >"$logs/synth-$name.log" 2>&1; then
    dumps+=("$work/$name.h5")
    say "   $name: $("$kvaudit" info "$work/$name.h5" | grep -E '^shapes' | tr -s ' ')"
  else
    say "   synth $name FAILED: $(tail -1 "$logs/synth-$name.log")"
  fi
}
# Requests over one and several pages, one not page-aligned; prefill rows 5, 3, 1 (grouped by
# rows in flashmla-dense-fp8), then 3 decode steps.
synth page64_h16 --heads 16 --prefix-lens 0,70,300 --prefill-tokens 5,3,1 --decode-steps 3
# DeepSeek-V3's 128 heads (two m-blocks of 64 rows per request in FlashMLA).
synth page64_h128 --heads 128 --prefix-lens 40,200 --prefill-tokens 2,2 --decode-steps 2

# -- checks --------------------------------------------------------------------------------------
check() {
  local label="$1" dump="$2" adapter="$3"; shift 3
  local name; name="$(basename "$dump" .h5)"
  local command="python3 -m kvdump.backends $adapter $*"
  "$kvaudit" check "$dump" --backend "exec:$adapter" --backend-command "$command" \
    --report "$logs/report-$label-$name" >"$logs/check-$label-$name.log" 2>&1
  local status=$?
  say "-- $label $name: exit $status; $(grep -m1 '^verdict' "$logs/check-$label-$name.log" || tail -1 "$logs/check-$label-$name.log" | cut -c1-400)"
  grep -A8 "^per step" "$logs/check-$label-$name.log" | sed "s/^/     /" | tee -a "$summary"
}
say "== [$(elapsed)] checks"
for dump in "${dumps[@]}"; do
  if [ -f "$so" ]; then
    check flashmla-dense-vllm "$dump" flashmla-dense-fp8 --flashmla-module "$so" --write kvdump
    check flashmla-dense-sglang "$dump" flashmla-dense-fp8 --flashmla-module "$so" \
      --flashmla-caller sglang --write server
  fi
  check flashinfer074-fa3 "$dump" flashinfer-fp8 --flashinfer-backend fa3
  check flashinfer074-fa2 "$dump" flashinfer-fp8 --flashinfer-backend fa2
done
cp "$FLASHMLA_BUILD_DIR.log" "$logs/" 2>/dev/null || true
say "== [$(elapsed)] done; logs: $out/peers-logs.tar.gz"
