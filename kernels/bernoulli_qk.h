// Bernoulli qK^T (S2ANTA paper, Section 5 and Appendix C): estimate the scores q.K_n from a few
// ternary samples of the query, so that only the key *features* (columns of K) that a sample
// touches are read.
//
// Per-head estimator (Eqs. 8-9). norm = max_i |q_i|; p_i = |q_i| / norm in [0, 1];
//   c_i = number of ones among B Bernoulli(p_i) draws;  q_eff_i = norm * c_i / B * sign(q_i);
//   p_hat = q_eff . K.
// E[c_i / B] = p_i, hence E[p_hat] = q . K: unbiased (up to the 2^-24 quantisation of p_i by the
// 24-bit uniforms: P(U < p) = ceil(p 2^24) / 2^24). Features with c_i = 0 are not read.
//
// Mean group query (Eqs. 10-13), one feature set for the G heads sharing a kv head:
//   m_i = (1/G) sum_g |q_gi|;  norm = max_i m_i;  c_i = ones among B Bernoulli(m_i / norm);
//   m_hat_i = norm * c_i / B;  q_eff_gi = m_hat_i * q_gi / m_i   (0 when m_i = 0, where every
//   q_gi = 0 too);  p_hat_g = q_eff_g . K.
// E[m_hat_i] = m_i, so E[p_hat_g] = q_g . K: unbiased per head, with one shared feature set.
//
// Samplers for the B draws of one feature (Appendix C.1 uses stratified):
//   kIid:        c = #{r < B : U_r < p}.
//   kStratified: c = #{r < B : float(r) + U_r < p * float(B)}  (one draw per stratum
//                [r/B, (r+1)/B)): c = floor(pB) or floor(pB) + 1, Var(c/B) <= 1/(4B^2).
// Arithmetic is fp32 with no fused multiply-add: p = |q_i| / norm, then p * float(B).
// Randomness (philox.h): per-head mode uses RngTag::kBernoulliHead with head = the query head,
// group mode RngTag::kBernoulliGroup with head = the kv head; lane = feature i, draw r is
// Uniform(r); sequence = batch row b.
//
// Softmax of estimated scores is *not* an unbiased attention weight: SANTA on p_hat samples
// from softmax(scale * p_hat), which differs from softmax(scale * q.K) (Jensen).
//
// Precision: SANTA's selection (kernels/santa.h) rounds q_eff to the problem's dtype before it
// scores (a bf16 / fp16 problem's query is of that dtype, and the GPU's scoring reads it so:
// kernels/cuda/bernoulli_qk.h), a relative change of at most 2^-9 (bf16) per feature, the
// rounding q itself had; SampleBernoulliQuery returns the fp32 values.
#ifndef KVSPARSE_KERNELS_BERNOULLI_QK_H_
#define KVSPARSE_KERNELS_BERNOULLI_QK_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/philox.h"

namespace kvsparse::kernels {

enum class BernoulliQkMode : uint8_t {
  kMeanGroupQuery = 0,  // Eqs. 10-13: one feature set per kv head (the paper's default)
  kPerHead = 1,         // Eqs. 8-9: each query head samples its own features
};

enum class BernoulliSampler : uint8_t {
  kStratified = 0,
  kIid = 1,
};

struct BernoulliQkParams {
  int32_t samples = 4;  // B >= 1: Bernoulli draws per feature
  BernoulliQkMode mode = BernoulliQkMode::kMeanGroupQuery;
  BernoulliSampler sampler = BernoulliSampler::kStratified;
};

// Ones among `samples` draws of Bernoulli(p) from stream s (its lane already set), by the
// sampler's rule above; shared by the reference and the CUDA kernel.
KVSPARSE_HD int32_t BernoulliCountOnes(const PhiloxStream& s, float p, int32_t samples,
                                       BernoulliSampler sampler) {
  int32_t c = 0;
  if (sampler == BernoulliSampler::kIid) {
    for (int32_t r = 0; r < samples; ++r) c += s.Uniform(r) < p ? 1 : 0;
  } else {
    const float pb = p * static_cast<float>(samples);
    for (int32_t r = 0; r < samples; ++r) {
      const float t = static_cast<float>(r) + s.Uniform(r);
      c += t < pb ? 1 : 0;
    }
  }
  return c;
}

// The sampled queries of one kv head's group. Estimated (unscaled) scores are
// p_hat[g, n] = sum_{i : touched} q_eff[g, i] * K[n, i].
struct BernoulliQuery {
  int32_t group = 0;
  int32_t dim = 0;
  std::vector<float> q_eff;                    // [G, d]
  std::vector<uint8_t> head_touched;           // [G, d]: 1 if query head g reads key feature i
  std::vector<uint8_t> group_touched;          // [d]: union over the group (what the kv head reads)
  std::vector<std::vector<int32_t>> features;  // [G][*]: touched features of head g, ascending

  // (query head, feature) pairs touched, over the group's heads.
  int64_t head_features() const;
  // Features touched by the group.
  int64_t group_features() const;
  // Mean over the group of (features touched by head g) / d.
  double head_fraction() const;
  // (features touched by the group) / d.
  double group_fraction() const;
};

[[nodiscard]] absl::Status ValidateBernoulliQkParams(const BernoulliQkParams& params);

// Samples the effective queries of one group. q: [G, d] fp32, the group's query heads in order
// (query head kv_head * G + g). seed, sequence b and kv_head select the Philox streams.
[[nodiscard]] absl::Status SampleBernoulliQuery(absl::Span<const float> q, int32_t group,
                                                int32_t dim, const BernoulliQkParams& params,
                                                uint64_t seed, int32_t sequence, int32_t kv_head,
                                                BernoulliQuery* out);

}  // namespace kvsparse::kernels

#endif  // KVSPARSE_KERNELS_BERNOULLI_QK_H_
