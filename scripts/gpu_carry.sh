#!/usr/bin/env bash
# Builds the CUDA kernels, their GPU tests and the C ABI library here (nvcc, sm_90) and copies
# them, with the non-system shared libraries they load, into .carry/dev (git-ignored), the
# folder scripts/gpu_check.sh runs from on the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build-cuda}
cmake -S . -B "$BUILD" -G Ninja -DKVSPARSE_CORE_ONLY=ON > /dev/null
cmake --build "$BUILD" -j2 --target kernels_cuda_test kvsparse_cuda_capi
mkdir -p .carry/dev/bin .carry/dev/lib
cp "$BUILD/bin/kernels_cuda_test" .carry/dev/bin/
cp "$BUILD/lib/libkvsparse_cuda_capi.so" .carry/dev/lib/
for f in .carry/dev/bin/kernels_cuda_test .carry/dev/lib/libkvsparse_cuda_capi.so; do
  ldd "$f" | awk '/=> \// {print $3}' \
    | grep -vE '/(libc|libm|libstdc\+\+|libgcc_s|libdl|libpthread|librt|ld-linux[^/]*|libcuda)\.so' \
    | while read -r lib; do cp -L "$lib" .carry/dev/lib/; done
done
du -sh .carry/dev
