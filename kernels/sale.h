// SALE: block-sparse prefill attention chosen by low-bit estimates of the attention weights
// (../shared/seeds/sale-low-bit-prefill-sparse-attention.txt). The CPU reference, the oracle of
// the CUDA kernels to come (issue 31). For one prompt of n tokens, causal, GQA (H query heads
// over Hkv kv heads, G = H / Hkv), query blocks of block_q tokens and key blocks of block_k:
//
// Selection pass, per query head h and query block i (rows r in [i b_q, min(n, (i + 1) b_q))):
//   1. Sink and local regions, exact: the key blocks [0, sink / b_k) and the last
//      local / b_k key blocks up to the block holding the block's last row. Per row r, over
//      those keys c <= r (the causal mask applied), m_r = max_c S[r, c] and
//      l_r = sum_c e^{S[r, c] - m_r}, S = scale q . k. These blocks are always computed.
//   2. Every key block j between them (all its keys precede the query block, since
//      local >= b_q): the estimate S~[r, c] from int8 Q and K (below) and the Relative
//      Attention Score P~[r, c] = e^{S~[r, c] - m_r} / l_r. The block is computed iff some
//      P~[r, c] >= tau_h, compared as S~[r, c] >= m_r + ln(tau_h l_r) (the paper's Eq. 3: one
//      comparison per element; tau_h = 0 selects every block).
// Computation pass: per row, exact softmax attention over the keys c <= r of the selected blocks
// (fp32 accumulation): with every block selected, dense causal attention.
//
// Quantization of the selection pass (int8, symmetric, round to nearest; the paper's 4-bit path
// is for Ada's tensor cores, Hopper's run int8 at twice bf16's rate): q~ per (head, token) with
// scale max |q| / 127; K smoothed by its per-(kv head, channel) mean over the prompt (as
// SageAttention), k~ per (kv head, key block) with scale max |k - mean| / 127; then
// S~[r, c] = scale (s_q[r] s_k[block] sum_e q~_e k~_e + q_r . mean), the smoothing's constant
// q_r . mean added back in fp32 so that S~ estimates S itself, not a per-row shift of it.
//
// Per-head calibration (the paper's Section 3.3): tau_h starts at tau0 and halves while the
// head's L1 error against dense attention, ||O_h - O~_h||_1 / n, exceeds theta on any sample.
#ifndef KVSPARSE_KERNELS_SALE_H_
#define KVSPARSE_KERNELS_SALE_H_

#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/dtype.h"

namespace kvsparse::kernels {

struct SaleParams {
  int32_t block_q = 64;        // query block b_q, a multiple of block_k
  int32_t block_k = 32;        // key block b_k
  int32_t sink_tokens = 32;    // a multiple of block_k (0: no sink region)
  int32_t local_tokens = 256;  // a multiple of block_k, at least block_q
};

// INVALID_ARGUMENT naming the field unless every constraint above holds.
[[nodiscard]] absl::Status ValidateSaleParams(const SaleParams& p);

// One prompt's attention, head-major and contiguous (a [1, heads, tokens, head_dim] torch
// tensor): q and out [num_q_heads, tokens, head_dim], k and v [num_kv_heads, tokens, head_dim],
// all of `dtype`.
struct SalePrefill {
  int32_t tokens = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  DType dtype = DType::kBf16;
  float scale = 0.f;  // softmax scale, usually 1 / sqrt(head_dim)
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
};

[[nodiscard]] absl::Status ValidateSalePrefill(const SalePrefill& p);

// The block mask of one prompt: selected[(h * q_blocks + i) * k_blocks + j] = 1 where query
// head h's query block i attends key block j. Blocks past the causal diagonal are never set.
struct SaleMask {
  int32_t heads = 0;
  int32_t q_blocks = 0;
  int32_t k_blocks = 0;
  std::vector<uint8_t> selected;
  std::vector<int64_t> causal_blocks;    // [heads]: blocks at or before the diagonal
  std::vector<int64_t> selected_blocks;  // [heads]: of those, selected

  bool at(int32_t h, int32_t i, int32_t j) const {
    return selected[(static_cast<size_t>(h) * q_blocks + i) * k_blocks + j] != 0;
  }
  // Share of the causal blocks skipped, over every head (0: dense).
  double sparsity() const;
};

// The selection pass with one threshold per query head (tau.size() == num_q_heads, each in
// [0, 1)). Reads q and k.
[[nodiscard]] absl::Status SaleSelect(const SalePrefill& p, const SaleParams& params,
                                      absl::Span<const float> tau, SaleMask* mask);

// The blocks at or before the causal diagonal of one head (SaleMask::causal_blocks' entries).
int64_t SaleCausalBlocks(int32_t tokens, const SaleParams& params);

// Every causal block selected (dense attention through SaleAttend).
SaleMask SaleFullMask(const SalePrefill& p, const SaleParams& params);

// The computation pass over the mask's blocks: writes out. Reads q, k and v.
[[nodiscard]] absl::Status SaleAttend(const SalePrefill& p, const SaleParams& params,
                                      const SaleMask& mask);

// ||a_h - b_h||_1 / tokens per query head, for outputs laid out as SalePrefill::out (floats).
std::vector<double> SaleHeadL1Error(const SalePrefill& p, absl::Span<const float> a,
                                    absl::Span<const float> b);

struct SaleCalibration {
  std::vector<float> tau;         // [num_q_heads]: the largest tau0 / 2^k meeting theta
  std::vector<double> error;      // [num_q_heads]: the worst sample's error at that tau
  std::vector<double> sparsity;   // [num_q_heads]: mean over samples of the blocks skipped
  std::vector<int32_t> halvings;  // [num_q_heads]
};

// What one round of the calibration measured at the heads' thresholds, per query head: the worst
// sample's L1 error per token against dense attention, and the share of the causal blocks skipped,
// the samples' mean.
struct SaleRound {
  std::vector<double> error;
  std::vector<double> skipped;
};
using SaleRoundFn = absl::FunctionRef<absl::StatusOr<SaleRound>(absl::Span<const float> tau)>;

// The paper's halving search, whatever runs its rounds (the reference in SaleCalibrate, SALE's
// CUDA kernels in the op's calibration): every head starts at tau0; after each round a head whose
// error is at most theta keeps its threshold, the others halve theirs, and a head still over
// theta after max_halvings halvings is dense (0). Rounds run until every head is settled.
[[nodiscard]] absl::StatusOr<SaleCalibration> SaleHalvingSearch(int32_t num_q_heads, double theta,
                                                                float tau0, int32_t max_halvings,
                                                                SaleRoundFn round);

// Per-head thresholds for the samples (same heads and head_dim; their out buffers are
// overwritten) by SaleHalvingSearch on the reference: tau_h = tau0 / 2^k for the least
// k <= max_halvings with every sample's error at most theta, or 0 (dense) when none is.
[[nodiscard]] absl::StatusOr<SaleCalibration> SaleCalibrate(absl::Span<const SalePrefill> samples,
                                                            const SaleParams& params, double theta,
                                                            float tau0 = 0.008f,
                                                            int32_t max_halvings = 24);

// The selection's test of one row against one middle key block (step 2 above) in the
// reference's arithmetic, one rounding a step: scale (s_q s_k m + q . mean) >= threshold, m the
// row's largest integer sum over the block's keys (the test is monotone in the sum, its factors
// non-negative, so the block passes for the row iff it passes at m). The CPU reference and the
// CUDA kernels share it.
KVSPARSE_HD bool SaleEstimatePasses(float scale, float q_scale, float k_scale, int32_t m,
                                    float q_mean, float threshold) {
#if defined(__CUDA_ARCH__)
  const float a = __fmul_rn(q_scale, k_scale);
  return __fmul_rn(scale, __fadd_rn(__fmul_rn(a, static_cast<float>(m)), q_mean)) >= threshold;
#else
  const float a = q_scale * k_scale;
  return scale * (a * static_cast<float>(m) + q_mean) >= threshold;
#endif
}

// A screen for SaleEstimatePasses that a kernel evaluates in three instructions a row from two
// registers: a row that passes there passes here (kernels/sale_test.cc checks it at and around
// the threshold). It evaluates the same real quantity with other roundings in another order,
// fma(s_k sq, m, c) >= 0 with sq = scale s_q and c = scale q . mean - lo, lo the threshold lowered
// by 2^-16 of |threshold| + |scale q . mean|. The two evaluations differ by a few ulps of their
// largest term, which where the row passes is at most about |threshold| + |scale q . mean| (or
// the row passes by far): far less than the lowering. A threshold of +inf (a row past the
// prompt) never passes, one of -inf (tau 0) always does.
struct SaleScreen {
  float sq, c;
};

KVSPARSE_HD SaleScreen MakeSaleScreen(float scale, float q_scale, float q_mean, float threshold) {
  SaleScreen s;
  s.sq = scale * q_scale;
  const float sm = scale * q_mean;
  const float lo =
      threshold == INFINITY ? threshold : threshold - 0x1p-16f * (fabsf(threshold) + fabsf(sm));
  s.c = sm - lo;
  return s;
}

KVSPARSE_HD bool SaleScreenMayPass(const SaleScreen& s, float k_scale, int32_t m) {
  return fmaf(k_scale * s.sq, static_cast<float>(m), s.c) >= 0.f;
}

}  // namespace kvsparse::kernels

#endif  // KVSPARSE_KERNELS_SALE_H_
