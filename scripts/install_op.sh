#!/usr/bin/env bash
# The in-process op in one command: builds libkvsparse_torch.so (torch.ops.kvsparse, the engine of
# kvsparse.torch.ops.InProcessEngine and the Hugging Face / vLLM in-process paths) against the torch of
# PYTHON's environment and copies it into that environment's installed kvsparse.torch package, where
# kvsparse.torch.ops finds it without $KVSPARSE_TORCH_LIB. CUDA kernels are built when nvcc is found and
# that torch is a CUDA build (sm_90a by default: CMAKE_CUDA_ARCHITECTURES overrides it;
# KVSPARSE_ENABLE_CUDA=OFF or ON decides instead), else the op runs the CPU engine. Needs the build dependencies of the C++ tree (scripts/install_deps.sh)
# and the package installed first (pip install "./client/python[torch]"). Reinstalling the
# package removes the op: run this again.
#   PYTHON=.venv/bin/python bash scripts/install_op.sh
#   OP_BUILD: the CMake build directory (default build-op)
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
op_build=${OP_BUILD:-build-op}
read -r prefix torch_cuda dest < <("$py" - <<'PY'
import os
import torch
import kvsparse
print(torch.utils.cmake_prefix_path, "ON" if torch.version.cuda else "OFF",
      os.path.join(os.path.dirname(kvsparse.__file__), "torch"))
PY
)
cuda=${KVSPARSE_ENABLE_CUDA:-}
if [ -z "$cuda" ]; then
  cuda=OFF
  if [ "$torch_cuda" = ON ] && command -v nvcc > /dev/null; then cuda=ON; fi
fi
cmake -S . -B "$op_build" -G Ninja -DKVSPARSE_ENABLE_CUDA="$cuda" \
  -DCMAKE_CUDA_ARCHITECTURES="${CMAKE_CUDA_ARCHITECTURES:-90a}" -DKVSPARSE_TORCH_PREFIX="$prefix" > /dev/null
cmake --build "$op_build" --target kvsparse_torch
install -m 755 "$op_build/lib/libkvsparse_torch.so" "$dest/libkvsparse_torch.so"
"$py" -c "import kvsparse.torch.ops as o; print('kvsparse op (CUDA $cuda):', o.load_library())"
