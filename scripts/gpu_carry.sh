#!/usr/bin/env bash
# For a GPU host without network access: build and pack here, copy the tree to the host, run
# scripts/gpu_check.sh there. Builds the GPU programs here (nvcc, sm_90a) and copies them, stripped
# of debug info, with the non-system shared libraries they load (gRPC, protobuf, Abseil,
# prometheus-cpp: the GPU host's image has none of them), into .carry/dev (git-ignored): the
# folder scripts/gpu_check.sh runs from on the GPU host, packed as .carry/pack/dev.tar.xz (every
# GPU program; over 64 MiB with the tree: for a host that takes a copy of any size), its
# libraries, server and the selection and host-tier benchmarks as .carry/qpack/dev.tar.xz, and
# its GPU tests with the PyTorch op as .carry/tpack/dev.tar.xz.
# With the PyTorch extension configured (scripts/python_test.sh does), libkvsparse_torch.so is
# packed too, with the libraries it needs beside torch's own (those the GPU host's torch has).
#   BUILD: build directory (default build, the README's full build)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
bins=(kernels_cuda_test gpu_engine_test gpu_host_tier_test engine_bench host_tier_bench
      selection_bench rpc_decode_bench kvsparse-server)
cmake -S . -B "$BUILD" -G Ninja > /dev/null
libs=(kvsparse_cuda_capi)
grep -q "KVSPARSE_TORCH_PREFIX:PATH=." "$BUILD/CMakeCache.txt" && libs+=(kvsparse_torch)
cmake --build "$BUILD" -j2 --target "${bins[@]}" "${libs[@]}"
rm -rf .carry/dev/bin .carry/dev/lib
mkdir -p .carry/dev/bin .carry/dev/lib
for b in "${bins[@]}"; do strip --strip-debug -o ".carry/dev/bin/$b" "$BUILD/bin/$b"; done
for l in "${libs[@]}"; do strip --strip-debug -o ".carry/dev/lib/lib$l.so" "$BUILD/lib/lib$l.so"; done
for f in .carry/dev/bin/* .carry/dev/lib/*.so; do
  ldd "$f" | awk '/=> \// {print $3}' \
    | grep -vE '/(libc|libm|libstdc\+\+|libgcc_s|libdl|libpthread|librt|ld-linux[^/]*|libcuda)\.so' \
    | grep -v site-packages \
    || true
done | sort -u | while read -r lib; do cp -L "$lib" .carry/dev/lib/; done
# The full pack: every GPU program, compressed (the CUDA code in every binary compresses well).
# scripts/gpu_check.sh unpacks it on the GPU host.
mkdir -p .carry/pack .carry/qpack
tar -C .carry -cf - dev | xz -T2 -6 > .carry/pack/dev.tar.xz
# The quality pack: the libraries (the PyTorch op among them), the server, the selection
# kernels' benchmark and the host tier's (no test binaries), small enough to travel beside the
# wheels (.whl, scripts/gpu_wheels.sh) for the e2e, Python, selbench and hosttier steps, or
# beside a model checkpoint (build/quality/model).
tar -C .carry --exclude=libkvsparse_cuda_capi.so -cf - dev/lib dev/bin/kvsparse-server \
  dev/bin/selection_bench dev/bin/host_tier_bench | xz -T2 -9 > .carry/qpack/dev.tar.xz
# The test pack: the GPU tests and the PyTorch op (when built) with the libraries they load (the
# tests' steps; beside the wheels while the tree stays under about 24 MiB).
mkdir -p .carry/tpack
tar -C .carry --exclude=libkvsparse_cuda_capi.so -cf - dev/lib dev/bin/kernels_cuda_test \
  dev/bin/gpu_engine_test dev/bin/gpu_host_tier_test | xz -T2 -6 > .carry/tpack/dev.tar.xz
du -sh .carry/dev .carry/pack/dev.tar.xz .carry/qpack/dev.tar.xz .carry/tpack/dev.tar.xz
