#!/usr/bin/env bash
# The whole-model check (scripts/bench-whole-model.sh) twice, with 1 and with N layers in flight
# (`kvaudit check --layers-in-flight`, issue 34): the two reports must be the same (everything but
# timing and provenance, scripts/same_report.py) and the wall times show what the overlap gains.
#
#   bash scripts/bench-layers-in-flight.sh [--in-flight N] [--out DIR] [bench-whole-model.sh's
#        arguments: --reference, --backend, --layers, ..., --kvaudit PATH, --dir DIR]
#
# Defaults: --in-flight 2, --out build/bench-layers-in-flight. Into DIR (--out): for each count C,
# bench-C.log (bench-whole-model.sh's summary: wall time, peak RSS, split), check-C.log,
# progress-C.log and report-C/; then same_report.py's verdict on the two reports. Exit 0 when both
# checks ran (exit 0 or 1) and their reports are the same, else 1.
# On the H200: bash scripts/bench-layers-in-flight.sh --reference cuda --backend cuda-fp8 \
#   --kvaudit build-gpu/kvaudit --dir /dev/shm/bench-whole-model
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

in_flight=2
out=build/bench-layers-in-flight
bench_dir=build/bench-whole-model
args=()
usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case $1 in
    --in-flight) in_flight=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --dir) bench_dir=$2; shift 2 ;;
    --layers-in-flight)
      echo "bench-layers-in-flight: use --in-flight N (1 is always run)" >&2
      exit 2 ;;
    -h | --help) usage; exit 0 ;;
    *) args+=("$1"); shift ;;
  esac
done

mkdir -p "$out"
status=0
for count in 1 "$in_flight"; do
  echo "bench-layers-in-flight: --layers-in-flight $count"
  bench_status=0
  bash scripts/bench-whole-model.sh "${args[@]}" --dir "$bench_dir" --layers-in-flight "$count" \
    >"$out/bench-$count.log" 2>&1 || bench_status=$?
  cat "$out/bench-$count.log"
  cp "$bench_dir/check.log" "$out/check-$count.log"
  cp "$bench_dir/progress.log" "$out/progress-$count.log"
  rm -rf "$out/report-$count"
  cp -r "$bench_dir/report" "$out/report-$count"
  if [[ $bench_status -ne 0 ]]; then
    echo "bench-layers-in-flight: bench-whole-model.sh exited $bench_status" >&2
    status=1
  fi
done
if python3 scripts/same_report.py "$out/report-1/report.json" "$out/report-$in_flight/report.json"; then
  echo "bench-layers-in-flight: the reports of 1 and $in_flight layers in flight are the same"
else
  echo "bench-layers-in-flight: the reports of 1 and $in_flight layers in flight differ" >&2
  status=1
fi
exit $status
