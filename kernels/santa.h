// SANTA and S2ANTA decode: estimate softmax(s) V by sampling rows of V from the post-softmax
// distribution p_j = e^{s_j} / Z and averaging them (S2ANTA paper, Section 2, Appendices A, P, Q).
// Scores s_j = scale * q . K_j are exact, or Bernoulli qK^T estimates (bernoulli_qk.h).
//
// Stages: the *selection* needs the scores of every row (so K, or Bernoulli-selected features
// of K, is resident where selection runs) and returns a RowSelection of kind kLinear; the
// *estimate* needs only the selected V rows: out_h = sum_r w[h,r] V_r. Every allocation below
// splits this way (prop's budgets need all tile statistics, but those come from K, not V).
//
// ---------------------------------------------------------------------------------------------
// Allocation kGlobal: one CDF over all n tokens (Section 2.1). Per query head, in float64:
//   u_j = exp(s_j - max s) (double), C_j = sum_{i<=j} u_i (ascending j), F^{-1}(t) = the first j
//   with C_j > t * C_{n-1}. Thresholds t_m, from the head's Philox stream (philox.h):
//     kIid:        t_s = Uniform(s), s < S                                      (Eq. 4)
//     kStratified: t_m = (m + Uniform(m)) / S                (S2ANTA-strat, one draw per stratum)
//     kSystematic: t_m = (m + Uniform(0)) / S                (S2ANTA-sys, one shared offset)
//   (all in double; a threshold that rounds past C_{n-1} maps to the last token with u_j > 0).
//   Estimate: (1/S) sum_m V_{J_m}, i.e. w[h, j] = count_j / S.
//   Properties (Appendix A): all three are unbiased, E = softmax(s) V. Cov(iid) = Sigma / S;
//   stratified's covariance is <= (Loewner) iid's (Theorem A.6); systematic has no general
//   guarantee (in our tests it behaves like stratified). "Exactly" up to the 24-bit uniforms:
//   a token's selection probability is off by < 2^-24 per draw (iid) or 2^-24 / S (strat, sys),
//   i.e. a relative bias ~sqrt(n) 2^-24, far below anything a test can see; the same holds for
//   the per-tile offsets a0_t below.
//
// Allocation kProp (S2ANTA-prop, Appendix P, Algorithms 2-5), systematic sampling only.
// Tiles T_t = [t*B_tile, min((t+1)*B_tile, n)), T = ceil(n / B_tile). In this order, fp32 unless
// said otherwise, with no fused multiply-add:
//   m_t = max_{n in T_t} s_n;  u_n = expf(s_n - m_t);  l_t = sum_{n in T_t} u_n (ascending n);
//   m* = max_t m_t;  W_t = expf(m_t - m*) * l_t;  Z = sum_t W_t (double, ascending t);
//   q_t = S * (double(W_t) / Z) (double), in fixed point Q_t = round(q_t 2^32) (uint64), C_t =
//   sum_{i<=t} Q_i (exact integer sums: the same in any order); budgets by systematic rounding
//   with one offset per (sequence, kv head), shared by the group's query heads (so that they
//   round up the same tiles and read few distinct V rows), U = Uniform(0) of
//   RngTag::kPropRounding (head index = kv head) as U_fp = U 2^32:
//     S_t = floor((C_t + U_fp) / 2^32) - floor((C_{t-1} + U_fp) / 2^32),
//   so S_t is floor(q_t) or ceil(q_t), E[S_t] = q_t (up to 2^-32) and sum_t S_t = S (up to one
//   when the Q_t's rounding moves C_T off S 2^32: probability ~ T 2^-32);
//   invdelta_t = S_t > 0 ? float(S_t) / l_t : 0;  a0_t = Uniform(t) of RngTag::kPropTileOffset;
//   pass 2 per tile: p = 0; for n ascending: x = invdelta_t * u_n; f0 = a0_t + p;
//     f1 = f0 + x; c_n = floor(f1) - floor(f0); p = p + x.
//   Estimate: (1/S) sum_n c_n V_n, i.e. w[h, n] = c_n / S.
//   Within a tile this is systematic sampling of S_t draws from u_n / l_t (offset 1 - a0_t), so
//   E[sum_{n in T_t} c_n V_n | S_t] = S_t mu_t, mu_t = sum_{n in T_t} u_n V_n / l_t, and with
//   E[S_t] = q_t = S W_t / Z:
//     E[out] = sum_t (q_t / S) mu_t = sum_t (W_t / Z) mu_t = softmax(s) V:   unbiased.
//   (Largest-remainder budgets, a deterministic function of the scores, were biased: tiles whose
//   q_t fell below the cut never sampled, by up to 200 standard errors on heavy-tailed scores.)
//   A tile whose scores are all -inf (masked: padding, a window) has u = 0, l_t = 0, W_t = 0,
//   hence Q_t = 0 and S_t = 0: it never samples.
//   (fp32 rounding of p can make sum_n c_n differ from S_t by one, with probability ~1e-6.)
//
// Allocation kFlash (S2ANTA-flash, Appendix Q, Algorithms 6-8), systematic sampling only.
//   Uniform tile budget S_tile = max(1, ceil(S / T)): "S/T rounded" is rounded UP so that the
//   total T * S_tile >= S and every tile gets at least one sample (the estimator needs S_tile
//   >= 1 in every tile with mass to be unbiased). E.g. n = 32768, B_tile = 256: T = 128, so
//   S = 2048 gives S_tile = 16 (2048 draws) and S = 128 gives S_tile = 1 (128 draws); S = 100
//   would also give S_tile = 1, i.e. 128 draws. The budget reported per head is T * S_tile.
//   Per tile: m_t, u_n, l_t as for prop; invdelta_t = float(S_tile) / l_t (l_t >= 1 because the
//   tile max contributes exp(0) = 1, so the "l tiny" branch of Algorithm 7 never fires), except
//   in a tile whose scores are all -inf: l_t = 0, W_t = 0, invdelta_t = 0, no samples;
//   a0_t = Uniform(t) of RngTag::kFlashTileOffset; the same pass-2 counts c_n.
//   Merge (Algorithm 8): W_t, Z as for prop; out = (1/Z) sum_t W_t (O~_t / S_tile), O~_t =
//   sum_{n in T_t} c_n V_n, i.e. w[h, n] = (W_t / Z) * c_n / S_tile (double, stored as float).
//   Unbiased given the tile weights: E[O~_t / S_tile] = mu_t, so E[out] = sum_t (W_t/Z) mu_t =
//   softmax(s) V. It spends S_tile draws even on tiles with negligible W_t ("sample waste"); the
//   selection lists those rows too (as the fused GPU kernel reads them), even where W_t / Z
//   underflows to a zero weight; a worker may skip rows whose weights are all zero.
//
// The group mixture proposal (params.proposal = kGroupMixture, with kRatio): the kv head's G
// query heads share one sample of S rows drawn from p = mean_h softmax(s~_h) (its scores
// GroupMixtureScores(s~_1..G) = log p + const); each head h takes the ratio estimate over those
// rows with its own exact scores, sum w_j e^{s_h,j - log p_j} V_j / sum w_j e^{s_h,j - log p_j}
// (the same self-normalised importance estimator, proposal p instead of softmax(s~_h)): S rows
// cross per kv head instead of the union of G heads' S.
//
// Scores from compressed keys (params.scores = kCompressedKeys; kernels/compressed_keys.h):
// the sequence keeps every key in a few bits per channel instead of K, and the sampler runs
// unchanged on the approximate scores s~_j = scale * q . k~_j, i.e. it draws from
// p~ = softmax(s~). Every allocation above is a linear estimator unbiased for p~:
// E[sum_j w_j f_j] = sum_j p~_j f_j for any f. Two estimates follow (params.correction):
//   kNone   out = sum_j w_j V_j, as above: only V rows cross, but it estimates softmax(s~) V, not
//           softmax(s) V (bias: (p~ - p) V, of the order of the score error; measured in
//           kernels/santa_test.cc, stated in docs/ACCURACY.md).
//   kRatio  the sampled K rows cross too, give the exact s_j, and with r_j = e^{s_j - s~_j}:
//             out = sum_j w_j r_j V_j / sum_j w_j r_j.
//           N = sum w r V and D = sum w r are unbiased for (Z / Z~) softmax(s) V and Z / Z~
//           (Z = sum e^s, Z~ = sum e^s~), so out is the ratio (self-normalised importance)
//           estimator of softmax(s) V: consistent, with bias
//             E[out] - O = E[(out - O)(E[D] - D)] / E[D],  |E[out] - O| <= rmse(out) * cv(D)
//           per coordinate (Cauchy-Schwarz; cv = sd / mean), i.e. O(1/S); with exact keys
//           (r = 1, D = sum w = 1) it is the estimator above, exactly. Both N and D are the
//           same systematic sums as the sampler's, so cv(D) is small where r varies slowly
//           over the sample (the error bound |s - s~| <= scale |q| err_j of the stored error
//           norms bounds ln r per row).
//           As a selection it is kind kSoftmax with weights w'_j = e^{ln w_j - s~_j - c} (c the
//           head's largest ln w - s~, so w' is in (0, 1]): the estimate stage forms
//           sum w' e^{s} V / sum w' e^{s}, which is the ratio above.
//
// GPU agreement: the CUDA kernels compute these quantities without FMA contraction
// (__fmul_rn/__fadd_rn) but add their sums in parallel orders of their own (fixed: the same
// indices every call), so their sums differ from the ascending ones above by rounding; with the
// scores also rounded differently, an index can differ only where a threshold falls within
// rounding distance of a CDF boundary (the GPU tests allow about one head in a hundred).
#ifndef KVSPARSE_KERNELS_SANTA_H_
#define KVSPARSE_KERNELS_SANTA_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/bernoulli_qk.h"
#include "kernels/compressed_keys.h"
#include "kernels/decode_problem.h"
#include "kernels/row_selection.h"

namespace kvsparse::kernels {

// One in prop's fixed-point quotas (2^32).
inline constexpr double kPropFixedOne = 4294967296.0;

// Numbering follows proto SantaSampler / SantaAllocation.
enum class SantaSampler : uint8_t {
  kIid = 1,         // SANTA (Eq. 4)
  kStratified = 2,  // S2ANTA-strat
  kSystematic = 3,  // S2ANTA-sys
};

enum class SantaAllocation : uint8_t {
  kGlobal = 1,  // one CDF over all tokens
  kProp = 2,    // S2ANTA-prop: tile budgets by systematic rounding of S W_t / Z
  kFlash = 3,   // S2ANTA-flash: uniform tile budgets, deferred merge
};

// The estimate when the scores are approximate (compressed keys); see the header comment.
enum class SantaCorrection : uint8_t {
  kRatio = 0,  // fetch the sampled K rows: self-normalised importance weights e^{s - s~}
  kNone = 1,   // V rows only: estimates softmax(s~) V
};

// What the samples of a kv head's query heads are drawn from (compressed scores, kRatio).
enum class SantaProposal : uint8_t {
  kPerHead = 0,       // each query head draws S from its own softmax(s~_h); the group reads the
                      // union of its heads' rows (up to G S)
  kGroupMixture = 1,  // the group draws S once from the mean of its heads' softmax(s~_h)
                      // (GroupMixtureScores) and every head weights those rows by its own
                      // exact scores: S rows per kv head
};

struct SantaParams {
  SantaSampler sampler = SantaSampler::kSystematic;
  SantaAllocation allocation = SantaAllocation::kProp;
  int32_t samples = 128;    // S per query head, >= 1
  int32_t tile_size = 256;  // B_tile for kProp / kFlash, >= 1
  // Bernoulli qK^T: estimate the scores from this many draws per feature; 0 = exact scores.
  int32_t bernoulli_qk_samples = 0;
  BernoulliQkMode bernoulli_mode = BernoulliQkMode::kMeanGroupQuery;
  BernoulliSampler bernoulli_sampler = BernoulliSampler::kStratified;
  // Exact scores (K read where selection runs) or the sequence's compressed keys.
  ScoreSource scores = ScoreSource::kExact;
  SantaCorrection correction = SantaCorrection::kRatio;  // compressed scores only
  SantaProposal proposal = SantaProposal::kPerHead;      // compressed scores, kRatio only
  // Compressed scores with kRatio: the proposal is (1 - a) softmax(s~) + a / n (ProposalFloor),
  // a in [0, 1); 0 draws from softmax(s~) itself.
  float uniform_floor = 0.f;
};

// A proposal's scores with a uniform floor: scores (log-probabilities up to a constant, -inf for
// no mass) replaced by log((1 - a) softmax(scores) + a / n) over their n entries, so that the
// sampler run on them draws from the defensive mixture and the ratio weights e^{s - scores} are
// at most e^{s} n / a. a = 0 leaves them as they are. REQUIRES: 0 <= a < 1.
void ProposalFloor(float a, std::vector<float>* scores);

// The group mixture proposal's scores: log of the mean over the G heads of softmax(s~_h), one
// value per token (-inf where no head has mass): the sampler run on them draws from
// p(j) = (1/G) sum_h softmax(s~_h)_j. heads: G arrays of n scores. Every p(j) >= p_h(j) / G, so
// each head's importance weight e^{s_h - log p} is at most G e^{s_h - s~_h} Z~_h (a defensive
// mixture: no head's mass is missed because another head's is elsewhere).
void GroupMixtureScores(absl::Span<const float* const> heads, int32_t n, std::vector<float>* out);

// INVALID_ARGUMENT naming the field: samples < 1, tile_size < 1 (tiled allocations), a sampler
// other than kSystematic with kProp / kFlash (the GPU kernels implement systematic only),
// unknown enum values, bernoulli_qk_samples < 0, Bernoulli qK^T with compressed-key scores, a
// uniform_floor outside [0, 1) or without compressed scores and the ratio correction.
[[nodiscard]] absl::Status ValidateSantaParams(const SantaParams& params);

// What the per-head sampler needs from one head's scores, computed once (the "prepared" form:
// tests draw thousands of seeds from one of these without recomputing anything).
struct SantaHeadPlan {
  int32_t n = 0;
  SantaAllocation allocation = SantaAllocation::kGlobal;
  // kGlobal: shape [n] cumulative unnormalised weights C_j (double), last token with u > 0.
  std::vector<double> cum;
  int32_t last_positive = -1;
  // kProp / kFlash: the Algorithm 3 stash and tile statistics.
  int32_t tile_size = 0;
  int32_t num_tiles = 0;             // T
  std::vector<float> u;              // [n] expf(s_n - m_t)
  std::vector<float> tile_max;       // [T] m_t
  std::vector<float> tile_sum;       // [T] l_t
  std::vector<double> tile_weight;   // [T] W_t / Z (double)
  std::vector<double> tile_quota;    // [T] q_t = S W_t / Z (prop)
  std::vector<uint64_t> quota_cum;   // [T] C_t, prop's fixed-point prefix sums of q_t
  std::vector<int32_t> tile_budget;  // [T] S_tile (flash); prop's S_t are drawn per sample
  std::vector<float> inv_delta;      // [T] invdelta_t (flash)
  int64_t budget = 0;                // samples drawn per head: S, or T * S_tile for flash
};

// Builds the plan for one query head. scores: [n] fp32 logits (already multiplied by scale).
[[nodiscard]] absl::Status PlanSantaHead(absl::Span<const float> scores, const SantaParams& params,
                                         SantaHeadPlan* plan);

// Draws one head's sample: rows ascending with counts and weights (w = count / S for global and
// prop, (W_t/Z) c / S_tile for flash). `sequence` and `head` (the query head) pick the Philox
// streams; `kv_head` (head / G) prop's rounding offset, which the heads of a GQA group share.
// Allocation-free once `out` has capacity; `scratch` holds the iid indices or prop's budgets.
void SampleSantaHead(const SantaHeadPlan& plan, const SantaParams& params, uint64_t seed,
                     int32_t sequence, int32_t head, int32_t kv_head, HeadRows* out,
                     std::vector<int32_t>* scratch = nullptr);

// Prop's tile budgets S_t for the rounding offset u in [0, 1) (PropRoundingOffset's).
void PropTileBudgets(const SantaHeadPlan& plan, float u, std::vector<int32_t>* budgets);
// The rounding offset of (seed, sequence, kv head): one per GQA group, so that heads with
// similar quotas round up the same tiles (each head's budgets are unbiased on their own; shared
// offsets keep the group's union of tiles, and of V rows read from host memory, small).
float PropRoundingOffset(uint64_t seed, int32_t sequence, int32_t kv_head);

// E[out] of the sampler for one head as weights over tokens: w_j such that E[out] = sum_j w_j V_j:
// the softmax probabilities for every allocation (all are unbiased), as the sampler computes
// them (prop and flash: (W_t / Z) u_j / l_t).
// shape of out: [n].
void SantaExpectedWeights(const SantaHeadPlan& plan, const SantaParams& params,
                          std::vector<double>* out);

// Per-head statistics of a SANTA selection.
struct SantaStats {
  int32_t group = 0, dim = 0;  // G and head_dim of the problem
  // Shape [B * Hkv]: the (query head, key feature) pairs the group's scores read (G * d with
  // exact scores), and the key features read for the group, their union (d with exact scores).
  std::vector<int64_t> key_features_head;
  std::vector<int64_t> key_features_group;

  // Entry i's fraction of key features read per head (mean over the group) and by the group.
  double head_fraction(size_t i) const {
    return static_cast<double>(key_features_head[i]) / (static_cast<double>(group) * dim);
  }
  double group_fraction(size_t i) const { return static_cast<double>(key_features_group[i]) / dim; }
};

// Selection stage: reads q and every K row (or the Bernoulli-selected features of them), never
// V. Fills `sel` (kind kLinear; budgets[g] = samples drawn by query head g). With compressed
// scores it reads q and `keys` instead of p.k ([B * Hkv], index b * Hkv + kv_head, each holding
// at least seq_lens[b] tokens, as ScoreTopKSelectCpu), and with kRatio the selection is kind
// kSoftmax (the estimate then reads the selected K rows).
[[nodiscard]] absl::Status SantaSelectCpu(const DecodeProblem& p, const SantaParams& params,
                                          uint64_t seed, RowSelection* sel,
                                          SantaStats* stats = nullptr,
                                          absl::Span<const CompressedKeysView> keys = {});

// Selection then EstimateInPlace: writes p.out. `sel` and `stats` may be null.
[[nodiscard]] absl::Status SantaDecodeCpu(const DecodeProblem& p, const SantaParams& params,
                                          uint64_t seed, RowSelection* sel = nullptr,
                                          SantaStats* stats = nullptr,
                                          absl::Span<const CompressedKeysView> keys = {});

}  // namespace kvsparse::kernels

#endif  // KVSPARSE_KERNELS_SANTA_H_
