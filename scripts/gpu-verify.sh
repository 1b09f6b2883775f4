#!/usr/bin/env bash
# Everything one GPU verification needs, in one go (the GPU machine is lent for short runs):
# the [gpu] tests, compute-sanitizer memcheck on them, `kvaudit check` of every shipped dump with
# the CUDA backends, the fault-injection table on cuda-fp8, and the bench. Build first, here,
# with the portable option (README "Running on a GPU"), then on the GPU machine:
#   bash scripts/gpu-verify.sh build-gpu OUTDIR
# Results land in OUTDIR: gpu-tests.log, memcheck.log, check-*.log, injections.tsv,
# bench.json, bench.log, device.txt.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build=${1:?usage: gpu-verify.sh BUILD_DIR OUTDIR}
out=${2:?usage: gpu-verify.sh BUILD_DIR OUTDIR}
mkdir -p "$out"
kvaudit="$build/kvaudit"
tests="$build/tests/kvaudit_tests"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$out/device.txt" 2>&1

echo "== [gpu] tests"
"$tests" "[gpu]" 2>&1 | tee "$out/gpu-tests.log" | tail -3

echo "== compute-sanitizer memcheck"
compute-sanitizer --tool memcheck "$tests" "[gpu]" >"$out/memcheck.log" 2>&1
tail -3 "$out/memcheck.log"

echo "== check: shipped dumps, cuda-fp8 and cuda-cast-bf16"
for dump in datasets/*.h5; do
  for backend in cuda-fp8 cuda-cast-bf16; do
    name=$(basename "$dump" .h5)
    "$kvaudit" check "$dump" --backend "$backend" >"$out/check-$name-$backend.log" 2>&1
    echo "$name $backend exit=$? $(grep '^verdict' "$out/check-$name-$backend.log")"
  done
done

echo "== injections on cuda-fp8"
printf 'injection\tdump\texit\tfirst evidence\n' >"$out/injections.tsv"
while read -r injection dump; do
  log="$out/inject-$injection.log"
  "$kvaudit" check "datasets/$dump" --backend cuda-fp8 --inject "$injection" >"$log" 2>&1
  status=$?
  evidence=$(grep -m1 -E 'written_slots|unwritten_slots|nan_written|first divergence' "$log")
  printf '%s\t%s\t%s\t%s\n' "$injection" "$dump" "$status" "${evidence:-$(grep '^verdict' "$log")}" \
    >>"$out/injections.tsv"
done <<'EOF'
none glm5_page1.h5
bf16-writeback glm5_page1.h5
round-toward-zero glm5_page1.h5
no-saturation saturated_page16.h5
scale-mismatch glm5_page1.h5
neighbour-slot-write glm5_page1.h5
fp8-read-as-bf16 glm5_page1.h5
masked-nan-leak page64_nan.h5
whole-pool-cast glm5_page1.h5
EOF
cut -f1-3 "$out/injections.tsv"

echo "== bench"
"$kvaudit" bench --json "$out/bench.json" >"$out/bench.log" 2>&1
tail -25 "$out/bench.log"
