#!/usr/bin/env bash
# The Python package (client/python) against the real kvsparse-server of BUILD_DIR: installs it
# with its test extras into a virtual environment (build/venv by default), builds its gRPC stubs
# from proto/ on the way, builds the PyTorch extension (libkvsparse_torch.so, the engine in
# process) against that torch, and runs pytest (the client over every RPC, the in-process ops,
# Hugging Face generation through both; tests marked gpu skip without a CUDA device).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build}
venv=${VENV:-$build/venv}
[ -x "$build/bin/kvsparse-server" ] || { echo "build $build/bin/kvsparse-server first"; exit 1; }
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
fi
"$venv/bin/pip" install -q -c client/python/tests/constraints.txt "./client/python[test]"
torch_prefix=$("$venv/bin/python" -c "import torch; print(torch.utils.cmake_prefix_path)")
cmake -S . -B "$build" -DKVSPARSE_TORCH_PREFIX="$torch_prefix" > /dev/null
cmake --build "$build" -j "${JOBS:-$(nproc)}" --target kvsparse_torch
# The op's tests skip where the library is not built; here it was built, so it must load (an
# undefined symbol would otherwise turn a dozen tests into skips).
"$venv/bin/python" -c "import sys, torch; torch.ops.load_library(sys.argv[1])" \
  "$PWD/$build/lib/libkvsparse_torch.so"
# PYTEST_WORKERS processes (pytest-xdist, default 2), each test file whole in one of them (its
# module fixtures built once); 1 runs them in this process.
KVSPARSE_SERVER="$PWD/$build/bin/kvsparse-server" KVSPARSE_TORCH_LIB="$PWD/$build/lib/libkvsparse_torch.so" \
  "$venv/bin/python" -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist loadfile client/python/tests tests/quality \
  tests/load tests/faults tests/scale tests/bench "$@"
