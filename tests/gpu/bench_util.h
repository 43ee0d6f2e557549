// Shared pieces of the GPU benchmarks in tests/gpu/.
#ifndef KVSPARSE_TESTS_GPU_BENCH_UTIL_H_
#define KVSPARSE_TESTS_GPU_BENCH_UTIL_H_

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
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

// Host-side cost of the CUDA calls a decode call makes, in us per call (median over batches of
// 100 calls on an idle non-blocking stream): what the engine's launch phase is made of.
struct ApiCost {
  double event_record = 0, memset_launch = 0, small_h2d = 0, small_d2h = 0, sync_idle = 0;
};
inline ApiCost MeasureApiCost() {
  cudaStream_t s;
  KVSPARSE_BENCH_CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t ev;
  KVSPARSE_BENCH_CK(cudaEventCreate(&ev));
  void *h = nullptr, *d = nullptr;
  KVSPARSE_BENCH_CK(cudaMallocHost(&h, 4096));
  KVSPARSE_BENCH_CK(cudaMalloc(&d, 4096));
  auto per_call = [&](auto&& call) {
    std::vector<double> us;
    for (int rep = 0; rep < 7; ++rep) {
      KVSPARSE_BENCH_CK(cudaStreamSynchronize(s));
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < 100; ++i) call();
      const auto t1 = std::chrono::steady_clock::now();
      us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / 100);
    }
    KVSPARSE_BENCH_CK(cudaStreamSynchronize(s));
    return Median(us);
  };
  ApiCost c;
  c.event_record = per_call([&] { KVSPARSE_BENCH_CK(cudaEventRecord(ev, s)); });
  c.memset_launch = per_call([&] { KVSPARSE_BENCH_CK(cudaMemsetAsync(d, 0, 4, s)); });
  c.small_h2d =
      per_call([&] { KVSPARSE_BENCH_CK(cudaMemcpyAsync(d, h, 4096, cudaMemcpyHostToDevice, s)); });
  c.small_d2h =
      per_call([&] { KVSPARSE_BENCH_CK(cudaMemcpyAsync(h, d, 4096, cudaMemcpyDeviceToHost, s)); });
  c.sync_idle = per_call([&] { KVSPARSE_BENCH_CK(cudaStreamSynchronize(s)); });
  KVSPARSE_BENCH_CK(cudaFreeHost(h));
  KVSPARSE_BENCH_CK(cudaFree(d));
  KVSPARSE_BENCH_CK(cudaEventDestroy(ev));
  KVSPARSE_BENCH_CK(cudaStreamDestroy(s));
  return c;
}

}  // namespace kvsparse::bench

#endif  // KVSPARSE_TESTS_GPU_BENCH_UTIL_H_
