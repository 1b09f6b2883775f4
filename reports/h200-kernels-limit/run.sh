#!/usr/bin/env bash
# The H200 call of the record (commit 35564c3's binaries, carried as .gpu2/): [gpu] tests, memcheck + racecheck on the new kernel
# paths, every shipped dump with cuda-fp8 (and memcheck), then the whole bench grid with
# FlashInfer 0.6.18's FP8 MLA (fa3) as the peer in the same run.
set -uo pipefail
r=/tmp/final5; mkdir -p $r
gunzip -f .gpu2/T.gz .gpu2/kvaudit.gz .gpu2/R.gz; chmod +x .gpu2/T .gpu2/kvaudit .gpu2/R
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
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > $r/pip.log 2>&1; echo "pip exit $?" | tee -a $r/summary.txt
export PYTHONPATH=/tmp/site:$PWD/python
python3 -c "import torch, flashinfer; print('torch', torch.__version__, 'flashinfer', flashinfer.__version__)" 2>&1 | tail -1 | tee -a $r/summary.txt
( time $k bench --peer exec:flashinfer-fp8 --peer-command "python3 -m kvdump.backends flashinfer-fp8 --flashinfer-backend fa3" --json $r/bench-h200.json --cpu-seconds 2 ) > $r/bench.log 2>&1; echo "bench exit $?" | tee -a $r/summary.txt
grep -A16 "^targets" $r/bench.log | tee -a $r/summary.txt
# Same-run A/B: R = the kernel of 14f9fe7 (the first record), kvaudit = this commit.
for c in "--batch 1 --context 4096 --heads 16 --page-size 64 --pool-slots 495552" "--batch 1 --context 32768 --heads 16 --page-size 64" "--batch 64 --context 8192 --heads 16 --page-size 64" "--batch 64 --context 4096 --heads 128 --page-size 64" "--batch 1 --context 4096 --q-len 4096 --heads 16 --page-size 64"; do
  for v in R kvaudit; do
    echo "$v $c: $(.gpu2/$v bench --gpu-only --no-cast --launches 30 $c 2>&1 | grep -E '^custom' | sed 's/custom *//')" | tee -a $r/ab.txt
  done
done
