// Every method's CPU reference on real attention: q, K and V of three layers of the model trained
// in the repository (kernels/synthetic.h RealAttention; tests/data/realattn), 32 decode queries
// of 4 heads each per layer, against exact attention in float64. The statistical tests of each
// method run on the same data as a family beside the synthetic ones (santa_test.cc and
// vattention_test.cc: real_layer cases); this file checks whole decodes: errors within bounds
// set from the measurements in docs/ACCURACY.md ("Real attention"), vAttention's (epsilon,
// delta) guarantee over the 384 (query, head) outputs, and rows read once per GQA group.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/dense.h"
#include "kernels/hash_topk.h"
#include "kernels/row_selection.h"
#include "kernels/santa.h"
#include "kernels/synthetic.h"
#include "kernels/vattention.h"

namespace kvsparse::kernels {
namespace {

struct Layer {
  RealAttention attention;
  SyntheticProblem problem;
  std::vector<double> exact;  // [queries, group, d] float64 attention
};

std::vector<Layer>& Layers() {
  static std::vector<Layer>* layers = [] {
    auto* v = new std::vector<Layer>();
    for (int32_t layer : kRealAttentionLayers) {
      absl::StatusOr<RealAttention> r = LoadRealAttention(RealAttentionPath(layer));
      if (!r.ok()) {
        ADD_FAILURE() << r.status();
        continue;
      }
      Layer l;
      l.problem = RealAttentionProblem(*r);
      l.attention = std::move(*r);
      if (!DenseDecodeFloat64(l.problem.problem, &l.exact).ok()) ADD_FAILURE() << "float64 dense";
      v->push_back(std::move(l));
    }
    return v;
  }();
  return *layers;
}

// Relative L2 error of each (query, head) output against exact attention.
std::vector<double> HeadErrors(const Layer& l) {
  const std::vector<double> got = OutputAsDouble(l.problem.problem);
  const int32_t heads = l.attention.queries * l.attention.group, d = l.attention.d;
  std::vector<double> err(heads);
  for (int32_t i = 0; i < heads; ++i) {
    double e2 = 0, r2 = 0;
    for (int32_t a = 0; a < d; ++a) {
      const double x = l.exact[static_cast<size_t>(i) * d + a];
      e2 += (got[static_cast<size_t>(i) * d + a] - x) * (got[static_cast<size_t>(i) * d + a] - x);
      r2 += x * x;
    }
    err[i] = std::sqrt(e2 / r2);
  }
  return err;
}

double Mean(const std::vector<double>& x) {
  double s = 0;
  for (double v : x) s += v;
  return x.empty() ? 0 : s / static_cast<double>(x.size());
}

TEST(RealAttentionTest, DataIsTheTrainedModels) {
  ASSERT_EQ(Layers().size(), std::size(kRealAttentionLayers));
  for (const Layer& l : Layers()) {
    EXPECT_EQ(l.attention.n, 8192);
    EXPECT_EQ(l.attention.d, 128);
    EXPECT_EQ(l.attention.group, 4);  // GQA 4:1
    EXPECT_EQ(l.attention.queries, 32);
    for (float x : l.attention.k) ASSERT_TRUE(std::isfinite(x));
  }
}

// Dense over bf16 rows with fp32 accumulation: only the output's bf16 rounding.
TEST(RealAttentionTest, Dense) {
  for (Layer& l : Layers()) {
    ASSERT_TRUE(DenseDecodeCpu(l.problem.problem).ok());
    EXPECT_LT(Mean(HeadErrors(l)), 4e-3) << "layer " << l.attention.layer;
  }
}

// S2ANTA-prop S = 256 (the README's setting), -flash S = 2048 and SANTA iid S = 256: mean
// relative L2 over each layer's outputs, bounded about 1.5x above what this data gave when the
// test was written (prop 0.009-0.139, flash 0.019-0.096, iid 0.032-0.204; layer 1's wide
// attention is the hardest): a regression guard, the statistics are in santa_test.cc.
TEST(RealAttentionTest, Santa) {
  struct Setting {
    const char* name;
    SantaParams params;
    double bound;
  };
  SantaParams prop, flash, iid;
  prop.samples = 256;
  flash.allocation = SantaAllocation::kFlash;
  flash.samples = 2048;
  iid.allocation = SantaAllocation::kGlobal;
  iid.sampler = SantaSampler::kIid;
  iid.samples = 256;
  for (const Setting& s : {Setting{"prop S=256", prop, 0.2}, Setting{"flash S=2048", flash, 0.15},
                           Setting{"iid S=256", iid, 0.3}}) {
    for (Layer& l : Layers()) {
      ASSERT_TRUE(SantaDecodeCpu(l.problem.problem, s.params, /*seed=*/3).ok());
      const double err = Mean(HeadErrors(l));
      std::printf("[real attention] layer %d S2ANTA %-12s rel L2 %.4f\n", l.attention.layer, s.name,
                  err);
      EXPECT_LT(err, s.bound) << s.name << " layer " << l.attention.layer;
    }
  }
}

// HashAttention top-k over SimHash signatures (32 bits): more rows, less error, and every row
// is dense attention.
TEST(RealAttentionTest, HashTopK) {
  for (Layer& l : Layers()) {
    const DecodeProblem& p = l.problem.problem;
    Signatures sigs;
    ASSERT_TRUE(
        ComputeSimHashSignatures(p, SimHashConfig{5, l.attention.layer, 32, {}}, &sigs).ok());
    double previous = 1e9;
    for (float fraction : {1.f / 32, 1.f / 8, 1.f / 2, 1.f}) {
      HashTopKParams params;
      params.fixed.top_k_fraction = fraction;
      RowSelection sel;
      ASSERT_TRUE(HashTopKDecodeCpu(p, params, sigs.view, &sel).ok());
      const double err = Mean(HeadErrors(l));
      std::printf("[real attention] layer %d hash top-k SimHash 32 bits %.4f: rel L2 %.4f\n",
                  l.attention.layer, fraction, err);
      EXPECT_LT(err, previous + 0.01) << fraction << " layer " << l.attention.layer;
      previous = err;
      if (fraction == 1.f) {
        EXPECT_LT(err, 4e-3) << "every row: dense";
      }
    }
  }
}

// vAttention's guarantee per output: P(rel L2 > epsilon) <= delta. The exact predictor over
// the 384 outputs of the three layers: the observed rate must be within a binomial 3-sigma of
// delta. The hash predictor's rate is printed (docs/ACCURACY.md: it exceeds delta on some
// heads). Rows: each (query, kv head) reads the union of its 4 heads' rows once, never more
// than the context.
TEST(RealAttentionTest, VAttentionGuaranteeAndRows) {
  for (TopKPredictor predictor : {TopKPredictor::kExact, TopKPredictor::kHash}) {
    for (float eps : {0.05f, 0.1f}) {
      VAttentionParams params;
      params.epsilon = eps;
      params.delta = eps;
      params.predictor = predictor;
      params.fixed.top_k_fraction = 1.f / 32;
      int violations = 0, outputs = 0;
      double rows = 0, context = 0;
      for (Layer& l : Layers()) {
        const DecodeProblem& p = l.problem.problem;
        Signatures sigs;
        ASSERT_TRUE(
            ComputeSimHashSignatures(p, SimHashConfig{5, l.attention.layer, 32, {}}, &sigs).ok());
        RowSelection sel;
        ASSERT_TRUE(VAttentionDecodeCpu(p, params, /*seed=*/11, &sigs.view, &sel).ok());
        for (double e : HeadErrors(l)) violations += e > eps;
        outputs += p.batch * p.num_q_heads;
        for (int32_t b = 0; b < p.batch; ++b) {
          const int32_t union_rows = sel.at(b, 0).num_rows();
          EXPECT_LE(union_rows, p.seq_lens[b]);
          rows += union_rows;
          context += p.seq_lens[b];
        }
      }
      const double rate = static_cast<double>(violations) / outputs;
      const bool exact = predictor == TopKPredictor::kExact;
      std::printf(
          "[real attention] vAttention %s eps=delta=%.2f: violations %d of %d (%.4f), rows per kv "
          "head %.3f of the context\n",
          exact ? "exact" : "hash ", eps, violations, outputs, rate, rows / context);
      if (exact) {
        EXPECT_LE(rate, eps + 3 * std::sqrt(eps * (1 - eps) / outputs)) << "eps " << eps;
      }
    }
  }
}

// Defect 4 on real attention: the hash predictor's violations per (layer, head), over 5 seeds x
// 32 queries (160 outputs a head), for candidate settings at eps = delta = 0.05. What this data
// showed when written (docs/ACCURACY.md): the base sample's variance estimate is the cause. With
// the statistics of every residual row (exact_statistics, a test-only switch) the CLT budget
// holds per head at the same rows; a 4x larger base sample or Hoeffding's bound hold it at
// 0.96-0.98 of the rows; the ratio bound on base-sample statistics does not (worst head 0.19).
// Asserted: exact statistics within delta per head (binomial 3 sigma), and the default's overall
// rate within delta.
// Per (layer, query head): its violations over seeds x queries, against (epsilon, delta). A
// head's rate is a binomial count, so the worst of 12 heads sits above delta by chance alone;
// the test of the guarantee is one-sided per head (H0: the head's rate <= delta, p-value
// P(X >= k | n, delta)) with Bonferroni over the heads, at a family-wise level of 1%. The
// Theorem-4.3 budgets (CLT with base-sample statistics, Hoeffding, exact statistics, a larger
// top-k) must not be rejected; the ratio bound's figures are printed (it is a normal
// approximation of the output, known to be anti-conservative on base-sample statistics).
TEST(RealAttentionTest, VAttentionHashPredictorPerHead) {
  struct Candidate {
    const char* name;
    VAttentionParams params;
    bool asserted = true;
  };
  std::vector<Candidate> candidates;
  auto add = [&](const char* name, auto&& set) {
    VAttentionParams p;
    p.predictor = TopKPredictor::kHash;
    p.fixed.top_k_fraction = 1.f / 32;
    set(p);
    candidates.push_back({name, p});
  };
  add("CLT, base 0.05", [](VAttentionParams&) {});
  add("CLT, base 0.2", [](VAttentionParams& p) { p.base_rate = 0.2f; });
  add("Hoeffding", [](VAttentionParams& p) { p.bound = BudgetBound::kHoeffding; });
  add("CLT-ratio", [](VAttentionParams& p) { p.bound = BudgetBound::kCltRatio; });
  candidates.back().asserted = false;
  add("CLT, exact statistics", [](VAttentionParams& p) { p.exact_statistics = true; });
  add("CLT, top-k 1/8", [](VAttentionParams& p) { p.fixed.top_k_fraction = 1.f / 8; });
  constexpr int kSeeds = 5;
  for (const Candidate& c : candidates) {
    int violations = 0, outputs = 0, heads = 0;
    double worst = 0, rows = 0, context = 0, min_p = 1;
    std::string worst_at;
    for (Layer& l : Layers()) {
      const DecodeProblem& p = l.problem.problem;
      Signatures sigs;
      ASSERT_TRUE(
          ComputeSimHashSignatures(p, SimHashConfig{5, l.attention.layer, 32, {}}, &sigs).ok());
      std::vector<int> per_head(p.num_q_heads, 0);
      for (int seed = 0; seed < kSeeds; ++seed) {
        RowSelection sel;
        ASSERT_TRUE(VAttentionDecodeCpu(p, c.params, 100 + seed, &sigs.view, &sel).ok());
        const std::vector<double> err = HeadErrors(l);
        for (size_t i = 0; i < err.size(); ++i) {
          const bool v = err[i] > c.params.epsilon;
          violations += v;
          per_head[i % p.num_q_heads] += v;
        }
        outputs += static_cast<int>(err.size());
        for (int32_t b = 0; b < p.batch; ++b) {
          rows += sel.at(b, 0).num_rows();
          context += p.seq_lens[b];
        }
      }
      for (int h = 0; h < p.num_q_heads; ++h) {
        const int trials = kSeeds * p.batch;
        const double rate = static_cast<double>(per_head[h]) / trials;
        if (rate > worst) {
          worst = rate;
          worst_at = absl::StrCat("layer ", l.attention.layer, " head ", h);
        }
        min_p = std::min(min_p, BinomialUpperTail(per_head[h], trials, c.params.delta));
        ++heads;
      }
    }
    const double family_p = std::min(1.0, min_p * heads);  // Bonferroni
    std::printf(
        "[real attention] vAttention hash %-22s violations %.4f, worst head %.3f (%s), "
        "rows %.3f, smallest per-head p %.3g (Bonferroni over %d heads: %.3g)\n",
        c.name, static_cast<double>(violations) / outputs, worst, worst_at.c_str(), rows / context,
        min_p, heads, family_p);
    if (c.asserted) {
      EXPECT_GT(family_p, 0.01) << c.name << ": a head's violation rate exceeds delta";
      EXPECT_LE(static_cast<double>(violations) / outputs, c.params.delta) << c.name;
    }
  }
}
}  // namespace
}  // namespace kvsparse::kernels
