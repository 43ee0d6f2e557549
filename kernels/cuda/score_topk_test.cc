#include "kernels/cuda/score_topk.h"

#include <algorithm>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_test_util.h"
#include "kernels/hash_topk.h"

namespace kvsparse::kernels::cuda {
namespace {

// The GPU selection equals SelectSinkLocalTopK's (the CPU rule), ties included: scores drawn
// from a few values so that many tie at the threshold, ragged lengths (0, 1, shorter than sink +
// window, long), budgets by count and by fraction, k of 0 and k covering every row.
TEST(ScoreTopKCudaTest, EqualsTheCpuRule) {
  KVSPARSE_REQUIRE_GPU();
  struct Case {
    int32_t sink, local, top_k;
    float fraction;
  };
  const std::vector<int32_t> lens = {0, 1, 100, 300, 4097, 20000};
  const int32_t B = static_cast<int32_t>(lens.size()), H = 4;
  const int32_t n_max = *std::max_element(lens.begin(), lens.end());
  for (const Case& c : {Case{128, 128, 0, 1.f / 32}, Case{16, 64, 37, 0.f}, Case{0, 0, 0, 0.5f},
                        Case{4, 4, 0, 0.f}, Case{8, 8, 50000, 0.f}, Case{0, 300, 0, 1.f}}) {
    for (int values : {3, 50, 0}) {  // 0: continuous scores (few ties)
      SCOPED_TRACE(testing::Message()
                   << "sink " << c.sink << " local " << c.local << " top_k " << c.top_k
                   << " fraction " << c.fraction << " values " << values);
      std::mt19937 rng(c.sink * 7 + c.local + values);
      std::normal_distribution<float> z;
      std::uniform_int_distribution<int> pick(0, std::max(values - 1, 0));
      std::vector<float> scores(static_cast<size_t>(B) * H * n_max);
      for (float& s : scores) s = values > 0 ? 0.25f * pick(rng) - 1.f : z(rng);
      scores[5] = -0.f;  // a negative zero ties with +0
      scores[6] = 0.f;
      DeviceBuffer ds = ToDevice(scores), dl = ToDevice(lens);
      ScoreTopKLaunchParams p;
      p.batch = B;
      p.num_q_heads = H;
      p.scores = ds.as<float>();
      p.score_stride = n_max;
      p.seq_lens = dl.as<int32_t>();
      p.max_seq_len = n_max;
      p.fixed.sink_tokens = c.sink;
      p.fixed.local_tokens = c.local;
      p.fixed.top_k = c.top_k;
      p.fixed.top_k_fraction = c.fraction;
      const int32_t max_out = std::max(1, p.MaxSelected());
      DeviceBuffer di(static_cast<size_t>(B) * H * max_out * 4), dc(B * H * 4), db(B * H * 4);
      ASSERT_EQ(di.Poison(), cudaSuccess);
      ASSERT_EQ(dc.Poison(), cudaSuccess);
      p.indices = di.as<int32_t>();
      p.counts = dc.as<int32_t>();
      p.budgets = db.as<int32_t>();
      KVSPARSE_ASSERT_CUDA(ScoreTopK(p, nullptr));
      KVSPARSE_ASSERT_CUDA(cudaDeviceSynchronize());
      const auto idx = ToHost<int32_t>(di, static_cast<size_t>(B) * H * max_out);
      const auto cnt = ToHost<int32_t>(dc, B * H);
      const auto bud = ToHost<int32_t>(db, B * H);
      std::vector<int32_t> want, scratch;
      for (int32_t b = 0; b < B; ++b) {
        const int32_t n = lens[b];
        const int32_t k =
            c.top_k > 0
                ? c.top_k
                : static_cast<int32_t>(std::floor(static_cast<double>(c.fraction) * n + 0.5));
        for (int32_t h = 0; h < H; ++h) {
          const float* s = scores.data() + (static_cast<size_t>(b) * H + h) * n_max;
          const int32_t chosen = SelectSinkLocalTopK(s, n, c.sink, c.local, k, &want, &scratch);
          const size_t bh = static_cast<size_t>(b) * H + h;
          ASSERT_EQ(cnt[bh], static_cast<int32_t>(want.size())) << "b " << b << " h " << h;
          EXPECT_EQ(bud[bh], chosen) << "b " << b << " h " << h;
          for (size_t i = 0; i < want.size(); ++i) {
            ASSERT_EQ(idx[bh * max_out + i], want[i]) << "b " << b << " h " << h << " i " << i;
          }
        }
      }
    }
  }
}

TEST(ScoreTopKCudaTest, RefusesBadParameters) {
  ScoreTopKLaunchParams p;
  p.batch = 1;
  p.num_q_heads = 1;
  p.max_seq_len = 100;
  p.score_stride = 50;  // shorter than a sequence
  EXPECT_EQ(ScoreTopK(p, nullptr), cudaErrorInvalidValue);
  p.score_stride = 100;
  p.fixed.top_k_fraction = 1.5f;
  EXPECT_EQ(ScoreTopK(p, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace kvsparse::kernels::cuda
