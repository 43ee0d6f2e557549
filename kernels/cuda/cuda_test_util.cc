#include "kernels/cuda/cuda_test_util.h"

#include <algorithm>
#include <cmath>

namespace kvsparse::kernels::cuda {

bool HaveGpu() {
  static const bool have = [] {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  }();
  return have;
}

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  if (bytes > 0 && cudaMalloc(&ptr_, bytes) != cudaSuccess) {
    ptr_ = nullptr;
    bytes_ = 0;
    ADD_FAILURE() << "cudaMalloc(" << bytes << ") failed";
  }
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) cudaFree(ptr_);
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

cudaError_t DeviceBuffer::Upload(const void* host, size_t bytes) {
  return cudaMemcpy(ptr_, host, bytes, cudaMemcpyHostToDevice);
}
cudaError_t DeviceBuffer::Download(void* host, size_t bytes) const {
  return cudaMemcpy(host, ptr_, bytes, cudaMemcpyDeviceToHost);
}
cudaError_t DeviceBuffer::Poison(uint8_t byte) {
  if (ptr_ == nullptr) return cudaSuccess;
  return cudaMemset(ptr_, byte, bytes_);
}

size_t KvElements(const DecodeProblem& p) {
  int32_t n_max = 0;
  for (int32_t b = 0; b < p.batch; ++b) n_max = std::max(n_max, p.seq_lens[b]);
  if (p.batch == 0 || n_max == 0) return static_cast<size_t>(p.head_dim);
  const int64_t last = static_cast<int64_t>(p.batch - 1) * p.kv_layout.batch_stride +
                       static_cast<int64_t>(p.num_kv_heads - 1) * p.kv_layout.head_stride +
                       static_cast<int64_t>(n_max - 1) * p.kv_layout.token_stride;
  return static_cast<size_t>(last + p.head_dim);
}

DeviceProblem DeviceProblem::Upload(const DecodeProblem& p, size_t kv_elems) {
  DeviceProblem d;
  const size_t es = DTypeSize(p.dtype);
  const size_t q_bytes = static_cast<size_t>(p.batch) * p.num_q_heads * p.head_dim * es;
  d.kv_bytes = kv_elems * es;
  d.q = DeviceBuffer(std::max<size_t>(q_bytes, 16));
  d.k = DeviceBuffer(std::max<size_t>(d.kv_bytes, 16));
  d.v = DeviceBuffer(std::max<size_t>(d.kv_bytes, 16));
  d.seq_lens = DeviceBuffer(std::max<size_t>(sizeof(int32_t) * p.batch, 4));
  d.out = DeviceBuffer(std::max<size_t>(q_bytes, 16));
  if (q_bytes > 0) {
    EXPECT_EQ(d.q.Upload(p.q, q_bytes), cudaSuccess);
  }
  if (d.kv_bytes > 0) {
    EXPECT_EQ(d.k.Upload(p.k, d.kv_bytes), cudaSuccess);
    EXPECT_EQ(d.v.Upload(p.v, d.kv_bytes), cudaSuccess);
  }
  if (p.batch > 0) {
    EXPECT_EQ(d.seq_lens.Upload(p.seq_lens, sizeof(int32_t) * p.batch), cudaSuccess);
  }
  EXPECT_EQ(d.out.Poison(), cudaSuccess);
  int32_t n_max = 0;
  for (int32_t b = 0; b < p.batch; ++b) n_max = std::max(n_max, p.seq_lens[b]);
  DecodeShape& s = d.shape;
  s.batch = p.batch;
  s.num_q_heads = p.num_q_heads;
  s.num_kv_heads = p.num_kv_heads;
  s.head_dim = p.head_dim;
  s.dtype = p.dtype;
  s.q = d.q.get();
  s.k = d.k.get();
  s.v = d.v.get();
  s.kv.batch_stride = p.kv_layout.batch_stride;
  s.kv.head_stride = p.kv_layout.head_stride;
  s.kv.token_stride = p.kv_layout.token_stride;
  s.seq_lens = d.seq_lens.as<int32_t>();
  s.max_seq_len = n_max;
  s.scale = p.scale;
  s.out = d.out.get();
  return d;
}

std::vector<double> DeviceProblem::OutputAsDouble(int64_t* non_finite) const {
  const size_t count = static_cast<size_t>(shape.batch) * shape.num_q_heads * shape.head_dim;
  std::vector<uint8_t> raw(count * DTypeSize(shape.dtype));
  if (count > 0) {
    EXPECT_EQ(out.Download(raw.data(), raw.size()), cudaSuccess);
  }
  std::vector<double> r(count);
  int64_t bad = 0;
  for (size_t i = 0; i < count; ++i) {
    r[i] = LoadAsFloat(raw.data(), i, shape.dtype);
    if (!std::isfinite(r[i])) ++bad;
  }
  if (non_finite != nullptr) *non_finite = bad;
  return r;
}

}  // namespace kvsparse::kernels::cuda
