// Synthetic decode problems with controlled score distributions, for the statistical tests in
// kernels/ and the accuracy program in tests/accuracy/. Target kvsparse_kernels_synthetic (not
// linked into the service). Data come from std::mt19937_64, not from the Philox streams: they
// are inputs, not part of any method.
#ifndef KVSPARSE_KERNELS_SYNTHETIC_H_
#define KVSPARSE_KERNELS_SYNTHETIC_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/compressed_keys.h"
#include "kernels/decode_problem.h"
#include "kernels/saap.h"

namespace kvsparse::kernels {

// How many seeds or trials a statistical test runs: n, divided by $KVSPARSE_TEST_REPEAT_DIVISOR
// where that is set (an integer >= 1; at least 2 remain). The sanitizer builds set it: there the
// tests drive the same code for memory errors, and their tolerances, written in standard errors
// of the count actually run, stay valid (with less power).
int StatisticalRepeats(int n);

// P(X >= k) for X ~ Binomial(n, p), summed in log space: the p-value of "rate <= p" for k events
// in n trials (the per-head violation tests).
double BinomialUpperTail(int k, int n, double p);

enum class ScoreFamily : uint8_t {
  // Logits ~ N(0, 0.5^2): attention spread almost evenly over all tokens.
  kNearUniform = 0,
  // Logits ~ N(0, 1), plus 4 attention sinks at the start (+9, +7, +6, +5), a local window of the
  // last 64 tokens ~ N(4, 1), and 8 planted "needle" tokens at +8 at random positions.
  kPeaked = 1,
  // Zipf: the token of rank r (a random permutation of positions) has logit -ln(r + 1), i.e.
  // attention proportional to 1 / (r + 1): a heavy tail.
  kZipf = 2,
};

const char* ScoreFamilyName(ScoreFamily f);

// Logits (already scaled) of one query over n tokens.
std::vector<float> MakeScores(ScoreFamily family, int32_t n, uint64_t seed);

struct SyntheticOptions {
  ScoreFamily family = ScoreFamily::kPeaked;
  int32_t batch = 1;
  int32_t num_q_heads = 32;                // H
  int32_t num_kv_heads = 8;                // Hkv
  int32_t head_dim = 128;                  // d
  std::vector<int32_t> seq_lens = {8192};  // [B]
  DType dtype = DType::kBf16;
  // Query head g of a group is q_anchor + head_noise * |q_anchor| * (random unit vector): heads of
  // a group see similar, not identical, distributions.
  float head_noise = 0.3f;
  // V rows are mean + N(0, 1) per coordinate, mean ~ N(0, v_mean^2) per coordinate and kv head
  // (a common component, as real value vectors have, keeps the output away from zero).
  float v_mean = 0.5f;
  uint64_t seed = 1;
};

// Owns the buffers of a DecodeProblem with layout [B, n_max, Hkv, d] (sequence-major). For
// kv head j the anchor query's logits follow `family`: K_t = (s_t / (scale |q_a|)) q_a / |q_a|
// + eta_t, with eta_t ~ N(0, I) projected orthogonal to q_a.
struct SyntheticProblem {
  std::vector<uint8_t> q, k, v, out;
  std::vector<int32_t> seq_lens;
  DecodeProblem problem;

  // Builds one. `out` is zeroed. problem.scale = 1/sqrt(d).
  static SyntheticProblem Make(const SyntheticOptions& options);

  // Sequence b's rows of `kv` (k or v) repeated for `layers` layers: [layers, n_b, Hkv, d] in the
  // problem's dtype, the layout a store's append takes (the tests load the same rows in every
  // layer: kvstore/synthetic_store.h, and the integration tests through the KvStore API).
  std::vector<uint8_t> LayerRows(const std::vector<uint8_t>& kv, int32_t b, uint32_t layers) const;

  SyntheticProblem() = default;
  SyntheticProblem(const SyntheticProblem&) = delete;
  SyntheticProblem& operator=(const SyntheticProblem&) = delete;
  SyntheticProblem(SyntheticProblem&& o) noexcept { *this = std::move(o); }
  SyntheticProblem& operator=(SyntheticProblem&& o) noexcept;
};

// Output of p as doubles, [B, H, d].
std::vector<double> OutputAsDouble(const DecodeProblem& p);

// ||got - ref|| / ||ref|| (||got - ref|| when ref is zero).
double RelativeL2(const std::vector<double>& ref, const std::vector<double>& got);

// Valid SAAP partitions of a shape with random values (kernels/saap.h): unit centroids, Llama
// RoPE frequencies of base 10000, classifier weights and biases N(0, 0.1^2); for tests.
SaapWeights RandomSaapWeights(int32_t layers, int32_t q_heads, int32_t kv_heads, int32_t head_dim,
                              int32_t clusters, int32_t hidden, uint32_t seed);

// Compressed keys (kernels/compressed_keys.h) of every (sequence, kv head) of a problem, index
// b * Hkv + j, as a worker builds them from the K rows; and their views.
std::vector<CompressedKeys> CompressProblemKeys(const DecodeProblem& p, int32_t bits);
std::vector<CompressedKeysView> ViewsOf(const std::vector<CompressedKeys>& keys);

// ---- Keys built against per-channel quantization (issue 50) ----------------------------------

// One head whose keys hide what matters from the compressed keys' scores (kernels/
// compressed_keys.h, groups of kKeyGroupTokens): d = 64 channels, 8 of high magnitude (N(0, 2^2))
// that the query weighs little (0.5), 56 of low magnitude (N(0, 0.25^2)) that it weighs most (9):
// scaled logits about N(0, 2.2^2). Values N(mu, 0.5^2) per channel around a common mu.
enum class AdversarialKeys : uint8_t {
  // A needle: a copy of its neighbour's key moved by up to 0.45 of a step, on every low channel,
  // toward the query's sign (clamped inside the group's range, so that the group's scales stay):
  // its codes equal its neighbour's, its approximate score too, its true logit is higher by the
  // sum of those moves (most of the attention). Its value row is mu - 2 mu + noise.
  kHiddenNeedle = 0,
  // A delimiter per group (its 6th token) with values of 12 sigma on the low channels, of the
  // sign that makes its own logit low: every group's range on the channels the query weighs, and
  // so its steps there, are stretched, and the other tokens' approximate scores are coarse.
  kRangeStretcher = 1,
};
const char* AdversarialKeysName(AdversarialKeys family);

struct AdversarialHead {
  int32_t n = 0, d = 0, dv = 0;
  float scale = 0;                    // 1 / sqrt(d)
  std::vector<float> q;               // [d]
  std::vector<float> k, v;            // [n, d], [n, dv] (fp32)
  int32_t needle = -1;                // kHiddenNeedle: its token (its neighbour is needle - 1)
  std::vector<float> Scores() const;  // scale q . k_t, t < n
};
// bits: the compression the keys are built against (1 or 2). n a multiple of kKeyGroupTokens.
AdversarialHead MakeAdversarialHead(AdversarialKeys family, int32_t n, int32_t bits, uint64_t seed);

// ---- Real attention: the model trained here -------------------------------------------------

// One kv head of one layer of the model trained in the repository (tests/quality/train_model.py),
// dumped by tests/quality/harness.py --dump_layers (file format KVSPQKV1, in tests/data/realattn:
// layers 1, 3 and 5 of a held-out 8192-token window, kv head 0, its 4 query heads' last 32
// queries): post-RoPE bf16 values, held here as floats (exact).
struct RealAttention {
  int32_t n = 0, d = 0, group = 0, queries = 0, layer = 0, kv_head = 0;
  std::vector<float> q;     // [queries, group, d]; query i sits at position n - queries + i
  std::vector<float> k, v;  // [n, d]
  // Keys query i attends to (causal): 0 .. n - queries + i.
  int32_t Keys(int32_t i) const { return n - queries + i + 1; }
  // Scaled logits (1/sqrt(d)) of query i, head g over its keys.
  std::vector<float> Scores(int32_t i, int32_t g) const;
};

inline constexpr int32_t kRealAttentionLayers[] = {1, 3, 5};
// tests/data/realattn/realattn-n8192-L<layer>-kv0.bin of the source tree.
std::string RealAttentionPath(int32_t layer);
// NOT_FOUND without the file, DATA_LOSS for a malformed one.
absl::StatusOr<RealAttention> LoadRealAttention(const std::string& path);
// Its decode problem: one sequence per query (batch = queries, sequence i of Keys(i) tokens, all
// reading the same K and V), H = group, Hkv = 1, in `dtype`.
SyntheticProblem RealAttentionProblem(const RealAttention& r, DType dtype = DType::kBf16);

}  // namespace kvsparse::kernels

#endif  // KVSPARSE_KERNELS_SYNTHETIC_H_
