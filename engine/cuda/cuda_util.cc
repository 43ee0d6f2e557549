#include "engine/cuda/cuda_util.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace kvsparse::engine::gpu {

absl::Status CudaStatus(cudaError_t e, absl::string_view what) {
  if (e == cudaSuccess) return absl::OkStatus();
  if (e == cudaErrorMemoryAllocation) {
    return absl::ResourceExhaustedError(absl::StrCat(what, ": GPU memory exhausted"));
  }
  return absl::InternalError(absl::StrCat(what, ": CUDA error ", cudaGetErrorString(e)));
}

PinnedBuf::~PinnedBuf() {
  if (ptr_ != nullptr) cudaFreeHost(ptr_);
}

absl::Status PinnedBuf::Reserve(size_t n) {
  if (n <= bytes_) return absl::OkStatus();
  if (ptr_ != nullptr) cudaFreeHost(ptr_);
  ptr_ = nullptr;
  bytes_ = 0;
  const size_t want = std::max<size_t>(n, 1 << 20);
  KVS_CUDA_OK(cudaMallocHost(&ptr_, want), "pinned staging");
  bytes_ = want;
  return absl::OkStatus();
}

}  // namespace kvsparse::engine::gpu
