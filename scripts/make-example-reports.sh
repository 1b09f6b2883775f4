#!/usr/bin/env bash
# Regenerates the example reports: every shipped dump (datasets/*.h5) checked with --signoff
# through one backend into OUT/<dump>/ (report.json, report.md, report.html, signed:
# report.manifest.json, report.sig), each verified with `kvaudit verify-report --public-key`, and
# each report.html rendered to OUT/<dump>/report.png by headless Chromium (Debian's chromium; the
# PNG is cropped to the page's height with python3-pil). The reports are signed with
# --signing-key FILE, or else with a throwaway key made by `kvaudit keygen` in a temporary folder
# and deleted afterwards; its public key is kept as OUT/signing-key.pub, so that anyone can check
# the examples (`kvaudit verify-report OUT/<dump> --public-key OUT/signing-key.pub`).
#
#   bash scripts/make-example-reports.sh [--kvaudit PATH] [--backend NAME] [--out DIR]
#                                        [--signed-by NAME] [--deployment TEXT]
#                                        [--signing-key FILE]
#                                        [--backend-command CMD]   # for --backend exec:NAME
#   bash scripts/make-example-reports.sh --png-only DIR    # render DIR/*/report.html again
#
# Defaults: build/kvaudit, cpu-fp8, reports/example. On the GPU machine, for example:
#   bash scripts/make-example-reports.sh --kvaudit build-gpu/kvaudit --backend cuda-fp8 \
#       --out reports/h200-cuda-fp8 --deployment "cuda-fp8 on NVIDIA H200"
# Where Chromium is missing (a GPU machine may have none) the reports are written and the PNGs are
# skipped with a note: run --png-only on the directory where Chromium is installed.
# A dump whose sign-off fails still gets its report (that is what the example shows); the script
# fails only when kvaudit cannot run (exit 2 or 3) or a report does not verify.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

kvaudit=build/kvaudit
backend=cpu-fp8
out=reports/example
signed_by="kvaudit example (not a real sign-off)"
deployment=""
png_only=""
backend_command=""
signing_key=""
while (($# > 0)); do
  case "$1" in
    --kvaudit) kvaudit=$2; shift 2 ;;
    --backend) backend=$2; shift 2 ;;
    --backend-command) backend_command=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --signed-by) signed_by=$2; shift 2 ;;
    --deployment) deployment=$2; shift 2 ;;
    --signing-key) signing_key=$2; shift 2 ;;
    --png-only) png_only=$2; shift 2 ;;
    *) echo "make-example-reports: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done

chromium_binary=$(command -v chromium || command -v chromium-browser || true)

# report.html -> report.png: a 1280-px-wide window as tall as any report, then cropped to the
# page (trailing white rows removed).
render_png() {
  local html=$1 png=${1%.html}.png profile
  if [[ -z $chromium_binary ]]; then
    echo "make-example-reports: no chromium; $png not made (run --png-only where it is)" >&2
    return 0
  fi
  profile=$(mktemp -d)
  "$chromium_binary" --headless --no-sandbox --disable-gpu --hide-scrollbars --no-first-run \
    --user-data-dir="$profile" --window-size=1280,9000 --screenshot="$(realpath "$png")" \
    "file://$(realpath "$html")" >/dev/null 2>&1
  rm -rf "$profile"
  /usr/bin/python3 - "$png" <<'PY'
import sys
from PIL import Image, ImageChops
path = sys.argv[1]
image = Image.open(path).convert("RGB")
box = ImageChops.difference(image, Image.new("RGB", image.size, (255, 255, 255))).getbbox()
if box:
    image = image.crop((0, 0, image.size[0], min(image.size[1], box[3] + 24)))
# 256 colours are plenty for text and flat charts, and a quarter of the bytes.
image.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
PY
  echo "make-example-reports: $png"
}

# The dump's model attribute, as kvaudit info reads it.
model_of() {
  "$kvaudit" info "$1" --json |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["model"])' 2>/dev/null || echo unknown
}

if [[ -n $png_only ]]; then
  for html in "$png_only"/*/report.html; do render_png "$html"; done
  exit 0
fi

[[ -z $deployment ]] && deployment="$backend on $(hostname)"
mkdir -p "$out"
if [[ -z $signing_key ]]; then  # a throwaway key: only its public key is kept
  key_dir=$(mktemp -d)
  trap 'rm -rf "$key_dir"' EXIT
  signing_key=$key_dir/key
  "$kvaudit" keygen --out "$signing_key" >/dev/null
  rm -f "$out/signing-key.pub"
  cp "$signing_key.pub" "$out/signing-key.pub"
fi
public_key=$signing_key.pub
for dump in datasets/*.h5; do
  name=$(basename "$dump" .h5)
  rm -rf "${out:?}/$name"
  status=0
  exec_options=()
  [[ -n $backend_command ]] && exec_options=(--backend-command "$backend_command")
  "$kvaudit" check "$dump" --backend "$backend" "${exec_options[@]}" --signoff \
    --signed-by "$signed_by" --signing-key "$signing_key" \
    --model "$(model_of "$dump")" \
    --deployment "$deployment" --report "$out/$name" >"$out/$name.stdout" 2>&1 || status=$?
  if ((status > 1)); then
    cat "$out/$name.stdout" >&2
    echo "make-example-reports: kvaudit check $dump exited $status" >&2
    exit "$status"
  fi
  mv "$out/$name.stdout" "$out/$name/check.stdout"
  echo "make-example-reports: $out/$name ($(tail -n 1 "$out/$name/check.stdout"))"
  "$kvaudit" verify-report "$out/$name" --public-key "$public_key" >/dev/null
  render_png "$out/$name/report.html"
done
