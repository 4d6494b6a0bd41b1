#!/usr/bin/env bash
# Installs the Debian packages moeflex needs (only those missing). Runs as root on
# Debian 12; elsewhere it prints what to install. Safe to run every time.
set -euo pipefail

packages=(
  build-essential cmake pkg-config ninja-build
  libopenblas-dev libopenblas-openmp-dev libomp-dev
  libsentencepiece-dev sentencepiece
  libcli11-dev libtomlplusplus-dev nlohmann-json3-dev libfmt-dev libspdlog-dev libssl-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libopenmpi-dev openmpi-bin
  python3-torch python3-numpy python3-matplotlib
  perl
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# npm comes with Debian's npm package, or bundled in another nodejs build (e.g.
# NodeSource's, which conflicts with Debian's npm): only install it when absent.
command -v npm >/dev/null 2>&1 || missing+=(npm)
if ((${#missing[@]} == 0)); then
  echo "setup: all ${#packages[@]} packages present."
  exit 0
fi
echo "setup: installing ${missing[*]}"
if [[ $(id -u) -ne 0 ]]; then
  echo "setup: error: not root; run: sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
