#!/usr/bin/env bash
# Installs kvaudit's build dependencies (Debian 12 packages) when any is missing; installed packages
# are not reinstalled, so it is quick to run again. It builds nothing: scripts/run-main-job.sh
# builds the kvaudit binary, scripts/run-tests.sh everything with the tests.
#   cmake g++ make pkg-config libhdf5-dev libboost-dev libcli11-dev catch2 nlohmann-json3-dev
#   libfmt-dev nettle-dev libgmp-dev python3-h5py python3-numpy python3-jsonschema clang-format
# (libgmp-dev, which nettle-dev pulls in anyway, for the libgmp.a the portable build links after
# libhogweed.a, nettle's Ed25519; python3-h5py and python3-numpy for the tests, which write dumps
# with /usr/bin/python3; python3-jsonschema for report.json's schema test, tests/report/check_report_schema.py; the
# kvdump Python package itself installs into any Python with `pip install ./python`.)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

packages=(cmake g++ make pkg-config libhdf5-dev libboost-dev libcli11-dev catch2 nlohmann-json3-dev
          libfmt-dev nettle-dev libgmp-dev python3-h5py python3-numpy python3-jsonschema
          clang-format
          chromium tidy python3-pil python3-html5lib fonts-dejavu-core)  # report.html's browser test
missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$package")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "setup: build dependencies present"
  exit 0
fi

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
