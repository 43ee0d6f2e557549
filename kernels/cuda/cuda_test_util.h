// Helpers for the GPU tests of kernels/cuda/: skip without a device, RAII device buffers,
// uploading a host DecodeProblem (with poisoned outputs) and reading results back.
#ifndef KVSPARSE_KERNELS_CUDA_CUDA_TEST_UTIL_H_
#define KVSPARSE_KERNELS_CUDA_CUDA_TEST_UTIL_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/decode_params.h"
#include "kernels/decode_problem.h"

namespace kvsparse::kernels::cuda {

// True when a CUDA device is usable (cudaGetDeviceCount succeeds with a count > 0).
bool HaveGpu();

#define KVSPARSE_REQUIRE_GPU()                                                   \
  do {                                                                           \
    if (!::kvsparse::kernels::cuda::HaveGpu()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

#define KVSPARSE_ASSERT_CUDA(expr)                                                 \
  do {                                                                             \
    const cudaError_t kvs_e_ = (expr);                                             \
    ASSERT_EQ(kvs_e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(kvs_e_); \
  } while (0)

// Owning device allocation (cudaMalloc); 0 bytes gives a null pointer.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;

  void* get() const { return ptr_; }
  template <typename X>
  X* as() const {
    return static_cast<X*>(ptr_);
  }
  size_t size() const { return bytes_; }
  // Synchronous copies (tests only).
  cudaError_t Upload(const void* host, size_t bytes);
  cudaError_t Download(void* host, size_t bytes) const;
  // Fills every byte with `byte` (0xFF: NaN for fp16/bf16/fp32, -1 for integers).
  cudaError_t Poison(uint8_t byte = 0xFF);

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

template <typename X>
DeviceBuffer ToDevice(const std::vector<X>& v) {
  DeviceBuffer b(v.size() * sizeof(X));
  if (!v.empty()) {
    EXPECT_EQ(b.Upload(v.data(), v.size() * sizeof(X)), cudaSuccess);
  }
  return b;
}

template <typename X>
std::vector<X> ToHost(const DeviceBuffer& b, size_t count) {
  std::vector<X> v(count);
  if (count > 0) {
    EXPECT_EQ(b.Download(v.data(), count * sizeof(X)), cudaSuccess);
  }
  return v;
}

// A host DecodeProblem copied to the device; out is allocated and poisoned.
struct DeviceProblem {
  DeviceBuffer q, k, v, seq_lens, out;
  DecodeShape shape;
  size_t kv_bytes = 0;

  // kv_elems: elements of each of p.k and p.v (the host buffers' sizes).
  static DeviceProblem Upload(const DecodeProblem& p, size_t kv_elems);
  // Output as doubles [B, H, d]; also counts non-finite values into *non_finite.
  std::vector<double> OutputAsDouble(int64_t* non_finite) const;
};

// Number of KV elements of p's buffers when laid out [B, n_max, Hkv, d] or with p.kv_layout:
// the largest offset reached plus one row.
size_t KvElements(const DecodeProblem& p);

}  // namespace kvsparse::kernels::cuda

#endif  // KVSPARSE_KERNELS_CUDA_CUDA_TEST_UTIL_H_
