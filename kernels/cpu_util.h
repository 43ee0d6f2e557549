// Small host-side helpers shared by the CPU references in kernels/: row access through a
// KvLayout, fp32 scores, validation of the parts of a DecodeProblem a stage needs.
// Internal to kernels/ (not part of the CUDA contract).
#ifndef KVSPARSE_KERNELS_CPU_UTIL_H_
#define KVSPARSE_KERNELS_CPU_UTIL_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/decode_problem.h"
#include "kernels/dtype.h"

namespace kvsparse::kernels {

// Which buffers of a DecodeProblem a stage reads or writes.
struct ProblemNeeds {
  bool q = true;
  bool k = false;
  bool v = false;
  bool out = false;
};

// Like ValidateDecodeProblem, but only the pointers named in `needs` must be non-null (a
// selection stage may run before V is fetched, an estimate stage without the full K).
[[nodiscard]] absl::Status ValidateProblemFor(const DecodeProblem& p, ProblemNeeds needs);

// Element offset of row (b, kv_head, token) of K or V.
inline int64_t KvRowOffset(const DecodeProblem& p, int32_t b, int32_t kv_head, int32_t token) {
  return b * p.kv_layout.batch_stride + kv_head * p.kv_layout.head_stride +
         token * p.kv_layout.token_stride;
}

// Copies d elements of dtype t starting at element `offset` of `base` into out as floats.
void LoadRowAsFloat(const void* base, int64_t offset, int d, DType t, float* out);

// q[b, h] as floats. shape of out: [d].
void LoadQuery(const DecodeProblem& p, int32_t b, int32_t h, float* out);

// scores[t] = p.scale * q[b,h] . K[b, h/G, t] for t in [0, n), fp32 accumulation over d in
// ascending order (the same arithmetic as DenseDecodeCpu). q: [d] floats. shape of scores: [n].
void ComputeScores(const DecodeProblem& p, int32_t b, int32_t h, const float* q, float* scores);

// Dot product of a float vector with row `offset` of `base` (dtype t), fp32, ascending order.
float DotRow(const float* q, const void* base, int64_t offset, int d, DType t);

// sum_{j < count} q[idx[j]] * row[idx[j]] (fp32, in the order of idx): a dot product that reads
// only the listed features of the row.
float SparseDotRow(const float* q, const int32_t* idx, int count, const void* base, int64_t offset,
                   DType t);

// acc[i] += w * row[i] for the d elements of the row.
void AxpyRow(float w, const void* base, int64_t offset, int d, DType t, float* acc);

}  // namespace kvsparse::kernels

#endif  // KVSPARSE_KERNELS_CPU_UTIL_H_
