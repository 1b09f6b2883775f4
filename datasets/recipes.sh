#!/usr/bin/env bash
# The exact commands that made the shipped dumps in this directory.
#   bash datasets/recipes.sh [path/to/kvaudit]      (default: build/kvaudit)
# tests/datasets/test_datasets.cpp reruns every '"$KVAUDIT" synth' command below (joined across
# backslash-newlines, split on whitespace: keep the arguments free of quotes and shell syntax)
# and requires each result to equal the shipped file tensor for tensor, bit for bit.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
KVAUDIT=${1:-$here/../build/kvaudit}
cd "$here"

# GLM-5 shape (16 heads, 512 + 64), page size 1, layers 0, 1 and 77, calibrated scales, kv_source.
# Requests: empty; 40 cached and no prefill rows; 257 cached + 3 prefill rows (crosses 256);
# a fresh 5-token prefill. Then 3 decode steps.
"$KVAUDIT" synth --out glm5_page1.h5 --seed 1 --model GLM-5 --layers 0,1,77 \
  --prefix-lens 0,40,257,0 --prefill-tokens 0,0,3,5 --decode-steps 3 --with-source

# Page size 64, 2 layers, calibrated non-power-of-two scales, NaN codes (0x7F / 0xFF) in every
# slot holding no token before step 0: spare pages, tails of last pages, slots the steps write.
"$KVAUDIT" synth --out page64_nan.h5 --seed 2 --model GLM-5 --layers 0,1 --page-size 64 \
  --prefix-lens 70,150,0,0 --prefill-tokens 5,2,30,0 --decode-steps 2 --nan-unused

# Page size 16, layer 5 only, a fixed scale (0.1137, above the calibrated 0.0943 so the regular
# values fit) and 0.2% of values past 464 * scale, stored as +-448 by satfinite.
"$KVAUDIT" synth --out saturated_page16.h5 --seed 3 --model GLM-5 --layers 5, --page-size 16 \
  --prefix-lens 0,33,100 --prefill-tokens 8,1,0 --decode-steps 2 --kv-scale 0.1137 \
  --saturate-fraction 0.002 --with-source
