#!/usr/bin/env bash
# Installs the Debian packages kvbridge needs, when they are missing.
# As root it runs apt-get; otherwise it prints the command and fails.
set -euo pipefail

PACKAGES=(
  cmake ninja-build g++ make pkg-config
  libgtest-dev libgmock-dev libbenchmark-dev
  nlohmann-json3-dev libxxhash-dev libcli11-dev
  clang-14 libclang-rt-14-dev clang-format-14
  libssl-dev
  python3 jq iproute2
  libucx-dev ucx-utils iperf3
  gnuplot-nox
  redis-server redis-tools libhiredis-dev
  etcd-server etcd-client libcurl4-openssl-dev
  python3-dev python3-pybind11 python3-pytest python3-numpy python3-torch
)

missing=()
for p in "${PACKAGES[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$p")
done

if [[ ${#missing[@]} -eq 0 ]]; then
  exit 0
fi

echo "kvbridge: missing Debian packages: ${missing[*]}" >&2
if [[ $(id -u) -ne 0 ]]; then
  echo "kvbridge: run as root, or: sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends "${missing[@]}"
