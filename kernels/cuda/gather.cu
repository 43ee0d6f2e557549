#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/gather.h"

namespace kvsparse::kernels::cuda {
namespace {

constexpr int kGatherThreads = 256;

// Where source row r starts (null: no row), for rows given by index into a strided array...
struct IndexedRows {
  const char* base;
  const int64_t* rows;
  int64_t stride;
  __device__ const char* operator()(int64_t r) const {
    const int64_t s = rows[r];
    return s >= 0 ? base + s * stride : nullptr;
  }
};
// ... or by address.
struct AddressedRows {
  const void* const* rows;
  __device__ const char* operator()(int64_t r) const { return static_cast<const char*>(rows[r]); }
};

// Each thread copies `kIn` chunks of type V (16 or 4 bytes), all loads issued before the
// stores so that many reads are in flight (what a zero-copy gather over PCIe needs).
template <typename V, int kIn, typename Rows>
__global__ void __launch_bounds__(kGatherThreads)
    GatherKernel(Rows src_rows, int32_t num_rows, int chunks, char* dst, int64_t dst_stride) {
  const int64_t total = static_cast<int64_t>(num_rows) * chunks;
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
      const char* src = r[i] >= 0 ? src_rows(r[i]) : nullptr;
      v[i] = src != nullptr ? reinterpret_cast<const V*>(src)[c[i]] : V{};
    }
#pragma unroll
    for (int i = 0; i < kIn; ++i) {
      if (r[i] >= 0) reinterpret_cast<V*>(dst + r[i] * dst_stride)[c[i]] = v[i];
    }
  }
}

constexpr int kIn = 4;

int GatherBlocks(int32_t num_rows, int chunks) {
  const int64_t total = static_cast<int64_t>(num_rows) * chunks;
  const int64_t want = (total + kGatherThreads * kIn - 1) / (kGatherThreads * kIn);
  return static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(want, static_cast<int64_t>(NumSms()) * 8)));
}

}  // namespace

cudaError_t GatherRows(const GatherRowsParams& p, cudaStream_t stream) {
  if (p.num_rows < 0 || p.row_bytes < 0 || p.row_bytes % 4 != 0) return cudaErrorInvalidValue;
  if (p.num_rows == 0 || p.row_bytes == 0) return cudaSuccess;
  if (p.src == nullptr || p.dst == nullptr || p.rows == nullptr) return cudaErrorInvalidValue;
  const auto addr = [](const void* x) { return reinterpret_cast<uintptr_t>(x); };
  const bool vec16 = p.row_bytes % 16 == 0 && !Misaligned16(p.src) && !Misaligned16(p.dst) &&
                     p.src_row_stride % 16 == 0 && p.dst_row_stride % 16 == 0;
  if (!vec16 && (addr(p.src) % 4 != 0 || addr(p.dst) % 4 != 0 || p.src_row_stride % 4 != 0 ||
                 p.dst_row_stride % 4 != 0)) {
    return cudaErrorInvalidValue;
  }
  const int chunks = vec16 ? p.row_bytes / 16 : p.row_bytes / 4;
  const int blocks = GatherBlocks(p.num_rows, chunks);
  const IndexedRows rows{static_cast<const char*>(p.src), p.rows, p.src_row_stride};
  char* dst = static_cast<char*>(p.dst);
  if (vec16) {
    GatherKernel<uint4, kIn>
        <<<blocks, kGatherThreads, 0, stream>>>(rows, p.num_rows, chunks, dst, p.dst_row_stride);
  } else {
    GatherKernel<uint32_t, kIn>
        <<<blocks, kGatherThreads, 0, stream>>>(rows, p.num_rows, chunks, dst, p.dst_row_stride);
  }
  return cudaGetLastError();
}

cudaError_t GatherRowPtrs(const GatherRowPtrsParams& p, cudaStream_t stream) {
  if (p.num_rows < 0 || p.row_bytes < 0 || p.row_bytes % 16 != 0) return cudaErrorInvalidValue;
  if (p.num_rows == 0 || p.row_bytes == 0) return cudaSuccess;
  if (p.rows == nullptr || p.dst == nullptr || Misaligned16(p.dst) || p.dst_row_stride % 16 != 0) {
    return cudaErrorInvalidValue;
  }
  const int chunks = p.row_bytes / 16;
  GatherKernel<uint4, kIn><<<GatherBlocks(p.num_rows, chunks), kGatherThreads, 0, stream>>>(
      AddressedRows{p.rows}, p.num_rows, chunks, static_cast<char*>(p.dst), p.dst_row_stride);
  return cudaGetLastError();
}

cudaError_t MappedDevicePointer(const void* host, const void** device) {
  void* d = nullptr;
  const cudaError_t e = cudaHostGetDevicePointer(&d, const_cast<void*>(host), 0);
  *device = d;
  return e;
}

}  // namespace kvsparse::kernels::cuda
