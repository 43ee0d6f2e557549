#include "kernels/cuda/bernoulli_qk.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/bernoulli_qk.h"
#include "kernels/cuda/cuda_test_util.h"
#include "kernels/dtype.h"

namespace kvsparse::kernels::cuda {
namespace {

// SampleBernoulliQueries writes the reference's effective queries bit for bit
// (SampleBernoulliQuery, rounded to q's dtype as SantaSelectCpu rounds them) and counts the
// features it reads as the reference's touched flags: both modes and samplers, bf16 and fp16, GQA
// groups of 4, head dims 64 and 128, per-sequence seeds and one seed, a head of zeros and a group
// of zeros.
TEST(BernoulliQkCudaTest, EffectiveQueriesAreTheReferences) {
  KVSPARSE_REQUIRE_GPU();
  const int32_t B = 3, Hkv = 2, G = 4, H = Hkv * G;
  std::mt19937 rng(11);
  std::normal_distribution<float> z;
  for (DType dt : {DType::kBf16, DType::kFp16}) {
    for (int32_t d : {64, 128}) {
      const size_t n = static_cast<size_t>(B) * H * d;
      std::vector<uint16_t> q(n);
      for (size_t i = 0; i < n; ++i) {
        const size_t head = i / d;
        float x = z(rng) * (i % d == 7 ? 6.f : 1.f);  // an outlier feature
        if (head == 1) x = 0.f;                       // a query head of zeros
        if (head / G == 2 * Hkv - 1) x = 0.f;         // sequence 1, kv head 1: a group of zeros
        StoreFromFloat(q.data(), i, dt, x);
      }
      const std::vector<uint64_t> seeds = {901, 902, 903};
      DeviceBuffer dq = ToDevice(q), dseeds = ToDevice(seeds), dout(n * 2),
                   dfeat(sizeof(int32_t) * B * Hkv * 2);
      for (int mode = 0; mode < 2; ++mode) {
        for (BernoulliSampler sampler : {BernoulliSampler::kStratified, BernoulliSampler::kIid}) {
          for (bool per_seq : {true, false}) {
            BernoulliQueriesParams p;
            p.batch = B;
            p.num_q_heads = H;
            p.num_kv_heads = Hkv;
            p.head_dim = d;
            p.dtype = dt;
            p.q = dq.get();
            p.q_eff = dout.get();
            p.params = {mode == 0 ? 4 : 2,
                        mode == 0 ? BernoulliQkMode::kMeanGroupQuery : BernoulliQkMode::kPerHead,
                        sampler};
            p.seed = 77;
            p.seeds = per_seq ? dseeds.as<uint64_t>() : nullptr;
            p.features = dfeat.as<int32_t>();
            ASSERT_EQ(dout.Poison(), cudaSuccess);
            KVSPARSE_ASSERT_CUDA(SampleBernoulliQueries(p, nullptr));
            KVSPARSE_ASSERT_CUDA(cudaDeviceSynchronize());
            const std::vector<uint16_t> got = ToHost<uint16_t>(dout, n);
            const std::vector<int32_t> feat = ToHost<int32_t>(dfeat, B * Hkv * 2);
            const std::string what = std::string(DTypeName(dt)) + " d " + std::to_string(d) +
                                     " mode " + std::to_string(mode) + " sampler " +
                                     std::to_string(static_cast<int>(sampler)) +
                                     (per_seq ? " seeds" : " seed");
            int64_t touched = 0;
            for (int32_t b = 0; b < B; ++b) {
              for (int32_t j = 0; j < Hkv; ++j) {
                std::vector<float> qg(static_cast<size_t>(G) * d);
                const size_t base = (static_cast<size_t>(b) * H + j * G) * d;
                for (size_t e = 0; e < qg.size(); ++e) qg[e] = LoadAsFloat(q.data(), base + e, dt);
                BernoulliQuery ref;
                ASSERT_TRUE(SampleBernoulliQuery(qg, G, d, p.params, per_seq ? seeds[b] : 77,
                                                 per_seq ? 0 : b, j, &ref)
                                .ok());
                int64_t head_pairs = 0, group = 0;
                for (uint8_t t : ref.head_touched) head_pairs += t;
                for (uint8_t t : ref.group_touched) group += t;
                EXPECT_EQ(feat[2 * (b * Hkv + j)], head_pairs) << what << " b " << b << " j " << j;
                EXPECT_EQ(feat[2 * (b * Hkv + j) + 1], group) << what << " b " << b << " j " << j;
                touched += head_pairs;
                for (size_t e = 0; e < qg.size(); ++e) {
                  uint16_t want[2] = {0, 0};  // room for any dtype's element
                  StoreFromFloat(want, 0, dt, ref.q_eff[e]);
                  ASSERT_EQ(got[base + e], want[0]) << what << " b " << b << " element " << e;
                }
              }
            }
            EXPECT_GT(touched, 0) << what;
            EXPECT_LT(touched, static_cast<int64_t>(n)) << what;  // fewer than every feature
          }
        }
      }
    }
  }
}

// What the launcher refuses before touching the device: kernels::ValidateBernoulliQkParams's
// samples < 1, fp32, a head dim it does not take.
TEST(BernoulliQkCudaTest, RefusesWhatItDoesNotTake) {
  uint16_t q = 0, out = 0;
  BernoulliQueriesParams p;
  p.batch = 1;
  p.num_q_heads = 4;
  p.num_kv_heads = 1;
  p.head_dim = 64;
  p.q = &q;
  p.q_eff = &out;
  p.params.samples = 0;
  EXPECT_EQ(SampleBernoulliQueries(p, nullptr), cudaErrorInvalidValue);
  p.params.samples = 4;
  p.dtype = DType::kFp32;
  EXPECT_EQ(SampleBernoulliQueries(p, nullptr), cudaErrorInvalidValue);
  p.dtype = DType::kBf16;
  p.head_dim = 48;
  EXPECT_EQ(SampleBernoulliQueries(p, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace kvsparse::kernels::cuda
