#!/usr/bin/env bash
# Everything one GPU verification needs, in one go (the GPU machine is lent for short runs):
# the [gpu] tests, compute-sanitizer memcheck on them, `kvaudit check` of every shipped dump with
# the CUDA backends, the fault-injection table on cuda-fp8, and the bench. Build first, here,
# with the portable option (README "Running on a GPU"), then on the GPU machine:
#   bash scripts/gpu-verify.sh build-gpu OUTDIR [--no-bench]
# Results land in OUTDIR: gpu-tests.log, memcheck.log, check-*.log, injections.tsv,
# bench.json, bench.log, device.txt.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build=${1:?usage: gpu-verify.sh BUILD_DIR OUTDIR}
out=${2:?usage: gpu-verify.sh BUILD_DIR OUTDIR [--no-bench]}
bench=yes
[ "${3:-}" = "--no-bench" ] && bench=no
mkdir -p "$out"
kvaudit="$build/kvaudit"
tests="$build/tests/kvaudit_tests"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$out/device.txt" 2>&1

echo "== [gpu] tests"
"$tests" "[gpu]" 2>&1 | tee "$out/gpu-tests.log" | tail -3

echo "== compute-sanitizer memcheck"
# (the injection matrix runs the kvaudit binary in child processes, which memcheck does not follow:
# leave it out here and run `check` under memcheck once below instead)
compute-sanitizer --tool memcheck "$tests" "[gpu]~[injection]" >"$out/memcheck.log" 2>&1
tail -3 "$out/memcheck.log"
for injection in none bf16-writeback masked-nan-leak; do
  compute-sanitizer --tool memcheck "$kvaudit" check datasets/page64_nan.h5 --backend cuda-fp8 \
    --inject "$injection" >"$out/memcheck-check-$injection.log" 2>&1
  echo "memcheck of check --inject $injection: $(grep -m1 'ERROR SUMMARY' "$out/memcheck-check-$injection.log")"
done

echo "== check: shipped dumps, cuda-fp8 and cuda-cast-bf16"
for dump in datasets/*.h5; do
  for backend in cuda-fp8 cuda-cast-bf16; do
    name=$(basename "$dump" .h5)
    "$kvaudit" check "$dump" --backend "$backend" >"$out/check-$name-$backend.log" 2>&1
    echo "$name $backend exit=$? $(grep '^verdict' "$out/check-$name-$backend.log")"
  done
done

echo "== injections: every injection on every shipped dump, cpu-fp8 and cuda-fp8"
# The [gpu] test above asserts the cuda-fp8 half (tests/backend/injection_matrix.hpp); this table
# is the record: backend, injection, dump, exit status, the first line that names the fault.
printf 'backend\tinjection\tdump\texit\tevidence\n' >"$out/injections.tsv"
for backend in cpu-fp8 cuda-fp8; do
  for injection in none bf16-writeback round-toward-zero no-saturation scale-mismatch \
    neighbour-slot-write fp8-read-as-bf16 masked-nan-leak whole-pool-cast; do
    for dump in glm5_page1 page64_nan saturated_page16; do
      log="$out/inject-$backend-$injection-$dump.log"
      "$kvaudit" check "datasets/$dump.h5" --backend "$backend" --inject "$injection" >"$log" 2>&1
      status=$?
      # the first integrity failure (write faults), else the first divergence (read faults)
      evidence=$(awk '/^integrity failures:/ { getline; sub(/^  /, ""); print; exit }' "$log")
      [ -z "$evidence" ] && evidence=$(grep -m1 '^first divergence' "$log")
      [ -z "$evidence" ] && evidence=$(grep -m1 '^verdict' "$log")
      printf '%s\t%s\t%s\t%s\t%s\n' "$backend" "$injection" "$dump" "$status" "${evidence:0:200}" \
        >>"$out/injections.tsv"
    done
  done
done
# The two backends must agree on every exit status.
awk -F'\t' 'NR > 1 { key = $2 "/" $3; if (key in seen && seen[key] != $4) { print "DISAGREE " key; bad = 1 } seen[key] = $4 }
  END { exit bad }' "$out/injections.tsv" && echo "cpu-fp8 and cuda-fp8 agree on all $(($(wc -l <"$out/injections.tsv") / 2)) cases"
cut -f1-4 "$out/injections.tsv"

[ "$bench" = no ] && exit 0
echo "== bench"
"$kvaudit" bench --json "$out/bench.json" >"$out/bench.log" 2>&1
tail -25 "$out/bench.log"
