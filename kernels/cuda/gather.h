// Row gathers: copy selected rows into a dense staging buffer. One kernel serves both tiers:
// src may be device memory or the device alias of pinned, mapped host memory (cudaHostAlloc with
// cudaHostAllocMapped, or cudaHostRegister with cudaHostRegisterMapped), in which case each row
// crosses PCIe/C2C exactly once, zero-copy, with no staging copy on the host.
#ifndef KVSPARSE_KERNELS_CUDA_GATHER_H_
#define KVSPARSE_KERNELS_CUDA_GATHER_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace kvsparse::kernels::cuda {

struct GatherRowsParams {
  // Device-visible base: device memory or a mapped host alias (MappedDevicePointer).
  const void* src = nullptr;
  int64_t src_row_stride = 0;  // bytes between row i and row i + 1 of src
  // device, shape: [num_rows]; row r of dst is row rows[r] of src (negative: dst row zeroed).
  const int64_t* rows = nullptr;
  int32_t num_rows = 0;
  int32_t row_bytes = 0;  // bytes per row; a multiple of 16 with 16-byte aligned rows takes the
                          // vector path, else a multiple of 4 with 4-byte alignment
  void* dst = nullptr;    // device, shape: [num_rows] rows of dst_row_stride bytes
  int64_t dst_row_stride = 0;
};

cudaError_t GatherRows(const GatherRowsParams& p, cudaStream_t stream);

// Rows given by address rather than by index: for a source that is not one strided array, such
// as the store's pages (kvstore::PageView), which a kernel may read in place when they are pinned
// and mapped (kvstore::NewPinnedHostMemoryResource: host addresses are device addresses).
struct GatherRowPtrsParams {
  // device, shape: [num_rows]; device-visible address of each source row, 16-byte aligned
  // (null: the dst row is zeroed).
  const void* const* rows = nullptr;
  int32_t num_rows = 0;
  int32_t row_bytes = 0;  // a multiple of 16
  void* dst = nullptr;    // device, shape: [num_rows] rows of dst_row_stride bytes, 16-aligned
  int64_t dst_row_stride = 0;
};

cudaError_t GatherRowPtrs(const GatherRowPtrsParams& p, cudaStream_t stream);

// The device alias of `host`, which must lie in memory allocated with cudaHostAlloc(...,
// cudaHostAllocMapped) or registered with cudaHostRegister(..., cudaHostRegisterMapped).
cudaError_t MappedDevicePointer(const void* host, const void** device);

}  // namespace kvsparse::kernels::cuda

#endif  // KVSPARSE_KERNELS_CUDA_GATHER_H_
