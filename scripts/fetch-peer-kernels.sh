#!/usr/bin/env bash
# Puts the peer Triton kernel files the vllm-triton-mla and sglang-triton-mla adapters load into
# build/peer-kernels/PACKAGE-VERSION/ (ignored by git; carry it to the GPU machine): each is taken
# from its release wheel on PyPI, with the wheel's LICENSE (Apache-2.0) beside it, and checked
# against the sha256 python/kvdump/backends/peer_kernels.py pins.
#   bash scripts/fetch-peer-kernels.sh            (needs pip and network; about 280 MB of wheels,
#                                                  downloaded to a temporary folder, then removed)
# The files are not in the repository: they are the peers' code, used as released.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
dest=build/peer-kernels
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

fetch() {  # fetch PACKAGE VERSION PLATFORM FILE_IN_WHEEL SHA256
  local package=$1 version=$2 platform=$3 file=$4 sha=$5
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --platform "$platform" -d "$tmp/$package" "$package==$version"
  local wheel
  wheel=$(ls "$tmp/$package"/*.whl)
  mkdir -p "$dest/$package-$version"
  unzip -o -q -j "$wheel" "$file" "$package-$version.dist-info/licenses/LICENSE" \
    -d "$dest/$package-$version"
  echo "$sha  $dest/$package-$version/$(basename "$file")" | sha256sum -c -
}

fetch vllm 0.34.0 manylinux_2_28_x86_64 vllm/v1/attention/ops/triton_decode_attention.py \
  c7915ed5afb74e3c56d877791a86850985149dddf37384da6146bfc4eb46f479
fetch sglang 0.5.23 manylinux_2_34_x86_64 sglang/kernels/ops/attention/decode_attention.py \
  7a3b66ce3daabbb027efd860411cd9abe4b399b1f2cfc3ed5c6c01731eb9fa0a
ls -l "$dest"/*/
