#!/usr/bin/env bash
# Installs kvaudit's build dependencies (Debian 12 packages) when any is missing, then configures
# and builds into build/ (Release; CUDA on when nvcc is found). Safe to run again: installed
# packages are not reinstalled and the build is incremental.
#   KVAUDIT_BUILD_DIR  build directory (default: build)
#   KVAUDIT_JOBS       parallel build jobs (default: nproc)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

packages=(cmake g++ make pkg-config libhdf5-dev libboost-dev libcli11-dev catch2 nlohmann-json3-dev
          libfmt-dev nettle-dev python3-h5py python3-numpy clang-format
          chromium tidy python3-pil python3-html5lib fonts-dejavu-core)  # report.html's browser test
missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$package")
  fi
done

if ((${#missing[@]} > 0)); then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=()
  if [[ $(id -u) -ne 0 ]]; then
    if command -v sudo >/dev/null; then
      sudo_cmd=(sudo)
    else
      echo "setup: missing packages (${missing[*]}) and not root; install them first" >&2
      exit 2
    fi
  fi
  apt_install=("${sudo_cmd[@]}" env DEBIAN_FRONTEND=noninteractive
               apt-get install -y --no-install-recommends "${missing[@]}")
  # Refresh the package lists only when there are none or the install cannot find a package.
  if ! compgen -G '/var/lib/apt/lists/*_Packages' >/dev/null; then
    "${sudo_cmd[@]}" apt-get update
  fi
  if ! "${apt_install[@]}"; then
    "${sudo_cmd[@]}" apt-get update
    "${apt_install[@]}"
  fi
else
  echo "setup: build dependencies present"
fi

# CUDA toolkits install nvcc outside PATH; CMake finds the compiler through PATH or CUDACXX.
if ! command -v nvcc >/dev/null && [[ -z ${CUDACXX:-} && -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi

build_dir=${KVAUDIT_BUILD_DIR:-build}
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release
cmake --build "$build_dir" -j"${KVAUDIT_JOBS:-$(nproc)}"
