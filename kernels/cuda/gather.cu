#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/gather.h"

namespace kvsparse::kernels::cuda {
namespace {

constexpr int kGatherThreads = 256;

// Each thread copies `kIn` chunks of type V (16 or 4 bytes), all loads issued before the
// stores so that many reads are in flight (what a zero-copy gather over PCIe needs).
template <typename V, int kIn>
__global__ void __launch_bounds__(kGatherThreads) GatherKernel(GatherRowsParams p, int chunks) {
  const int64_t total = static_cast<int64_t>(p.num_rows) * chunks;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kGatherThreads;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kGatherThreads + threadIdx.x; base < total;
       base += stride * kIn) {
    V v[kIn];
    int64_t r[kIn];
    int c[kIn];
#pragma unroll
    for (int i = 0; i < kIn; ++i) {
      const int64_t e = base + i * stride;
      r[i] = e < total ? e / chunks : -1;
      c[i] = e < total ? static_cast<int>(e % chunks) : 0;
      const int64_t src_row = r[i] >= 0 ? p.rows[r[i]] : -1;
      if (src_row >= 0) {
        v[i] = reinterpret_cast<const V*>(static_cast<const char*>(p.src) +
                                          src_row * p.src_row_stride)[c[i]];
      } else {
        v[i] = V{};
      }
    }
#pragma unroll
    for (int i = 0; i < kIn; ++i) {
      if (r[i] >= 0) {
        reinterpret_cast<V*>(static_cast<char*>(p.dst) + r[i] * p.dst_row_stride)[c[i]] = v[i];
      }
    }
  }
}

}  // namespace

cudaError_t GatherRows(const GatherRowsParams& p, cudaStream_t stream) {
  if (p.num_rows < 0 || p.row_bytes < 0 || p.row_bytes % 4 != 0) return cudaErrorInvalidValue;
  if (p.num_rows == 0 || p.row_bytes == 0) return cudaSuccess;
  if (p.src == nullptr || p.dst == nullptr || p.rows == nullptr) return cudaErrorInvalidValue;
  const auto addr = [](const void* x) { return reinterpret_cast<uintptr_t>(x); };
  const bool vec16 = p.row_bytes % 16 == 0 && addr(p.src) % 16 == 0 && addr(p.dst) % 16 == 0 &&
                     p.src_row_stride % 16 == 0 && p.dst_row_stride % 16 == 0;
  if (!vec16 && (addr(p.src) % 4 != 0 || addr(p.dst) % 4 != 0 || p.src_row_stride % 4 != 0 ||
                 p.dst_row_stride % 4 != 0)) {
    return cudaErrorInvalidValue;
  }
  const int chunks = vec16 ? p.row_bytes / 16 : p.row_bytes / 4;
  constexpr int kIn = 4;
  const int64_t total = static_cast<int64_t>(p.num_rows) * chunks;
  const int64_t want = (total + kGatherThreads * kIn - 1) / (kGatherThreads * kIn);
  const int blocks = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(want, static_cast<int64_t>(NumSms()) * 8)));
  if (vec16) {
    GatherKernel<uint4, kIn><<<blocks, kGatherThreads, 0, stream>>>(p, chunks);
  } else {
    GatherKernel<uint32_t, kIn><<<blocks, kGatherThreads, 0, stream>>>(p, chunks);
  }
  return cudaGetLastError();
}

cudaError_t MappedDevicePointer(const void* host, const void** device) {
  void* d = nullptr;
  const cudaError_t e = cudaHostGetDevicePointer(&d, const_cast<void*>(host), 0);
  *device = d;
  return e;
}

}  // namespace kvsparse::kernels::cuda
