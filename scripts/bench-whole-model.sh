#!/usr/bin/env bash
# The whole-model check, timed (issue 34): generate a GLM-5-shaped dump with `kvaudit synth` (78
# layers, 16 heads as in reports/reference-cuda-h200.md's record, 8 requests of 512 prefill
# tokens each over 4,096 cached ones, page 64, one decode step: the record's synth command) into
# build/, then run `kvaudit check` on it under /usr/bin/time -v and
# print the wall time, the peak resident memory and the split of the check's time (reference,
# backend, reading, comparisons; where they ran on the GPU, theirs into host preparation, uploads,
# kernels and downloads), with one --progress line per layer on stderr.
#
#   bash scripts/bench-whole-model.sh [--reference cpu|cuda] [--backend NAME] [--layers N]
#        [--heads H] [--prefix TOKENS] [--prefill TOKENS] [--decode-steps N] [--threads N]
#        [--layers-in-flight N] [--kvaudit PATH] [--dir DIR]
#
# Defaults: --reference cpu --backend cpu-fp8 --layers 78 --heads 16 --prefix 4096 --prefill 512
# --decode-steps 1, every core, check's own --layers-in-flight (4 with a GPU reference or backend,
# else 1), build/kvaudit, --dir build/bench-whole-model. The dump is generated
# once per shape (DIR/glm5_L<layers>_h<heads>_p<prefix>_f<prefill>_d<decode>.h5; about 105 MB per
# layer at the defaults, 8.2 GB for 78 layers) and reused; the check's stdout goes to
# DIR/check.log, its --progress lines to progress.log, /usr/bin/time's to time.log, the report
# to report/.
# On the H200: bash scripts/bench-whole-model.sh --reference cuda --backend cuda-fp8 \
#   --kvaudit build-gpu/kvaudit --dir /dev/shm/bench-whole-model
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

reference=cpu
backend=cpu-fp8
layers=78
heads=16
prefix=4096
prefill=512
decode_steps=1
threads=0
in_flight=0
kvaudit=build/kvaudit
out=build/bench-whole-model
usage() { sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case $1 in
    --reference) reference=$2; shift 2 ;;
    --backend) backend=$2; shift 2 ;;
    --layers) layers=$2; shift 2 ;;
    --heads) heads=$2; shift 2 ;;
    --prefix) prefix=$2; shift 2 ;;
    --prefill) prefill=$2; shift 2 ;;
    --decode-steps) decode_steps=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --layers-in-flight) in_flight=$2; shift 2 ;;
    --kvaudit) kvaudit=$2; shift 2 ;;
    --dir) out=$2; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "bench-whole-model: unknown argument '$1' (--help lists them)" >&2; exit 2 ;;
  esac
done
if [[ ! -x $kvaudit ]]; then
  echo "bench-whole-model: $kvaudit is not an executable kvaudit (build it, or --kvaudit PATH)" >&2
  exit 2
fi
# /usr/bin/time -v where it is installed (Debian package: time); else the same two lines of its
# log (wall clock, peak resident set of the child) from python3's resource module.
timed() {  # timed LOG COMMAND...
  local log=$1; shift
  if [[ -x /usr/bin/time ]]; then
    /usr/bin/time -v -o "$log" "$@"
    return
  fi
  python3 - "$log" "$@" <<'PY'
import resource, subprocess, sys, time
log, command = sys.argv[1], sys.argv[2:]
start = time.monotonic()
status = subprocess.call(command)
wall = time.monotonic() - start
rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
with open(log, "w") as f:
    f.write(f"Elapsed (wall clock) time (h:mm:ss or m:ss): {int(wall // 60)}:{wall % 60:05.2f}\n")
    f.write(f"Maximum resident set size (kbytes): {rss}\n")
sys.exit(status)
PY
}

mkdir -p "$out"
dump="$out/glm5_L${layers}_h${heads}_p${prefix}_f${prefill}_d${decode_steps}.h5"
requests=8
list() { local value=$1; printf '%s' "$value"; for ((i = 1; i < requests; ++i)); do printf ',%s' "$value"; done; }

if [[ ! -f $dump ]]; then
  echo "bench-whole-model: generating $dump ($layers layers of $heads heads, $requests x $prefill prefill over $prefix cached, $decode_steps decode step(s))"
  synth_start=$SECONDS
  "$kvaudit" synth --out "$dump" --model GLM-5 --heads "$heads" --kv-lora-rank 512 --rope-dim 64 \
    --layers "$layers" --page-size 64 --prefix-lens "$(list "$prefix")" \
    --prefill-tokens "$(list "$prefill")" --decode-steps "$decode_steps" >/dev/null
  echo "bench-whole-model: generated in $((SECONDS - synth_start)) s ($(du -h "$dump" | cut -f1))"
fi

echo "bench-whole-model: kvaudit check $dump --backend $backend --reference $reference --threads $threads --layers-in-flight $in_flight"
status=0
timed "$out/time.log" "$kvaudit" check "$dump" --backend "$backend" \
  --reference "$reference" --threads "$threads" --layers-in-flight "$in_flight" --verbose \
  --progress --report "$out/report" \
  >"$out/check.log" 2>"$out/progress.log" || status=$?
tail -n 3 "$out/progress.log" >&2
wall=$(sed -n 's/.*Elapsed (wall clock) time (h:mm:ss or m:ss): //p' "$out/time.log")
rss_kib=$(sed -n 's/.*Maximum resident set size (kbytes): //p' "$out/time.log")
echo "wall time:   $wall (h:mm:ss or m:ss)"
echo "peak RSS:    $((rss_kib / 1024)) MiB"
echo "split:       $(grep '^timing:' "$out/check.log" | sed 's/^timing: //')"
grep '^layers in flight:' "$out/check.log" || true
# The GPU reference's and the cuda backends' own split (host prep, uploads, kernels, downloads).
grep '^timing on the GPU: ' "$out/check.log" | sed 's/^timing on the GPU: /on the GPU:  /' || true
grep '^verdict:' "$out/check.log" || true
echo "exit status: $status (0 pass, 1 checks failed; logs in $out/)"
