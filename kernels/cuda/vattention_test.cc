// GPU vAttention against the CPU reference (kernels/vattention.h): the fixed set, the base sample
// and the final sample token for token, the budget b (up to one where float64 sums in another
// order land b_raw on the other side of an integer) and the output.
#include "kernels/cuda/vattention.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
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
  kernels::VAttentionParams cp;
  cp.sink_tokens = 16;
  cp.local_tokens = 32;
  cp.top_k_fraction = 0.05f;
  cp.base_rate = 0.1f;
  cp.epsilon = 0.1f;
  cp.delta = 0.1f;
  cp.bound = static_cast<BudgetBound>(c.bound);
  cp.target = static_cast<VerifyTarget>(c.target);
  cp.predictor = TopKPredictor::kHash;
  const uint64_t rng_seed = 77 + seed;
  std::vector<uint8_t> cpu_out(sp.out.size());
  DecodeProblem cpu_p = p;
  cpu_p.out = cpu_out.data();
  VAttentionStats stats;
  ASSERT_TRUE(VAttentionDecodeCpu(cpu_p, cp, rng_seed, &sigs.view, nullptr, &stats).ok()) << what;

  DeviceProblem d = DeviceProblem::Upload(p, sp.k.size() / DTypeSize(c.dtype));
  DeviceBuffer qs = ToDevice(sigs.q), ks = ToDevice(sigs.k);
  VAttentionParams gp;
  gp.shape = d.shape;
  gp.seed = rng_seed;
  gp.epsilon = cp.epsilon;
  gp.delta = cp.delta;
  gp.sink_tokens = cp.sink_tokens;
  gp.local_tokens = cp.local_tokens;
  gp.top_k = cp.top_k;
  gp.top_k_fraction = cp.top_k_fraction;
  gp.base_rate = cp.base_rate;
  gp.bound = c.bound;
  gp.target = c.target;
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
  const VAttentionSelectionView v = VAttentionSelection(gp, ws.get());
  const int bh = p.batch * p.num_q_heads;
  auto host_i32 = [](const int32_t* dp, size_t count) {
    std::vector<int32_t> r(count);
    EXPECT_EQ(cudaMemcpy(r.data(), dp, count * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    return r;
  };
  const auto fixed = host_i32(v.fixed, static_cast<size_t>(bh) * v.fixed_stride);
  const auto fixed_n = host_i32(v.fixed_count, bh);
  const auto base = host_i32(v.base, static_cast<size_t>(bh) * v.max_list);
  const auto base_n = host_i32(v.base_count, bh);
  const auto dyn = host_i32(v.dyn, static_cast<size_t>(bh) * v.max_list);
  const auto dyn_n = host_i32(v.dyn_count, bh);
  std::vector<int64_t> budget(bh);
  ASSERT_EQ(cudaMemcpy(budget.data(), v.budget, bh * 8, cudaMemcpyDeviceToHost), cudaSuccess);
  auto slice = [](const std::vector<int32_t>& a, int i, int stride, int count) {
    return std::vector<int32_t>(a.begin() + static_cast<int64_t>(i) * stride,
                                a.begin() + static_cast<int64_t>(i) * stride + std::max(count, 0));
  };
  int b_off_by_one = 0;
  for (int i = 0; i < bh; ++i) {
    const VAttentionHeadResult& r = stats.heads[i];
    EXPECT_EQ(slice(fixed, i, v.fixed_stride, fixed_n[i]), r.fixed) << what << " head " << i;
    EXPECT_EQ(slice(base, i, v.max_list, base_n[i]), r.base) << what << " head " << i;
    EXPECT_LE(std::llabs(budget[i] - r.b), 1) << what << " head " << i;
    if (budget[i] == r.b) {
      EXPECT_EQ(slice(dyn, i, v.max_list, dyn_n[i]), r.dyn) << what << " head " << i;
    } else {
      ++b_off_by_one;
    }
  }
  EXPECT_LE(b_off_by_one, std::max(1, bh / 20)) << what;
  // Each (b, kv head) reads the union of its group's rows once: A = U (fixed u base), then
  // R = U dyn \ A.
  const int bk = p.batch * p.num_kv_heads, G = c.g;
  const auto ua = host_i32(v.union_a, static_cast<size_t>(bk) * v.max_list);
  const auto ua_n = host_i32(v.union_a_count, bk);
  const auto ur = host_i32(v.union_r, static_cast<size_t>(bk) * v.max_list);
  const auto ur_n = host_i32(v.union_r_count, bk);
  const auto fetched = host_i32(v.fetched, bk);
  int64_t union_rows = 0, head_rows = 0;
  for (int k = 0; k < bk; ++k) {
    std::set<int32_t> a, r;
    auto head = [&](int g) {
      return (k / p.num_kv_heads) * p.num_q_heads + (k % p.num_kv_heads) * G + g;
    };
    for (int g = 0; g < G; ++g) {
      const int i = head(g);
      for (int32_t t : slice(fixed, i, v.fixed_stride, fixed_n[i])) a.insert(t);
      for (int32_t t : slice(base, i, v.max_list, base_n[i])) a.insert(t);
      head_rows += fixed_n[i] + base_n[i] + std::max(dyn_n[i], 0);
    }
    for (int g = 0; g < G; ++g) {
      const int i = head(g);
      for (int32_t t : slice(dyn, i, v.max_list, dyn_n[i])) {
        if (!a.count(t)) r.insert(t);
      }
    }
    EXPECT_EQ(slice(ua, k, v.max_list, ua_n[k]), std::vector<int32_t>(a.begin(), a.end()))
        << what << " kv head " << k;
    EXPECT_EQ(slice(ur, k, v.max_list, ur_n[k]), std::vector<int32_t>(r.begin(), r.end()))
        << what << " kv head " << k;
    EXPECT_EQ(fetched[k], static_cast<int32_t>(a.size() + r.size())) << what << " kv head " << k;
    union_rows += fetched[k];
  }
  if (G > 1) {
    EXPECT_LT(union_rows, head_rows) << what;
  }
  int64_t bad = 0;
  const double err = RelativeL2(OutputAsDouble(cpu_p), d.OutputAsDouble(&bad));
  EXPECT_EQ(bad, 0) << what;
  EXPECT_LT(err, b_off_by_one == 0 ? 2e-2 : 0.1) << what;
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
