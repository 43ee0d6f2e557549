// Small pieces the GPU backend's parts share: CUDA errors as statuses, stream-ordered device
// buffers, growing pinned host buffers, and the carving of aligned regions out of one buffer.
#ifndef KVSPARSE_ENGINE_CUDA_CUDA_UTIL_H_
#define KVSPARSE_ENGINE_CUDA_CUDA_UTIL_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvsparse::engine::gpu {

// RESOURCE_EXHAUSTED for an allocation failure, INTERNAL for any other CUDA error.
absl::Status CudaStatus(cudaError_t e, absl::string_view what);

#define KVS_CUDA_OK(expr, what)                                                                   \
  do {                                                                                            \
    if (absl::Status s_ = ::kvsparse::engine::gpu::CudaStatus((expr), what); !s_.ok()) return s_; \
  } while (0)

// A stream-ordered device allocation (DeviceState allocates and frees it on its stream).
struct DevBuf {
  void* ptr = nullptr;
  size_t bytes = 0;
  template <typename X>
  X* as() const {
    return static_cast<X*>(ptr);
  }
};

// Pinned host memory that grows (contents not kept).
class PinnedBuf {
 public:
  PinnedBuf() = default;
  PinnedBuf(const PinnedBuf&) = delete;
  PinnedBuf& operator=(const PinnedBuf&) = delete;
  ~PinnedBuf();
  // At least n bytes (1 MiB at least); RESOURCE_EXHAUSTED / INTERNAL from cudaMallocHost.
  absl::Status Reserve(size_t n);
  void* ptr() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// A second stream that work of one call forks onto and joins back, with event record and wait
// only: inside a stream capture a fork pulls the side stream into the capture (and its join must
// come before the capture ends), outside one the two streams run side by side. Not thread-safe
// (its owner serialises calls).
class SideStream {
 public:
  SideStream() = default;
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;
  ~SideStream();
  // Creates the stream, at cudaDeviceGetStreamPriorityRange's lowest priority (its work is
  // background to the call's stream), and its events on the current device; before any capture.
  absl::Status Create();
  cudaStream_t stream() const { return stream_; }
  // The side stream waits for what `from` has enqueued so far.
  absl::Status Fork(cudaStream_t from);
  // Records the join point: what the side stream has enqueued so far. JoinRecorded makes `into`
  // wait for the last one recorded.
  absl::Status RecordJoin();
  absl::Status JoinRecorded(cudaStream_t into);

 private:
  cudaStream_t stream_ = nullptr;
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
};

// Consecutive 256-byte aligned regions of a buffer: sizes first (base null: Take returns null
// and only counts), then the same Takes over the real base give the pointers.
// TakeTransient is for a buffer whose contents end with the call's kernels (scores, a sampler's
// workspace): with a second region (the two-argument constructor: the layers of a captured step
// run one after another on one stream and share one) it comes from there, counted apart
// (transient_used); otherwise it is a Take.
class Carver {
 public:
  explicit Carver(void* base) : base_(static_cast<char*>(base)) {}
  // shared: the transient region (null in a sizing pass, as base).
  Carver(void* base, void* shared)
      : base_(static_cast<char*>(base)), shared_(static_cast<char*>(shared)), split_(true) {}
  template <typename X>
  X* Take(size_t count) {
    X* r = base_ == nullptr ? nullptr : reinterpret_cast<X*>(base_ + used_);
    used_ += Aligned(count * sizeof(X));
    return r;
  }
  template <typename X>
  X* TakeTransient(size_t count) {
    if (!split_) return Take<X>(count);
    X* r = shared_ == nullptr ? nullptr : reinterpret_cast<X*>(shared_ + transient_used_);
    transient_used_ += Aligned(count * sizeof(X));
    return r;
  }
  size_t used() const { return used_; }
  size_t transient_used() const { return transient_used_; }

 private:
  static size_t Aligned(size_t bytes) { return (bytes + 255) / 256 * 256; }
  char* base_;
  char* shared_ = nullptr;
  bool split_ = false;
  size_t used_ = 0, transient_used_ = 0;
};

// A device array of a call's scratch and its host copy, downloaded after the kernels.
template <typename T>
struct Downloaded {
  const T* device = nullptr;
  std::vector<T> host;
  // Enqueues the copy of n values (readable once the stream is done).
  absl::Status Fetch(size_t n, cudaStream_t stream) {
    host.resize(n);
    return CudaStatus(
        cudaMemcpyAsync(host.data(), device, sizeof(T) * n, cudaMemcpyDeviceToHost, stream),
        "download");
  }
};

inline bool IsPow2(uint64_t x) { return x != 0 && (x & (x - 1)) == 0; }
inline int Log2(uint64_t x) {
  int s = 0;
  while ((uint64_t{1} << s) < x) ++s;
  return s;
}

}  // namespace kvsparse::engine::gpu

#endif  // KVSPARSE_ENGINE_CUDA_CUDA_UTIL_H_
