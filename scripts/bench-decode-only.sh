#!/usr/bin/env bash
# Times the 78-layer GLM-5 decode-only check on the CPU (issue 34, target 2: <= 20 s on 2 cores).
#
# The dump: the decode-only form of target 1's dump (78 layers, 8 requests x 512-token prefill):
# the same 8 requests with those 512 tokens already cached (--prefix-lens 512) and one decode
# step instead of the prefill (--prefill-tokens 0 --decode-steps 1), so each of the 8 decode rows
# attends over 513 tokens, 16 heads (GLM-5's preset), page 64, with kv_source (the bf16 values the
# pool was quantized from), so the check computes both exact references, R8 on the FP8 pool and Rs
# on the source. `kvaudit synth` generates it into the build directory once (0.7 GB; 5.1 GB with
# KVAUDIT_CONTEXT=4096, the realistic context: 8 x 4096 tokens, 16 heads).
#
# Then `kvaudit check --backend cpu-fp8 --verbose` on it, timed with /usr/bin/time, prints the
# split the check reports (reading, reference, backend, comparisons) and the wall time.
#
# Measured on a 2-core Xeon with AVX-512 and without a GPU (reports/whole-model-speed.md):
# KVAUDIT_CONTEXT=4096, 2026-12-06 05:09 UTC: 17.3-18.1 s wall (e127a7b), against 19.7-20.9 s
# for b84808a in runs alternating with it; 01:38 UTC: 22.6-24.9 s (078f69f), against 26.1-28.3 s
# for e446bf7; 2026-12-05: 26.6-27.6 s (568fad7), and 47.0 s for the code before the reference's
# AVX-512 loops; context 512: 2.7 s (e127a7b, 05:11 UTC), 4.2-4.9 s on 2026-12-05. The same
# binary's time drifts by up to 20% within an hour on such a machine: compare only runs made side
# by side.
#
# Usage: scripts/bench-decode-only.sh [KVAUDIT_BINARY] (default build-cpu/kvaudit)
#   KVAUDIT_DUMP_DIR  where the dump goes (default build/decode-only)
#   KVAUDIT_THREADS   --threads for the check (default 2: the target's 2 cores)
#   KVAUDIT_CONTEXT   cached tokens per request (default 512)
set -euo pipefail

kvaudit=${1:-build-cpu/kvaudit}
dump_dir=${KVAUDIT_DUMP_DIR:-build/decode-only}
threads=${KVAUDIT_THREADS:-2}
context=${KVAUDIT_CONTEXT:-512}
dump="$dump_dir/glm5_78layers_decode_${context}.h5"
# Eight requests: a list of eight values (a single value would apply to synth's default count).
prefix_lens=$(printf "$context,%.0s" 1 2 3 4 5 6 7 8)
prefill_tokens=$(printf "0,%.0s" 1 2 3 4 5 6 7 8)

if [[ ! -x "$kvaudit" ]]; then
  echo "bench-decode-only: $kvaudit is not an executable kvaudit (build it first)" >&2
  exit 2
fi
mkdir -p "$dump_dir"
if [[ ! -f "$dump" ]]; then
  echo "bench-decode-only: generating $dump"
  "$kvaudit" synth --out "$dump" --model GLM-5 --layers 78 --heads 16 --page-size 64 \
    --prefix-lens "${prefix_lens%,}" --prefill-tokens "${prefill_tokens%,}" --decode-steps 1 --with-source --seed 34
fi
echo "bench-decode-only: $(nproc) cores, load: $(cut -d' ' -f1-3 /proc/loadavg)"
report="$dump_dir/report-$(basename "$kvaudit")"
/usr/bin/time -f "bench-decode-only: wall %e s, user %U s, sys %S s, max RSS %M KiB" \
  "$kvaudit" check "$dump" --backend cpu-fp8 --threads "$threads" --verbose --report "$report"
