#include "kernels/compressed_keys.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu_util.h"
#include "kernels/dense.h"
#include "kernels/hash_topk.h"
#include "kernels/score_topk.h"
#include "kernels/synthetic.h"

namespace kvsparse::kernels {
namespace {

// Random bf16 keys [n, d] with per-channel offsets and scales (as real keys have: a few
// channels of large magnitude), returned as the stored bf16 rows and as floats.
struct Keys {
  std::vector<Bf16> rows;
  std::vector<float> f;
};

Keys RandomKeys(int64_t n, int32_t d, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> z;
  std::vector<float> offset(d), scale(d);
  for (int32_t c = 0; c < d; ++c) {
    offset[c] = 2.f * z(rng);
    scale[c] = c % 16 == 0 ? 8.f : 1.f;
  }
  Keys k;
  k.rows.resize(n * d);
  k.f.resize(n * d);
  for (int64_t i = 0; i < n * d; ++i) {
    k.rows[i] = FloatToBf16(offset[i % d] + scale[i % d] * z(rng));
    k.f[i] = Bf16ToFloat(k.rows[i]);
  }
  return k;
}

CompressedKeys Compress(const Keys& k, int64_t n, int32_t d, int32_t bits, int32_t group = 128) {
  CompressedKeys c(KeyCompression{bits, group}, d, DType::kBf16);
  for (int64_t t = 0; t < n; ++t) c.Append(k.rows.data() + t * d);
  return c;
}

TEST(CompressedKeysTest, ValidatesBitsHeadDimAndGroup) {
  for (int32_t bits : {0, 3, 5, 16, -2}) {
    EXPECT_EQ(ValidateKeyCompression({bits, 128}, 128).code(), absl::StatusCode::kInvalidArgument)
        << bits;
  }
  for (int32_t bits : {1, 2, 4, 8}) EXPECT_TRUE(ValidateKeyCompression({bits, 128}, 128).ok());
  EXPECT_EQ(ValidateKeyCompression({1, 128}, 48).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ValidateKeyCompression({2, 128}, 48).ok());
  EXPECT_EQ(ValidateKeyCompression({2, 0}, 128).code(), absl::StatusCode::kInvalidArgument);
}

// 2 bits at d = 128, groups of 128: 32 bytes of codes, 4 of fp16 scales and 2 of error norm a
// token (7.4% of a bf16 token's K and V rows, 512 bytes), plus the open group's exact rows.
TEST(CompressedKeysTest, BytesPerTokenAsDocumented) {
  const size_t row = 128 * 2;
  const uint64_t n = 1 << 20;
  const size_t b2 = CompressedKeyBytes({2, 128}, 128, row, n);
  EXPECT_EQ(b2, n * 38);
  EXPECT_LT(static_cast<double>(b2) / (n * 2 * row), 0.075);
  EXPECT_EQ(CompressedKeyBytes({1, 128}, 128, row, n), n * 22);
  EXPECT_EQ(CompressedKeyBytes({1, 128}, 128, row, 0), 0u);
  // The open group's exact rows in steps of 16.
  EXPECT_EQ(CompressedKeyBytes({2, 128}, 128, row, 128 + 17), 128 * 38 + 32 * row);
  // What CompressedKeys holds is what it says.
  const Keys k = RandomKeys(300, 128, 1);
  CompressedKeys c = Compress(k, 0, 128, 2);
  for (int64_t t = 0; t < 300; ++t) {
    const size_t want = c.bytes_after(1);
    c.Append(k.rows.data() + t * 128);
    ASSERT_EQ(c.bytes(), want);
    ASSERT_EQ(c.bytes(), CompressedKeyBytes({2, 128}, 128, row, t + 1));
  }
}

// Every dequantized channel sits within half a step of the key (plus the fp16 rounding of lo),
// the stored error norm is at least the true one, and so |q.k - q.k~| <= |q| err for any q.
TEST(CompressedKeysTest, QuantizationErrorIsBoundedAndTheStoredNormIsSound) {
  const int32_t d = 128;
  const int64_t n = 1000;  // 7 closed groups and an open one of 104 tokens
  const Keys k = RandomKeys(n, d, 7);
  std::mt19937 rng(11);
  std::normal_distribution<float> z;
  for (int32_t bits : {1, 2, 4, 8}) {
    const CompressedKeys c = Compress(k, n, d, bits);
    const CompressedKeysView v = c.view();
    ASSERT_EQ(v.length, n);
    ASSERT_EQ(v.closed, 896);
    std::vector<float> kt(d), q(d);
    for (int64_t t = 0; t < n; ++t) {
      DecompressKey(v, t, kt.data());
      double e2 = 0;
      for (int32_t ch = 0; ch < d; ++ch) {
        const double e = static_cast<double>(k.f[t * d + ch]) - kt[ch];
        e2 += e * e;
        if (t >= v.closed) {
          ASSERT_EQ(e, 0.0) << "tail token " << t << " is exact";
          continue;
        }
        const int64_t g = t / 128;
        const float step = Fp16ToFloat(Fp16{v.step(g)[ch]});
        const float lo = Fp16ToFloat(Fp16{v.lo(g)[ch]});
        ASSERT_LE(std::abs(e), 0.5 * step + std::abs(lo) * 1e-3 + 1e-6)
            << "bits " << bits << " token " << t << " channel " << ch;
      }
      if (t < v.closed) {
        ASSERT_GE(KeyErrorBound(v, t), std::sqrt(e2)) << "bits " << bits << " token " << t;
        for (int32_t ch = 0; ch < d; ++ch) q[ch] = z(rng);
        double qn = 0, exact = 0, approx = 0;
        for (int32_t ch = 0; ch < d; ++ch) {
          qn += static_cast<double>(q[ch]) * q[ch];
          exact += static_cast<double>(q[ch]) * k.f[t * d + ch];
          approx += static_cast<double>(q[ch]) * kt[ch];
        }
        ASSERT_LE(std::abs(exact - approx), std::sqrt(qn) * KeyErrorBound(v, t) * (1 + 1e-6));
      }
    }
  }
}

// More bits, smaller errors: the mean error norm halves (about) with each added bit.
TEST(CompressedKeysTest, ErrorShrinksWithBits) {
  const int32_t d = 128;
  const int64_t n = 1024;
  const Keys k = RandomKeys(n, d, 3);
  double prev = 1e30;
  for (int32_t bits : {1, 2, 4, 8}) {
    const CompressedKeys c = Compress(k, n, d, bits);
    double mean = 0;
    for (int64_t t = 0; t < n; ++t) mean += KeyErrorBound(c.view(), t) / n;
    std::printf("bits %d: mean |k - k~| %.4f\n", bits, mean);
    EXPECT_LT(mean, 0.75 * prev) << bits;
    prev = mean;
  }
}

// The approximate scores are the dot products with the dequantized keys (fp32), exact for the
// open group.
TEST(CompressedKeysTest, ApproximateScoresAreDotProductsWithDequantizedKeys) {
  const int32_t d = 64;
  const int64_t n = 300;
  const Keys k = RandomKeys(n, d, 5);
  std::mt19937 rng(2);
  std::normal_distribution<float> z;
  std::vector<float> q(d);
  for (float& x : q) x = z(rng);
  for (int32_t bits : {1, 2, 4, 8}) {
    const CompressedKeys c = Compress(k, n, d, bits, 64);
    const CompressedKeysView v = c.view();
    std::vector<float> s(n), kt(d);
    ApproximateScores(v, q.data(), 0.125f, s.data());
    for (int64_t t = 0; t < n; ++t) {
      DecompressKey(v, t, kt.data());
      double ref = 0, mag = 0;
      for (int32_t ch = 0; ch < d; ++ch) {
        ref += static_cast<double>(q[ch]) * kt[ch];
        mag += std::abs(static_cast<double>(q[ch]) * kt[ch]);
      }
      ASSERT_NEAR(s[t], 0.125 * ref, 0.125 * mag * 1e-5 + 1e-6) << "bits " << bits << " t " << t;
    }
  }
}

// The group's quantization is fixed when it closes: appending more tokens changes nothing before.
TEST(CompressedKeysTest, ClosedGroupsNeverChange) {
  const int32_t d = 128;
  const Keys k = RandomKeys(700, d, 9);
  const CompressedKeys a = Compress(k, 256, d, 2);
  const CompressedKeys b = Compress(k, 700, d, 2);
  const CompressedKeysView va = a.view(), vb = b.view();
  ASSERT_EQ(va.closed, 256);
  const size_t block = KeyGroupBytes({2, 128}, d);
  for (int64_t g = 0; g < 2; ++g) {
    ASSERT_EQ(std::memcmp(va.groups[g], vb.groups[g], block), 0) << "group " << g;
  }
}

// ---- Top-k by scores ---------------------------------------------------------------------------

// Fraction of the oracle's rows (every kv head's union) that `got` selected too.
double Recall(const RowSelection& oracle, const RowSelection& got) {
  size_t hit = 0, total = 0;
  for (size_t i = 0; i < oracle.heads.size(); ++i) {
    const std::vector<int32_t>& a = oracle.heads[i].tokens;
    const std::vector<int32_t>& b = got.heads[i].tokens;
    std::vector<int32_t> both;
    std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(both));
    hit += both.size();
    total += a.size();
  }
  return total > 0 ? static_cast<double>(hit) / total : 1.0;
}

TEST(ScoreTopKTest, ValidatesParamsAndViews) {
  SyntheticOptions o;
  o.num_q_heads = 4;
  o.num_kv_heads = 2;
  o.seq_lens = {300};
  SyntheticProblem sp = SyntheticProblem::Make(o);
  RowSelection sel;
  ScoreTopKParams p;
  p.fixed.top_k = -1;
  EXPECT_EQ(ScoreTopKSelectCpu(sp.problem, p, {}, &sel).code(), absl::StatusCode::kInvalidArgument);
  p.fixed.top_k = 400;  // > n: every row (a short sequence reads what it has)
  p.source = ScoreSource::kExact;
  ASSERT_TRUE(ScoreTopKSelectCpu(sp.problem, p, {}, &sel).ok());
  EXPECT_EQ(sel.at(0, 0).num_rows(), 300);
  p.fixed.top_k = 10;
  p.source = ScoreSource::kCompressedKeys;
  EXPECT_EQ(ScoreTopKSelectCpu(sp.problem, p, {}, &sel).code(), absl::StatusCode::kInvalidArgument)
      << "one view per (sequence, kv head)";
  std::vector<CompressedKeys> c = CompressProblemKeys(sp.problem, 2);
  EXPECT_TRUE(ScoreTopKSelectCpu(sp.problem, p, ViewsOf(c), &sel).ok());
}

// Oracle top-k with every token selected is dense attention.
TEST(ScoreTopKTest, EveryRowSelectedIsDense) {
  SyntheticOptions o;
  o.num_q_heads = 8;
  o.num_kv_heads = 2;
  o.seq_lens = {500, 77};
  o.batch = 2;
  SyntheticProblem sp = SyntheticProblem::Make(o);
  ASSERT_TRUE(DenseDecodeCpu(sp.problem).ok());
  const std::vector<double> dense = OutputAsDouble(sp.problem);
  for (ScoreSource src : {ScoreSource::kExact, ScoreSource::kCompressedKeys}) {
    std::vector<CompressedKeys> c = CompressProblemKeys(sp.problem, 1);
    ScoreTopKParams p;
    p.fixed.top_k_fraction = 1.f;
    p.source = src;
    ASSERT_TRUE(ScoreTopKDecodeCpu(sp.problem, p, ViewsOf(c)).ok());
    EXPECT_LT(RelativeL2(dense, OutputAsDouble(sp.problem)), 1e-3);
  }
}

// The selection rule: sink and window always, then the k best exact scores (ties to the lower
// index), budgets = k.
TEST(ScoreTopKTest, ExactSelectsSinkWindowAndTheBestScores) {
  SyntheticOptions o;
  o.num_q_heads = 4;
  o.num_kv_heads = 1;
  o.seq_lens = {1000};
  o.family = ScoreFamily::kZipf;
  SyntheticProblem sp = SyntheticProblem::Make(o);
  ScoreTopKParams p;
  p.fixed.sink_tokens = 4;
  p.fixed.local_tokens = 16;
  p.fixed.top_k = 30;
  p.source = ScoreSource::kExact;
  RowSelection sel;
  ASSERT_TRUE(ScoreTopKSelectCpu(sp.problem, p, {}, &sel).ok());
  const KvHeadSelection& ks = sel.at(0, 0);
  for (int64_t b : ks.budgets) EXPECT_EQ(b, 30);
  std::vector<float> q(128), s(1000);
  for (int32_t g = 0; g < 4; ++g) {
    LoadQuery(sp.problem, 0, g, q.data());
    ComputeScores(sp.problem, 0, g, q.data(), s.data());
    std::vector<int32_t> rest;
    for (int32_t t = 4; t < 984; ++t) rest.push_back(t);
    std::stable_sort(rest.begin(), rest.end(), [&](int32_t a, int32_t b) { return s[a] > s[b]; });
    for (int32_t i = 0; i < 30; ++i) {
      const int32_t t = rest[i];
      const size_t r = std::lower_bound(ks.tokens.begin(), ks.tokens.end(), t) - ks.tokens.begin();
      ASSERT_LT(r, ks.tokens.size());
      ASSERT_EQ(ks.tokens[r], t);
      EXPECT_EQ(ks.head_counts[g * ks.num_rows() + r], 1) << "head " << g << " token " << t;
    }
  }
  for (int32_t t : {0, 1, 2, 3, 984, 999}) {
    EXPECT_TRUE(std::binary_search(ks.tokens.begin(), ks.tokens.end(), t)) << t;
  }
}

// On real attention of the model trained here (tests/data/realattn), top-k from 2-bit
// compressed keys finds most of the oracle's rows at 1/32, and its output error stays close to
// the oracle's; 8 bits find nearly all (measured: 0.82-0.84 and 0.997 of the rows; errors
// within 0.007 of the oracle's).
TEST(ScoreTopKTest, CompressedKeysRecallTheOracleOnRealAttention) {
  for (int32_t layer : kRealAttentionLayers) {
    absl::StatusOr<RealAttention> r = LoadRealAttention(RealAttentionPath(layer));
    if (!r.ok()) GTEST_SKIP() << r.status();
    SyntheticProblem sp = RealAttentionProblem(*r);
    const DecodeProblem& p = sp.problem;
    ASSERT_TRUE(DenseDecodeCpu(p).ok());
    const std::vector<double> dense = OutputAsDouble(p);
    ScoreTopKParams params;
    params.fixed.top_k_fraction = 1.f / 32;
    params.source = ScoreSource::kExact;
    RowSelection oracle;
    ASSERT_TRUE(ScoreTopKDecodeCpu(p, params, {}, &oracle).ok());
    const double oracle_err = RelativeL2(dense, OutputAsDouble(p));
    // One set of compressed keys over the whole window, read by every query's sequence (the
    // first Keys(i) tokens of it).
    const size_t es = DTypeSize(p.dtype);
    for (int32_t bits : {2, 8}) {
      CompressedKeys c(KeyCompression{bits, kKeyGroupTokens}, p.head_dim, p.dtype);
      for (int32_t t = 0; t < r->n; ++t) {
        c.Append(static_cast<const uint8_t*>(p.k) + t * p.kv_layout.token_stride * es);
      }
      const std::vector<CompressedKeysView> views(p.batch, c.view());
      params.source = ScoreSource::kCompressedKeys;
      RowSelection got;
      ASSERT_TRUE(ScoreTopKDecodeCpu(p, params, views, &got).ok());
      const double recall = Recall(oracle, got);
      const double err = RelativeL2(dense, OutputAsDouble(p));
      std::printf(
          "layer %d, %d bits: recall of the oracle's rows %.3f, rel L2 %.4f (oracle %.4f)\n", layer,
          bits, recall, err, oracle_err);
      EXPECT_GE(recall, bits == 8 ? 0.95 : 0.75) << "layer " << layer << ", " << bits << " bits";
      EXPECT_LE(err, 2 * oracle_err + 0.01) << "layer " << layer << ", " << bits << " bits";
    }
  }
}

// The stored error bound on real attention (issue 50): |s_t - s~_t| <= scale |q| err_t holds for
// every token of layers 1, 3 and 5 over 2-bit keys (two queries, four heads each), and how loose
// it is there (printed; 2026-11-30: mean bound 6.5 / 10.0 / 9.0 nats against a mean true error
// of 0.52 / 1.07 / 0.65), with the share of the rows a budget reading every token whose bound
// could make it heavy would add to a fixed set of sink 128, window 128 and top-k 1/32 by s~
// (e^{s~ + B} >= 1% of the fixed set's exact mass; median 0.34 / 0.03 / 0.55 of the rows).
TEST(CompressedKeysTest, StoredBoundOnRealAttentionIsSoundAndLoose) {
  for (int32_t layer : kRealAttentionLayers) {
    absl::StatusOr<RealAttention> r = LoadRealAttention(RealAttentionPath(layer));
    if (!r.ok()) GTEST_SKIP() << r.status();
    const int32_t d = r->d;
    CompressedKeys ck({2, kKeyGroupTokens}, d, DType::kFp32);
    for (int32_t t = 0; t < r->n; ++t) ck.Append(&r->k[static_cast<size_t>(t) * d]);
    const CompressedKeysView view = ck.view();
    const float scale = 1.f / std::sqrt(static_cast<float>(d));
    double bound_sum = 0, err_sum = 0;
    int64_t count = 0;
    std::vector<double> screened;
    for (int32_t i : {r->queries - 1, r->queries - 8}) {
      for (int32_t g = 0; g < r->group; ++g) {
        const float* q = &r->q[(static_cast<size_t>(i) * r->group + g) * d];
        const int32_t m = r->Keys(i);
        const std::vector<float> s = r->Scores(i, g);
        std::vector<float> approx(view.length);
        ApproximateScores(view, q, scale, approx.data());
        double qn = 0;
        for (int32_t c = 0; c < d; ++c) qn += static_cast<double>(q[c]) * q[c];
        qn = std::sqrt(qn);
        std::vector<double> upper(m);
        for (int32_t t = 0; t < m; ++t) {
          const double b = scale * qn * KeyErrorBound(view, t);
          ASSERT_LE(std::fabs(s[t] - approx[t]), b + 1e-3) << "layer " << layer << " token " << t;
          bound_sum += b;
          err_sum += std::fabs(s[t] - approx[t]);
          ++count;
          upper[t] = approx[t] + b;
        }
        std::vector<int32_t> chosen, scratch;
        SelectSinkLocalTopK(approx.data(), m, 128, 128, static_cast<int32_t>(m / 32.0 + 0.5),
                            &chosen, &scratch);
        std::vector<char> fixed(m, 0);
        for (int32_t t : chosen) fixed[t] = 1;
        const float smax = *std::max_element(s.begin(), s.begin() + m);
        double fixed_mass = 0;
        for (int32_t t = 0; t < m; ++t) {
          if (fixed[t]) fixed_mass += std::exp(static_cast<double>(s[t] - smax));
        }
        int32_t heavy = 0;
        for (int32_t t = 0; t < m; ++t) {
          heavy += !fixed[t] && std::exp(upper[t] - smax) >= 0.01 * fixed_mass;
        }
        screened.push_back(static_cast<double>(heavy) / m);
      }
    }
    std::sort(screened.begin(), screened.end());
    std::printf(
        "layer %d, 2 bits: mean bound %.2f nats, mean |s - s~| %.2f; rows whose bound could make "
        "them heavy, beyond the fixed set: median %.3f, max %.3f\n",
        layer, bound_sum / count, err_sum / count, screened[screened.size() / 2], screened.back());
  }
}

}  // namespace
}  // namespace kvsparse::kernels
