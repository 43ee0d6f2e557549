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

SideStream::~SideStream() {
  if (join_ != nullptr) cudaEventDestroy(join_);
  if (fork_ != nullptr) cudaEventDestroy(fork_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::Status SideStream::Create() {
  if (stream_ != nullptr) return absl::OkStatus();
  int lowest = 0, highest = 0;
  KVS_CUDA_OK(cudaDeviceGetStreamPriorityRange(&lowest, &highest), "stream priorities");
  KVS_CUDA_OK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming), "side stream event");
  KVS_CUDA_OK(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming), "side stream event");
  KVS_CUDA_OK(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, lowest), "side stream");
  return absl::OkStatus();
}

absl::Status SideStream::Fork(cudaStream_t from) {
  KVS_CUDA_OK(cudaEventRecord(fork_, from), "side stream fork");
  KVS_CUDA_OK(cudaStreamWaitEvent(stream_, fork_, 0), "side stream fork");
  return absl::OkStatus();
}

absl::Status SideStream::RecordJoin() {
  KVS_CUDA_OK(cudaEventRecord(join_, stream_), "side stream join");
  return absl::OkStatus();
}

absl::Status SideStream::JoinRecorded(cudaStream_t into) {
  KVS_CUDA_OK(cudaStreamWaitEvent(into, join_, 0), "side stream join");
  return absl::OkStatus();
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
