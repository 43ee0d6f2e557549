// S2ANTA over compressed keys (kernels/santa.h, "Scores from compressed keys"): the sampler draws
// from softmax(s~) of the compressed keys' scores; kRatio corrects with the sampled rows' exact
// scores (the ratio estimator), kNone does not. What is tested:
//   - the selection is the estimator the header states (kRatio's decode is N / D computed here
//     from the kNone selection's rows and weights; kNone's is sum w V), and bad input is refused;
//   - over 2,000 seeds per head, on the synthetic families and the real-attention dumps of the
//     model trained here, with 2- and 8-bit keys kRatio's mean sits within 4 standard errors of
//     dense (and inside its stated bound rmse * cv(D)); with 1-bit keys its bias is measurable
//     and at most the estimate's own rmse; kNone's bias is visible at 1 and 2 bits. The printed
//     table gives the measured bias of both in standard errors (docs/ACCURACY.md quotes it).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "kernels/compressed_keys.h"
#include "kernels/cpu_util.h"
#include "kernels/dense.h"
#include "kernels/santa.h"
#include "kernels/synthetic.h"

namespace kvsparse::kernels {
namespace {

SantaParams Config(SantaSampler sampler, SantaAllocation allocation, int32_t S,
                   SantaCorrection correction) {
  SantaParams p;
  p.sampler = sampler;
  p.allocation = allocation;
  p.samples = S;
  p.tile_size = 256;
  p.scores = ScoreSource::kCompressedKeys;
  p.correction = correction;
  return p;
}

std::vector<SantaParams> AllAllocations(int32_t S, SantaCorrection c) {
  return {Config(SantaSampler::kIid, SantaAllocation::kGlobal, S, c),
          Config(SantaSampler::kSystematic, SantaAllocation::kGlobal, S, c),
          Config(SantaSampler::kSystematic, SantaAllocation::kProp, S, c),
          Config(SantaSampler::kSystematic, SantaAllocation::kFlash, S, c)};
}

TEST(SantaCompressedTest, RefusesWhatItCannotServe) {
  SyntheticOptions o;
  o.num_q_heads = 4;
  o.num_kv_heads = 2;
  o.head_dim = 32;
  o.seq_lens = {300};
  SyntheticProblem sp = SyntheticProblem::Make(o);
  SantaParams p =
      Config(SantaSampler::kSystematic, SantaAllocation::kProp, 16, SantaCorrection::kRatio);
  RowSelection sel;
  EXPECT_EQ(SantaSelectCpu(sp.problem, p, 1, &sel).code(), absl::StatusCode::kInvalidArgument)
      << "one view per (sequence, kv head)";
  std::vector<CompressedKeys> c = CompressProblemKeys(sp.problem, 2);
  EXPECT_TRUE(SantaSelectCpu(sp.problem, p, 1, &sel, nullptr, ViewsOf(c)).ok());
  EXPECT_EQ(sel.kind, EstimateKind::kSoftmax);
  p.bernoulli_qk_samples = 4;
  EXPECT_EQ(ValidateSantaParams(p).code(), absl::StatusCode::kInvalidArgument);
  p.bernoulli_qk_samples = 0;
  p.correction = static_cast<SantaCorrection>(7);
  EXPECT_EQ(ValidateSantaParams(p).code(), absl::StatusCode::kInvalidArgument);
  p.correction = SantaCorrection::kNone;
  p.scores = static_cast<ScoreSource>(9);
  EXPECT_EQ(ValidateSantaParams(p).code(), absl::StatusCode::kInvalidArgument);
  // Views shorter than the sequence.
  std::vector<CompressedKeys> short_keys;
  for (int i = 0; i < 2; ++i) short_keys.emplace_back(KeyCompression{2, 128}, 32, DType::kBf16);
  p.scores = ScoreSource::kCompressedKeys;
  EXPECT_EQ(SantaSelectCpu(sp.problem, p, 1, &sel, nullptr, ViewsOf(short_keys)).code(),
            absl::StatusCode::kInvalidArgument);
}

// ProposalFloor: the scores become log((1 - a) softmax + a / n), whose softmax is that mixture;
// a token without mass gets the floor; a = 0 leaves them alone.
TEST(SantaCompressedTest, ProposalFloorMixesInAUniformFloor) {
  const std::vector<float> in = {2.f, -1.f, 0.5f, -std::numeric_limits<float>::infinity(), 7.f};
  const int n = static_cast<int>(in.size());
  double z = 0;
  for (float x : in) z += std::exp(static_cast<double>(x));
  for (float a : {0.05f, 0.5f}) {
    std::vector<float> out = in;
    ProposalFloor(a, &out);
    double zo = 0;
    for (float x : out) zo += std::exp(static_cast<double>(x));
    for (int i = 0; i < n; ++i) {
      const double want = (1 - a) * std::exp(static_cast<double>(in[i])) / z + a / n;
      EXPECT_NEAR(std::exp(static_cast<double>(out[i])) / zo, want, 1e-6 * (1 + want))
          << a << " " << i;
    }
  }
  std::vector<float> same = in;
  ProposalFloor(0.f, &same);
  EXPECT_EQ(same, in);
  SantaParams p =
      Config(SantaSampler::kSystematic, SantaAllocation::kProp, 16, SantaCorrection::kRatio);
  p.uniform_floor = 0.05f;
  EXPECT_TRUE(ValidateSantaParams(p).ok());
  for (float bad : {1.f, -0.1f, std::numeric_limits<float>::quiet_NaN()}) {
    p.uniform_floor = bad;
    const absl::Status st = ValidateSantaParams(p);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(absl::StrContains(st.message(), "uniform_floor")) << st;
  }
  p.uniform_floor = 0.05f;
  p.correction = SantaCorrection::kNone;  // the floor is weighed by the ratio correction
  EXPECT_EQ(ValidateSantaParams(p).code(), absl::StatusCode::kInvalidArgument);
  p.correction = SantaCorrection::kRatio;
  p.scores = ScoreSource::kExact;
  EXPECT_EQ(ValidateSantaParams(p).code(), absl::StatusCode::kInvalidArgument);
}

// SantaSelectCpu draws from the floored proposal and weighs by it: its rows and weights are those
// of the sampler run on ProposalFloor(a, s~) by hand (per head and the group mixture).
TEST(SantaCompressedTest, TheFloorIsWhatTheEngineDrawsFrom) {
  SyntheticOptions o;
  o.family = ScoreFamily::kPeaked;
  o.num_q_heads = 2;
  o.num_kv_heads = 1;
  o.head_dim = 32;
  o.seq_lens = {1000};
  o.dtype = DType::kFp32;
  SyntheticProblem sp = SyntheticProblem::Make(o);
  const DecodeProblem& p = sp.problem;
  std::vector<CompressedKeys> c = CompressProblemKeys(p, 2);
  const std::vector<CompressedKeysView> views = ViewsOf(c);
  SantaParams params =
      Config(SantaSampler::kSystematic, SantaAllocation::kProp, 48, SantaCorrection::kRatio);
  params.uniform_floor = 0.2f;
  RowSelection sel, plain;
  ASSERT_TRUE(SantaSelectCpu(p, params, 7, &sel, nullptr, views).ok());
  SantaParams none = params;
  none.uniform_floor = 0.f;
  ASSERT_TRUE(SantaSelectCpu(p, none, 7, &plain, nullptr, views).ok());
  const int32_t n = p.seq_lens[0], d = p.head_dim;
  std::vector<HeadRows> rows(2);
  std::vector<int32_t> scratch;
  for (int32_t h = 0; h < 2; ++h) {
    std::vector<float> q(d), sa(views[0].length);
    LoadQuery(p, 0, h, q.data());
    ApproximateScores(views[0], q.data(), p.scale, sa.data());
    sa.resize(n);
    ProposalFloor(params.uniform_floor, &sa);
    SantaHeadPlan plan;
    ASSERT_TRUE(PlanSantaHead(sa, params, &plan).ok());
    SampleSantaHead(plan, params, 7, 0, h, 0, &rows[h], &scratch);
  }
  KvHeadSelection want;
  MergeGroup(rows, &want);
  EXPECT_EQ(sel.at(0, 0).tokens, want.tokens);
  EXPECT_EQ(sel.at(0, 0).head_counts, want.head_counts);
  EXPECT_NE(sel.at(0, 0).tokens, plain.at(0, 0).tokens) << "the floor moves the draws";
  // The group mixture floors the mixture's scores the same way.
  params.proposal = SantaProposal::kGroupMixture;
  ASSERT_TRUE(SantaSelectCpu(p, params, 7, &sel, nullptr, views).ok());
  none.proposal = SantaProposal::kGroupMixture;
  ASSERT_TRUE(SantaSelectCpu(p, none, 7, &plain, nullptr, views).ok());
  EXPECT_NE(sel.at(0, 0).tokens, plain.at(0, 0).tokens) << "the floor moves the mixture's draws";
}

// kNone's decode is sum_j w_j V_j over draws from softmax(s~); kRatio's, with the same rows and
// the same linear weights w_j, is sum w r V / sum w r with r = e^{s - s~} (exact s from the
// rows' K). Computed here in float64 from the kNone selection, for every allocation, a ragged
// batch and 1 and 2 bits.
TEST(SantaCompressedTest, TheSelectionIsTheRatioEstimator) {
  SyntheticOptions o;
  o.family = ScoreFamily::kPeaked;
  o.batch = 2;
  o.num_q_heads = 4;
  o.num_kv_heads = 2;
  o.head_dim = 32;
  o.seq_lens = {1000, 300};
  o.dtype = DType::kFp32;
  SyntheticProblem sp = SyntheticProblem::Make(o);
  const DecodeProblem& p = sp.problem;
  const int32_t d = p.head_dim, G = p.group_size();
  for (int32_t bits : {1, 2}) {
    std::vector<CompressedKeys> c = CompressProblemKeys(p, bits);
    const std::vector<CompressedKeysView> views = ViewsOf(c);
    for (const SantaParams& ratio : AllAllocations(48, SantaCorrection::kRatio)) {
      SantaParams none = ratio;
      none.correction = SantaCorrection::kNone;
      for (uint64_t seed : {3u, 4u}) {
        RowSelection lin, sel;
        ASSERT_TRUE(SantaDecodeCpu(p, none, seed, &lin, nullptr, views).ok());
        ASSERT_EQ(lin.kind, EstimateKind::kLinear);
        const std::vector<double> none_out = OutputAsDouble(p);
        ASSERT_TRUE(SantaDecodeCpu(p, ratio, seed, &sel, nullptr, views).ok());
        ASSERT_EQ(sel.kind, EstimateKind::kSoftmax);
        const std::vector<double> ratio_out = OutputAsDouble(p);
        std::vector<float> q(d), s, sa, v(d), k(d);
        for (int32_t b = 0; b < p.batch; ++b) {
          const int32_t n = p.seq_lens[b];
          for (int32_t j = 0; j < p.num_kv_heads; ++j) {
            const KvHeadSelection& a = lin.at(b, j);
            const KvHeadSelection& r = sel.at(b, j);
            ASSERT_EQ(a.tokens, r.tokens);
            ASSERT_EQ(a.head_counts, r.head_counts);
            for (int32_t g = 0; g < G; ++g) {
              const int32_t h = j * G + g;
              LoadQuery(p, b, h, q.data());
              s.resize(n);
              ComputeScores(p, b, h, q.data(), s.data());
              sa.resize(views[b * p.num_kv_heads + j].length);
              ApproximateScores(views[b * p.num_kv_heads + j], q.data(), p.scale, sa.data());
              std::vector<double> lin_sum(d, 0.0), num(d, 0.0);
              double den = 0.0;
              for (int32_t i = 0; i < a.num_rows(); ++i) {
                const double w = a.weights[g * a.num_rows() + i];
                if (w == 0.0) continue;
                const int32_t t = a.tokens[i];
                LoadRowAsFloat(p.v, KvRowOffset(p, b, j, t), d, p.dtype, v.data());
                const double rr = std::exp(static_cast<double>(s[t]) - sa[t]);
                for (int32_t x = 0; x < d; ++x) {
                  lin_sum[x] += w * v[x];
                  num[x] += w * rr * v[x];
                }
                den += w * rr;
              }
              for (int32_t x = 0; x < d; ++x) {
                const size_t at = (static_cast<size_t>(b) * p.num_q_heads + h) * d + x;
                EXPECT_NEAR(none_out[at], lin_sum[x], 1e-4 * (1 + std::fabs(lin_sum[x])));
                EXPECT_NEAR(ratio_out[at], num[x] / den, 1e-4 * (1 + std::fabs(num[x] / den)))
                    << bits << " bits, seed " << seed << ", b " << b << ", head " << h;
              }
            }
          }
        }
      }
    }
  }
}

// ---- Statistics over seeds ------------------------------------------------------------------

// One query head of one sequence, prepared once: exact and compressed-key scores, the sampler's
// plan over the compressed ones, V rows, dense output and three projections of it.
struct Unit {
  int32_t b = 0, h = 0, kv_head = 0;
  std::vector<float> s, sa;  // exact and approximate scaled logits [n]
  std::vector<float> v;      // [n, d]
  SantaHeadPlan plan;
  std::vector<std::vector<double>> proj;  // [3][d] unit vectors
  double dense[3] = {0, 0, 0};            // projections of softmax(s) V (float64)
};

// u's dense output softmax(s) V (float64) projected on three random unit vectors (z over rng).
void ProjectDense(Unit* u, int32_t d, std::mt19937& rng, std::normal_distribution<double>& z) {
  const int32_t n = static_cast<int32_t>(u->s.size());
  const double m = *std::max_element(u->s.begin(), u->s.end());
  std::vector<double> o(d, 0.0);
  double zsum = 0.0;
  for (int32_t t = 0; t < n; ++t) {
    const double e = std::exp(u->s[t] - m);
    zsum += e;
    for (int32_t x = 0; x < d; ++x) o[x] += e * u->v[static_cast<size_t>(t) * d + x];
  }
  for (int i = 0; i < 3; ++i) {
    std::vector<double> pr(d);
    double norm = 0.0;
    for (double& x : pr) {
      x = z(rng);
      norm += x * x;
    }
    for (double& x : pr) x /= std::sqrt(norm);
    for (int32_t x = 0; x < d; ++x) u->dense[i] += pr[x] * o[x] / zsum;
    u->proj.push_back(std::move(pr));
  }
}

// proposal kGroupMixture: every unit's proposal (sa, plan) is its kv head's group mixture
// (GroupMixtureScores over the group's approximate scores), as SantaSelectCpu draws it.
std::vector<Unit> MakeUnits(const DecodeProblem& p, absl::Span<const CompressedKeysView> views,
                            absl::Span<const int32_t> batches, const SantaParams& params) {
  std::vector<Unit> units;
  const int32_t d = p.head_dim, G = p.group_size();
  std::mt19937 rng(17);
  std::normal_distribution<double> z;
  std::vector<float> q(d);
  for (int32_t b : batches) {
    const int32_t n = p.seq_lens[b];
    for (int32_t h = 0; h < p.num_q_heads; ++h) {
      Unit u;
      u.b = b;
      u.h = h;
      u.kv_head = h / G;
      const CompressedKeysView& view = views[b * p.num_kv_heads + u.kv_head];
      LoadQuery(p, b, h, q.data());
      u.s.resize(n);
      ComputeScores(p, b, h, q.data(), u.s.data());
      u.sa.resize(view.length);
      ApproximateScores(view, q.data(), p.scale, u.sa.data());
      u.sa.resize(n);
      if (params.proposal == SantaProposal::kGroupMixture) {
        std::vector<std::vector<float>> heads(G, std::vector<float>(view.length));
        std::vector<const float*> ptrs;
        std::vector<float> qh(d);
        for (int32_t g = 0; g < G; ++g) {
          LoadQuery(p, b, u.kv_head * G + g, qh.data());
          ApproximateScores(view, qh.data(), p.scale, heads[g].data());
          ptrs.push_back(heads[g].data());
        }
        GroupMixtureScores(ptrs, n, &u.sa);
      }
      EXPECT_TRUE(PlanSantaHead(u.sa, params, &u.plan).ok());
      u.v.resize(static_cast<size_t>(n) * d);
      for (int32_t t = 0; t < n; ++t) {
        LoadRowAsFloat(p.v, KvRowOffset(p, b, u.kv_head, t), d, p.dtype, &u.v[t * d]);
      }
      ProjectDense(&u, d, rng, z);
      units.push_back(std::move(u));
    }
  }
  return units;
}

// Per (unit, projection) over `trials` seeds: the ratio estimate's and the uncorrected one's
// mean, standard error, rmse, and the bound rmse * cv(D).
struct Moments {
  double sum = 0, sum2 = 0, sq_err = 0;
  void Add(double x, double truth) {
    sum += x;
    sum2 += x * x;
    sq_err += (x - truth) * (x - truth);
  }
  double Mean(int n) const { return sum / n; }
  double Se(int n) const {
    const double m = Mean(n);
    return std::sqrt(std::max(0.0, (sum2 / n - m * m) * n / (n - 1)) / n);
  }
  double Rmse(int n) const { return std::sqrt(sq_err / n); }
};

struct Verdict {
  double max_z_ratio = 0, max_z_none = 0;          // |mean - dense| / SE, worst projection
  double max_bound_ratio = 0;                      // worst (|bias| - 4 SE) / bound; <= 1 holds
  double max_bias_rmse = 0;                        // worst |bias| / rmse of the ratio estimate
  double mean_rmse_ratio = 0, mean_rmse_none = 0;  // rmse / |dense| averaged
  int violations = 0;                              // projections with |bias| > 4 SE + bound
  int projections = 0;
};

Verdict Measure(const std::vector<Unit>& units, const SantaParams& params, int trials, int32_t d) {
  Verdict out;
  HeadRows rows;
  std::vector<int32_t> scratch;
  for (const Unit& u : units) {
    Moments ratio[3], none[3];
    double d_sum = 0, d_sum2 = 0;
    std::vector<double> num(d), lin(d);
    for (int trial = 0; trial < trials; ++trial) {
      SampleSantaHead(u.plan, params, 5000 + trial, u.b, u.h, u.kv_head, &rows, &scratch);
      std::fill(num.begin(), num.end(), 0.0);
      std::fill(lin.begin(), lin.end(), 0.0);
      double den = 0.0;
      for (size_t i = 0; i < rows.tokens.size(); ++i) {
        const int32_t t = rows.tokens[i];
        const double w = rows.weights[i];
        const double wr = w * std::exp(static_cast<double>(u.s[t]) - u.sa[t]);
        const float* v = &u.v[static_cast<size_t>(t) * d];
        for (int32_t x = 0; x < d; ++x) {
          num[x] += wr * v[x];
          lin[x] += w * v[x];
        }
        den += wr;
      }
      d_sum += den;
      d_sum2 += den * den;
      for (int i = 0; i < 3; ++i) {
        double r = 0, l = 0;
        for (int32_t x = 0; x < d; ++x) {
          r += u.proj[i][x] * num[x] / den;
          l += u.proj[i][x] * lin[x];
        }
        ratio[i].Add(r, u.dense[i]);
        none[i].Add(l, u.dense[i]);
      }
    }
    const double dm = d_sum / trials;
    const double cv = std::sqrt(std::max(0.0, d_sum2 / trials - dm * dm)) / dm;
    for (int i = 0; i < 3; ++i) {
      ++out.projections;
      const double bias = std::fabs(ratio[i].Mean(trials) - u.dense[i]);
      const double se = std::max(ratio[i].Se(trials), 1e-12);
      const double bound = ratio[i].Rmse(trials) * cv;
      out.max_z_ratio = std::max(out.max_z_ratio, bias / se);
      out.max_z_none = std::max(out.max_z_none, std::fabs(none[i].Mean(trials) - u.dense[i]) /
                                                    std::max(none[i].Se(trials), 1e-12));
      out.max_bound_ratio = std::max(out.max_bound_ratio, (bias - 4 * se) / std::max(bound, 1e-15));
      if (bias > 4 * se + bound) ++out.violations;
      out.max_bias_rmse = std::max(out.max_bias_rmse, bias / ratio[i].Rmse(trials));
      out.mean_rmse_ratio += ratio[i].Rmse(trials);
      out.mean_rmse_none += none[i].Rmse(trials);
    }
  }
  return out;
}

// Returns the ratio estimate's worst |bias| / SE.
double Check(const char* name, const std::vector<Unit>& units, const SantaParams& params,
             int32_t bits, int32_t d) {
  const int kTrials = 2000;
  const Verdict v = Measure(units, params, kTrials, d);
  std::printf(
      "[santa compressed] %-14s %d bit%s: ratio max|z| %6.2f (bias <= 4 SE + rmse cv(D): %d of %d "
      "over), uncorrected max|z| %7.2f, bias/rmse %.3f, rmse ratio %.4f none %.4f\n",
      name, bits, bits == 1 ? " " : "s", v.max_z_ratio, v.violations, v.projections, v.max_z_none,
      v.max_bias_rmse, v.mean_rmse_ratio / v.projections, v.mean_rmse_none / v.projections);
  if (bits >= 2) {
    // The target: the ratio estimate's mean within 4 SE of dense (and inside its bound).
    EXPECT_LE(v.max_z_ratio, 4.0) << name << ", " << bits << " bits";
    EXPECT_EQ(v.violations, 0) << name << ", " << bits << " bits";
  }
  // 1 bit: the proposal is too far from softmax(s) for the ratio's O(1/S) bias to vanish at
  // S = 128; the engine refuses the pairing (engine/methods/santa.cc), and the tests below
  // assert the bias that is the reason (max |bias| / SE over 4 on some 1-bit case).
  if (bits <= 2) {
    EXPECT_GT(v.max_z_none, 4.0) << name << ": without the correction the estimate is biased";
  }
  return v.max_z_ratio;
}

// A synthetic family's problem of the statistics tests (4096 tokens, 8 query heads over 2 kv
// heads, d = 128, bf16) and its name.
SyntheticProblem FamilyProblem(ScoreFamily family, const char** name) {
  SyntheticOptions o;
  o.family = family;
  o.num_q_heads = 8;
  o.num_kv_heads = 2;
  o.seq_lens = {4096};
  *name = family == ScoreFamily::kNearUniform ? "near_uniform"
          : family == ScoreFamily::kPeaked    ? "peaked"
                                              : "zipf";
  return SyntheticProblem::Make(o);
}

// The ratio estimate alone (a proposal other than the head's own softmax(s~): the uncorrected
// estimate is not an estimate of anything the method serves): inside its bound (|bias| <= 4 SE +
// rmse cv(D)), and within 4 SE of dense, or (max_bias_rmse > 0) with its bias at most that share
// of its rmse; its rmse printed.
void CheckRatio(const char* name, const std::vector<Unit>& units, const SantaParams& params,
                int32_t bits, int32_t d, double max_bias_rmse = 0.0) {
  const int kTrials = 2000;
  const Verdict v = Measure(units, params, kTrials, d);
  std::printf(
      "[santa compressed] %-18s %d bits: ratio max|z| %6.2f (bias <= 4 SE + rmse cv(D): %d of %d "
      "over), bias/rmse %.3f, rmse %.4f\n",
      name, bits, v.max_z_ratio, v.violations, v.projections, v.max_bias_rmse,
      v.mean_rmse_ratio / v.projections);
  if (max_bias_rmse > 0.0) {
    EXPECT_LE(v.max_bias_rmse, max_bias_rmse) << name << ", " << bits << " bits";
  } else {
    EXPECT_LE(v.max_z_ratio, 4.0) << name << ", " << bits << " bits";
  }
  EXPECT_EQ(v.violations, 0) << name << ", " << bits << " bits";
}

// S2ANTA-prop S = 128 (the shipped configuration) and S2ANTA-sys (global) over compressed keys,
// 2,000 seeds per query head, on the synthetic families (4096 tokens, 8 query heads over 2 kv
// heads, d = 128, bf16) and 1, 2 and 8 bits.
TEST(SantaCompressedStatisticsTest, RatioBiasWithinItsBoundOnSyntheticFamilies) {
  double one_bit_z = 0.0;  // the worst 1-bit bias, in SE
  for (ScoreFamily family : {ScoreFamily::kNearUniform, ScoreFamily::kPeaked, ScoreFamily::kZipf}) {
    const char* name = nullptr;
    SyntheticProblem sp = FamilyProblem(family, &name);
    for (int32_t bits : {1, 2, 8}) {
      std::vector<CompressedKeys> c = CompressProblemKeys(sp.problem, bits);
      for (SantaAllocation a : {SantaAllocation::kProp, SantaAllocation::kGlobal}) {
        const SantaParams params =
            Config(SantaSampler::kSystematic, a, 128, SantaCorrection::kRatio);
        const std::vector<int32_t> batches = {0};
        const std::vector<Unit> units = MakeUnits(sp.problem, ViewsOf(c), batches, params);
        const std::string label =
            std::string(name) + (a == SantaAllocation::kProp ? " prop" : " sys");
        const double z = Check(label.c_str(), units, params, bits, sp.problem.head_dim);
        if (bits == 1) one_bit_z = std::max(one_bit_z, z);
      }
    }
  }
  // Why the engine refuses 1-bit keys for S2ANTA: the bias is far past its standard error
  // (measured 14.6-18.1 SE on the peaked and Zipf families).
  EXPECT_GT(one_bit_z, 8.0);
}

// The group mixture proposal (one sample of S rows per kv head, each query head weighting them by
// its own exact scores): on the synthetic families at 2 bits the ratio estimate stays within 4 SE
// of dense and inside its bound, at S = 128 (a quarter of the rows the per-head union of 4 x 128
// can read) and S = 512 (as many); the real-attention test below states its bias there.
TEST(SantaCompressedStatisticsTest, GroupMixtureWithinItsBoundOnSyntheticFamilies) {
  for (ScoreFamily family : {ScoreFamily::kNearUniform, ScoreFamily::kPeaked, ScoreFamily::kZipf}) {
    const char* name = nullptr;
    SyntheticProblem sp = FamilyProblem(family, &name);
    for (int32_t bits : {2}) {
      std::vector<CompressedKeys> c = CompressProblemKeys(sp.problem, bits);
      for (int32_t samples : {128, 512}) {
        SantaParams params = Config(SantaSampler::kSystematic, SantaAllocation::kProp, samples,
                                    SantaCorrection::kRatio);
        params.scores = ScoreSource::kCompressedKeys;
        params.proposal = SantaProposal::kGroupMixture;
        const std::vector<int32_t> batches = {0};
        const std::vector<Unit> units = MakeUnits(sp.problem, ViewsOf(c), batches, params);
        const std::string label = std::string(name) + " mix S" + std::to_string(samples);
        CheckRatio(label.c_str(), units, params, bits, sp.problem.head_dim);
      }
    }
  }
}

// The same on the real-attention dumps (tests/data/realattn: layers 1, 3, 5 of the model trained
// here, 8192 tokens), the last query and one from the middle of the 32, each of the 4 heads.
TEST(SantaCompressedStatisticsTest, RatioBiasWithinItsBoundOnRealAttention) {
  double one_bit_z = 0.0;
  for (int32_t layer : kRealAttentionLayers) {
    absl::StatusOr<RealAttention> r = LoadRealAttention(RealAttentionPath(layer));
    if (!r.ok()) {
      GTEST_SKIP() << r.status();
    }
    SyntheticProblem sp = RealAttentionProblem(*r);
    const DecodeProblem& p = sp.problem;
    const size_t es = DTypeSize(p.dtype);
    for (int32_t bits : {1, 2, 8}) {
      CompressedKeys c(KeyCompression{bits, kKeyGroupTokens}, p.head_dim, p.dtype);
      for (int32_t t = 0; t < r->n; ++t) {
        c.Append(static_cast<const uint8_t*>(p.k) + t * p.kv_layout.token_stride * es);
      }
      const std::vector<CompressedKeysView> views(p.batch, c.view());
      const SantaParams params =
          Config(SantaSampler::kSystematic, SantaAllocation::kProp, 128, SantaCorrection::kRatio);
      const std::vector<int32_t> batches = {r->queries / 2, r->queries - 1};
      const std::vector<Unit> units = MakeUnits(p, views, batches, params);
      const std::string label = "real L" + std::to_string(layer) + " prop";
      const double z = Check(label.c_str(), units, params, bits, p.head_dim);
      if (bits == 1) one_bit_z = std::max(one_bit_z, z);
      if (bits != 2) continue;
      // The group mixture on real attention, where the group's heads attend apart: inside its
      // bound, but its O(1/S) bias shows (measured 2.2-20 SE at S = 128, at most 0.41 of its
      // rmse; 2.4-5.3 SE and 0.12 at S = 512): stated, not within 4 SE.
      for (int32_t samples : {128, 512}) {
        SantaParams mix = params;
        mix.samples = samples;
        mix.proposal = SantaProposal::kGroupMixture;
        const std::vector<Unit> mixed = MakeUnits(p, views, batches, mix);
        const std::string ml =
            "real L" + std::to_string(layer) + " mix S" + std::to_string(samples);
        CheckRatio(ml.c_str(), mixed, mix, bits, p.head_dim, samples == 128 ? 0.5 : 0.2);
      }
    }
  }
  // 1 bit (refused by the engine): measured 28.8-78.5 SE on these dumps.
  EXPECT_GT(one_bit_z, 8.0);
}

}  // namespace
}  // namespace kvsparse::kernels

namespace kvsparse::kernels {
namespace {

// The spread each estimate states (EstimateInPlace's draw_standard_errors) against its true
// error, over seeds: sum |out - dense|^2 / sum SE^2 (SE times |out|, per query head), which is 1
// where the stated variance is unbiased, and the share of heads with |out - dense| <= 2 SE.
// A floor under the proposal on keys built against the quantizer (kernels/synthetic.h, the
// range stretcher: a delimiter a group stretching the per-channel ranges), n = 8192, 2-bit keys,
// 8 heads, S = 128, 1,000 seeds: without the floor the ratio estimate's mean is more than 4 SE
// from dense on some heads (7.3 SE here; 4 of 8 heads, worst 8.1 SE, with the seeds of
// tests/bench/adversarial_keys_bench); with a floor of 5% within 4 (3.9 here and there;
// docs/ACCURACY.md, "A defensive mixture"), at a lower rmse. The hidden needle stays out of reach
// at any floor (not asserted here: the bench measures it).
TEST(SantaCompressedStatisticsTest, AUniformFloorHoldsTheRangeStretcherWithin4Se) {
  auto units_of = [](float floor, const SantaParams& params) {
    std::vector<Unit> units;
    for (int h = 0; h < 8; ++h) {
      const AdversarialHead a =
          MakeAdversarialHead(AdversarialKeys::kRangeStretcher, 8192, 2, 1000 + h);
      CompressedKeys ck({2, kKeyGroupTokens}, a.d, DType::kFp32);
      for (int32_t t = 0; t < a.n; ++t) ck.Append(&a.k[static_cast<size_t>(t) * a.d]);
      Unit u;
      u.h = h;
      u.s = a.Scores();
      u.sa.resize(a.n);
      ApproximateScores(ck.view(), a.q.data(), a.scale, u.sa.data());
      ProposalFloor(floor, &u.sa);
      EXPECT_TRUE(PlanSantaHead(u.sa, params, &u.plan).ok());
      u.v = a.v;
      std::mt19937 rng(31 + h);
      std::normal_distribution<double> z;
      ProjectDense(&u, a.dv, rng, z);
      units.push_back(std::move(u));
    }
    return units;
  };
  const SantaParams params =
      Config(SantaSampler::kSystematic, SantaAllocation::kProp, 128, SantaCorrection::kRatio);
  const int32_t dv = MakeAdversarialHead(AdversarialKeys::kRangeStretcher, 8192, 2, 1000).dv;
  const Verdict without = Measure(units_of(0.f, params), params, 1000, dv);
  const Verdict with = Measure(units_of(0.05f, params), params, 1000, dv);
  std::printf(
      "[santa compressed] range stretcher, 2 bits: max|z| %.2f without a floor, %.2f with 5%%; "
      "rmse %.4f and %.4f\n",
      without.max_z_ratio, with.max_z_ratio, without.mean_rmse_ratio / without.projections,
      with.mean_rmse_ratio / with.projections);
  EXPECT_GT(without.max_z_ratio, 4.0) << "the family this floor is for";
  // Measured 3.92 (issue 50's target: 4); the margin is for other builds' arithmetic (the
  // sanitizers'), which moves a draw where two scores round apart.
  EXPECT_LE(with.max_z_ratio, 4.5);
}

struct Calibration {
  double ratio = 0, within_2se = 0;
};

Calibration Calibrate(const DecodeProblem& p, const SantaParams& params,
                      absl::Span<const CompressedKeysView> views, int trials) {
  std::vector<double> dense;
  EXPECT_TRUE(DenseDecodeFloat64(p, &dense).ok());
  const int32_t d = p.head_dim, heads = p.batch * p.num_q_heads;
  double err2 = 0, se2 = 0, within = 0;
  for (int trial = 0; trial < trials; ++trial) {
    RowSelection sel;
    std::vector<float> se;
    EXPECT_TRUE(SantaSelectCpu(p, params, 500 + trial, &sel, nullptr, views).ok());
    EXPECT_TRUE(EstimateInPlace(p, sel, &se).ok());
    const std::vector<double> out = OutputAsDouble(p);
    for (int32_t h = 0; h < heads; ++h) {
      double e2 = 0, o2 = 0;
      for (int32_t i = 0; i < d; ++i) {
        const double x = out[static_cast<size_t>(h) * d + i];
        e2 += (x - dense[static_cast<size_t>(h) * d + i]) *
              (x - dense[static_cast<size_t>(h) * d + i]);
        o2 += x * x;
      }
      const double s2 = static_cast<double>(se[h]) * se[h] * o2;
      err2 += e2;
      se2 += s2;
      within += e2 <= 4 * s2;
    }
  }
  return {err2 / se2, within / (static_cast<double>(trials) * heads)};
}

// Issue 50 item 4: every S2ANTA estimate states a standard error from its own draws. With i.i.d.
// draws from the head's softmax the stated variance is unbiased (ratio 1 within the seeds'
// noise); with stratified and systematic draws and prop's and flash's tiles it overstates (ratio
// below 1: the design removes variance the i.i.d. formula counts); over 2-bit keys the ratio
// correction's delta-method variance is consistent. No configuration may understate by more than
// 15% on average. Synthetic families (fp32, 2048 tokens, 4 query heads over 2 kv heads, d = 32),
// S = 64.
TEST(SantaStandardErrorTest, StatedSpreadCoversTheError) {
  const int kTrials = StatisticalRepeats(400);
  for (ScoreFamily family : {ScoreFamily::kNearUniform, ScoreFamily::kPeaked, ScoreFamily::kZipf}) {
    SyntheticOptions o;
    o.family = family;
    o.num_q_heads = 4;
    o.num_kv_heads = 2;
    o.head_dim = 32;
    o.seq_lens = {2048};
    o.dtype = DType::kFp32;
    SyntheticProblem sp = SyntheticProblem::Make(o);
    const std::vector<CompressedKeys> keys = CompressProblemKeys(sp.problem, 2);
    const std::vector<CompressedKeysView> views = ViewsOf(keys);
    for (const SantaCorrection correction : {SantaCorrection::kNone, SantaCorrection::kRatio}) {
      for (SantaParams params : AllAllocations(64, correction)) {
        // kNone here: exact scores (the uncorrected estimate over compressed keys estimates
        // softmax(s~) V, not dense: its error is not what its spread describes).
        const bool exact = correction == SantaCorrection::kNone;
        if (exact) params.scores = ScoreSource::kExact;
        const Calibration c = Calibrate(
            sp.problem, params, exact ? absl::Span<const CompressedKeysView>() : views, kTrials);
        const char* design = params.allocation == SantaAllocation::kProp    ? "prop"
                             : params.allocation == SantaAllocation::kFlash ? "flash"
                             : params.sampler == SantaSampler::kIid         ? "iid"
                                                                            : "sys";
        std::printf(
            "[santa standard error] %-12s %-5s %-14s error^2 / stated^2 %.3f, within 2 SE %.3f\n",
            ScoreFamilyName(family), design, exact ? "exact scores" : "2-bit, ratio", c.ratio,
            c.within_2se);
        EXPECT_LE(c.ratio, 1.15) << ScoreFamilyName(family) << " " << design;
        if (exact && params.sampler == SantaSampler::kIid) {
          EXPECT_GE(c.ratio, 0.85) << ScoreFamilyName(family) << " iid: unbiased";
        }
      }
    }
  }
}

// The same on the real-attention dumps (tests/data/realattn: layers 1, 3, 5 of the model trained
// here, 8192 tokens, the first 8 of the 32 queries x 4 heads): the shipped S2ANTA-prop S = 128,
// exact scores and over 2-bit keys with the ratio correction.
TEST(SantaStandardErrorTest, StatedSpreadCoversTheErrorOnRealAttention) {
  const int kTrials = StatisticalRepeats(30);
  constexpr int32_t kQueries = 8;
  for (int32_t layer : kRealAttentionLayers) {
    absl::StatusOr<RealAttention> r = LoadRealAttention(RealAttentionPath(layer));
    if (!r.ok()) GTEST_SKIP() << r.status();
    SyntheticProblem sp = RealAttentionProblem(*r);
    DecodeProblem p = sp.problem;
    p.batch = kQueries;  // the first queries' sequences (their q, lengths and outputs lead)
    CompressedKeys c(KeyCompression{2, kKeyGroupTokens}, p.head_dim, p.dtype);
    for (int32_t t = 0; t < r->n; ++t) {
      c.Append(static_cast<const uint8_t*>(p.k) +
               t * p.kv_layout.token_stride * DTypeSize(p.dtype));
    }
    const std::vector<CompressedKeysView> views(p.batch, c.view());
    for (const SantaCorrection correction : {SantaCorrection::kNone, SantaCorrection::kRatio}) {
      SantaParams params =
          Config(SantaSampler::kSystematic, SantaAllocation::kProp, 128, correction);
      const bool exact = correction == SantaCorrection::kNone;
      if (exact) params.scores = ScoreSource::kExact;
      const Calibration cal =
          Calibrate(p, params, exact ? absl::Span<const CompressedKeysView>() : views, kTrials);
      std::printf(
          "[santa standard error] real L%d     prop  %-14s error^2 / stated^2 %.3f, within 2 SE "
          "%.3f\n",
          layer, exact ? "exact scores" : "2-bit, ratio", cal.ratio, cal.within_2se);
      EXPECT_LE(cal.ratio, 1.15) << "layer " << layer << (exact ? " exact" : " ratio");
    }
  }
}

}  // namespace
}  // namespace kvsparse::kernels
