#!/usr/bin/env bash
# The test job (what CI runs, through .ci/run): checks that every C++/CUDA source is clang-format
# clean, builds everything with the tests into build-tests/ (every .cu file too wherever nvcc
# exists: CI compiles the CUDA code even without a GPU), runs the mutation fuzz through a kvaudit
# built with AddressSanitizer and UndefinedBehaviorSanitizer (build-asan/, CPU only), the [gpu]
# cases (skipped by name without a device), and every other test through CTest (the Python
# package's unittest suite runs inside it, as the [python] cases). Each phase prints one line with
# the time elapsed. Exits non-zero when any of them fails.
#   KVAUDIT_BUILD_DIR        build directory of the tests (default: build-tests; the main job's is
#                            build/, so the two never reconfigure each other)
#   KVAUDIT_JOBS             parallel compile jobs (default: nproc)
#   KVAUDIT_TEST_JOBS        parallel CTest jobs (default: 2)
#   KVAUDIT_CUDA             ON or OFF (default: ON where nvcc is found)
#   KVAUDIT_FUZZ_MUTATIONS   mutations per dump in the sanitizer fuzz (default: 300)
#   KVAUDIT_FUZZ_V1_1_MUTATIONS  mutations per kvdump v1.1 seed in it (default: 100; a small
#                            seed's accepted inputs also run `kvaudit check`)
#   KVAUDIT_SANITIZER_FUZZ=0 skip the sanitizer build and fuzz
#   KVAUDIT_REQUIRE          prerequisite tags whose cases must run, not skip (tests/test_main.cpp;
#                            "torch" is added with KVAUDIT_WITH_TORCH=1, "gpu" on a GPU machine)
#   KVAUDIT_WITH_TORCH=1     install PyTorch into the Python venv, so that the exec protocol is
#                            tested end to end with the torch adapter (CI does; about 5.6 GiB, 7 GiB free needed)
#   KVAUDIT_PYTHON_VENV      the Python venv (default: build/python-venv, scripts/setup-python.sh)
# Where nvcc exists but no cuobjdump, NVIDIA's PyPI wheel of it goes into that venv, for the CTest
# fault_free_kernels.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

start=$SECONDS
build_dir=${KVAUDIT_BUILD_DIR:-build-tests}
asan_dir=build-asan
jobs=${KVAUDIT_JOBS:-$(nproc)}
status=0

phase() {
  local elapsed=$((SECONDS - start))
  printf 'run-tests [%d:%02d] %s\n' $((elapsed / 60)) $((elapsed % 60)) "$*"
}

phase "checking the build and test dependencies (scripts/setup.sh tests)"
bash scripts/setup.sh tests
# The Python package's venv (build/python-venv: pip install ./python), where its unittest suite
# and the exec-backend tests run; torch in it with KVAUDIT_WITH_TORCH=1 (.ci/run sets it), else
# the torch adapter's cases say by name that they were skipped. With torch asked for, its cases
# are required (KVAUDIT_REQUIRE, tests/test_main.cpp): should torch not import after all, they
# fail instead of being skipped.
phase "Python package venv (scripts/setup-python.sh; KVAUDIT_WITH_TORCH=${KVAUDIT_WITH_TORCH:-0})"
bash scripts/setup-python.sh
if [[ ${KVAUDIT_WITH_TORCH:-0} == 1 ]]; then
  export KVAUDIT_REQUIRE="${KVAUDIT_REQUIRE:+$KVAUDIT_REQUIRE,}torch"
fi

# CUDA toolkits install nvcc outside PATH; CMake finds the compiler through PATH or CUDACXX.
if ! command -v nvcc >/dev/null && [[ -z ${CUDACXX:-} && -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
configure=(cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DKVAUDIT_TESTS=ON)
[[ -n ${KVAUDIT_CUDA:-} ]] && configure+=("-DKVAUDIT_CUDA=$KVAUDIT_CUDA")

# cuobjdump, for the CTest fault_free_kernels (the production kernels' device code holds no fault
# variant): a CUDA toolkit that ships without it (the minimal 13.0 install here has nvcc, ptxas and
# fatbinary only) gets NVIDIA's PyPI wheel of it in the Python venv. Any 13.x cuobjdump reads what
# nvcc 13.0 writes.
venv_python=${KVAUDIT_PYTHON_VENV:-build/python-venv}/bin/python
venv_cuobjdump() {
  "$venv_python" - <<'PY' 2>/dev/null || true
import pathlib
import nvidia
print(next(iter(sorted(p for root in nvidia.__path__ for p in pathlib.Path(root).glob("cu*/bin/cuobjdump"))), ""))
PY
}
if command -v nvcc >/dev/null && ! command -v cuobjdump >/dev/null &&
    [[ ! -x /usr/local/cuda/bin/cuobjdump ]] &&
    ! [[ ${KVAUDIT_CUDA:-ON} =~ ^(OFF|Off|off|0|FALSE|False|false|NO|No|no)$ ]]; then
  cuobjdump=$(venv_cuobjdump)
  if [[ -z $cuobjdump ]]; then
    phase "installing cuobjdump (nvidia-cuda-cuobjdump, PyPI) into the Python venv"
    "$venv_python" -m pip install -q nvidia-cuda-cuobjdump==13.2.51 ||
      echo "run-tests: cuobjdump could not be installed; fault_free_kernels will say skipped" >&2
    cuobjdump=$(venv_cuobjdump)
  fi
  [[ -n $cuobjdump ]] && configure+=("-DKVAUDIT_CUOBJDUMP=$cuobjdump")
fi

phase "clang-format check of every C++ and CUDA source"
mapfile -t sources < <(find src kernels references tests -type f \
  \( -name '*.cpp' -o -name '*.hpp' -o -name '*.cu' -o -name '*.cuh' \) 2>/dev/null | sort)
if ((${#sources[@]} > 0)) && ! clang-format --dry-run --Werror "${sources[@]}"; then
  echo "clang-format: the files above differ from .clang-format; run clang-format -i on them" >&2
  status=1
fi

phase "configuring $build_dir (Release, tests; CUDA where nvcc exists)"
"${configure[@]}"
phase "building everything in $build_dir with $jobs jobs"
cmake --build "$build_dir" -j"$jobs"

if [[ ${KVAUDIT_SANITIZER_FUZZ:-1} != 0 ]]; then
  phase "building kvaudit with -fsanitize=address,undefined in $asan_dir (CPU only)"
  cmake -S . -B "$asan_dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" -DKVAUDIT_CUDA=OFF -DKVAUDIT_TESTS=OFF \
    -DKVAUDIT_SANITIZE=address,undefined > /dev/null
  cmake --build "$asan_dir" --target kvaudit -j"$jobs"
  mutations=${KVAUDIT_FUZZ_MUTATIONS:-300}
  v1_1_mutations=${KVAUDIT_FUZZ_V1_1_MUTATIONS:-100}
  phase "mutation fuzz through the sanitizer build: $mutations mutations of each v1 dump, $v1_1_mutations of each v1.1 dump"
  # tests/format/test_kvdump_fuzz.cpp and test_dump_probe.cpp: every run must end with exit 0, 1
  # or 2, and no sanitizer report may come from kvaudit's own code (HDF5's are contained by the
  # probe child). Seeds: kvdump v1 and v1.1 (per-token-group scales, split and packed layouts,
  # topk_indices; the accepted v1.1 inputs also go through `kvaudit check`). Each case prints a
  # "fuzz: N mutated inputs over K seed dumps, F findings, ..." line; the total follows.
  fuzz_log="$asan_dir/fuzz.log"
  if ! KVAUDIT_TEST_BINARY="$PWD/$asan_dir/kvaudit" KVAUDIT_FUZZ_MUTATIONS=$mutations \
      KVAUDIT_FUZZ_V1_1_MUTATIONS=$v1_1_mutations \
      "$build_dir/tests/kvaudit_tests" "[fuzz]" | tee "$fuzz_log"; then
    echo "sanitizer fuzz: FAILED (a crash, a hang, exit 3, or a sanitizer report from kvaudit)" >&2
    status=1
  fi
  awk '$1 == "fuzz:" && $3 == "mutated" {
         inputs += $2; findings += $9; hdf5 += $11
         if ($15 == "v1.1:") v11 += $6; else v1 += $6 }
       END { printf "fuzz: %d mutated inputs over %d seed dumps (%d v1, %d v1.1), %d sanitizer or exit-status findings, %d HDF5 faults contained\n",
               inputs, v1 + v11, v1, v11, findings, hdf5 }' "$fuzz_log"
fi

# The [gpu] cases run outside CTest, so that their names show in the log: on a machine without a
# CUDA device the runner lists each one as skipped and exits 77.
phase "gpu tests"
gpu_status=0
"$build_dir/tests/kvaudit_tests" "[gpu]" || gpu_status=$?
case "$gpu_status" in
  0) echo "gpu tests: passed" ;;
  77) echo "gpu tests: skipped (no CUDA device)" ;;
  *) echo "gpu tests: FAILED (exit $gpu_status)" >&2; status=1 ;;
esac

phase "tests (CTest, ${KVAUDIT_TEST_JOBS:-2} at a time)"
if ! ctest --test-dir "$build_dir" --output-on-failure -j"${KVAUDIT_TEST_JOBS:-2}" \
    -E '^gpu_tests$'; then
  status=1
fi
phase "done (exit $status)"
exit "$status"
