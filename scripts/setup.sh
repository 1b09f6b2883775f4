#!/usr/bin/env bash
# Installs what kvaudit needs (Debian 12 packages) when any of it is missing; installed packages
# are not reinstalled, so it is quick to run again. It builds nothing: scripts/run-main-job.sh
# builds the kvaudit binary, scripts/run-tests.sh everything with the tests.
#   bash scripts/setup.sh --list [tests]   prints the set's packages, one per line, installs nothing
#   bash scripts/setup.sh          what building kvaudit needs (the main job calls this):
#     cmake g++ make pkg-config libhdf5-dev libboost-dev libcli11-dev nlohmann-json3-dev
#     libfmt-dev nettle-dev libgmp-dev (libgmp-dev, which nettle-dev pulls in anyway, for the
#     libgmp.a that the portable build links after libhogweed.a, nettle's Ed25519)
#   bash scripts/setup.sh tests    that, and what the tests need (scripts/run-tests.sh calls this):
#     catch2 clang-format python3-h5py python3-numpy python3-jsonschema, and for the test that
#     renders report.html in headless Chromium (tests/report/test_report_browser.cpp, about
#     120 MB): chromium tidy python3-pil python3-html5lib fonts-dejavu-core
# (python3-h5py and python3-numpy because the tests write dumps with /usr/bin/python3;
# python3-jsonschema for report.json's schema test, tests/report/check_report_schema.py; the
# kvdump Python package itself goes into a venv, scripts/setup-python.sh.)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

build_packages=(cmake g++ make pkg-config libhdf5-dev libboost-dev libcli11-dev nlohmann-json3-dev
                libfmt-dev nettle-dev libgmp-dev)
test_packages=(catch2 clang-format python3-h5py python3-numpy python3-jsonschema)
browser_packages=(chromium tidy python3-pil python3-html5lib fonts-dejavu-core)

list=0
if [[ ${1:-} == --list ]]; then
  list=1
  shift
fi
case ${1:-build} in
  build) packages=("${build_packages[@]}") ;;
  tests) packages=("${build_packages[@]}" "${test_packages[@]}" "${browser_packages[@]}") ;;
  *)
    echo "setup: unknown set '$1'; use no argument (building kvaudit) or 'tests'" >&2
    exit 2
    ;;
esac
if ((list)); then
  printf '%s\n' "${packages[@]}"
  exit 0
fi

missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$package")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "setup: the packages for ${1:-build} are present"
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
