#include "kernels/vattention.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/compressed_keys.h"
#include "kernels/cpu_util.h"
#include "kernels/dense.h"
#include "kernels/synthetic.h"

namespace kvsparse::kernels {
namespace {

TEST(VAttentionTest, NormalQuantile) {
  EXPECT_NEAR(NormalQuantile(0.975), 1.959963984540054, 1e-12);
  EXPECT_NEAR(NormalQuantile(0.5), 0.0, 1e-15);
  EXPECT_NEAR(NormalQuantile(0.05), -1.6448536269514729, 1e-12);
  EXPECT_NEAR(NormalQuantile(1e-10), -6.361340902404056, 1e-9);
  EXPECT_NEAR(NormalQuantile(1 - 1e-6), 4.753424308822899, 1e-9);
}

// The closed forms of step 5, and the output target's split against a brute-force 2-D grid.
TEST(VAttentionTest, BudgetFormulas) {
  VAttentionStatistics st;
  st.n_s = 10000;
  st.d_hat = 5000;
  st.n_hat_norm = 3000;
  st.sigma = 0.8;
  st.trace_sigma = 40;
  st.x_max = 6;
  st.y_max = 50;
  VAttentionParams p;
  p.epsilon = 0.1f;
  p.delta = 0.05f;
  const double eps = p.epsilon, dl = p.delta;
  const double z = NormalQuantile(1 - dl / 2);
  p.target = VerifyTarget::kDenominator;
  EXPECT_NEAR(ComputeVAttentionBudget(st, p).raw, std::pow(z * 1e4 * 0.8 / (eps * 5000), 2), 1e-6);
  p.target = VerifyTarget::kNumerator;
  EXPECT_NEAR(ComputeVAttentionBudget(st, p).raw,
              std::pow(z * 1e4 * std::sqrt(40.0) / (eps * 3000), 2), 1e-6);
  p.bound = BudgetBound::kHoeffding;
  p.target = VerifyTarget::kDenominator;
  EXPECT_NEAR(ComputeVAttentionBudget(st, p).raw,
              36.0 * 1e8 * std::log(2 / dl) / (2 * eps * eps * 5000.0 * 5000.0), 1e-6);
  p.target = VerifyTarget::kNumerator;
  EXPECT_NEAR(ComputeVAttentionBudget(st, p).raw,
              2 * 100.0 * 100.0 * 1e8 * std::log(2 / dl) / (eps * eps * 3000.0 * 3000.0), 1e-4);
  for (BudgetBound bound : {BudgetBound::kClt, BudgetBound::kHoeffding}) {
    p.bound = bound;
    p.target = VerifyTarget::kOutput;
    const VAttentionBudget got = ComputeVAttentionBudget(st, p);
    VAttentionParams q = p;
    double brute = std::numeric_limits<double>::infinity();
    for (int i = 1; i < 400; ++i) {
      for (int j = 1; j < 400; ++j) {
        const double e1 = eps * i / 400, d1 = dl * j / 400;
        q.epsilon = static_cast<float>(e1 / 2);
        q.delta = static_cast<float>(d1);
        q.target = VerifyTarget::kDenominator;
        const double bd = ComputeVAttentionBudget(st, q).raw;
        q.epsilon = static_cast<float>((eps - e1) / 2);
        q.delta = static_cast<float>(dl - d1);
        q.target = VerifyTarget::kNumerator;
        const double bn = ComputeVAttentionBudget(st, q).raw;
        brute = std::min(brute, std::max(bd, bn));
      }
    }
    EXPECT_LE(got.raw, brute * 1.001);
    EXPECT_GE(got.raw, brute * 0.97);
    EXPECT_GT(got.eps_split, 0);
    EXPECT_LT(got.eps_split, eps);
    std::printf(
        "[vattention budget] %s output target: b=%.1f (grid 400x400: %.1f) eps'=%.4f "
        "delta'=%.4f\n",
        bound == BudgetBound::kClt ? "CLT" : "Hoeffding", got.raw, brute, got.eps_split,
        got.delta_split);
  }
}

SyntheticProblem Problem(DType dtype, ScoreFamily family, std::vector<int32_t> lens) {
  SyntheticOptions o;
  o.family = family;
  o.batch = static_cast<int32_t>(lens.size());
  o.num_q_heads = 4;
  o.num_kv_heads = 2;
  o.head_dim = 32;
  o.seq_lens = std::move(lens);
  o.dtype = dtype;
  return SyntheticProblem::Make(o);
}

// A budget covering every row (epsilon tiny) selects all rows: dense attention.
TEST(VAttentionTest, BudgetCoveringEveryRowEqualsDense) {
  SyntheticProblem sp = Problem(DType::kFp32, ScoreFamily::kZipf, {900, 40, 0});
  std::vector<double> dense;
  ASSERT_TRUE(DenseDecodeFloat64(sp.problem, &dense).ok());
  Signatures sigs;
  ASSERT_TRUE(ComputeSimHashSignatures(sp.problem, SimHashConfig{2, 0, 32, {}}, &sigs).ok());
  for (TopKPredictor pred : {TopKPredictor::kExact, TopKPredictor::kHash}) {
    VAttentionParams params;
    params.epsilon = 1e-4f;
    params.fixed.sink_tokens = 4;
    params.fixed.local_tokens = 16;
    params.fixed.top_k_fraction = 0.05f;
    params.predictor = pred;
    RowSelection sel;
    VAttentionStats stats;
    ASSERT_TRUE(VAttentionDecodeCpu(sp.problem, params, 1, &sigs.view, &sel, &stats).ok());
    EXPECT_EQ(sel.at(0, 0).num_rows(), 900);
    for (int h = 0; h < 4; ++h) EXPECT_EQ(stats.heads[h].b, stats.heads[h].stats.n_s);
    EXPECT_LT(RelativeL2(dense, OutputAsDouble(sp.problem)), 2e-6);
  }
}

// ---- statistical tests on precomputed scores
// -----------------------------------------------------

struct Case {
  int32_t n;
  ScoreFamily family;
  // >= 0: real attention instead of `family` (kernels/synthetic.h RealAttention): the last
  // query's head 2 of this layer of the model trained here (n = 8192) and its real V rows.
  int32_t real_layer = -1;
};

std::string CaseName(const testing::TestParamInfo<Case>& info) {
  if (info.param.real_layer >= 0) return absl::StrCat("real_layer", info.param.real_layer);
  return absl::StrCat("n", info.param.n, "_", ScoreFamilyName(info.param.family));
}

std::string Label(const Case& c) {
  return c.real_layer >= 0 ? absl::StrCat("real L", c.real_layer) : ScoreFamilyName(c.family);
}

// The scores of a case and its V: real rows (dv = d), or `family`'s scores from `seed` with V =
// per-coordinate means (from `mean_of`) + N(0, 1) noise from `rng` (dv columns).
void CaseData(const Case& c, uint64_t seed, int dv, std::mt19937_64& rng,
              const std::function<float(int)>& mean_of, std::vector<float>* s,
              std::vector<float>* v, int* dv_out) {
  if (c.real_layer >= 0) {
    absl::StatusOr<RealAttention> r = LoadRealAttention(RealAttentionPath(c.real_layer));
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->Keys(r->queries - 1), c.n);
    *s = r->Scores(r->queries - 1, 2);
    *v = r->v;
    *dv_out = r->d;
    return;
  }
  *s = MakeScores(c.family, c.n, seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  v->resize(static_cast<size_t>(c.n) * dv);
  for (size_t i = 0; i < v->size(); ++i) (*v)[i] = mean_of(static_cast<int>(i % dv)) + normal(rng);
  *dv_out = dv;
}

class VAttentionStatisticsTest : public testing::TestWithParam<Case> {};

// The unbiasedness tests' data: the case's scores, and V as 3 columns (synthetic: means 0.5,
// -0.2, -0.2 plus N(0, 1) noise; real rows: coordinates 0, 7 and 14 of the real V).
void ProjectedCaseData(const Case& c, std::vector<float>* s, std::vector<float>* v, int* dv) {
  std::mt19937_64 rng(9);
  CaseData(
      c, 500 + c.n, 3, rng, [](int a) { return a == 0 ? 0.5f : -0.2f; }, s, v, dv);
  if (c.real_layer < 0) return;
  std::vector<float> v3(static_cast<size_t>(c.n) * 3);
  for (int32_t t = 0; t < c.n; ++t) {
    for (int a = 0; a < 3; ++a) v3[t * 3 + a] = (*v)[static_cast<size_t>(t) * *dv + a * 7];
  }
  v->swap(v3);
  *dv = 3;
}

// Each statistic's mean over the seeds (est[a][seed]) within 4 SE of target[a] (plus a relative
// floor for rounding); returns the largest |z|.
double ExpectMeansWithin4SE(const std::vector<double> (&est)[4], const double (&target)[4], int dv,
                            double rel_floor) {
  double zmax = 0;
  for (int a = 0; a <= dv; ++a) {
    const double n = static_cast<double>(est[a].size());
    double m = 0, ss = 0;
    for (double x : est[a]) m += x / n;
    for (double x : est[a]) ss += (x - m) * (x - m);
    const double se = std::sqrt(ss / (n - 1) / n);
    EXPECT_LT(std::fabs(m - target[a]), 4 * se + rel_floor * std::fabs(target[a]))
        << (a == 0 ? "denominator" : "numerator projection") << " " << a;
    if (se > rel_floor * std::fabs(target[a])) zmax = std::max(zmax, std::fabs(m - target[a]) / se);
  }
  return zmax;
}

// The sampled part is unbiased: over 2000 seeds, the mean of (n_s/b) sum_{I_dyn} x_t (the
// dynamic denominator) and of 3 fixed projections of (n_s/b) sum_{I_dyn} x_t V_t (the dynamic
// numerator) is within 4 SE of the residual sums, with the full adaptive pipeline (base sample,
// CLT output-target budget, fresh final sample). 4 statistics x 6 cases = 24 two-sided checks
// at 4 SE: family-wise false alarm < 0.2% (Bonferroni).
TEST_P(VAttentionStatisticsTest, SampledPartUnbiased) {
  const Case c = GetParam();
  const int kSeeds = StatisticalRepeats(2000);
  std::vector<float> s, v;
  int dv = 0;
  ProjectedCaseData(c, &s, &v, &dv);
  if (HasFatalFailure()) return;
  VAttentionParams params;
  params.fixed.sink_tokens = 16;
  params.fixed.local_tokens = 64;
  params.fixed.top_k_fraction = 0.02f;
  params.base_rate = 0.02f;
  params.epsilon = 0.3f;  // loose, so that b < n_s: the test is about bias, not accuracy
  params.delta = 0.2f;
  params.predictor = TopKPredictor::kExact;
  VAttentionRowAccess access;
  access.dv = dv;
  access.logit = [&](int32_t t) { return s[t]; };
  access.load_v = [&](int32_t t, float* out) {
    for (int a = 0; a < dv; ++a) out[a] = v[static_cast<size_t>(t) * dv + a];
  };
  VAttentionHeadResult plan;
  std::vector<int32_t> scratch;
  absl::StatusOr<int32_t> k = ResolveTopK(FixedSet{0, 0, 0, params.fixed.top_k_fraction}, c.n);
  ASSERT_TRUE(k.ok());
  VAttentionPlanFixed(s.data(), c.n, *k, params, &plan, &scratch);
  const double smax = *std::max_element(s.begin(), s.end());
  std::vector<bool> fixed(c.n, false);
  for (int32_t t : plan.fixed) fixed[t] = true;
  double target[4] = {0, 0, 0, 0};
  float rmax = -1e30f;
  std::vector<double> xs(c.n);
  for (int32_t t = 0; t < c.n; ++t) xs[t] = std::exp(s[t] - smax);
  for (int32_t t = 0; t < c.n; ++t) {
    if (fixed[t]) continue;
    rmax = std::max(rmax, s[t]);
    const double x = xs[t];
    target[0] += x;
    for (int a = 0; a < dv; ++a) target[1 + a] += x * v[static_cast<size_t>(t) * dv + a];
  }
  access.residual_logit_max = rmax;
  std::vector<double> est[4];
  for (auto& e : est) e.resize(kSeeds);
  double mean_b = 0;
  VAttentionHeadResult r;
  for (int seed = 0; seed < kSeeds; ++seed) {
    r.fixed = plan.fixed;
    VAttentionSampleHead(c.n, params, access, seed, 0, 5, &r);
    const double w = static_cast<double>(r.stats.n_s) / r.b;
    double e[4] = {0, 0, 0, 0};
    for (int32_t t : r.dyn) {
      const double x = xs[t];
      e[0] += w * x;
      for (int a = 0; a < dv; ++a) e[1 + a] += w * x * v[static_cast<size_t>(t) * dv + a];
    }
    for (int a = 0; a <= dv; ++a) est[a][seed] = e[a];
    mean_b += static_cast<double>(r.b) / kSeeds;
  }
  const double zmax = ExpectMeansWithin4SE(est, target, dv, 1e-9);
  std::printf("[vattention unbiased] n=%d %-12s n_f=%zu n_s=%lld mean b=%.1f  max|z|=%.2f\n", c.n,
              Label(c).c_str(), plan.fixed.size(), static_cast<long long>(c.n - plan.fixed.size()),
              mean_b, zmax);
}

// Dense attention of one head over logits s and values v ([n, dv]), in double: the weights
// x_t = e^(s_t - max s), their sum, the output and its norm.
struct DenseHead {
  std::vector<double> x, out;
  double sum = 0, norm = 0;
};

DenseHead MakeDenseHead(const std::vector<float>& s, const std::vector<float>& v, int dv) {
  DenseHead d;
  const double smax = *std::max_element(s.begin(), s.end());
  d.x.resize(s.size());
  d.out.assign(dv, 0.0);
  for (size_t t = 0; t < s.size(); ++t) {
    d.x[t] = std::exp(s[t] - smax);
    d.sum += d.x[t];
    for (int a = 0; a < dv; ++a) d.out[a] += d.x[t] * v[t * dv + a];
  }
  for (double& o : d.out) {
    o /= d.sum;
    d.norm += o * o;
  }
  d.norm = std::sqrt(d.norm);
  return d;
}

// Row access over logits s and values v ([n, dv]); both must outlive it.
VAttentionRowAccess RowsOf(const std::vector<float>& s, const std::vector<float>& v, int dv) {
  VAttentionRowAccess access;
  access.dv = dv;
  access.logit = [&s](int32_t t) { return s[t]; };
  access.load_v = [&v, dv](int32_t t, float* out) {
    std::copy_n(&v[static_cast<size_t>(t) * dv], dv, out);
  };
  return access;
}

// The relative error of vAttention's estimate (the weights of ToHeadRows: fixed rows 1, the
// sample n_s / b or, importance sampler, m / (b p_t)) against dense: of the denominator or of
// the whole output.
double EstimateError(const DenseHead& d, const VAttentionHeadResult& r, const std::vector<float>& v,
                     int dv, VerifyTarget target) {
  HeadRows rows;
  r.ToHeadRows(&rows);
  double dh = 0;
  std::vector<double> nh(dv, 0.0);
  for (size_t i = 0; i < rows.tokens.size(); ++i) {
    const double wt = rows.weights[i];
    const int32_t t = rows.tokens[i];
    dh += wt * d.x[t];
    for (int a = 0; a < dv; ++a) nh[a] += wt * d.x[t] * v[static_cast<size_t>(t) * dv + a];
  }
  if (target == VerifyTarget::kDenominator) return std::fabs(dh - d.sum) / d.sum;
  double e2 = 0;
  for (int a = 0; a < dv; ++a) e2 += (nh[a] / dh - d.out[a]) * (nh[a] / dh - d.out[a]);
  return std::sqrt(e2) / d.norm;
}

// Violation rates: fraction of trials with relative error > epsilon, 400 trials per setting,
// n = 8192, d = 64, epsilon = 0.1 (denominator) / 0.2 (output), delta = 0.1. With the
// Hoeffding bound and exact statistics (the setting the theory covers: Hoeffding for sampling
// without replacement, Theorem 4.3's union bound) the rate must be <= delta + 3 sqrt(delta (1 -
// delta) / 400) = 0.145 (a binomial 3-sigma tolerance). Base-sample statistics and the CLT bound
// (an asymptotic approximation) are printed, not asserted.
TEST_P(VAttentionStatisticsTest, ViolationRates) {
  const Case c = GetParam();
  if (c.n != 8192) GTEST_SKIP() << "violation rates run at n = 8192 only";
  const int kTrials = StatisticalRepeats(400);
  std::mt19937_64 rng(10);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> mean(64), s, v;
  for (float& m : mean) m = 0.5f * normal(rng);
  int dv = 0;
  CaseData(
      c, 900 + static_cast<int>(c.family), 64, rng, [&](int a) { return mean[a]; }, &s, &v, &dv);
  if (HasFatalFailure()) return;
  const DenseHead dense = MakeDenseHead(s, v, dv);
  const double tol = 0.1 + 3 * std::sqrt(0.1 * 0.9 / kTrials);
  for (VerifyTarget target : {VerifyTarget::kDenominator, VerifyTarget::kOutput}) {
    double clt_output_b[2] = {0, 0};  // mean b of CLT, target output, [exact_stats]
    for (BudgetBound bound : {BudgetBound::kHoeffding, BudgetBound::kClt, BudgetBound::kCltRatio}) {
      if (bound == BudgetBound::kCltRatio && target != VerifyTarget::kOutput) continue;
      for (bool exact_stats : {true, false}) {
        VAttentionParams params;
        params.fixed.sink_tokens = 16;
        params.fixed.local_tokens = 64;
        params.fixed.top_k_fraction = 0.01f;
        params.base_rate = 0.02f;
        params.epsilon = target == VerifyTarget::kDenominator ? 0.1f : 0.2f;
        params.delta = 0.1f;
        params.predictor = TopKPredictor::kExact;
        params.bound = bound;
        params.target = target;
        params.exact_statistics = exact_stats;
        VAttentionRowAccess access = RowsOf(s, v, dv);
        VAttentionHeadResult plan, r;
        std::vector<int32_t> scratch;
        VAttentionPlanFixed(s.data(), c.n, static_cast<int32_t>(0.01 * c.n), params, &plan,
                            &scratch);
        float rmax = -1e30f;
        size_t e = 0;
        for (int32_t t = 0; t < c.n; ++t) {
          if (e < plan.fixed.size() && plan.fixed[e] == t) {
            ++e;
          } else {
            rmax = std::max(rmax, s[t]);
          }
        }
        access.residual_logit_max = rmax;
        int violations = 0;
        double mean_b = 0;
        for (int trial = 0; trial < kTrials; ++trial) {
          r.fixed = plan.fixed;
          VAttentionSampleHead(c.n, params, access, 100 + trial, 0, 0, &r);
          mean_b += static_cast<double>(r.b) / kTrials;
          violations += EstimateError(dense, r, v, dv, target) > params.epsilon;
        }
        const double rate = static_cast<double>(violations) / kTrials;
        const char* tname = target == VerifyTarget::kDenominator ? "denominator" : "output";
        const char* bname = bound == BudgetBound::kClt        ? "CLT"
                            : bound == BudgetBound::kCltRatio ? "CLT-ratio"
                                                              : "Hoeffding";
        std::printf(
            "[vattention violations] %-12s %-11s %-9s %-10s stats: eps=%.2f delta=0.10 "
            "rate=%.4f  mean b=%.0f of n_s=%lld\n",
            Label(c).c_str(), tname, bname, exact_stats ? "exact" : "base-sample", params.epsilon,
            rate, mean_b, static_cast<long long>(r.stats.n_s));
        RecordProperty(
            absl::StrCat("violation_", tname, "_", bname, exact_stats ? "_exact" : "_base"),
            absl::StrCat(rate));
        if (bound == BudgetBound::kHoeffding && exact_stats) {
          EXPECT_LE(rate, tol) << tname << " Hoeffding";
        }
        if (bound == BudgetBound::kClt && target == VerifyTarget::kOutput) {
          clt_output_b[exact_stats] = mean_b;
        }
        if (bound == BudgetBound::kCltRatio) {
          // One normal approximation of the output: its rate sits at or below delta (exact
          // statistics) on a budget no larger than Theorem 4.3's two bounds'.
          if (exact_stats) {
            EXPECT_LE(rate, tol) << "output CLT-ratio";
          }
          EXPECT_LE(mean_b, clt_output_b[exact_stats] + 1) << "output CLT-ratio";
        }
      }
    }
  }
}

// A predictor that is off by N(0, sigma^2) per token: s~_t = s_t + noise (the importance
// sampler's proposal; with sigma = 0.5 its weights r_t = e^{s_t - s~_t} spread over about a
// factor of e either way).
std::vector<float> NoisyScores(const std::vector<float>& s, float sigma, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, sigma);
  std::vector<float> out(s);
  for (float& x : out) x += normal(rng);
  return out;
}

// The importance sampler (kernels/vattention.h) is unbiased for the residual's sums given b:
// over 2000 seeds, with a predictor off by N(0, 0.5^2) per token, the mean of the sample's
// denominator and of 3 projections of its numerator (ToHeadRows' weights m / (b p_t) on the
// exact x_t) is within 4 SE of the residual sums, through the full pipeline (base draws,
// CLT-ratio output budget, fresh draws). 4 statistics x 12 cases = 48 checks at 4 SE:
// family-wise false alarm < 0.4% (Bonferroni).
TEST_P(VAttentionStatisticsTest, ImportanceSamplerUnbiased) {
  const Case c = GetParam();
  const int kSeeds = StatisticalRepeats(2000);
  std::vector<float> s, v;
  int dv = 0;
  ProjectedCaseData(c, &s, &v, &dv);
  if (HasFatalFailure()) return;
  const std::vector<float> pred = NoisyScores(s, 0.5f, 31 + c.n);
  VAttentionParams params;
  params.fixed.sink_tokens = 16;
  params.fixed.local_tokens = 64;
  params.fixed.top_k_fraction = 0.02f;
  params.base_rate = 0.02f;
  params.epsilon = 0.3f;  // loose, so that b < n_s: the test is about bias, not accuracy
  params.delta = 0.2f;
  params.predictor = TopKPredictor::kExact;
  params.sampler = ResidualSampler::kImportance;
  params.bound = BudgetBound::kCltRatio;
  ASSERT_TRUE(ValidateVAttentionParams(params).ok());
  const VAttentionRowAccess access = RowsOf(s, v, dv);
  VAttentionHeadResult plan, r;
  std::vector<int32_t> scratch;
  absl::StatusOr<int32_t> k = ResolveTopK(FixedSet{0, 0, 0, params.fixed.top_k_fraction}, c.n);
  ASSERT_TRUE(k.ok());
  VAttentionPlanFixed(pred.data(), c.n, *k, params, &plan, &scratch);
  const double smax = *std::max_element(s.begin(), s.end());
  std::vector<bool> fixed(c.n, false);
  for (int32_t t : plan.fixed) fixed[t] = true;
  double target[4] = {0, 0, 0, 0};
  std::vector<double> xs(c.n);
  for (int32_t t = 0; t < c.n; ++t) {
    xs[t] = std::exp(s[t] - smax);
    if (fixed[t]) continue;
    target[0] += xs[t];
    for (int a = 0; a < dv; ++a) target[1 + a] += xs[t] * v[static_cast<size_t>(t) * dv + a];
  }
  std::vector<double> est[4];
  for (auto& e : est) e.resize(kSeeds);
  double mean_b = 0;
  int exact_residual = 0;
  HeadRows rows;
  for (int seed = 0; seed < kSeeds; ++seed) {
    r.fixed = plan.fixed;
    VAttentionSampleHead(c.n, params, access, seed, 0, 5, &r, pred.data());
    r.ToHeadRows(&rows);
    double e[4] = {0, 0, 0, 0};
    for (size_t i = 0; i < rows.tokens.size(); ++i) {
      const int32_t t = rows.tokens[i];
      if (fixed[t]) continue;
      const double x = rows.weights[i] * xs[t];
      e[0] += x;
      for (int a = 0; a < dv; ++a) e[1 + a] += x * v[static_cast<size_t>(t) * dv + a];
    }
    for (int a = 0; a <= dv; ++a) est[a][seed] = e[a];
    mean_b += static_cast<double>(r.b) / kSeeds;
    exact_residual += r.residual_exact;
  }
  const double zmax = ExpectMeansWithin4SE(est, target, dv, 1e-6);
  EXPECT_LT(exact_residual, kSeeds) << "every budget covered the residual: nothing was sampled";
  std::printf(
      "[vattention importance unbiased] n=%d %-12s n_s=%lld mean b=%.1f (draws), exact "
      "residual in %d seeds  max|z|=%.2f\n",
      c.n, Label(c).c_str(), static_cast<long long>(c.n - plan.fixed.size()), mean_b,
      exact_residual, zmax);
}

// The importance sampler's violation rates on the same heads (n = 8192; output target, eps =
// 0.2, delta = 0.1, top-k 1/100 by the predictor, base draws 2% of the residual), with a
// predictor off by N(0, 0.5^2) per token, against the uniform sampler on the same fixed set:
// with the CLT-ratio bound from the base draws the rate is within delta's binomial 3-sigma
// tolerance (0.145) on every family and real head, and the importance sampler reads fewer
// distinct rows than the uniform one on each heavy-tailed head (printed for all).
TEST_P(VAttentionStatisticsTest, ImportanceViolationRates) {
  const Case c = GetParam();
  if (c.n != 8192) GTEST_SKIP() << "violation rates run at n = 8192 only";
  const int kTrials = StatisticalRepeats(400);
  std::mt19937_64 rng(10);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> mean(64), s, v;
  for (float& m : mean) m = 0.5f * normal(rng);
  int dv = 0;
  CaseData(
      c, 900 + static_cast<int>(c.family), 64, rng, [&](int a) { return mean[a]; }, &s, &v, &dv);
  if (HasFatalFailure()) return;
  const std::vector<float> pred = NoisyScores(s, 0.5f, 41);
  const DenseHead dense = MakeDenseHead(s, v, dv);
  const double tol = 0.1 + 3 * std::sqrt(0.1 * 0.9 / kTrials);
  double rows_read[2] = {0, 0};  // [importance]
  for (ResidualSampler sampler : {ResidualSampler::kUniform, ResidualSampler::kImportance}) {
    VAttentionParams params;
    params.fixed.sink_tokens = 16;
    params.fixed.local_tokens = 64;
    params.fixed.top_k_fraction = 0.01f;
    params.base_rate = 0.02f;
    params.epsilon = 0.2f;
    params.delta = 0.1f;
    params.predictor = TopKPredictor::kExact;
    params.bound = BudgetBound::kCltRatio;
    params.target = VerifyTarget::kOutput;
    params.sampler = sampler;
    const VAttentionRowAccess access = RowsOf(s, v, dv);
    VAttentionHeadResult plan, r;
    std::vector<int32_t> scratch;
    VAttentionPlanFixed(pred.data(), c.n, static_cast<int32_t>(0.01 * c.n), params, &plan,
                        &scratch);
    int violations = 0;
    HeadRows rows;
    for (int trial = 0; trial < kTrials; ++trial) {
      r.fixed = plan.fixed;
      VAttentionSampleHead(c.n, params, access, 100 + trial, 0, 0, &r, pred.data());
      violations += EstimateError(dense, r, v, dv, VerifyTarget::kOutput) > params.epsilon;
      r.ToHeadRows(&rows);
      rows_read[sampler == ResidualSampler::kImportance] +=
          static_cast<double>(rows.tokens.size()) / kTrials / c.n;
    }
    const double rate = static_cast<double>(violations) / kTrials;
    const bool imp = sampler == ResidualSampler::kImportance;
    std::printf(
        "[vattention importance violations] %-12s %-10s CLT-ratio eps=0.20 delta=0.10 "
        "rate=%.4f  rows read %.4f of n\n",
        Label(c).c_str(), imp ? "importance" : "uniform", rate, rows_read[imp]);
    RecordProperty(absl::StrCat("violation_output_", imp ? "importance" : "uniform"),
                   absl::StrCat(rate));
    if (imp) {
      EXPECT_LE(rate, tol) << "importance sampler, CLT-ratio";
    }
  }
  if (c.family != ScoreFamily::kNearUniform || c.real_layer >= 0) {
    EXPECT_LT(rows_read[1], rows_read[0]) << "importance reads fewer rows than uniform";
  }
}

// The hard head of the two tests below: n = 8192 logits, one key at +9 over a flat N(0, 0.5^2)
// rest holding about half the attention, values (dv = 32) with a common component (as real
// ones have, and the synthetic families: the flat rest's output is far from zero, so the budget
// it asks for is small) and the spike's different (it matters); and the parameters both use
// (eps = delta = 0.1, output target, sink 16, window 64, top-k 1/32, base rate 0.02).
struct SpikeHead {
  static constexpr int32_t n = 8192, dv = 32, spike = 3001;
  std::vector<float> s, v;
  std::mt19937_64 rng{21};
  SpikeHead() : s(n), v(static_cast<size_t>(n) * dv) {
    std::normal_distribution<float> normal(0.f, 1.f);
    for (float& x : s) x = 0.5f * normal(rng);
    s[spike] = 9.f;
    std::vector<float> mu(dv);
    for (float& m : mu) m = normal(rng);
    for (size_t i = 0; i < v.size(); ++i) v[i] = mu[i % dv] + 0.5f * normal(rng);
    for (int a = 0; a < dv; ++a) v[static_cast<size_t>(spike) * dv + a] -= 2.f * mu[a];
  }
  static VAttentionParams Params(TopKPredictor predictor, BudgetBound bound) {
    VAttentionParams params;
    params.fixed.sink_tokens = 16;
    params.fixed.local_tokens = 64;
    params.fixed.top_k_fraction = 1.f / 32;
    params.base_rate = 0.02f;
    params.epsilon = 0.1f;
    params.delta = 0.1f;
    params.predictor = predictor;
    params.bound = bound;
    params.target = VerifyTarget::kOutput;
    return params;
  }
};

// A hard head: one key holds most of the attention (a spike of +9 over a flat rest) and the
// predictor misses it (its top-k is chosen from scores in which the spike looks ordinary, as a
// hash predictor's can be). The budget then comes from a base sample that almost never holds the
// spike: the CLT budget trusts a residual that looks flat, and the output is over epsilon in
// most trials (measured: 196 of 200), a rate far above delta (one-sided binomial p-value of
// "rate <= delta" below 1e-6). Hoeffding's budget on this head is every residual row. The (epsilon,
// delta) promise therefore needs every heavy token in the fixed set or in the statistics: with the
// exact predictor (the spike is its top-1) or with exact statistics the same head stays within
// delta. What the service promises per predictor is written in docs/ACCURACY.md ("vAttention: what
// the promise covers").
TEST(VAttentionTest, APredictorThatMissesTheSpikeBreaksThePromise) {
  constexpr int32_t n = SpikeHead::n, dv = SpikeHead::dv, spike = SpikeHead::spike;
  const int kTrials = 200;
  const SpikeHead head;
  const std::vector<float>&s = head.s, &v = head.v;
  std::vector<float> missed = s;
  missed[spike] = 0.f;  // what the predictor saw
  const DenseHead dense = MakeDenseHead(s, v, dv);
  // Violations of the output target over kTrials seeds, for a predictor that saw `pred`.
  auto rate = [&](const std::vector<float>& pred, BudgetBound bound, bool exact_stats) {
    VAttentionParams params = SpikeHead::Params(TopKPredictor::kExact, bound);
    params.exact_statistics = exact_stats;
    const VAttentionRowAccess access = RowsOf(s, v, dv);
    VAttentionHeadResult plan, r;
    std::vector<int32_t> scratch;
    VAttentionPlanFixed(pred.data(), n, n / 32, params, &plan, &scratch);
    int violations = 0;
    for (int trial = 0; trial < kTrials; ++trial) {
      r.fixed = plan.fixed;
      VAttentionSampleHead(n, params, access, 500 + trial, 0, 0, &r);
      violations += EstimateError(dense, r, v, dv, VerifyTarget::kOutput) > params.epsilon;
    }
    return violations;
  };
  const int limit = static_cast<int>(0.1 * kTrials + 3 * std::sqrt(0.1 * 0.9 * kTrials));
  for (BudgetBound bound : {BudgetBound::kClt, BudgetBound::kHoeffding}) {
    const char* name = bound == BudgetBound::kClt ? "CLT" : "Hoeffding";
    const int missed_base = rate(missed, bound, false);
    const int missed_exact = rate(missed, bound, true);
    const int seen = rate(s, bound, false);
    std::printf(
        "[vattention missed spike] %s: predictor misses it, base sample %d/%d over eps "
        "(p %.2g); exact statistics %d/%d; predictor finds it %d/%d\n",
        name, missed_base, kTrials, BinomialUpperTail(missed_base, kTrials, 0.1), missed_exact,
        kTrials, seen, kTrials);
    if (bound == BudgetBound::kClt) {
      EXPECT_LT(BinomialUpperTail(missed_base, kTrials, 0.1), 1e-6)
          << "CLT: the missed spike breaks the promise";
    }  // Hoeffding's budget here is every residual row (no violation, no saving).
    EXPECT_LE(missed_exact, limit) << name << " with exact statistics";
    EXPECT_LE(seen, limit) << name << " with the spike in the fixed set";
  }
}

// The compressed predictor (kernels/compressed_keys.h): ranked by the compressed keys' scores,
// the spike the hash predictor missed above is in the fixed set, and the residual's logits are
// bounded soundly from the stored error norms; the violation rate is then within delta (the
// same binomial tolerance), at 1 and 2 bits, CLT and Hoeffding.
TEST(VAttentionTest, TheCompressedPredictorKeepsThePromiseTheHashBroke) {
  constexpr int32_t n = SpikeHead::n, dv = SpikeHead::dv, d = 32, spike = SpikeHead::spike;
  const int kTrials = 200;
  SpikeHead head;
  const std::vector<float>&s = head.s, &v = head.v;
  std::mt19937_64& rng = head.rng;
  std::normal_distribution<float> normal(0.f, 1.f);
  // Keys whose logit with q = e_0 (scale 1) is s_t exactly; the other channels carry noise.
  std::vector<float> q(d, 0.f), key(d);
  q[0] = 1.f;
  const DenseHead dense = MakeDenseHead(s, v, dv);
  const int limit = static_cast<int>(0.1 * kTrials + 3 * std::sqrt(0.1 * 0.9 * kTrials));
  for (int32_t bits : {1, 2}) {
    CompressedKeys ck({bits, kKeyGroupTokens}, d, DType::kFp32);
    for (int32_t t = 0; t < n; ++t) {
      key[0] = s[t];
      for (int32_t c = 1; c < d; ++c) key[c] = normal(rng);
      ck.Append(key.data());
    }
    const CompressedKeysView view = ck.view();
    std::vector<float> approx(n);
    ApproximateScores(view, q.data(), 1.f, approx.data());
    for (auto [bound, sampler] :
         {std::pair{BudgetBound::kClt, ResidualSampler::kUniform},
          std::pair{BudgetBound::kHoeffding, ResidualSampler::kUniform},
          std::pair{BudgetBound::kClt, ResidualSampler::kImportance},
          std::pair{BudgetBound::kCltRatio, ResidualSampler::kImportance}}) {
      VAttentionParams params = SpikeHead::Params(TopKPredictor::kCompressed, bound);
      params.sampler = sampler;
      VAttentionHeadResult plan, r;
      std::vector<int32_t> scratch;
      VAttentionPlanFixed(approx.data(), n, n / 32, params, &plan, &scratch);
      ASSERT_TRUE(std::binary_search(plan.fixed.begin(), plan.fixed.end(), spike)) << bits;
      VAttentionRowAccess access = RowsOf(s, v, dv);
      access.residual_logit_max =
          CompressedLogitUpperBound(view, q.data(), 1.f, approx.data(), plan.fixed);
      size_t e = 0;
      for (int32_t t = 0; t < n; ++t) {  // the bound holds for every residual token
        if (e < plan.fixed.size() && plan.fixed[e] == t) {
          ++e;
        } else {
          ASSERT_LE(s[t], access.residual_logit_max) << "token " << t;
        }
      }
      int violations = 0;
      int64_t rows = 0;
      for (int trial = 0; trial < kTrials; ++trial) {
        r.fixed = plan.fixed;
        VAttentionSampleHead(n, params, access, 500 + trial, 0, 0, &r, approx.data());
        violations += EstimateError(dense, r, v, dv, VerifyTarget::kOutput) > params.epsilon;
        HeadRows read;
        r.ToHeadRows(&read);
        rows += static_cast<int64_t>(read.tokens.size());
      }
      std::printf(
          "[vattention compressed predictor] %d bits, %s, %s sampler: %d/%d over eps, rows "
          "%.3f of n\n",
          bits,
          bound == BudgetBound::kClt        ? "CLT"
          : bound == BudgetBound::kCltRatio ? "CLT-ratio"
                                            : "Hoeffding",
          sampler == ResidualSampler::kImportance ? "importance" : "uniform", violations, kTrials,
          static_cast<double>(rows) / kTrials / n);
      EXPECT_LE(violations, limit) << bits << " bits";
    }
  }
}

// Issue 50: keys built against the compressed predictor (kernels/synthetic.h AdversarialKeys),
// 8 heads (seeds) per family at n = 8192 over 2-bit keys, vAttention as documented for them
// (compressed predictor, importance sampler, CLT-ratio, eps = delta = 0.1, SpikeHead's fixed
// set and base rate), 200 trials a head; a head is rejected when its violation count's binomial
// p-value of "rate <= delta" is below 0.01 / 8 (Bonferroni). Checks the families are what they
// claim (the hidden needle's codes equal its neighbour's, it is outside the fixed set and holds
// over a tenth of the attention, 12-90% on these seeds) and states what the method does on them
// today (2026-11-30: the hidden needle, 8 of 8 heads rejected, every output over eps, 7.5% of
// the rows read; the range stretcher, 5 of 8 rejected, 22% over eps): the budget never accounts
// for a token whose approximate score understates its logit. The fix is issue 50's; this test
// then asserts no head rejected.
TEST(VAttentionTest, AdversarialKeysAgainstTheCompressedPredictor) {
  constexpr int32_t n = 8192, kHeads = 8;
  const int kTrials = StatisticalRepeats(200);
  for (AdversarialKeys family :
       {AdversarialKeys::kHiddenNeedle, AdversarialKeys::kRangeStretcher}) {
    int rejected = 0;
    double rate_sum = 0, rows_sum = 0;
    for (int h = 0; h < kHeads; ++h) {
      const AdversarialHead a = MakeAdversarialHead(family, n, 2, 1000 + h);
      CompressedKeys ck({2, kKeyGroupTokens}, a.d, DType::kFp32);
      for (int32_t t = 0; t < n; ++t) ck.Append(&a.k[static_cast<size_t>(t) * a.d]);
      const CompressedKeysView view = ck.view();
      std::vector<float> approx(n);
      ApproximateScores(view, a.q.data(), a.scale, approx.data());
      const std::vector<float> s = a.Scores();
      const DenseHead dense = MakeDenseHead(s, a.v, a.dv);
      VAttentionParams params =
          SpikeHead::Params(TopKPredictor::kCompressed, BudgetBound::kCltRatio);
      params.sampler = ResidualSampler::kImportance;
      VAttentionHeadResult plan, r;
      std::vector<int32_t> scratch;
      VAttentionPlanFixed(approx.data(), n, n / 32, params, &plan, &scratch);
      if (family == AdversarialKeys::kHiddenNeedle) {
        std::vector<float> needle(a.d), neighbour(a.d);
        DecompressKey(view, a.needle, needle.data());
        DecompressKey(view, a.needle - 1, neighbour.data());
        ASSERT_EQ(needle, neighbour) << "head " << h << ": the needle's codes are its neighbour's";
        ASSERT_FALSE(std::binary_search(plan.fixed.begin(), plan.fixed.end(), a.needle)) << h;
        // How far its stored error norm sets it apart: the share of tokens with a larger one.
        int32_t larger = 0;
        for (int32_t t = 0; t < n; ++t)
          larger += KeyErrorBound(view, t) > KeyErrorBound(view, a.needle);
        const float smax = *std::max_element(s.begin(), s.end());
        double total = 0;
        for (float x : s) total += std::exp(static_cast<double>(x - smax));
        const double share = std::exp(static_cast<double>(s[a.needle] - smax)) / total;
        EXPECT_GT(share, 0.1) << "head " << h << ": the needle holds a heavy share of attention";
        std::printf(
            "[vattention adversarial keys] hidden needle, head %d: %.3f of the attention, %.3f of "
            "the tokens with a larger error norm\n",
            h, share, static_cast<double>(larger) / n);
      }
      VAttentionRowAccess access = RowsOf(s, a.v, a.dv);
      access.residual_logit_max =
          CompressedLogitUpperBound(view, a.q.data(), a.scale, approx.data(), plan.fixed);
      int violations = 0;
      double rows = 0;
      for (int trial = 0; trial < kTrials; ++trial) {
        r.fixed = plan.fixed;
        VAttentionSampleHead(n, params, access, 700 + trial, 0, h, &r, approx.data());
        violations += EstimateError(dense, r, a.v, a.dv, VerifyTarget::kOutput) > params.epsilon;
        HeadRows read;
        r.ToHeadRows(&read);
        rows += static_cast<double>(read.tokens.size()) / kTrials / n;
      }
      rejected += BinomialUpperTail(violations, kTrials, 0.1) < 0.01 / kHeads;
      rate_sum += static_cast<double>(violations) / kTrials / kHeads;
      rows_sum += rows / kHeads;
    }
    std::printf(
        "[vattention adversarial keys] %-15s 2 bits, importance, CLT-ratio: %d of %d heads "
        "rejected, mean rate over eps %.3f, rows read %.3f of n\n",
        AdversarialKeysName(family), rejected, kHeads, rate_sum, rows_sum);
    RecordProperty(absl::StrCat("rejected_", AdversarialKeysName(family)), rejected);
    if (family == AdversarialKeys::kHiddenNeedle) {
      EXPECT_EQ(rejected, kHeads) << "the hidden needle breaks the promise (issue 50, open)";
    } else {
      EXPECT_GT(rejected, 0) << "the range stretcher breaks the promise (issue 50, open)";
    }
  }
}

// CompressedLogitUpperBound is sound token by token: with every other token fixed, the bound of
// the one left is at least its logit as the estimate computes it (a float dot product of the
// exact key), over bits, dtypes, closed groups and the open group's exact rows; and it is not
// looser than the stored error norm allows (plus rounding).
TEST(VAttentionTest, CompressedLogitBoundHoldsTokenByToken) {
  const int32_t n = 300, d = 64;  // 2 closed groups and 44 open rows
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (DType dt : {DType::kBf16, DType::kFp32}) {
    for (int32_t bits : {1, 2, 4, 8}) {
      const size_t es = DTypeSize(dt);
      std::vector<uint8_t> k(static_cast<size_t>(n) * d * es);
      for (int32_t i = 0; i < n * d; ++i)
        StoreFromFloat(k.data(), i, dt, (i % 5 == 0 ? 3.f : 1.f) * normal(rng));
      CompressedKeys ck({bits, kKeyGroupTokens}, d, dt);
      for (int32_t t = 0; t < n; ++t) ck.Append(k.data() + static_cast<size_t>(t) * d * es);
      const CompressedKeysView view = ck.view();
      std::vector<float> q(d), approx(n), key(d);
      for (float& x : q) x = normal(rng);
      const float scale = 0.125f;
      ApproximateScores(view, q.data(), scale, approx.data());
      double qn = 0;
      for (float x : q) qn += x * x;
      qn = std::sqrt(qn);
      for (int32_t t = 0; t < n; t += 7) {
        std::vector<int32_t> fixed;
        for (int32_t u = 0; u < n; ++u) {
          if (u != t) fixed.push_back(u);
        }
        const float bound = CompressedLogitUpperBound(view, q.data(), scale, approx.data(), fixed);
        float logit = 0.f;
        for (int32_t c = 0; c < d; ++c)
          logit += q[c] * LoadAsFloat(k.data() + static_cast<size_t>(t) * d * es, c, dt);
        logit *= scale;
        ASSERT_LE(logit, bound) << DTypeName(dt) << " bits " << bits << " token " << t;
        EXPECT_LE(bound, approx[t] + scale * qn * KeyErrorBound(view, t) + 1e-3f) << "token " << t;
      }
      // Nothing left: no bound.
      std::vector<int32_t> all(n);
      for (int32_t u = 0; u < n; ++u) all[u] = u;
      EXPECT_EQ(CompressedLogitUpperBound(view, q.data(), scale, approx.data(), all),
                -std::numeric_limits<float>::infinity());
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Families, VAttentionStatisticsTest,
    testing::Values(Case{1024, ScoreFamily::kNearUniform}, Case{1024, ScoreFamily::kPeaked},
                    Case{1024, ScoreFamily::kZipf}, Case{8192, ScoreFamily::kNearUniform},
                    Case{8192, ScoreFamily::kPeaked}, Case{8192, ScoreFamily::kZipf},
                    Case{32768, ScoreFamily::kNearUniform}, Case{32768, ScoreFamily::kPeaked},
                    Case{32768, ScoreFamily::kZipf}, Case{8192, ScoreFamily::kPeaked, 1},
                    Case{8192, ScoreFamily::kPeaked, 3}, Case{8192, ScoreFamily::kPeaked, 5}),
    CaseName);

// ---- end to end ---------------------------------------------------------------------------------

// Selection shape: budgets are the b of each head; base-only rows are listed with count 0;
// rows selected = sum over heads of |I_f| + b; same seed, same rows.
TEST(VAttentionTest, SelectionShapeAndDeterminism) {
  SyntheticProblem sp = Problem(DType::kBf16, ScoreFamily::kPeaked, {3000});
  Signatures sigs;
  ASSERT_TRUE(ComputeSimHashSignatures(sp.problem, SimHashConfig{4, 0, 64, {}}, &sigs).ok());
  std::vector<double> dense;
  ASSERT_TRUE(DenseDecodeFloat64(sp.problem, &dense).ok());
  for (auto [pred, sampler] : {std::pair{TopKPredictor::kHash, ResidualSampler::kUniform},
                               std::pair{TopKPredictor::kExact, ResidualSampler::kUniform},
                               std::pair{TopKPredictor::kExact, ResidualSampler::kImportance}}) {
    VAttentionParams params;
    params.fixed.sink_tokens = 8;
    params.fixed.local_tokens = 32;
    params.fixed.top_k_fraction = 0.02f;
    params.bits = 64;
    params.predictor = pred;
    params.sampler = sampler;
    const bool imp = sampler == ResidualSampler::kImportance;
    RowSelection sel, again;
    VAttentionStats stats;
    ASSERT_TRUE(VAttentionDecodeCpu(sp.problem, params, 17, &sigs.view, &sel, &stats).ok());
    ASSERT_TRUE(VAttentionSelectCpu(sp.problem, params, 17, &sigs.view, &again).ok());
    const double err = RelativeL2(dense, OutputAsDouble(sp.problem));
    for (int32_t kvh = 0; kvh < 2; ++kvh) {
      const KvHeadSelection& h = sel.at(0, kvh);
      EXPECT_EQ(h.tokens, again.at(0, kvh).tokens);
      EXPECT_EQ(h.weights, again.at(0, kvh).weights);
      int64_t expect_selected = 0;
      std::vector<int32_t> used, base;
      for (int g = 0; g < 2; ++g) {
        const VAttentionHeadResult& r = stats.heads[kvh * 2 + g];
        EXPECT_EQ(h.budgets[g], r.b);
        EXPECT_EQ(r.fixed.size(), 8u + 32u + 60u);  // 0.02f * 3000 rounds to 60
        EXPECT_EQ(r.base.size(),
                  static_cast<size_t>(std::max<int64_t>(2, std::llround(0.05 * r.stats.n_s))));
        EXPECT_GE(r.b, static_cast<int64_t>(r.base.size()));
        // The importance sampler draws with repeats: b draws, the row counts sum to them.
        expect_selected += static_cast<int64_t>(r.fixed.size()) + r.b;
        if (imp) {
          EXPECT_TRUE(std::is_sorted(r.dyn.begin(), r.dyn.end()));
          EXPECT_EQ(static_cast<int64_t>(r.dyn.size()), r.residual_exact ? r.stats.n_s : r.b);
        }
        used.insert(used.end(), r.fixed.begin(), r.fixed.end());
        used.insert(used.end(), r.dyn.begin(), r.dyn.end());
        base.insert(base.end(), r.base.begin(), r.base.end());
        std::printf(
            "[vattention e2e] %s predictor%s head %d: |I_f|=%zu n_b=%zu b=%lld (raw %.1f) "
            "of n_s=%lld\n",
            pred == TopKPredictor::kHash ? "hash" : "exact", imp ? " (importance)" : "",
            kvh * 2 + g, r.fixed.size(), r.base.size(), static_cast<long long>(r.b), r.budget.raw,
            static_cast<long long>(r.stats.n_s));
      }
      EXPECT_EQ(h.rows_selected(), expect_selected);
      // Rows read only for the budget: base rows no head of the group uses in its estimate.
      std::sort(used.begin(), used.end());
      std::sort(base.begin(), base.end());
      base.erase(std::unique(base.begin(), base.end()), base.end());
      int base_only = 0;
      for (int32_t t : base) base_only += std::binary_search(used.begin(), used.end(), t) ? 0 : 1;
      int zero_rows = 0;
      for (int32_t cnt : h.counts) zero_rows += cnt == 0 ? 1 : 0;
      EXPECT_EQ(zero_rows, base_only);
    }
    std::printf(
        "[vattention e2e] %s predictor%s: rel L2 vs dense %.4f, rows fetched kv0 %d of 3000\n",
        pred == TopKPredictor::kHash ? "hash" : "exact", imp ? " (importance)" : "", err,
        sel.at(0, 0).num_rows());
    EXPECT_LT(err, 0.2);
  }
}

// End to end through VAttentionSelectCpu (hash predictor, 300 seeds): the importance-weighted
// numerator and denominator built from the RowSelection weights, N^ = sum_r w_r e^{s_r - c} V_r
// and D^ = sum_r w_r e^{s_r - c}, are unbiased for N and D of every head (their ratio, the
// output, is not exactly). Per head: D and every coordinate of N within 5 SE; Bonferroni over
// 4 heads x 17 statistics = 68 checks at p = 5.7e-7: family-wise < 4e-5.
TEST(VAttentionTest, EndToEndNumeratorAndDenominatorUnbiased) {
  SyntheticOptions o;
  o.family = ScoreFamily::kZipf;
  o.num_q_heads = 4;
  o.num_kv_heads = 2;
  o.head_dim = 16;
  o.seq_lens = {600};
  o.dtype = DType::kFp32;
  SyntheticProblem sp = SyntheticProblem::Make(o);
  const DecodeProblem& p = sp.problem;
  Signatures sigs;
  ASSERT_TRUE(ComputeSimHashSignatures(p, SimHashConfig{3, 0, 32, {}}, &sigs).ok());
  VAttentionParams params;
  params.epsilon = 0.9f;  // loose: the point is the weights, not the budget
  params.delta = 0.5f;
  params.fixed.sink_tokens = 4;
  params.fixed.local_tokens = 16;
  params.fixed.top_k_fraction = 0.02f;
  params.base_rate = 0.05f;
  const int d = 16, kTrials = 300;
  // Exact logits, D and N per head (shift c = max logit of the head).
  std::vector<std::vector<float>> logit(4, std::vector<float>(600));
  std::vector<double> shift(4), dtrue(4, 0.0), ntrue(4 * d, 0.0);
  std::vector<float> q(d), v(d);
  for (int h = 0; h < 4; ++h) {
    LoadQuery(p, 0, h, q.data());
    ComputeScores(p, 0, h, q.data(), logit[h].data());
    shift[h] = *std::max_element(logit[h].begin(), logit[h].end());
    for (int t = 0; t < 600; ++t) {
      const double x = std::exp(logit[h][t] - shift[h]);
      LoadRowAsFloat(p.v, KvRowOffset(p, 0, h / 2, t), d, p.dtype, v.data());
      dtrue[h] += x;
      for (int a = 0; a < d; ++a) ntrue[h * d + a] += x * v[a];
    }
  }
  std::vector<double> sum(4 * (d + 1), 0.0), sum2(4 * (d + 1), 0.0);
  double mean_b = 0;
  for (int trial = 0; trial < kTrials; ++trial) {
    RowSelection sel;
    ASSERT_TRUE(VAttentionSelectCpu(p, params, 500 + trial, &sigs.view, &sel).ok());
    for (int h = 0; h < 4; ++h) {
      const KvHeadSelection& ks = sel.at(0, h / 2);
      const int g = h % 2;
      std::vector<double> e(d + 1, 0.0);
      for (int32_t r = 0; r < ks.num_rows(); ++r) {
        const float w = ks.weights[g * ks.num_rows() + r];
        if (w == 0.f) continue;
        const int32_t t = ks.tokens[r];
        const double x = w * std::exp(logit[h][t] - shift[h]);
        LoadRowAsFloat(p.v, KvRowOffset(p, 0, h / 2, t), d, p.dtype, v.data());
        e[0] += x;
        for (int a = 0; a < d; ++a) e[1 + a] += x * v[a];
      }
      for (int a = 0; a <= d; ++a) {
        sum[h * (d + 1) + a] += e[a];
        sum2[h * (d + 1) + a] += e[a] * e[a];
      }
      mean_b += static_cast<double>(ks.budgets[g]) / (4 * kTrials);
    }
  }
  double zmax = 0;
  for (int h = 0; h < 4; ++h) {
    for (int a = 0; a <= d; ++a) {
      const double m = sum[h * (d + 1) + a] / kTrials;
      const double var =
          std::max(0.0, sum2[h * (d + 1) + a] / kTrials - m * m) * kTrials / (kTrials - 1);
      const double se = std::sqrt(var / kTrials);
      const double target = a == 0 ? dtrue[h] : ntrue[h * d + a - 1];
      EXPECT_LE(std::fabs(m - target), 5 * se + 1e-6 * (std::fabs(target) + 1))
          << "head " << h << (a == 0 ? " denominator" : " numerator coordinate ") << a;
      if (se > 1e-9 * (std::fabs(target) + 1)) zmax = std::max(zmax, std::fabs(m - target) / se);
    }
  }
  std::printf("[vattention e2e unbiased] 300 seeds, mean b = %.1f of n_s ~ 560: max|z| = %.2f\n",
              mean_b, zmax);
}

TEST(VAttentionTest, RejectsBadParameters) {
  SyntheticProblem sp = Problem(DType::kBf16, ScoreFamily::kPeaked, {100});
  Signatures sigs;
  ASSERT_TRUE(ComputeSimHashSignatures(sp.problem, SimHashConfig{4, 0, 32, {}}, &sigs).ok());
  auto expect_invalid = [&](VAttentionParams params, const char* field, const SignatureView* view) {
    const absl::Status s = VAttentionDecodeCpu(sp.problem, params, 1, view);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(std::string(s.message()).find(field), std::string::npos) << s.message();
  };
  for (float e : {0.f, 1.f, -0.5f, 2.f}) {
    VAttentionParams p;
    p.epsilon = e;
    expect_invalid(p, "epsilon", &sigs.view);
    p = VAttentionParams{};
    p.delta = e;
    expect_invalid(p, "delta", &sigs.view);
  }
  VAttentionParams p;
  p.base_rate = 0.f;
  expect_invalid(p, "base_rate", &sigs.view);
  p = VAttentionParams{};
  p.fixed.top_k = 101;  // above the 100 tokens: every row (kernels/hash_topk.h), not an error
  EXPECT_TRUE(VAttentionDecodeCpu(sp.problem, p, 1, &sigs.view).ok());
  p = VAttentionParams{};
  p.fixed.top_k = -1;
  expect_invalid(p, "top_k", &sigs.view);
  p = VAttentionParams{};
  p.bits = 48;
  expect_invalid(p, "bits", &sigs.view);
  p = VAttentionParams{};
  p.bits = 64;
  expect_invalid(p, "bits", &sigs.view);
  p = VAttentionParams{};
  expect_invalid(p, "predictor", nullptr);
  p.predictor = TopKPredictor::kExact;
  EXPECT_TRUE(VAttentionDecodeCpu(sp.problem, p, 1, nullptr).ok());
  p.sampler = ResidualSampler::kImportance;
  EXPECT_TRUE(VAttentionDecodeCpu(sp.problem, p, 1, nullptr).ok());
  p.bound = BudgetBound::kHoeffding;  // no range of r from a sample
  expect_invalid(p, "sampler", nullptr);
  p = VAttentionParams{};
  p.sampler = ResidualSampler::kImportance;  // the hash predictor has no scores to sample by
  expect_invalid(p, "sampler", &sigs.view);
  p.predictor = TopKPredictor::kExact;
  p.sampler = static_cast<ResidualSampler>(9);
  expect_invalid(p, "sampler", nullptr);
}

}  // namespace
}  // namespace kvsparse::kernels
