#!/usr/bin/env bash
# The main job: build kvaudit (scripts/setup.sh), describe the shipped GLM-5-shaped dump, and
# write a fresh synthetic dump.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh
build_dir=${KVAUDIT_BUILD_DIR:-build}
kvaudit="$build_dir/kvaudit"

echo "== kvaudit info datasets/glm5_page1.h5"
"$kvaudit" info datasets/glm5_page1.h5

mkdir -p "$build_dir/main-job"
echo "== kvaudit synth"
"$kvaudit" synth --out "$build_dir/main-job/synth.h5" --seed 7 --layers 0,1,77 \
  --prefix-lens 0,37,300 --prefill-tokens 0,5,12 --decode-steps 2 --page-size 16 --nan-unused \
  --with-source
"$kvaudit" info "$build_dir/main-job/synth.h5"
