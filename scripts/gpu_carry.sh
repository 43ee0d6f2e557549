#!/usr/bin/env bash
# Builds the GPU programs here (nvcc, sm_90) and copies them, stripped of debug info, with the
# non-system shared libraries they load (gRPC, protobuf, Abseil, prometheus-cpp: the GPU
# machine's image has none of them), into .carry/dev (git-ignored): the folder
# scripts/gpu_check.sh runs from on the GPU machine, packed as .carry/pack/dev.tar.xz (carry
# [".carry/pack"]).
#   BUILD: build directory (default build, the README's full build)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
bins=(kernels_cuda_test gpu_engine_test gpu_host_tier_test engine_bench host_tier_bench
      rpc_decode_bench kvsparse-server)
cmake -S . -B "$BUILD" -G Ninja > /dev/null
cmake --build "$BUILD" -j2 --target "${bins[@]}" kvsparse_cuda_capi
rm -rf .carry/dev/bin .carry/dev/lib
mkdir -p .carry/dev/bin .carry/dev/lib
for b in "${bins[@]}"; do strip --strip-debug -o ".carry/dev/bin/$b" "$BUILD/bin/$b"; done
strip --strip-debug -o .carry/dev/lib/libkvsparse_cuda_capi.so "$BUILD/lib/libkvsparse_cuda_capi.so"
for f in .carry/dev/bin/* .carry/dev/lib/libkvsparse_cuda_capi.so; do
  ldd "$f" | awk '/=> \// {print $3}' \
    | grep -vE '/(libc|libm|libstdc\+\+|libgcc_s|libdl|libpthread|librt|ld-linux[^/]*|libcuda)\.so' \
    || true
done | sort -u | while read -r lib; do cp -L "$lib" .carry/dev/lib/; done
# One compressed pack: the carried tree is limited to 64 MiB, and the CUDA code in every binary
# compresses well. scripts/gpu_check.sh unpacks it on the GPU machine.
mkdir -p .carry/pack
tar -C .carry -cf - dev | xz -T2 -6 > .carry/pack/dev.tar.xz
du -sh .carry/dev .carry/pack/dev.tar.xz
