// Issue 50, item 4: top-k over compressed keys states a certified upper bound on the attention
// mass its rows leave out (kernels/compressed_keys.h: UpperScores, LogSumExpOutside,
// MissedMassBound). Per head of every family, the bound against the true share computed in
// float64 from the exact keys: synthetic keys (per-channel offsets and scales, as real keys
// have), heavy-tailed keys (Student-t, 3 degrees of freedom), keys built against the
// quantization (kernels/synthetic.h AdversarialKeys: the hidden needle, the range stretcher; 1
// and 2 bits) and real attention (the trained model's three dumped layers, 384 query heads; 1,
// 2, 4 and 8 bits). The bound is never below the truth; without the stored error norms it would
// be on the hidden needle (the family is what it claims, and the test can fail). How close it
// is, printed per family, is docs/ACCURACY.md's table ("Top-k states a certified bound"): at 1-2
// bits near 1 on real attention, at 4 bits within 6x, at 8 within 1.2x.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/compressed_keys.h"
#include "kernels/hash_topk.h"
#include "kernels/synthetic.h"

namespace kvsparse::kernels {
namespace {

struct Outcome {
  double truth = 0;  // the share of the softmax's mass outside the selection, float64
  double bound = 0;  // MissedMassBound
  double naive = 0;  // the same from the compressed scores alone (no error norms, no rounding)
};

// One query head: top-k (sink, window, k) over the compressed keys `view` of k [n, d] (floats,
// stored as fp32: view.length = n), its missed-mass bound and the truth.
CompressedKeys Compress(const float* k, int32_t n, int32_t d, int32_t bits) {
  CompressedKeys ck({bits, kKeyGroupTokens}, d, DType::kFp32);
  for (int32_t t = 0; t < n; ++t) ck.Append(k + static_cast<size_t>(t) * d);
  return ck;
}

Outcome Check(const float* q, const float* k, const CompressedKeysView& view, float scale,
              int32_t top_k) {
  const int32_t n = static_cast<int32_t>(view.length), d = view.head_dim;
  std::vector<float> approx(n);
  ApproximateScores(view, q, scale, approx.data());
  std::vector<int32_t> chosen, scratch;
  SelectSinkLocalTopK(approx.data(), n, 16, 64, top_k, &chosen, &scratch);
  std::vector<double> upper(n), exact(n), plain(approx.begin(), approx.end());
  UpperScores(view, q, scale, approx.data(), upper.data());
  double m = -INFINITY;
  for (int32_t t = 0; t < n; ++t) {
    double s = 0;
    for (int32_t c = 0; c < d; ++c)
      s += static_cast<double>(q[c]) * k[static_cast<size_t>(t) * d + c];
    exact[t] = s * scale;
    m = std::max(m, exact[t]);
  }
  double all = 0, kept = 0;
  for (int32_t t = 0; t < n; ++t) all += std::exp(exact[t] - m);
  for (int32_t t : chosen) kept += std::exp(exact[t] - m);
  const double log_kept = m + std::log(kept);
  Outcome o;
  o.truth = (all - kept) / all;
  o.bound = MissedMassBound(log_kept, LogSumExpOutside(upper.data(), n, chosen));
  o.naive = MissedMassBound(log_kept, LogSumExpOutside(plain.data(), n, chosen));
  return o;
}

struct Family {
  std::string name;
  std::vector<Outcome> heads;
};

void ExpectSound(const Family& f) {
  std::vector<double> ratio, truth, bound;
  int naive_below = 0;
  for (size_t h = 0; h < f.heads.size(); ++h) {
    const Outcome& o = f.heads[h];
    EXPECT_GE(o.bound, o.truth) << f.name << ", head " << h << ": the bound is below the truth";
    EXPECT_LE(o.bound, 1.0) << f.name << ", head " << h;
    naive_below += o.naive < o.truth;
    if (o.truth > 0) ratio.push_back(o.bound / o.truth);
    truth.push_back(o.truth);
    bound.push_back(o.bound);
  }
  for (auto* x : {&ratio, &truth, &bound}) std::sort(x->begin(), x->end());
  auto median = [](const std::vector<double>& x) { return x.empty() ? 0.0 : x[x.size() / 2]; };
  std::printf(
      "[missed mass] %-22s %3zu heads: median truth %.3g, bound %.3g; bound / truth median "
      "%.3g (min %.3g, max %.3g); without the error norms %d heads below the truth\n",
      f.name.c_str(), f.heads.size(), median(truth), median(bound), median(ratio),
      ratio.empty() ? 0.0 : ratio.front(), ratio.empty() ? 0.0 : ratio.back(), naive_below);
}

// Keys with per-channel offsets and scales (a few channels large) or Student-t values, q whose
// logits are peaked enough that top-k matters.
Family Synthetic(bool heavy, int32_t bits) {
  Family f{std::string(heavy ? "student-t" : "gaussian") + ", " + std::to_string(bits) + " bits",
           {}};
  constexpr int32_t n = 4096, d = 128;
  for (uint32_t seed = 0; seed < 16; ++seed) {
    std::mt19937 rng(seed * 7 + bits + (heavy ? 100 : 0));
    std::normal_distribution<float> z;
    std::student_t_distribution<float> t3(3.f);
    std::vector<float> offset(d), sc(d), q(d), k(static_cast<size_t>(n) * d);
    for (int32_t c = 0; c < d; ++c) {
      offset[c] = z(rng);
      sc[c] = c % 16 == 0 ? 4.f : 1.f;
      q[c] = 2.f * z(rng);
    }
    for (size_t i = 0; i < k.size(); ++i) {
      const int32_t c = static_cast<int32_t>(i % d);
      k[i] = offset[c] + sc[c] * (heavy ? t3(rng) : z(rng));
    }
    const CompressedKeys ck = Compress(k.data(), n, d, bits);
    f.heads.push_back(Check(q.data(), k.data(), ck.view(), 1.f / std::sqrt(float{d}), n / 32));
  }
  return f;
}

TEST(MissedMassTest, NeverBelowTheTruthOnSyntheticFamilies) {
  for (bool heavy : {false, true}) {
    for (int32_t bits : {1, 2}) ExpectSound(Synthetic(heavy, bits));
  }
}

TEST(MissedMassTest, NeverBelowTheTruthOnAdversarialKeys) {
  constexpr int32_t n = 8192, kHeads = 8;
  for (AdversarialKeys family :
       {AdversarialKeys::kHiddenNeedle, AdversarialKeys::kRangeStretcher}) {
    for (int32_t bits : {1, 2}) {
      Family f{std::string(AdversarialKeysName(family)) + ", " + std::to_string(bits) + " bits",
               {}};
      for (int32_t h = 0; h < kHeads; ++h) {
        const AdversarialHead a = MakeAdversarialHead(family, n, bits, 2000 + h);
        const CompressedKeys ck = Compress(a.k.data(), n, a.d, bits);
        f.heads.push_back(Check(a.q.data(), a.k.data(), ck.view(), a.scale, n / 32));
      }
      ExpectSound(f);
      if (family == AdversarialKeys::kHiddenNeedle) {
        // The family hides mass from the compressed scores: without the error norms a bound
        // from them falls below the truth (the error norms are what keeps this one sound).
        int below = 0;
        for (const Outcome& o : f.heads) below += o.naive < o.truth;
        EXPECT_GT(below, 0) << f.name
                            << ": the compressed scores alone understate the mass left out";
      }
    }
  }
}

TEST(MissedMassTest, NeverBelowTheTruthOnRealAttention) {
  for (int32_t bits : {1, 2, 4, 8}) {
    Family f{"real attention, " + std::to_string(bits) + " bits", {}};
    for (int32_t layer : kRealAttentionLayers) {
      absl::StatusOr<RealAttention> r = LoadRealAttention(RealAttentionPath(layer));
      ASSERT_TRUE(r.ok()) << r.status();
      const float scale = 1.f / std::sqrt(static_cast<float>(r->d));
      // The queries' key counts ascend: one compressed-key set, grown to each query's keys.
      CompressedKeys ck({bits, kKeyGroupTokens}, r->d, DType::kFp32);
      for (int32_t i = 0; i < r->queries; ++i) {
        const int32_t n = r->Keys(i);
        while (ck.length() < n) ck.Append(&r->k[static_cast<size_t>(ck.length()) * r->d]);
        for (int32_t g = 0; g < r->group; ++g) {
          const float* q = &r->q[(static_cast<size_t>(i) * r->group + g) * r->d];
          f.heads.push_back(Check(q, r->k.data(), ck.view(), scale, n / 32));
        }
      }
    }
    ExpectSound(f);
  }
}

}  // namespace
}  // namespace kvsparse::kernels
