// Dense (exact) decode attention: the reference every sparse method is measured against.
#ifndef KVSPARSE_KERNELS_DENSE_H_
#define KVSPARSE_KERNELS_DENSE_H_

#include <vector>

#include "absl/status/status.h"
#include "kernels/decode_problem.h"

namespace kvsparse::kernels {

// out[b, h] = softmax(scale * q[b, h] . K[b, h/G]^T) V[b, h/G], fp32 accumulation with a running
// max (online softmax), output rounded to p.dtype. A sequence of length 0 yields zeros.
// Thread-compatible; allocates nothing.
[[nodiscard]] absl::Status DenseDecodeCpu(const DecodeProblem& p);

// The same function in float64 throughout, written out in [B, H, d] doubles. Slow; for tests.
[[nodiscard]] absl::Status DenseDecodeFloat64(const DecodeProblem& p, std::vector<double>* out);

}  // namespace kvsparse::kernels

#endif  // KVSPARSE_KERNELS_DENSE_H_
