#!/usr/bin/env bash
# The main job: build the kvaudit binary, then check the shipped GLM-5-shaped dump with the cpu-fp8
# backend (the CPU model of the FP8 kernel) against the high-precision reference, and write a
# report directory (report.json, report.md, report.html). It builds only what it runs: the `kvaudit` target,
# without the tests, and the CUDA backends only where a GPU is present (`nvidia-smi -L` lists one;
# then for that GPU's architecture alone) or where asked (KVAUDIT_CUDA=ON). Each phase prints one
# line with the time elapsed since the start. How long a fresh clone takes, measured, with the
# machine: README "The two commands"; a second run only rebuilds what changed.
#   KVAUDIT_BUILD_DIR  build directory (default: build)
#   KVAUDIT_JOBS       parallel compile jobs (default: nproc)
#   KVAUDIT_CUDA       ON or OFF: build the CUDA backends or not, whatever nvidia-smi says
#   KVAUDIT_DRY_RUN=1  print the phases and the commands without running them (its tests use it)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

start=$SECONDS
build_dir=${KVAUDIT_BUILD_DIR:-build}
jobs=${KVAUDIT_JOBS:-$(nproc)}
kvaudit="$build_dir/kvaudit"
report_dir="$build_dir/main-job/report"
dump=datasets/glm5_page1.h5

phase() {
  local elapsed=$((SECONDS - start))
  printf 'main-job [%d:%02d] %s\n' $((elapsed / 60)) $((elapsed % 60)) "$*"
}
run() {
  if [[ ${KVAUDIT_DRY_RUN:-0} == 1 ]]; then
    echo "  + $*"
  else
    "$@"
  fi
}

# Whether to build CUDA (cuda=ON/OFF), why, and the GPU's architecture when one is present.
cuda_arch=""
if [[ -n ${KVAUDIT_CUDA:-} ]]; then
  case ${KVAUDIT_CUDA^^} in
    ON | 1 | TRUE | YES) cuda=ON ;;
    OFF | 0 | FALSE | NO) cuda=OFF ;;
    *) cuda=invalid ;;
  esac
  why="KVAUDIT_CUDA=$KVAUDIT_CUDA"
elif nvidia-smi -L >/dev/null 2>&1; then
  cuda=ON
  capability=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1)
  [[ $capability =~ ^([0-9]+)\.([0-9])$ ]] && cuda_arch="${BASH_REMATCH[1]}${BASH_REMATCH[2]}"
  why="a GPU is present (nvidia-smi -L)${cuda_arch:+, sm_$cuda_arch}"
  # sm_90 (H100/H200) builds its "a" target: the 64-row attention blocks use wgmma, which only
  # sm_90a code has (without it they fall back to mma.sync).
  [[ $cuda_arch == 90 ]] && cuda_arch=90a
else
  cuda=OFF
  why="no GPU found (nvidia-smi -L fails); KVAUDIT_CUDA=ON builds the CUDA backends anyway"
fi
if [[ $cuda != ON && $cuda != OFF ]]; then
  echo "main-job: KVAUDIT_CUDA must be ON or OFF, not '$KVAUDIT_CUDA'" >&2
  exit 2
fi
# CUDA toolkits install nvcc outside PATH; CMake finds the compiler through PATH or CUDACXX.
if [[ $cuda == ON ]] && ! command -v nvcc >/dev/null && [[ -z ${CUDACXX:-} ]]; then
  if [[ -x /usr/local/cuda/bin/nvcc ]]; then
    export PATH="/usr/local/cuda/bin:$PATH"
  elif [[ ${KVAUDIT_DRY_RUN:-0} != 1 ]]; then
    echo "main-job: CUDA is to be built ($why) but no nvcc was found (PATH, /usr/local/cuda/bin," \
      "CUDACXX)" >&2
    exit 2
  fi
fi

configure=(cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DKVAUDIT_TESTS=OFF
           "-DKVAUDIT_CUDA=$cuda")
[[ -n $cuda_arch ]] && configure+=("-DCMAKE_CUDA_ARCHITECTURES=$cuda_arch")

phase "checking the build dependencies (scripts/setup.sh)"
run bash scripts/setup.sh
phase "configuring $build_dir: Release, kvaudit only, CUDA $cuda ($why)"
if [[ ${KVAUDIT_DRY_RUN:-0} == 1 ]]; then
  run "${configure[@]}"
else
  mkdir -p "$build_dir"
  # CMake's own report goes to a log; shown when configuring fails.
  if ! "${configure[@]}" > "$build_dir/configure.log" 2>&1; then
    cat "$build_dir/configure.log" >&2
    exit 1
  fi
fi
phase "building the kvaudit target with $jobs jobs (each line is one compiled file)"
run cmake --build "$build_dir" --target kvaudit -j"$jobs"
phase "kvaudit info $dump"
run "$kvaudit" info "$dump"
phase "kvaudit check $dump --backend cpu-fp8 --report $report_dir"
run "$kvaudit" check "$dump" --backend cpu-fp8 --report "$report_dir" --verbose
phase "done: report in $report_dir/report.html, report.md and report.json"
