// Bernoulli qK^T's sampled queries on the GPU (kernels/bernoulli_qk.h is the reference): per
// (sequence, kv head), the effective queries q_eff of the group's heads, written in q's dtype, so
// that SANTA / S2ANTA's scoring kernels (kernels/cuda/santa.h) run on them in place of q and
// score p_hat = q_eff . K. Features a head does not sample have q_eff = 0.
//
// Arithmetic and random numbers are the reference's (kernels::SampleBernoulliQuery, then the
// rounding to q's dtype that kernels::SantaSelectCpu applies): fp32 without fused multiply-adds,
// the group mean summed over heads in order, Philox streams (seeds[b] or seed, kBernoulliGroup /
// kBernoulliHead, sequence 0 or b, kv head or query head) with lane = feature, and the draws
// counted by kernels::BernoulliCountOnes. So q_eff equals the reference's bit for bit.
//
// One block per (sequence, kv head), one thread per feature; no allocation, no host sync: the
// launch can be captured in a CUDA graph.
#ifndef KVSPARSE_KERNELS_CUDA_BERNOULLI_QK_H_
#define KVSPARSE_KERNELS_CUDA_BERNOULLI_QK_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/bernoulli_qk.h"
#include "kernels/dtype.h"

namespace kvsparse::kernels::cuda {

struct BernoulliQueriesParams {
  int32_t batch = 0, num_q_heads = 0, num_kv_heads = 0;
  int32_t head_dim = 0;        // a multiple of 32, at most 256
  DType dtype = DType::kBf16;  // of q and q_eff: kBf16 or kFp16
  const void* q = nullptr;     // device [B, H, d]
  void* q_eff = nullptr;       // device [B, H, d], every element written
  BernoulliQkParams params;
  // Random numbers: streams (seeds[b], tag, 0, head) when seeds (device [B]) is given, else
  // (seed, tag, b, head), as kernels::cuda::SantaLaunchParams.
  uint64_t seed = 0;
  const uint64_t* seeds = nullptr;
  // Optional, device [B, Hkv, 2]: (query head, feature) pairs the group's heads read, and
  // features the group reads (the union), per (sequence, kv head): BernoulliQuery's
  // head_touched and group_touched summed.
  int32_t* features = nullptr;
};

// cudaErrorInvalidValue for a shape, dtype or parameter it does not take (samples < 1, as
// kernels::ValidateBernoulliQkParams refuses: checked here, the CUDA library linking no host
// library).
cudaError_t SampleBernoulliQueries(const BernoulliQueriesParams& p, cudaStream_t stream);

}  // namespace kvsparse::kernels::cuda

#endif  // KVSPARSE_KERNELS_CUDA_BERNOULLI_QK_H_
