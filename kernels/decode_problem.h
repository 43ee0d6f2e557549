// The shape of one decode step handed to a kernel: one query token per sequence, H query heads
// sharing Hkv kv heads (GQA), head dim d. Raw pointers only; the caller owns every buffer.
#ifndef KVSPARSE_KERNELS_DECODE_PROBLEM_H_
#define KVSPARSE_KERNELS_DECODE_PROBLEM_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/dtype.h"

namespace kvsparse::kernels {

// Where row (b, kv_head, token) of K or V starts, in elements:
//   b * batch_stride + kv_head * head_stride + token * token_stride.
// Rows are head_dim contiguous elements. Examples:
//   [B, Hkv, n, d] (torch SDPA):  {Hkv*n*d, n*d, d}
//   [B, n, Hkv, d] (FlashInfer NHD, the paper's sequence-major cache): {n*Hkv*d, d, Hkv*d}
//   K and V interleaved per token ([.., n, 2, d]): token_stride = 2*d, v = k + d.
struct KvLayout {
  int64_t batch_stride = 0;
  int64_t head_stride = 0;
  int64_t token_stride = 0;
};

struct DecodeProblem {
  int32_t batch = 0;         // B
  int32_t num_q_heads = 0;   // H; a multiple of num_kv_heads
  int32_t num_kv_heads = 0;  // Hkv
  int32_t head_dim = 0;      // d
  DType dtype = DType::kBf16;  // of q, K, V and out
  const void* q = nullptr;     // shape: [B, H, d]
  const void* k = nullptr;     // per kv_layout
  const void* v = nullptr;     // per kv_layout
  KvLayout kv_layout;
  // shape: [B]; tokens of each sequence (ragged batches allowed). Host memory for CPU code,
  // device memory for CUDA launchers.
  const int32_t* seq_lens = nullptr;
  float scale = 0.f;  // softmax scale applied to q.k; usually 1/sqrt(d)
  void* out = nullptr;  // shape: [B, H, d], dtype

  int32_t group_size() const { return num_kv_heads > 0 ? num_q_heads / num_kv_heads : 0; }
};

// Checks the fields a CPU implementation relies on (shapes, pointers, group divisibility,
// non-negative host-readable lengths). INVALID_ARGUMENT says which field is wrong.
[[nodiscard]] absl::Status ValidateDecodeProblem(const DecodeProblem& p, bool lens_on_host = true);

}  // namespace kvsparse::kernels

#endif  // KVSPARSE_KERNELS_DECODE_PROBLEM_H_
