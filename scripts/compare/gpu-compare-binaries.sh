#!/usr/bin/env bash
# Two kvaudit binaries on one GPU, in one call: does a change keep the cuda-fp8 outputs bit for bit
# and the speed? BASE (the binary before the change) and NEW (after) each check the shipped dumps
# and six generated ones (16, 32, 128 heads; decode with short and long splits, prefill and extend,
# page sizes 1, 16, 64) with --save-outputs, under every kernel variant and the attention fault
# variants, and the backend outputs (bf16 out bits, fp32 lse bits) are compared
# (scripts/compare/same_outputs.py); then `kvaudit bench` runs BASE, NEW, BASE, NEW and
# scripts/compare/bench_ratio.py prints NEW / BASE per case (the smaller median of each binary).
# BASE given the kernel variant by the environment variables of kvaudit before the --cuda-*
# options (KVAUDIT_CUDA_MMA, ...): set BASE_USES_ENV=0 for a BASE that has the options.
#   bash scripts/compare/gpu-compare-binaries.sh BASE NEW OUTDIR
# Writes OUTDIR/logs (each run's output, the bench JSONs, bench-ratio.txt). Used for issue 31's
# restructuring (docs/kernels.md "Checking a change on the GPU").
set -uo pipefail
B=$(realpath "${1:?usage: gpu-compare-binaries.sh BASE NEW OUTDIR}")
N=$(realpath "${2:?usage: gpu-compare-binaries.sh BASE NEW OUTDIR}")
out=$(realpath -m "${3:?usage: gpu-compare-binaries.sh BASE NEW OUTDIR}")
L=$out/logs; D=$out/dumps; O=$out/outputs
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
mkdir -p $L $D $O
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; $N --version; } > $L/device.txt 2>&1
cat $L/device.txt
synth() { name=$1; shift; $N synth --out $D/$name.h5 --seed 11 "$@" > $L/synth-$name.log 2>&1 || echo "synth $name failed"; }
synth h16 --layers 2 --heads 16 --prefix-lens 300,1000,4000,0 --prefill-tokens 0,5,12,0 --decode-steps 2 --page-size 64
synth h16long --layers 1 --heads 16 --prefix-lens 20000,9000 --prefill-tokens 0,0 --decode-steps 1 --page-size 64
synth h32 --layers 1 --heads 32 --prefix-lens 2000,100 --prefill-tokens 0,0 --decode-steps 2 --page-size 16
synth h128 --layers 1 --heads 128 --prefix-lens 700,2100 --prefill-tokens 3,0 --decode-steps 2 --page-size 64
synth h8p --layers 1 --heads 8 --prefix-lens 0,37 --prefill-tokens 300,200 --decode-steps 1 --page-size 1
synth h32p --layers 1 --heads 32 --prefix-lens 64,0 --prefill-tokens 257,129 --decode-steps 1 --page-size 16
for f in datasets/*.h5; do cp "$f" $D/; done
# cmp_run NAME DUMP "BASE ENV AND ARGS" NEW ARGS...: both binaries on the dump, outputs compared
cmp_run() {
  local name=$1 dump=$2 base=$3; shift 3
  local base_env=() base_args=()
  for w in $base; do if [[ $w == *=* ]]; then base_env+=("$w"); else base_args+=("$w"); fi; done
  env "${base_env[@]}" $B check $D/$dump.h5 --backend cuda-fp8 "${base_args[@]}" --save-outputs $O/$name-base.h5 > $L/$name-base.log 2>&1; rb=$?
  $N check $D/$dump.h5 --backend cuda-fp8 "$@" --save-outputs $O/$name-new.h5 > $L/$name-new.log 2>&1; rn=$?
  printf '%-24s exit %s/%s  %s\n' "$name" $rb $rn "$(python3 scripts/compare/same_outputs.py $O/$name-base.h5 $O/$name-new.h5 2>&1 | tail -1)"
}
echo "== bit identity of the cuda-fp8 outputs, BASE vs NEW (exit BASE/NEW)"
for d in glm5_page1 glm5_dsa_flashmla glm5_pertoken_fp8rope page64_nan saturated_page16 h16 h16long h32 h128 h8p h32p; do
  cmp_run "$d" $d ""
done
# base_variant ENV OPTION VALUE: how BASE is given a kernel variant
base_variant() { if [[ ${BASE_USES_ENV:-1} == 1 ]]; then echo "$1=$3"; else echo "$2 $3"; fi; }
cmp_run h128-mmasync h128 "$(base_variant KVAUDIT_CUDA_MMA --cuda-mma mma-sync)" --cuda-mma mma-sync
cmp_run h32p-mmasync h32p "$(base_variant KVAUDIT_CUDA_MMA --cuda-mma mma-sync)" --cuda-mma mma-sync
cmp_run h16-registers h16 "$(base_variant KVAUDIT_CUDA_DECODE16 --cuda-decode16 registers)" --cuda-decode16 registers
cmp_run h16long-shared h16long "$(base_variant KVAUDIT_CUDA_DECODE16 --cuda-decode16 shared-tile)" --cuda-decode16 shared-tile
cmp_run h16-noplan h16 "$(base_variant KVAUDIT_CUDA_HOST_PLAN --cuda-host-plan off)" --cuda-host-plan off
cmp_run h8p-inorder h8p "$(base_variant KVAUDIT_CUDA_LONGEST_FIRST --cuda-longest-first off)" --cuda-longest-first off
for d in page64_nan h8p h32p h128 h16long; do
  cmp_run $d-maskedleak $d "--inject masked-nan-leak" --inject masked-nan-leak
done
cmp_run h128-leak-mmasync h128 "$(base_variant KVAUDIT_CUDA_MMA --cuda-mma mma-sync) --inject masked-nan-leak" --cuda-mma mma-sync --inject masked-nan-leak
cmp_run h16-leak-registers h16 "$(base_variant KVAUDIT_CUDA_DECODE16 --cuda-decode16 registers) --inject masked-nan-leak" --cuda-decode16 registers --inject masked-nan-leak
cmp_run h16-bf16read h16 "--inject fp8-read-as-bf16" --inject fp8-read-as-bf16
cmp_run h16-neighbour h16 "--inject neighbour-slot-write" --inject neighbour-slot-write
grep -h "^verdict" $L/*-new.log | sort | uniq -c
echo "== describe of new"
$N check $D/h16.h5 --backend cuda-fp8 --json $O/h16.json > /dev/null 2>&1
python3 -c "import json; d=json.load(open('$O/h16.json')); print(json.dumps(d['backend_description'].get('kernel_variant')))"
echo "== bench: base, new, base, new"
for i in 1 2; do
  $B bench --json $O/bench-base-$i.json > $L/bench-base-$i.log 2>&1; echo "base $i exit $?"
  $N bench --json $O/bench-new-$i.json > $L/bench-new-$i.log 2>&1; echo "new $i exit $?"
done
python3 scripts/compare/bench_ratio.py $O/bench-base-1.json $O/bench-base-2.json $O/bench-new-1.json $O/bench-new-2.json | tee $L/bench-ratio.txt | tail -45
grep -A20 "^targets" $L/bench-new-1.log | head -20
cp $O/bench-*.json $L/
