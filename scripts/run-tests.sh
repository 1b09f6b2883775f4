#!/usr/bin/env bash
# Builds kvaudit (scripts/setup.sh), runs every test through CTest (the Python writer's unittest
# suite runs inside it, as the [python] case),
# and checks that every C++/CUDA source is clang-format clean. Exits non-zero when any test or the
# format check fails.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh
build_dir=${KVAUDIT_BUILD_DIR:-build}

status=0
echo "== clang-format check"
mapfile -t sources < <(find src kernels references tests -type f \
  \( -name '*.cpp' -o -name '*.hpp' -o -name '*.cu' -o -name '*.cuh' \) 2>/dev/null | sort)
if ((${#sources[@]} > 0)) && ! clang-format --dry-run --Werror "${sources[@]}"; then
  echo "clang-format: the files above differ from .clang-format; run clang-format -i on them" >&2
  status=1
fi

echo "== tests"
if ! ctest --test-dir "$build_dir" --output-on-failure -j"${KVAUDIT_TEST_JOBS:-2}" \
    -E '^gpu_tests$'; then
  status=1
fi

# The [gpu] cases run here, outside CTest, so that their names show in the log: on a machine
# without a CUDA device the runner lists each one as skipped and exits 77.
echo "== gpu tests"
gpu_status=0
"$build_dir/tests/kvaudit_tests" "[gpu]" || gpu_status=$?
case "$gpu_status" in
  0) echo "gpu tests: passed" ;;
  77) echo "gpu tests: skipped (no CUDA device)" ;;
  *) echo "gpu tests: FAILED (exit $gpu_status)" >&2; status=1 ;;
esac
exit "$status"
