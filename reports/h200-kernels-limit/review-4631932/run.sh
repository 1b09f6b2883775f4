#!/usr/bin/env bash
# Review commit 4631932's binaries: [gpu] tests, memcheck + racecheck on the new kernel paths,
# every shipped dump with cuda-fp8 (and memcheck), and a same-run A/B against 35564c3 (P), the
# commit of the bench record.
set -uo pipefail
r=/tmp/final6; mkdir -p $r
gunzip -f .gpu2/T.gz .gpu2/kvaudit.gz .gpu2/P.gz; chmod +x .gpu2/T .gpu2/kvaudit .gpu2/P
k=.gpu2/kvaudit
export KVAUDIT_TEST_BINARY=$PWD/$k
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a $r/summary.txt
( time .gpu2/T "[gpu]" ) > $r/gpu-tests.log 2>&1; echo "gpu tests exit $?: $(grep -E 'All tests|test cases' $r/gpu-tests.log | tail -1)" | tee -a $r/summary.txt
S=/usr/local/cuda/bin/compute-sanitizer
timeout 200 $S --tool memcheck .gpu2/T "cuda-fp8 prefill*","cuda-fp8 long context*","cuda-cast-bf16 agrees*" > $r/memcheck-tests.log 2>&1; echo "memcheck tests exit $?: $(grep -E 'ERROR SUMMARY' $r/memcheck-tests.log | tail -1) | $(grep -E 'All tests|test cases' $r/memcheck-tests.log | tail -1)" | tee -a $r/summary.txt
timeout 200 $S --tool racecheck .gpu2/T "cuda-fp8 prefill*","cuda-fp8 long context*" > $r/racecheck-tests.log 2>&1; echo "racecheck tests exit $?: $(grep -E 'RACECHECK SUMMARY' $r/racecheck-tests.log | tail -1) | $(grep -E 'All tests|test cases' $r/racecheck-tests.log | tail -1)" | tee -a $r/summary.txt
for d in datasets/*.h5; do
  n=$(basename $d .h5)
  timeout 120 $k check $d --backend cuda-fp8 --json $r/$n.json > $r/check-$n.log 2>&1; echo "$n cuda-fp8 exit $?: $(grep verdict: $r/check-$n.log) rev $(python3 -c "import json;print(json.load(open('$r/$n.json'))['provenance']['git_revision'])")" | tee -a $r/summary.txt
  timeout 200 $S --tool memcheck $k check $d --backend cuda-fp8 > $r/$n-memcheck.log 2>&1; echo "$n memcheck exit $?: $(grep 'ERROR SUMMARY' $r/$n-memcheck.log)" | tee -a $r/summary.txt
done
for c in "--batch 1 --context 4096 --heads 16 --page-size 64 --pool-slots 495552" "--batch 64 --context 8192 --heads 16 --page-size 64" "--batch 64 --context 4096 --heads 32 --page-size 64" "--batch 64 --context 4096 --heads 128 --page-size 64" "--batch 1 --context 4096 --q-len 4096 --heads 16 --page-size 64"; do
  for v in P kvaudit; do
    echo "$v $c: $(.gpu2/$v bench --gpu-only --no-cast --launches 30 $c 2>&1 | grep -E '^custom' | sed 's/custom *//')" | tee -a $r/summary.txt
  done
done
