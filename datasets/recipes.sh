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

# kvdump v1.1, GLM-5 with DeepSeek Sparse Attention as FlashMLA caches it: the packed 656-byte
# slot (512 e4m3 codes, 4 fp32 power-of-two scales per 128 channels, 64 bf16 RoPE values), page
# size 64, and topk_indices of 64 positions per row (fewer than the 300-token request holds; the
# 40-token request and the fresh 16-token prefill list all they see, padded with -1). Every 7th
# token's last latent group is all zero (the zero-scale fault needs one). No kv_source (size).
"$KVAUDIT" synth --out glm5_dsa_flashmla.h5 --seed 4 --model GLM-5 --layers 0,1 --page-size 64 \
  --prefix-lens 40,300,0 --prefill-tokens 8,4,16 --decode-steps 2 \
  --scale-group-size 128 --scale-format power_of_two --rope-dtype bfloat16 --layout flashmla_fp8 \
  --topk 64 --zero-group-every 7

# kvdump v1.1, dense, as FlashInfer's BatchMLAPagedAttentionWrapper with ckv_scale_arr stores it:
# fp32 scales per token and 128 latent channels (amax / 448), an e4m3 RoPE part with the layer's
# per-tensor kv_scale, page size 16, one layer (id 3). The RoPE part is 8x wider than usual, so a
# RoPE quantized with the latent's scale saturates (the calibration fault needs it).
"$KVAUDIT" synth --out glm5_pertoken_fp8rope.h5 --seed 5 --model GLM-5 --layers 3, --page-size 16 \
  --prefix-lens 33,200 --prefill-tokens 8,2 --decode-steps 2 --with-source \
  --scale-group-size 128 --scale-format float32 --rope-dtype float8_e4m3fn --rope-gain 8 \
  --zero-group-every 7

# The scale question (`kvaudit calibrate`, issue 30): latents with the statistics real MLA caches
# show, 48 of the 512 latent channels 400-800x wider than the rest and a RoPE part 20x narrower
# than the default (so |latent| reaches ~1000 while RoPE stays below ~1). Written with scale 1.0,
# as a server does when the checkpoint ships no k_scale: the outliers saturate. Then the same
# trace with the recommended scale (synth's calibration, amax/448 per layer, which `kvaudit
# calibrate glm5_outliers_scale1.h5` recommends): the same source rows, a different pool.
"$KVAUDIT" synth --out glm5_outliers_scale1.h5 --seed 30 --model GLM-5 --layers 0,1 \
  --prefix-lens 0,40,100 --prefill-tokens 0,3,5 --decode-steps 3 --with-source \
  --outlier-channels 48 --outlier-gain 400 --rope-gain 0.1 --kv-scale 1
"$KVAUDIT" synth --out glm5_outliers_calibrated.h5 --seed 30 --model GLM-5 --layers 0,1 \
  --prefix-lens 0,40,100 --prefill-tokens 0,3,5 --decode-steps 3 --with-source \
  --outlier-channels 48 --outlier-gain 400 --rope-gain 0.1
