#!/usr/bin/env bash
# Installs the build and test dependencies from Debian packages (Debian 12 / bookworm).
# The CUDA toolkit is optional: when nvcc is on PATH or at /usr/local/cuda, CUDA kernels build.
set -euo pipefail
pkgs=(build-essential cmake ninja-build ccache pkg-config python3 python3-venv python3-pip
      libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
      libabsl-dev prometheus-cpp-dev libgtest-dev libbenchmark-dev
      libucx-dev                     # the UCX data plane (kvstore/ucx_plane.h)
      clang libclang-common-14-dev   # clang + its libFuzzer runtime: scripts/fuzz.sh
      openssl                        # certificates of the TLS tests (test_security.py)
      iproute2 iptables)             # the network-namespace fault test (tests/faults/test_netem.py)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#pkgs[@]} packages present"
  exit 0
fi
sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "install_deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
