// GPU vAttention against the CPU reference (kernels/vattention.h): the fixed set, the base sample
// and the final sample token for token, the budget b (up to one where float64 sums in another
// order land b_raw on the other side of an integer) and the output; with the hash predictor, and
// in importance mode (the compressed predictor's scores, the importance sampler).
#include "kernels/cuda/vattention.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/compressed_keys.h"
#include "kernels/cpu_util.h"
#include "kernels/cuda/cuda_test_util.h"
#include "kernels/hash_topk.h"
#include "kernels/synthetic.h"
#include "kernels/vattention.h"

namespace kvsparse::kernels::cuda {
namespace {

struct Config {
  DType dtype;
  int d, g;
  std::vector<int32_t> lens;
  int bound, target;
};

// The reference's parameters of a case: sink 16, window 32, top-k 5%, base rate 0.1,
// eps = delta = 0.1, the case's bound and target.
kernels::VAttentionParams CpuParamsOf(const Config& c) {
  kernels::VAttentionParams cp;
  cp.fixed.sink_tokens = 16;
  cp.fixed.local_tokens = 32;
  cp.fixed.top_k_fraction = 0.05f;
  cp.base_rate = 0.1f;
  cp.epsilon = 0.1f;
  cp.delta = 0.1f;
  cp.bound = static_cast<BudgetBound>(c.bound);
  cp.target = static_cast<VerifyTarget>(c.target);
  return cp;
}

// The GPU parameters matching the CPU reference's (thresholds, rates, bound and target).
VAttentionLaunchParams GpuParamsOf(const kernels::VAttentionParams& cp, const DecodeShape& shape,
                                   uint64_t seed) {
  VAttentionLaunchParams gp;
  gp.shape = shape;
  gp.seed = seed;
  gp.epsilon = cp.epsilon;
  gp.delta = cp.delta;
  gp.fixed = cp.fixed;
  gp.base_rate = cp.base_rate;
  gp.bound = static_cast<int32_t>(cp.bound);
  gp.target = static_cast<int32_t>(cp.target);
  return gp;
}

std::vector<int32_t> HostInts(const int32_t* dp, size_t count) {
  std::vector<int32_t> r(count);
  EXPECT_EQ(cudaMemcpy(r.data(), dp, count * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  return r;
}

// A finished VAttentionDecode's selection, on the host: per query head i its fixed set, base
// and final samples and budget; per (b, kv head) k the union parts and the rows fetched.
struct HostSelection {
  HostSelection(const VAttentionLaunchParams& gp, const void* ws, int bh, int bk)
      : v(VAttentionSelection(gp, ws)),
        fixed(HostInts(v.fixed, static_cast<size_t>(bh) * v.fixed_stride)),
        fixed_n(HostInts(v.fixed_count, bh)),
        base(HostInts(v.base, static_cast<size_t>(bh) * v.max_list)),
        base_n(HostInts(v.base_count, bh)),
        dyn(HostInts(v.dyn, static_cast<size_t>(bh) * v.max_list)),
        dyn_n(HostInts(v.dyn_count, bh)),
        ua(HostInts(v.union_a, static_cast<size_t>(bk) * v.max_list)),
        ua_n(HostInts(v.union_a_count, bk)),
        ur(HostInts(v.union_r, static_cast<size_t>(bk) * v.max_list)),
        ur_n(HostInts(v.union_r_count, bk)),
        fetched(HostInts(v.fetched, bk)),
        budget(bh) {
    EXPECT_EQ(cudaMemcpy(budget.data(), v.budget, bh * 8, cudaMemcpyDeviceToHost), cudaSuccess);
  }
  static std::vector<int32_t> Slice(const std::vector<int32_t>& a, int i, int stride, int count) {
    return std::vector<int32_t>(a.begin() + static_cast<int64_t>(i) * stride,
                                a.begin() + static_cast<int64_t>(i) * stride + std::max(count, 0));
  }
  std::vector<int32_t> Fixed(int i) const { return Slice(fixed, i, v.fixed_stride, fixed_n[i]); }
  std::vector<int32_t> Base(int i) const { return Slice(base, i, v.max_list, base_n[i]); }
  std::vector<int32_t> Dyn(int i) const { return Slice(dyn, i, v.max_list, dyn_n[i]); }
  std::vector<int32_t> UnionA(int k) const { return Slice(ua, k, v.max_list, ua_n[k]); }
  std::vector<int32_t> UnionR(int k) const { return Slice(ur, k, v.max_list, ur_n[k]); }

  const VAttentionSelectionView v;
  const std::vector<int32_t> fixed, fixed_n, base, base_n, dyn, dyn_n, ua, ua_n, ur, ur_n, fetched;
  std::vector<int64_t> budget;
};

void RunCase(const Config& c, int seed) {
  const std::string what = std::string(DTypeName(c.dtype)) + " d=" + std::to_string(c.d) +
                           " G=" + std::to_string(c.g) + " bound " + std::to_string(c.bound) +
                           " target " + std::to_string(c.target);
  SyntheticOptions o;
  o.family = ScoreFamily::kPeaked;
  o.batch = static_cast<int32_t>(c.lens.size());
  o.num_kv_heads = 2;
  o.num_q_heads = 2 * c.g;
  o.head_dim = c.d;
  o.seq_lens = c.lens;
  o.dtype = c.dtype;
  o.seed = 300 + seed;
  SyntheticProblem sp = SyntheticProblem::Make(o);
  DecodeProblem& p = sp.problem;
  SimHashConfig sh;
  sh.seed = 5;
  sh.bits = 32;
  Signatures sigs;
  ASSERT_TRUE(ComputeSimHashSignatures(p, sh, &sigs).ok());
  kernels::VAttentionParams cp = CpuParamsOf(c);
  cp.predictor = TopKPredictor::kHash;
  const uint64_t rng_seed = 77 + seed;
  std::vector<uint8_t> cpu_out(sp.out.size());
  DecodeProblem cpu_p = p;
  cpu_p.out = cpu_out.data();
  VAttentionStats stats;
  ASSERT_TRUE(VAttentionDecodeCpu(cpu_p, cp, rng_seed, &sigs.view, nullptr, &stats).ok()) << what;

  DeviceProblem d = DeviceProblem::Upload(p, sp.k.size() / DTypeSize(c.dtype));
  DeviceBuffer qs = ToDevice(sigs.q), ks = ToDevice(sigs.k);
  VAttentionLaunchParams gp = GpuParamsOf(cp, d.shape, rng_seed);
  gp.bits = 32;
  gp.q_sigs = qs.as<uint32_t>();
  gp.k_sigs = ks.as<uint32_t>();
  gp.k_batch_stride = sigs.view.batch_stride;
  gp.k_head_stride = sigs.view.head_stride;
  gp.k_token_stride = sigs.view.token_stride;
  gp.key_heads = sigs.view.key_heads;
  DeviceBuffer ws(VAttentionWorkspaceBytes(gp));
  ASSERT_EQ(ws.Poison(), cudaSuccess);
  ASSERT_EQ(VAttentionDecode(gp, ws.get(), ws.size(), nullptr), cudaSuccess) << what;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
  const int bh = p.batch * p.num_q_heads, bk = p.batch * p.num_kv_heads;
  const HostSelection sel(gp, ws.get(), bh, bk);
  int b_off_by_one = 0;
  for (int i = 0; i < bh; ++i) {
    const VAttentionHeadResult& r = stats.heads[i];
    EXPECT_EQ(sel.Fixed(i), r.fixed) << what << " head " << i;
    EXPECT_EQ(sel.Base(i), r.base) << what << " head " << i;
    EXPECT_LE(std::llabs(sel.budget[i] - r.b), 1) << what << " head " << i;
    if (sel.budget[i] == r.b) {
      EXPECT_EQ(sel.Dyn(i), r.dyn) << what << " head " << i;
    } else {
      ++b_off_by_one;
    }
  }
  EXPECT_LE(b_off_by_one, std::max(1, bh / 20)) << what;
  // Each (b, kv head) reads the union of its group's rows once: A = U (fixed u base), then
  // R = U dyn \ A.
  const int G = c.g;
  int64_t union_rows = 0, head_rows = 0;
  for (int k = 0; k < bk; ++k) {
    std::set<int32_t> a, r;
    auto head = [&](int g) {
      return (k / p.num_kv_heads) * p.num_q_heads + (k % p.num_kv_heads) * G + g;
    };
    for (int g = 0; g < G; ++g) {
      const int i = head(g);
      for (int32_t t : sel.Fixed(i)) a.insert(t);
      for (int32_t t : sel.Base(i)) a.insert(t);
      head_rows += sel.fixed_n[i] + sel.base_n[i] + std::max(sel.dyn_n[i], 0);
    }
    for (int g = 0; g < G; ++g) {
      const int i = head(g);
      for (int32_t t : sel.Dyn(i)) {
        if (!a.count(t)) r.insert(t);
      }
    }
    EXPECT_EQ(sel.UnionA(k), std::vector<int32_t>(a.begin(), a.end())) << what << " kv head " << k;
    EXPECT_EQ(sel.UnionR(k), std::vector<int32_t>(r.begin(), r.end())) << what << " kv head " << k;
    EXPECT_EQ(sel.fetched[k], static_cast<int32_t>(a.size() + r.size()))
        << what << " kv head " << k;
    union_rows += sel.fetched[k];
  }
  if (G > 1) {
    EXPECT_LT(union_rows, head_rows) << what;
  }
  int64_t bad = 0;
  const double err = RelativeL2(OutputAsDouble(cpu_p), d.OutputAsDouble(&bad));
  EXPECT_EQ(bad, 0) << what;
  EXPECT_LT(err, b_off_by_one == 0 ? 2e-2 : 0.1) << what;
}

// Importance mode: the CPU reference with the compressed predictor and the importance sampler
// over keys quantized to `bits`, and the GPU with the same approximate scores (ApproximateScores,
// which the GPU's CompressedScores equals bit for bit) uploaded. Fixed sets equal; base and
// final draws equal where the two float64 cumulative sums put no draw across a boundary (all
// heads here but at most one); budgets within one; the output close.
void RunImportanceCase(const Config& c, int bits, int seed) {
  const std::string what = std::string(DTypeName(c.dtype)) + " d=" + std::to_string(c.d) +
                           " G=" + std::to_string(c.g) + " bound " + std::to_string(c.bound) +
                           " target " + std::to_string(c.target) + " bits " + std::to_string(bits);
  SyntheticOptions o;
  o.family = ScoreFamily::kPeaked;
  o.batch = static_cast<int32_t>(c.lens.size());
  o.num_kv_heads = 2;
  o.num_q_heads = 2 * c.g;
  o.head_dim = c.d;
  o.seq_lens = c.lens;
  o.dtype = c.dtype;
  o.seed = 500 + seed;
  SyntheticProblem sp = SyntheticProblem::Make(o);
  DecodeProblem& p = sp.problem;
  const int B = p.batch, H = p.num_q_heads, hkv = p.num_kv_heads, G = c.g;
  int32_t max_len = 0;
  for (int32_t n : c.lens) max_len = std::max(max_len, n);
  std::vector<CompressedKeys> keys;
  std::vector<CompressedKeysView> views;
  const size_t esize = DTypeSize(p.dtype);
  for (int b = 0; b < B; ++b) {
    for (int j = 0; j < hkv; ++j) {
      keys.emplace_back(KeyCompression{bits, kKeyGroupTokens}, p.head_dim, p.dtype);
      for (int32_t t = 0; t < p.seq_lens[b]; ++t) {
        keys.back().Append(static_cast<const uint8_t*>(p.k) + KvRowOffset(p, b, j, t) * esize);
      }
    }
  }
  for (const CompressedKeys& k : keys) views.push_back(k.view());
  // The scores the GPU selects from: [B * H, max_len].
  std::vector<float> scores(static_cast<size_t>(B) * H * max_len, 0.f), q(p.head_dim);
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      LoadQuery(p, b, h, q.data());
      ApproximateScores(views[static_cast<size_t>(b) * hkv + h / G], q.data(), p.scale,
                        scores.data() + (static_cast<size_t>(b) * H + h) * max_len);
    }
  }
  kernels::VAttentionParams cp = CpuParamsOf(c);
  cp.predictor = TopKPredictor::kCompressed;
  cp.sampler = ResidualSampler::kImportance;
  const uint64_t rng_seed = 91 + seed;
  std::vector<uint8_t> cpu_out(sp.out.size());
  DecodeProblem cpu_p = p;
  cpu_p.out = cpu_out.data();
  VAttentionStats stats;
  ASSERT_TRUE(VAttentionDecodeCpu(cpu_p, cp, rng_seed, nullptr, nullptr, &stats, views).ok())
      << what;

  DeviceProblem d = DeviceProblem::Upload(p, sp.k.size() / esize);
  DeviceBuffer dscores = ToDevice(scores);
  VAttentionLaunchParams gp = GpuParamsOf(cp, d.shape, rng_seed);
  gp.scores = dscores.as<float>();
  gp.scores_stride = max_len;
  // A sizing pass carves the scores after it asks for the workspace: the mode is the stride's.
  VAttentionLaunchParams sizing = gp;
  sizing.scores = nullptr;
  EXPECT_EQ(VAttentionWorkspaceBytes(sizing), VAttentionWorkspaceBytes(gp)) << what;
  DeviceBuffer ws(VAttentionWorkspaceBytes(gp));
  ASSERT_EQ(ws.Poison(), cudaSuccess);
  ASSERT_EQ(VAttentionDecode(gp, ws.get(), ws.size(), nullptr), cudaSuccess) << what;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
  const int bh = B * H;
  const HostSelection sel(gp, ws.get(), bh, B * hkv);
  int base_differs = 0, b_off = 0, dyn_differs = 0, exact_residual = 0, repeats = 0;
  for (int i = 0; i < bh; ++i) {
    const VAttentionHeadResult& r = stats.heads[i];
    EXPECT_EQ(sel.Fixed(i), r.fixed) << what << " head " << i;
    const std::vector<int32_t> gb = sel.Base(i);
    EXPECT_EQ(gb.size(), r.base.size()) << what << " head " << i;
    base_differs += gb != r.base;
    EXPECT_TRUE(std::is_sorted(gb.begin(), gb.end())) << what << " head " << i;
    repeats += std::adjacent_find(gb.begin(), gb.end()) != gb.end();
    EXPECT_LE(std::llabs(sel.budget[i] - r.b), 1) << what << " head " << i;
    if (sel.budget[i] != r.b) {
      ++b_off;
      continue;
    }
    exact_residual += r.residual_exact;
    const std::vector<int32_t> gd = sel.Dyn(i);
    EXPECT_EQ(static_cast<int64_t>(gd.size()),
              r.residual_exact ? static_cast<int64_t>(r.dyn.size()) : r.b)
        << what << " head " << i;
    dyn_differs += gd != r.dyn;
  }
  EXPECT_LE(base_differs, 1) << what;
  EXPECT_LE(dyn_differs, 1) << what;
  EXPECT_LE(b_off, std::max(1, bh / 20)) << what;
  int64_t bad = 0;
  const double err = RelativeL2(OutputAsDouble(cpu_p), d.OutputAsDouble(&bad));
  EXPECT_EQ(bad, 0) << what;
  EXPECT_LT(err, b_off + base_differs + dyn_differs == 0 ? 2e-2 : 0.1) << what;
  std::printf(
      "[importance] %s: %d heads, %d with repeated draws, %d read the residual exactly, "
      "rel L2 %.2e\n",
      what.c_str(), bh, repeats, exact_residual, err);
}

TEST(VAttentionCudaTest, ImportanceModeMatchesCpu) {
  KVSPARSE_REQUIRE_GPU();
  const std::vector<Config> configs = {
      {DType::kBf16, 128, 4, {5000, 1, 300, 57}, 1, 3},
      {DType::kFp16, 64, 1, {2000, 129}, 3, 3},
      {DType::kBf16, 128, 4, {9000, 700}, 3, 3},
      {DType::kFp16, 128, 2, {700, 4000}, 1, 1},
  };
  int seed = 0;
  for (const Config& c : configs) {
    for (int bits : {1, 2}) RunImportanceCase(c, bits, seed++);
  }
  // Hoeffding has no range from a sample: refused.
  VAttentionLaunchParams bad;
  bad.bound = 2;
  bad.scores = reinterpret_cast<const float*>(16);
  bad.scores_stride = 0;
  EXPECT_EQ(VAttentionDecode(bad, nullptr, 0, nullptr), cudaErrorInvalidValue);
}

TEST(VAttentionCudaTest, MatchesCpuSelectionAndOutput) {
  KVSPARSE_REQUIRE_GPU();
  const std::vector<Config> configs = {
      {DType::kBf16, 128, 4, {5000, 1, 300, 57}, 1, 3},
      {DType::kFp16, 64, 1, {2000, 129}, 2, 3},
      {DType::kBf16, 256, 8, {3000}, 1, 1},
      {DType::kFp16, 128, 2, {700, 4000}, 2, 2},
      {DType::kBf16, 64, 4, {20000}, 1, 3},
      {DType::kBf16, 128, 4, {6000, 900}, 3, 3},
      {DType::kFp16, 256, 2, {3000}, 3, 3},
  };
  int seed = 0;
  for (const Config& c : configs) RunCase(c, seed++);
}

}  // namespace
}  // namespace kvsparse::kernels::cuda
