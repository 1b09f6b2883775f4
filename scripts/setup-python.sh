#!/usr/bin/env bash
# Creates the Python environment kvaudit's tests use for the Python package (python/): a venv at
# build/python-venv with `pip install ./python` (kvdump: the dump writer and the external-backend
# adapters, `python -m kvdump.backends`), and PyTorch in it when KVAUDIT_WITH_TORCH=1 (CI sets
# it), so that the `torch` adapter can be run end to end on the CPU. Safe to run again: an
# existing venv is reused, the package is reinstalled from the source tree, torch is installed
# only when it does not import yet. Prints what it did.
#   KVAUDIT_PYTHON_VENV     where the venv goes (default: build/python-venv)
#   KVAUDIT_PYTHON          the interpreter that creates it (default: python3)
#   KVAUDIT_WITH_TORCH=1    also install torch (the package's [torch] extra) and transformers
#                           5.25.0 (its [hf] extra: kvdump.hf_capture, GLM-5's own attention)
#   KVAUDIT_TORCH_INDEX_URL a package index to take torch from (e.g. one serving CPU-only
#                           wheels); default: pip's configured index
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

venv=${KVAUDIT_PYTHON_VENV:-build/python-venv}
python=${KVAUDIT_PYTHON:-python3}

say() { echo "setup-python: $*"; }

# Debian's python3 has venv only with the python3-venv package (ensurepip is split out).
install_debian_venv() {
  local sudo_cmd=()
  if [[ $(id -u) -ne 0 ]]; then
    if ! command -v sudo >/dev/null; then
      echo "setup-python: $python cannot create a venv; install python3-venv" >&2
      exit 2
    fi
    sudo_cmd=(sudo)
  fi
  local version
  version=$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  say "installing python3-venv (and python${version}-venv) for $python"
  "${sudo_cmd[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
    python3-venv "python${version}-venv" ||
    { "${sudo_cmd[@]}" apt-get update &&
      "${sudo_cmd[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y \
        --no-install-recommends python3-venv; }
}

if [[ -x $venv/bin/python ]] && "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
  say "reusing $venv ($("$venv/bin/python" --version 2>&1))"
else
  rm -rf "$venv"
  if ! "$python" -m venv "$venv" 2>/dev/null; then
    rm -rf "$venv"
    install_debian_venv
    "$python" -m venv "$venv"
  fi
  say "created $venv with $("$venv/bin/python" --version 2>&1) ($(command -v "$python"))"
fi

pip=("$venv/bin/python" -m pip --disable-pip-version-check --quiet)
"${pip[@]}" install ./python
version=$("$venv/bin/python" -c \
  'import importlib.metadata as m; print(m.version("kvaudit-kvdump"))')
say "installed ./python: kvaudit-kvdump $version, numpy and h5py"

if [[ ${KVAUDIT_WITH_TORCH:-0} == 1 ]]; then
  if "$venv/bin/python" -c 'import torch' >/dev/null 2>&1; then
    say "torch already installed: $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
  else
    index=()
    [[ -n ${KVAUDIT_TORCH_INDEX_URL:-} ]] && index=(--index-url "$KVAUDIT_TORCH_INDEX_URL")
    say "installing torch (>= 2.1)${index:+ from $KVAUDIT_TORCH_INDEX_URL}"
    # torch's Linux wheels pull in CUDA libraries (about 5 GiB installed); without pip's cache
    # they are not stored a second time, which keeps a CI machine's disk from filling up.
    # Measured: the venv with torch 2.x and its CUDA libraries is 5.6 GiB; pip also holds the
    # largest wheel while it unpacks. Below 7 GiB free pip ends in "[Errno 28] No space left on
    # device" after minutes of downloading, so say so before starting.
    free_kib=$(df -k --output=avail "$(dirname "$venv")" | tail -1 | tr -d ' ')
    say "free disk before torch: $((free_kib / 1024 / 1024)) GiB in $(dirname "$venv")"
    if ((free_kib < 7 * 1024 * 1024)); then
      echo "setup-python: torch with its CUDA libraries needs about 7 GiB free in" \
        "$(dirname "$venv") (5.6 GiB installed plus the download); $((free_kib / 1024)) MiB" \
        "are free. Free some space, or set KVAUDIT_TORCH_INDEX_URL to an index of CPU-only" \
        "wheels (about 1 GiB), or leave KVAUDIT_WITH_TORCH unset to skip the torch adapter's" \
        "tests" >&2
      exit 2
    fi
    "${pip[@]}" install --no-cache-dir "${index[@]}" 'torch>=2.1'
    say "installed torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
  fi
  # The version kvdump.hf_capture is written against (python/pyproject.toml, extra [hf]).
  if [[ $("$venv/bin/python" -c 'import transformers; print(transformers.__version__)' \
    2>/dev/null) == 5.25.0 ]]; then
    say "transformers 5.25.0 already installed"
  else
    say "installing transformers 5.25.0 and safetensors"
    "${pip[@]}" install --no-cache-dir 'transformers==5.25.0' safetensors
    say "installed transformers $("$venv/bin/python" -c 'import transformers; print(transformers.__version__)')"
  fi
else
  say "torch not requested (KVAUDIT_WITH_TORCH=1 installs it; the torch adapter's tests" \
    "skip without it)"
fi
say "python for the package's tests: $venv/bin/python"
