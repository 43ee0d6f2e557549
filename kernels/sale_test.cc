// SALE's CPU reference (kernels/sale.h): the computation pass over every causal block is dense
// causal attention; the selection keeps sink, local and diagonal blocks, never a block past the
// diagonal, is monotone in tau, and tracks the exact Relative Attention Score (a block whose
// exact score clears 4 tau is chosen, one below tau / 4 is not); on attention with a sink, a local
// band and scattered heavy blocks, calibrated thresholds skip most blocks within the error bound,
// and calibration returns the largest halving of tau0 that meets it.
#include "kernels/sale.h"

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvsparse::kernels {
namespace {

struct Prompt {
  int32_t n, H, hkv, d;
  DType dtype;
  std::vector<uint8_t> q, k, v, out;
  SalePrefill prefill() {
    SalePrefill p;
    p.tokens = n;
    p.num_q_heads = H;
    p.num_kv_heads = hkv;
    p.head_dim = d;
    p.dtype = dtype;
    p.scale = 1.f / std::sqrt(static_cast<float>(d));
    p.q = q.data();
    p.k = k.data();
    p.v = v.data();
    p.out = out.data();
    return p;
  }
  std::vector<float> Out() const {
    std::vector<float> r(static_cast<size_t>(H) * n * d);
    for (size_t i = 0; i < r.size(); ++i) r[i] = LoadAsFloat(out.data(), i, dtype);
    return r;
  }
};

// Unstructured: i.i.d. normal q, k, v. Structured (heavy = true): every query attends to a sink
// (token 0), a local band (a smooth positional direction shared by q and k), and per query block
// of 64 one key planted in a random earlier block; v normal.
Prompt MakePrompt(int32_t n, int32_t H, int32_t hkv, int32_t d, DType dtype, uint32_t seed,
                  bool heavy) {
  Prompt p{n, H, hkv, d, dtype, {}, {}, {}, {}};
  const size_t es = DTypeSize(dtype);
  p.q.resize(static_cast<size_t>(H) * n * d * es);
  p.k.resize(static_cast<size_t>(hkv) * n * d * es);
  p.v.resize(p.k.size());
  p.out.resize(p.q.size());
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> q(static_cast<size_t>(H) * n * d), k(static_cast<size_t>(hkv) * n * d);
  for (float& x : q) x = normal(rng);
  for (float& x : k) x = normal(rng);
  if (heavy) {
    const int32_t G = H / hkv;
    // Positional directions: a random walk, normalised, so nearby tokens align.
    std::vector<float> pos(static_cast<size_t>(n) * d), step(d);
    for (int32_t e = 0; e < d; ++e) pos[e] = normal(rng);
    for (int32_t t = 1; t < n; ++t) {
      for (int32_t e = 0; e < d; ++e) pos[t * d + e] = pos[(t - 1) * d + e] + 0.35f * normal(rng);
    }
    for (int32_t t = 0; t < n; ++t) {
      float nn = 0.f;
      for (int32_t e = 0; e < d; ++e) nn += pos[t * d + e] * pos[t * d + e];
      nn = std::sqrt(nn);
      for (int32_t e = 0; e < d; ++e) pos[t * d + e] /= nn;
    }
    std::vector<float> sink(d);
    for (float& x : sink) x = normal(rng) / std::sqrt(static_cast<float>(d));
    const float a = std::sqrt(static_cast<float>(d));
    for (int32_t j = 0; j < hkv; ++j) {
      for (int32_t t = 0; t < n; ++t) {
        float* kr = k.data() + (static_cast<size_t>(j) * n + t) * d;
        for (int32_t e = 0; e < d; ++e) kr[e] = 0.3f * kr[e] + 2.5f * a * pos[t * d + e];
        if (t == 0) {
          for (int32_t e = 0; e < d; ++e) kr[e] += 10.f * a * sink[e];
        }
      }
    }
    for (int32_t h = 0; h < H; ++h) {
      for (int32_t t = 0; t < n; ++t) {
        float* qr = q.data() + (static_cast<size_t>(h) * n + t) * d;
        for (int32_t e = 0; e < d; ++e)
          qr[e] = 0.3f * qr[e] + 2.5f * pos[t * d + e] + 1.2f * sink[e];
      }
    }
    // Plant: per query block of 64 past the first 512 tokens, one earlier key that the block's
    // queries of every head in the group point at.
    for (int32_t i = 8; i * 64 < n; ++i) {
      const int32_t c = std::uniform_int_distribution<int32_t>(64, i * 64 - 320)(rng);
      std::vector<float> u(d);
      for (float& x : u) x = normal(rng) / std::sqrt(static_cast<float>(d));
      for (int32_t j = 0; j < hkv; ++j) {
        float* kr = k.data() + (static_cast<size_t>(j) * n + c) * d;
        for (int32_t e = 0; e < d; ++e) kr[e] += 2.f * a * u[e];
        for (int32_t g = 0; g < G; ++g) {
          for (int32_t r = i * 64; r < std::min(n, (i + 1) * 64); ++r) {
            float* qr = q.data() + (static_cast<size_t>(j * G + g) * n + r) * d;
            for (int32_t e = 0; e < d; ++e) qr[e] += 7.f * u[e];
          }
        }
      }
    }
  }
  for (size_t i = 0; i < q.size(); ++i) StoreFromFloat(p.q.data(), i, dtype, q[i]);
  for (size_t i = 0; i < k.size(); ++i) StoreFromFloat(p.k.data(), i, dtype, k[i]);
  for (size_t i = 0; i < k.size(); ++i) StoreFromFloat(p.v.data(), i, dtype, normal(rng));
  return p;
}

// Dense causal attention, computed here from the definition (float64).
std::vector<double> NaiveCausal(const Prompt& p) {
  const float scale = 1.f / std::sqrt(static_cast<float>(p.d));
  const int32_t G = p.H / p.hkv;
  std::vector<double> out(static_cast<size_t>(p.H) * p.n * p.d, 0.0);
  auto qf = [&](int32_t h, int32_t t, int32_t e) {
    return LoadAsFloat(p.q.data(), (static_cast<size_t>(h) * p.n + t) * p.d + e, p.dtype);
  };
  auto kv = [&](const std::vector<uint8_t>& x, int32_t j, int32_t t, int32_t e) {
    return LoadAsFloat(x.data(), (static_cast<size_t>(j) * p.n + t) * p.d + e, p.dtype);
  };
  for (int32_t h = 0; h < p.H; ++h) {
    for (int32_t r = 0; r < p.n; ++r) {
      std::vector<double> s(r + 1);
      double mx = -1e300;
      for (int32_t c = 0; c <= r; ++c) {
        double dot = 0;
        for (int32_t e = 0; e < p.d; ++e) dot += double{qf(h, r, e)} * kv(p.k, h / G, c, e);
        s[c] = dot * scale;
        mx = std::max(mx, s[c]);
      }
      double den = 0;
      for (int32_t c = 0; c <= r; ++c) den += std::exp(s[c] - mx);
      for (int32_t c = 0; c <= r; ++c) {
        const double w = std::exp(s[c] - mx) / den;
        for (int32_t e = 0; e < p.d; ++e) {
          out[(static_cast<size_t>(h) * p.n + r) * p.d + e] += w * kv(p.v, h / G, c, e);
        }
      }
    }
  }
  return out;
}

TEST(SaleTest, EveryBlockIsDenseCausalAttention) {
  struct Case {
    int32_t n, H, hkv, d;
    DType dtype;
  };
  for (const Case& c : {Case{1, 2, 1, 16, DType::kFp32}, Case{37, 4, 2, 32, DType::kFp32},
                        Case{64, 2, 2, 16, DType::kBf16}, Case{300, 8, 2, 64, DType::kFp16},
                        Case{1000, 4, 1, 32, DType::kFp32}}) {
    Prompt pr = MakePrompt(c.n, c.H, c.hkv, c.d, c.dtype, 7 + c.n, false);
    SalePrefill p = pr.prefill();
    const SaleParams params;
    SaleMask mask;
    ASSERT_TRUE(SaleSelect(p, params, std::vector<float>(c.H, 0.f), &mask).ok());
    const SaleMask full = SaleFullMask(p, params);
    EXPECT_EQ(mask.selected, full.selected) << "tau 0 selects every causal block, n " << c.n;
    EXPECT_EQ(mask.sparsity(), 0.0);
    ASSERT_TRUE(SaleAttend(p, params, mask).ok());
    const std::vector<double> ref = NaiveCausal(pr);
    const std::vector<float> got = pr.Out();
    const double tol = c.dtype == DType::kFp32 ? 1e-5 : 1e-2;
    for (size_t i = 0; i < ref.size(); ++i) {
      ASSERT_NEAR(got[i], ref[i], tol * (1 + std::fabs(ref[i]))) << "n " << c.n << " element " << i;
    }
  }
}

TEST(SaleTest, PromptsWithinSinkAndLocalAreDenseAtAnyTau) {
  // 32 sink + 256 local tokens cover every block of a prompt of at most 288 tokens (the block of
  // its last row included).
  for (int32_t n : {1, 31, 64, 200, 288}) {
    Prompt pr = MakePrompt(n, 4, 2, 32, DType::kFp32, n, false);
    SalePrefill p = pr.prefill();
    SaleMask mask;
    ASSERT_TRUE(SaleSelect(p, SaleParams{}, std::vector<float>(4, 0.9f), &mask).ok());
    EXPECT_EQ(mask.selected, SaleFullMask(p, SaleParams{}).selected) << "n " << n;
  }
}

// The exact Relative Attention Score of each middle block (max over its elements), computed here
// from the definition, for head h.
std::vector<double> ExactBlockScores(const Prompt& pr, const SaleParams& sp, int32_t h, int32_t i,
                                     int32_t* sink_end, int32_t* local_first) {
  const int32_t n = pr.n, d = pr.d, G = pr.H / pr.hkv, bq = sp.block_q, bk = sp.block_k;
  const int32_t r0 = i * bq, r1 = std::min(n, r0 + bq), last = (r1 - 1) / bk;
  *local_first = std::max(0, last + 1 - sp.local_tokens / bk);
  *sink_end = std::min(sp.sink_tokens / bk, last + 1);
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  auto logit = [&](int32_t r, int32_t c) {
    double s = 0;
    for (int32_t e = 0; e < d; ++e) {
      s += double{LoadAsFloat(pr.q.data(), (static_cast<size_t>(h) * n + r) * d + e, pr.dtype)} *
           LoadAsFloat(pr.k.data(), (static_cast<size_t>(h / G) * n + c) * d + e, pr.dtype);
    }
    return s * scale;
  };
  std::vector<double> best(last + 1, 0.0);
  for (int32_t r = r0; r < r1; ++r) {
    double m = -1e300, l = 0;
    std::vector<double> s;
    for (int32_t c = 0; c <= r; ++c) {
      const int32_t blk = c / bk;
      if (blk < *sink_end || blk >= *local_first) s.push_back(logit(r, c));
    }
    for (double x : s) m = std::max(m, x);
    for (double x : s) l += std::exp(x - m);
    for (int32_t blk = *sink_end; blk < *local_first; ++blk) {
      for (int32_t c = blk * bk; c < (blk + 1) * bk; ++c) {
        best[blk] = std::max(best[blk], std::exp(logit(r, c) - m) / l);
      }
    }
  }
  return best;
}

TEST(SaleTest, SelectionTracksTheExactRelativeScore) {
  const SaleParams sp;
  for (DType dt : {DType::kFp32, DType::kBf16}) {
    Prompt pr = MakePrompt(1500, 4, 2, 64, dt, 11, true);
    SalePrefill p = pr.prefill();
    const float tau = 0.004f;
    SaleMask lo, mid, hi;
    ASSERT_TRUE(SaleSelect(p, sp, std::vector<float>(4, tau / 4), &lo).ok());
    ASSERT_TRUE(SaleSelect(p, sp, std::vector<float>(4, tau), &mid).ok());
    ASSERT_TRUE(SaleSelect(p, sp, std::vector<float>(4, tau * 4), &hi).ok());
    int64_t checked = 0, chosen = 0;
    for (int32_t h = 0; h < p.num_q_heads; ++h) {
      for (int32_t i = 0; i < mid.q_blocks; ++i) {
        int32_t sink_end = 0, local_first = 0;
        const std::vector<double> best = ExactBlockScores(pr, sp, h, i, &sink_end, &local_first);
        for (int32_t j = 0; j < mid.k_blocks; ++j) {
          const bool causal = j < static_cast<int32_t>(best.size());
          // Monotone in tau; sink, local and diagonal always; nothing past the diagonal.
          EXPECT_LE(hi.at(h, i, j), mid.at(h, i, j));
          EXPECT_LE(mid.at(h, i, j), lo.at(h, i, j));
          if (!causal) {
            EXPECT_FALSE(lo.at(h, i, j))
                << "past the diagonal: h " << h << " i " << i << " j " << j;
            continue;
          }
          if (j < sink_end || j >= local_first) {
            EXPECT_TRUE(hi.at(h, i, j)) << "sink/local: h " << h << " i " << i << " j " << j;
            continue;
          }
          ++checked;
          chosen += mid.at(h, i, j);
          if (best[j] >= 4 * tau) {
            EXPECT_TRUE(mid.at(h, i, j))
                << "missed: h " << h << " i " << i << " j " << j << " score " << best[j];
          }
          if (best[j] < tau / 4) {
            EXPECT_FALSE(mid.at(h, i, j))
                << "extra: h " << h << " i " << i << " j " << j << " score " << best[j];
          }
        }
      }
    }
    EXPECT_GT(checked, 1000);
    EXPECT_GT(chosen, 0);
    EXPECT_LT(chosen, checked / 2) << "a structured prompt is sparse at tau " << tau;
  }
}

TEST(SaleTest, CalibratedThresholdsAreSparseWithinTheBound) {
  const SaleParams sp;
  std::vector<Prompt> prompts;
  for (uint32_t s = 0; s < 2; ++s)
    prompts.push_back(MakePrompt(1536, 4, 2, 64, DType::kBf16, 20 + s, true));
  std::vector<SalePrefill> samples;
  for (Prompt& pr : prompts) samples.push_back(pr.prefill());
  const double theta = 0.05;
  absl::StatusOr<SaleCalibration> cal = SaleCalibrate(samples, sp, theta);
  ASSERT_TRUE(cal.ok()) << cal.status();
  for (int32_t h = 0; h < 4; ++h) {
    EXPECT_LE(cal->error[h], theta) << "head " << h;
    EXPECT_GT(cal->tau[h], 0.f) << "head " << h;
    EXPECT_GT(cal->halvings[h], 0) << "head " << h << ": tau0 was too loose for this theta";
    // Sink and local (288 tokens) hold over a third of the causal blocks at this length; the
    // thresholds found skip about a quarter (25-28% here).
    EXPECT_GT(cal->sparsity[h], 0.15) << "head " << h;
    std::printf(
        "[sale] head %d: tau %.6f after %d halvings, L1 error %.4f, %.1f%% of blocks skipped\n", h,
        cal->tau[h], cal->halvings[h], cal->error[h], 100 * cal->sparsity[h]);
  }
  // The largest halving: at 2 tau (where calibration had not stopped) some sample is over theta.
  for (int32_t h = 0; h < 4; ++h) {
    if (cal->halvings[h] == 0) continue;
    double worst = 0;
    for (size_t x = 0; x < samples.size(); ++x) {
      std::vector<float> tau = cal->tau;
      tau[h] *= 2;
      SaleMask dense_mask = SaleFullMask(samples[x], sp), mask;
      ASSERT_TRUE(SaleAttend(samples[x], sp, dense_mask).ok());
      const std::vector<float> ref = prompts[x].Out();
      ASSERT_TRUE(SaleSelect(samples[x], sp, tau, &mask).ok());
      ASSERT_TRUE(SaleAttend(samples[x], sp, mask).ok());
      worst = std::max(worst, SaleHeadL1Error(samples[x], prompts[x].Out(), ref)[h]);
    }
    EXPECT_GT(worst, theta) << "head " << h << ": tau " << 2 * cal->tau[h] << " also met theta";
  }
}

// The CUDA selection screens each row with SaleScreen before the exact test; a row the screen
// turned away that the exact test would pass would drop a block the reference selects. Drawn
// over the estimate's factors (scales over four decades, sums of either sign up to 2^21, mean
// terms of either sign, including ones that cancel the product), with the threshold at the
// estimate itself and a few ulps on either side, where the two evaluations' roundings matter.
// The search alone, on rounds whose errors are a known function of tau: head 0 meets theta at
// once, head 1 after three halvings, head 2 never (dense after max_halvings), head 3 only at tau 0.
TEST(SaleTest, HalvingSearchHalvesEachHeadUntilItsErrorMeetsTheBound) {
  const double theta = 1.0;
  const float tau0 = 0.008f;
  std::vector<std::vector<float>> seen;
  auto round = [&](absl::Span<const float> tau) -> absl::StatusOr<SaleRound> {
    seen.emplace_back(tau.begin(), tau.end());
    SaleRound m;
    m.error = {0.5, tau[1] / tau0 * 5.0, 2.0, tau[3] > 0 ? 3.0 : 0.25};
    m.skipped = {0.9, tau[1] / tau0, 0.1, tau[3] > 0 ? 0.5 : 0.0};
    return m;
  };
  absl::StatusOr<SaleCalibration> cal = SaleHalvingSearch(4, theta, tau0, 5, round);
  ASSERT_TRUE(cal.ok()) << cal.status();
  EXPECT_EQ(cal->tau, (std::vector<float>{tau0, tau0 / 8, 0.f, 0.f}));
  EXPECT_EQ(cal->halvings, (std::vector<int32_t>{0, 3, 5, 5}));
  EXPECT_EQ(cal->error, (std::vector<double>{0.5, 5.0 / 8, 2.0, 0.25}));
  EXPECT_EQ(cal->sparsity, (std::vector<double>{0.9, 1.0 / 8, 0.1, 0.0}));
  // Five halvings, then one round at tau 0 for the heads that never met theta.
  ASSERT_EQ(seen.size(), 7u);
  EXPECT_EQ(seen[0], (std::vector<float>(4, tau0)));
  EXPECT_EQ(seen[6][2], 0.f);

  // A failing round stops the search with its status; a bad bound runs no round.
  auto failing = [](absl::Span<const float>) -> absl::StatusOr<SaleRound> {
    return absl::UnavailableError("device lost");
  };
  EXPECT_EQ(SaleHalvingSearch(2, theta, tau0, 5, failing).status().code(),
            absl::StatusCode::kUnavailable);
  seen.clear();
  EXPECT_FALSE(SaleHalvingSearch(4, -1.0, tau0, 5, round).ok());
  EXPECT_FALSE(SaleHalvingSearch(4, theta, 1.5f, 5, round).ok());
  EXPECT_FALSE(SaleHalvingSearch(4, theta, tau0, -1, round).ok());
  EXPECT_TRUE(seen.empty());
  auto short_round = [](absl::Span<const float>) -> absl::StatusOr<SaleRound> {
    return SaleRound{{0.0}, {0.0}};
  };
  EXPECT_EQ(SaleHalvingSearch(4, theta, tau0, 5, short_round).status().code(),
            absl::StatusCode::kInternal);
}

TEST(SaleTest, ScreenNeverTurnsAwayARowThatPasses) {
  std::mt19937 rng(20261128);
  std::uniform_real_distribution<float> unit(0.f, 1.f);
  auto decades = [&](float lo_exp, float hi_exp) {
    return std::pow(10.f, lo_exp + (hi_exp - lo_exp) * unit(rng));
  };
  std::uniform_int_distribution<int32_t> sum(-(1 << 21), 1 << 21);
  int64_t at_threshold = 0, passed = 0;
  for (int draw = 0; draw < 200000; ++draw) {
    const float scale = draw % 3 == 0 ? 1.f / std::sqrt(128.f) : decades(-2.f, 0.f);
    const float q_scale = decades(-4.f, 0.f), k_scale = decades(-4.f, 0.f);
    const int32_t m = sum(rng);
    const float product = q_scale * k_scale * static_cast<float>(m);
    const float q_mean = draw % 4 == 0 ? -product * (1.f + 1e-3f * (unit(rng) - 0.5f))
                                       : (unit(rng) - 0.5f) * decades(-3.f, 3.f);
    const float est = scale * (q_scale * k_scale * static_cast<float>(m) + q_mean);
    const SaleScreen screen = MakeSaleScreen(scale, q_scale, q_mean, est);
    ASSERT_TRUE(SaleEstimatePasses(scale, q_scale, k_scale, m, q_mean, est));
    ++at_threshold;
    float thr = est;
    for (int ulp = 0; ulp < 4; ++ulp) thr = std::nextafter(thr, -INFINITY);
    for (int step = 0; step < 9; ++step, thr = std::nextafter(thr, INFINITY)) {
      if (!SaleEstimatePasses(scale, q_scale, k_scale, m, q_mean, thr)) continue;
      ++passed;
      ASSERT_TRUE(SaleScreenMayPass(MakeSaleScreen(scale, q_scale, q_mean, thr), k_scale, m))
          << "scale " << scale << " q_scale " << q_scale << " k_scale " << k_scale << " m " << m
          << " q_mean " << q_mean << " threshold " << thr;
    }
    ASSERT_TRUE(SaleScreenMayPass(screen, k_scale, m));
    // Rows past the prompt (threshold +inf) never pass; tau = 0 (threshold -inf) always does.
    ASSERT_FALSE(SaleScreenMayPass(MakeSaleScreen(scale, q_scale, q_mean, INFINITY), k_scale, m));
    ASSERT_TRUE(SaleScreenMayPass(MakeSaleScreen(scale, q_scale, q_mean, -INFINITY), k_scale, m));
  }
  EXPECT_EQ(at_threshold, 200000);
  EXPECT_GE(passed, 5 * at_threshold);  // the thresholds at and just under each estimate
}

TEST(SaleTest, RefusesBadInput) {
  Prompt pr = MakePrompt(100, 4, 2, 16, DType::kFp32, 1, false);
  SalePrefill p = pr.prefill();
  SaleMask mask;
  EXPECT_EQ(SaleSelect(p, SaleParams{}, std::vector<float>(3, 0.01f), &mask).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SaleSelect(p, SaleParams{}, std::vector<float>(4, 1.f), &mask).code(),
            absl::StatusCode::kInvalidArgument);
  SaleParams bad;
  bad.local_tokens = 32;  // below block_q
  EXPECT_EQ(SaleSelect(p, bad, std::vector<float>(4, 0.01f), &mask).code(),
            absl::StatusCode::kInvalidArgument);
  bad = SaleParams{};
  bad.block_q = 48;  // not a multiple of block_k
  EXPECT_EQ(ValidateSaleParams(bad).code(), absl::StatusCode::kInvalidArgument);
  SalePrefill odd = p;
  odd.num_kv_heads = 3;
  EXPECT_EQ(SaleSelect(odd, SaleParams{}, std::vector<float>(4, 0.01f), &mask).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SaleAttend(p, SaleParams{}, SaleMask{}).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvsparse::kernels
