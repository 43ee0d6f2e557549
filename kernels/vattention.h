// vAttention: verified sparse attention (Section 4, Algorithm 1, Lemmas 4.1-4.2, Theorem 4.3,
// Appendix D of the vAttention paper). Per query head: deterministic sink, window and predicted
// top-k rows, plus a uniform random sample of the remaining rows whose size b is chosen from a
// base sample so that the numerator N, the denominator D or the output N/D is within relative
// error epsilon with probability >= 1 - delta.
//
// Algorithm, per query head h of a sequence with n tokens (logits s_t = scale q_h . K_t,
// x_t = e^{s_t - c} for a shift c, y_t = x_t V_t):
//  1. Fixed set I_f = sink [0, min(sink, n)) u window [max(0, n - local), n) u top-k, where the
//     top-k are the k best of the rest by the predictor (hash: bits - 2 Hamming of signatures;
//     exact: s_t; compressed: s~_t = scale q . k~_t over the compressed keys of
//     kernels/compressed_keys.h), k = min(top_k, n) or top_k_fraction * n rounded to nearest,
//     ties to the lower index (hash_topk.h ResolveTopK, SelectSinkLocalTopK). Sink and window
//     are absolute token counts (the paper's experiments use 128 each), not fractions of n.
//  2. Residual R = [0, n) \ I_f, n_s = |R|.
//  3. Base sample B: n_b = min(n_s, max(2, round(base_rate * n_s))) residual tokens, uniform
//     WITHOUT replacement: the n_b residual tokens with the smallest priority key Draw64(t) of
//     RngTag::kVattBase (head h), ties to the lower index.
//  4. Statistics (float64) from I_f and B (their K and V rows are read):
//       D_f = sum_{I_f} x,  N_f = sum_{I_f} y,  D^ = D_f + n_s mean_B(x),  N^ = N_f + n_s
//       mean_B(y), sigma^2 = sample variance_B(x) (divisor n_b - 1),  Tr(Sigma) = sum over the d
//       coordinates of sample variance_B(y),  Tr(Sigma_z) = the same of z_t = y_t - o^ x_t with
//       o^ = N^ / D^ (= Tr Sigma - 2 o^ . cov_B(x, y) + |o^|^2 sigma^2),  x_max = max x over R
//       (exact when every logit is known, i.e. the exact predictor; with the compressed
//       predictor a sound upper bound from each residual token's stored error norm,
//       s_t <= s~_t + scale |q| err_t: CompressedLogitUpperBound; else max over B),  y_max =
//       x_max * max_B |V_t|.
//     The shift c = max logit over I_f u B cancels in every ratio below.
//  5. Budget for (eps, delta) and target T (D^ or |N^|), b(eps, delta) = (n_s a(delta) c / (eps
//  T))^2:
//       CLT (Lemma 4.1, Corollaries D.2, D.3): a = Phi^{-1}(1 - delta/2); c = sigma (denominator)
//         or sqrt(Tr Sigma) (numerator). A normal approximation, not a guarantee.
//       Hoeffding, denominator: x in [0, x_max], a = sqrt(ln(2/delta) / 2), c = x_max.
//         (Hoeffding 1963: also valid for sampling without replacement.)
//       Hoeffding, numerator: the Hilbert-space bound P(|mean - mu| >= t) <= 2 exp(-b t^2 /
//         (2 R^2)) with |y - mu| <= R = 2 y_max (Pinelis 1994): a = sqrt(2 ln(2/delta)), c = R.
//       CLT on the ratio (kCltRatio, target kOutput; the others as kClt): the delta method on
//         o^ = N^ / D^. With the sample's share of N^ and D^ scaled by n_s / b, N^ - o D^ =
//         (N_f - o D_f) + (n_s / b) sum_{I_dyn} z_t has mean N - o D = 0 and covariance
//         n_s^2 Sigma_z / b, so o^ - o ~ (N^ - o D^) / D and |o^ - o| <= eps |o| asks
//         |N^ - o D^| <= eps |N|: b = (n_s a(delta) sqrt(Tr Sigma_z) / (eps |N^|))^2, one normal
//         approximation of the output itself instead of Theorem 4.3's two bounds at eps / 2 each.
//         a = Phi^{-1}(1 - delta/2) bounds the norm of a Gaussian vector whatever its covariance's
//         shape (P(|g|^2 >= a^2 Tr C) <= P(Z^2 >= a^2) for a^2 >= 1.54: Szekely and Bakirov
//         2003; a >= 1.64 for delta <= 0.1). Still a normal approximation, not a guarantee.
//     Target kOutput (Theorem 4.3): b = min over eps' in (0, eps), delta' in (0, delta) of
//       max(b_D(eps'/2, delta'), b_N((eps - eps')/2, delta - delta')). For a fixed delta' the
//       minimum over eps' is where the two are equal (one decreasing, one increasing in eps'):
//       b = (2 n_s / eps)^2 (a_D(delta') c_D / D^ + a_N(delta - delta') c_N / |N^|)^2, so we
//       minimise exactly over eps' and over a grid delta' = delta j / 1024, j = 1..1023.
//       (Lemma 4.2 needs the denominator's eps'/2 < 0.5: always true for eps < 1.)
//     b = clamp(ceil(b_raw), n_b, n_s): the base size is a lower cap, as the paper's experiments
//     do (Appendix F); with D^ or |N^| zero, b = n_s. No finite-population correction (the
//     bounds are for sampling with replacement; sampling without is never worse).
//  6. Final sample I_dyn: b residual tokens, uniform WITHOUT replacement, the b smallest priority
//     keys Draw64(t) of RngTag::kVattDynamic: a fresh sample independent of B (Algorithm 1 line 7
//     draws it after the budget; B is NOT reused inside it). Hence, given b,
//     E[(n_s/b) sum_{I_dyn} x] = sum_R x and likewise for y: N^ and D^ of Eqs. 6-7 are unbiased
//     conditionally on b (their ratio, the output, is not exactly). Base rows are still fetched
//     (for step 4); a row in both samples is fetched once.
//  7. Estimate (Eq. 3 / Eqs. 6-7): out = (N_f + (n_s/b) N_dyn) / (D_f + (n_s/b) D_dyn), i.e. a
//     kSoftmax RowSelection with weight 1 on I_f, n_s / b on I_dyn, 0 on base-only rows.
// b = n_s selects every row: the output is dense attention.
//
// The importance sampler (sampler = kImportance; an extension of the paper, which samples the
// residual uniformly; exact or compressed predictor, CLT or CLT-ratio bound). The predictor's
// logit s~_t is known for every token, so the residual is sampled i.i.d. WITH replacement from
// the proposal p_t = e^{s~_t} / Z~ (Z~ = sum_R e^{s~}) instead of uniformly: draw j picks the
// token whose cumulative share of Z~ first exceeds u_j = (Draw64(j) >> 11) 2^-53 (RngTag
// kVattImportanceBase for B, kVattImportanceDynamic for I_dyn). Each draw of token t estimates
// the residual sums by (e^{s_t} / p_t, e^{s_t} V_t / p_t), unbiased for sum_R x and sum_R y
// given b; with r_t = e^{s_t - s~_t} this is Z~ r_t (1, V_t), whose spread is that of r (near 1
// when s~ is near s) times V's under the attention distribution, not that of e^{s} over uniform
// tokens. Steps 4-5 are unchanged once each draw's logit is replaced by its effective logit
//   s'_t = s_t - s~_t + L,  L = ln(Z~ / n_s),
// so that n_s e^{s'_t - c} = Z~ r_t e^{-c}: every statistic, the CLT budgets and b keep their
// formulas (b = number of draws). Step 6: if b >= n_s the whole residual is read with weight 1
// (exact residual: cheaper than b draws); else b fresh draws. Step 7: a token drawn m times
// has weight m (n_s / b) e^{L - s~_t} = m / (b p_t). Hoeffding needs a range of r over R that
// a sample cannot give (INVALID_ARGUMENT).
//
// Stages: selection needs the predictor's input (signatures, or all K for the exact
// predictor) and then the K and V rows of I_f u B (for the budget) before it can draw I_dyn;
// the estimate needs K and V of I_f u I_dyn. So a worker fetches twice: I_f u B, then the rows
// of I_dyn not already fetched. For one head: VAttentionPlanFixed (step 1, predictor input
// only), VAttentionSampleBase (step 3, no data), then VAttentionBudgetAndSample (steps 4-6, reads
// the rows of I_f u B through callbacks); VAttentionSelectCpu runs them all on a DecodeProblem,
// reading rows in place.
#ifndef KVSPARSE_KERNELS_VATTENTION_H_
#define KVSPARSE_KERNELS_VATTENTION_H_

#include <cstdint>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/compressed_keys.h"
#include "kernels/decode_problem.h"
#include "kernels/hash_topk.h"
#include "kernels/philox.h"
#include "kernels/row_selection.h"
#include "kernels/sink_local_topk.h"

namespace kvsparse::kernels {

// Numbering follows proto TopKPredictor / BudgetBound / VerifyTarget.
enum class TopKPredictor : uint8_t { kHash = 1, kExact = 2, kCompressed = 3 };
enum class BudgetBound : uint8_t { kClt = 1, kHoeffding = 2, kCltRatio = 3 };
enum class VerifyTarget : uint8_t { kDenominator = 1, kNumerator = 2, kOutput = 3 };
enum class ResidualSampler : uint8_t { kUniform = 1, kImportance = 2 };

struct VAttentionParams {
  float epsilon = 0.05f;               // relative error target, in (0, 1)
  float delta = 0.05f;                 // failure probability, in (0, 1)
  FixedSet fixed{128, 128, 0, 0.05f};  // sink, window, top-k 5% of the rest by the predictor
  TopKPredictor predictor = TopKPredictor::kHash;
  float base_rate = 0.05f;  // f_b, in (0, 1)
  BudgetBound bound = BudgetBound::kClt;
  VerifyTarget target = VerifyTarget::kOutput;
  int32_t bits = 32;                                    // hash predictor signature bits
  ResidualSampler sampler = ResidualSampler::kUniform;  // how the residual is sampled (above)
  // Testing only: compute the step-4 statistics exactly over the whole residual (reads every
  // row) instead of from a base sample; no base sample is drawn and b >= 1.
  bool exact_statistics = false;
};

// INVALID_ARGUMENT naming the field: epsilon or delta outside (0, 1), base_rate outside (0, 1),
// negative sink / local / top_k, top_k_fraction outside [0, 1], unknown enums, bad bits, the
// importance sampler with the hash predictor, the Hoeffding bound or exact_statistics.
[[nodiscard]] absl::Status ValidateVAttentionParams(const VAttentionParams& params);

// Phi^{-1}(p) for p in (0, 1), accurate to ~1e-15 (Acklam's rational approximation plus one
// Halley step on erfc).
double NormalQuantile(double p);

// Step-4 statistics of one head.
struct VAttentionStatistics {
  int64_t n_s = 0;           // residual size
  double d_hat = 0;          // D^ (shifted by the same c as everything else)
  double n_hat_norm = 0;     // |N^|
  double sigma = 0;          // std of x over the residual (estimated)
  double trace_sigma = 0;    // Tr(Sigma) of y over the residual (estimated)
  double trace_sigma_z = 0;  // Tr(Sigma_z) of z = y - o^ x over the residual (estimated)
  double x_max = 0;          // Hoeffding range of x
  double y_max = 0;          // bound on |y|
};

// The budget of step 5 before clamping (may be +inf), and the split chosen for kOutput.
struct VAttentionBudget {
  double raw = 0;
  double eps_split = 0;    // eps' (kOutput)
  double delta_split = 0;  // delta' (kOutput)
};
VAttentionBudget ComputeVAttentionBudget(const VAttentionStatistics& st,
                                         const VAttentionParams& params);

// The importance sampler's proposal over one head's residual (built by VAttentionSampleBase).
struct ImportanceProposal {
  std::vector<int32_t> tokens;  // the residual R, ascending
  std::vector<float> scores;    // [|R|] the predictor's s~_t
  std::vector<double> cdf;      // [|R|] cumulative sums of e^{s~_t - max s~}
  double log_scale = 0;         // L = ln(Z~ / n_s)

  // s~ of residual token t (t must be in `tokens`).
  float Score(int32_t t) const;
  // `count` i.i.d. draws from p (Draw64(j) of `stream`, j < count), ascending with repeats.
  void Draw(const PhiloxStream& stream, int64_t count, std::vector<int32_t>* out) const;
};

// Everything about one head's selection.
struct VAttentionHeadResult {
  std::vector<int32_t> fixed;   // I_f, ascending
  std::vector<int32_t> base;    // B, ascending (importance sampler: with repeats, one per draw)
  std::vector<int32_t> dyn;     // I_dyn, ascending (importance sampler: as base)
  ImportanceProposal proposal;  // importance sampler only
  bool residual_exact = false;  // importance sampler: b >= n_s, I_dyn is R with weight 1
  int32_t top_k_chosen = 0;
  VAttentionStatistics stats;
  VAttentionBudget budget;
  int64_t b = 0;  // the final sample size (the reported per-head budget)
  // Rows for the RowSelection: I_f (count 1, weight 1), I_dyn (count 1, weight n_s / b; the
  // importance sampler: count m, weight m / (b p_t)), base rows not in I_dyn (count 0, weight 0).
  void ToHeadRows(HeadRows* out) const;

  // Workspace reused across calls (priority keys); no meaning to callers.
  std::vector<std::pair<uint64_t, int32_t>> scratch;
};

// Step 1. scores: [n] predictor scores (T = int32_t for hash similarities, float for logits).
template <typename T>
void VAttentionPlanFixed(const T* scores, int32_t n, int32_t k, const VAttentionParams& params,
                         VAttentionHeadResult* r, std::vector<int32_t>* scratch);

// Uniform sample without replacement of `count` tokens of [0, n) \ excluded (ascending
// `excluded`): the `count` smallest Draw64 keys of `stream`, ties to the lower index; out
// ascending. Used for steps 3 and 6.
void SampleWithoutReplacement(const PhiloxStream& stream, int32_t n,
                              const std::vector<int32_t>& excluded, int64_t count,
                              std::vector<int32_t>* out,
                              std::vector<std::pair<uint64_t, int32_t>>* scratch);

// Row access for the budget step: logit(t) and the V row of token t (dv floats).
struct VAttentionRowAccess {
  std::function<float(int32_t)> logit;
  std::function<void(int32_t, float*)> load_v;
  int32_t dv = 0;
  // Optional: the max logit over the residual when every logit is known (exact predictor) or
  // bounded (compressed); NaN when unknown. The importance sampler does not use it.
  float residual_logit_max = std::numeric_limits<float>::quiet_NaN();
};

// The compressed predictor's bound on the residual's logits: the largest s~_t + scale |q| err_t
// + the float rounding of s~_t over the tokens t < v.length not in `fixed` (ascending), where
// approx[t] = s~_t (ApproximateScores over v with q and scale). Every true logit scale q . k_t
// of those tokens is at most this (the open group's tokens are exact: err 0, their computed
// logit, as the exact predictor takes it); -inf when the residual is empty.
float CompressedLogitUpperBound(const CompressedKeysView& v, const float* q, float scale,
                                const float* approx, const std::vector<int32_t>& fixed);

// Step 3 after VAttentionPlanFixed: fills r->base (left empty with exact_statistics).
// `sequence` and `head` (the query head) select the Philox streams. The importance sampler needs
// `scores`, the predictor's logits s~ of all n tokens (the same array VAttentionPlanFixed ranked),
// and builds r->proposal from them; the uniform sampler ignores them.
void VAttentionSampleBase(int32_t n, const VAttentionParams& params, uint64_t seed,
                          int32_t sequence, int32_t head, VAttentionHeadResult* r,
                          const float* scores = nullptr);

// Steps 4-6 after VAttentionSampleBase: statistics from the rows of r->fixed and r->base (every
// residual row with exact_statistics), the budget r->b, and the final sample r->dyn.
void VAttentionBudgetAndSample(int32_t n, const VAttentionParams& params,
                               const VAttentionRowAccess& rows, uint64_t seed, int32_t sequence,
                               int32_t head, VAttentionHeadResult* r);

// VAttentionSampleBase then VAttentionBudgetAndSample.
void VAttentionSampleHead(int32_t n, const VAttentionParams& params,
                          const VAttentionRowAccess& rows, uint64_t seed, int32_t sequence,
                          int32_t head, VAttentionHeadResult* r, const float* scores = nullptr);

struct VAttentionStats {
  std::vector<VAttentionHeadResult> heads;  // [B * H], index b * H + h (rows and budgets)
};

// Selection on a DecodeProblem: reads q, the K rows the predictor needs (all for kExact) and
// the K and V rows of I_f u B. sigs is required for kHash (its bits must equal params.bits);
// keys for kCompressed ([B * Hkv], index b * Hkv + kv_head, each holding at least seq_lens[b]
// tokens). Fills `sel` (kind kSoftmax, budgets[g] = b of query head g); `stats` may be null.
[[nodiscard]] absl::Status VAttentionSelectCpu(const DecodeProblem& p,
                                               const VAttentionParams& params, uint64_t seed,
                                               const SignatureView* sigs, RowSelection* sel,
                                               VAttentionStats* stats = nullptr,
                                               absl::Span<const CompressedKeysView> keys = {});

// Selection then EstimateInPlace (writes p.out).
[[nodiscard]] absl::Status VAttentionDecodeCpu(const DecodeProblem& p,
                                               const VAttentionParams& params, uint64_t seed,
                                               const SignatureView* sigs,
                                               RowSelection* sel = nullptr,
                                               VAttentionStats* stats = nullptr,
                                               absl::Span<const CompressedKeysView> keys = {});

}  // namespace kvsparse::kernels

#endif  // KVSPARSE_KERNELS_VATTENTION_H_
