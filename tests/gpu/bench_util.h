// Shared pieces of the GPU benchmarks in tests/gpu/.
#ifndef KVSPARSE_TESTS_GPU_BENCH_UTIL_H_
#define KVSPARSE_TESTS_GPU_BENCH_UTIL_H_

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace kvsparse::bench {

#define KVSPARSE_BENCH_CK(x)                                                                 \
  do {                                                                                       \
    cudaError_t e = (x);                                                                     \
    if (e != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "CUDA %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

template <typename X>
X Median(std::vector<X> v) {
  if (v.empty()) return X{};
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// GB/s of one bulk copy of 256 MiB from pinned host memory to the device (median of 10 after 2
// warm-ups): what rows crossing the host link are judged against.
inline double BulkHostToDeviceGBs() {
  const size_t n = 256ull << 20;
  void *h = nullptr, *d = nullptr;
  cudaEvent_t e0, e1;
  KVSPARSE_BENCH_CK(cudaEventCreate(&e0));
  KVSPARSE_BENCH_CK(cudaEventCreate(&e1));
  KVSPARSE_BENCH_CK(cudaMallocHost(&h, n));
  KVSPARSE_BENCH_CK(cudaMalloc(&d, n));
  std::memset(h, 1, n);
  std::vector<float> ms;
  for (int i = 0; i < 12; ++i) {
    KVSPARSE_BENCH_CK(cudaEventRecord(e0));
    KVSPARSE_BENCH_CK(cudaMemcpyAsync(d, h, n, cudaMemcpyHostToDevice));
    KVSPARSE_BENCH_CK(cudaEventRecord(e1));
    KVSPARSE_BENCH_CK(cudaEventSynchronize(e1));
    float t;
    KVSPARSE_BENCH_CK(cudaEventElapsedTime(&t, e0, e1));
    if (i >= 2) ms.push_back(t);
  }
  KVSPARSE_BENCH_CK(cudaFreeHost(h));
  KVSPARSE_BENCH_CK(cudaFree(d));
  KVSPARSE_BENCH_CK(cudaEventDestroy(e0));
  KVSPARSE_BENCH_CK(cudaEventDestroy(e1));
  return n / Median(ms) / 1e6;
}

}  // namespace kvsparse::bench

#endif  // KVSPARSE_TESTS_GPU_BENCH_UTIL_H_
