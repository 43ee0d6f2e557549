// SAAP's CPU reference: the partition file, un-RoPE, key assignment, the group's bucket choice
// and the rows it selects, and the estimate (all buckets = dense attention).
#include "kernels/saap.h"

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/dense.h"
#include "kernels/dtype.h"
#include "kernels/synthetic.h"

namespace kvsparse::kernels {
namespace {

// transformers' Llama RoPE (rotate_half) at `position`, in double.
std::vector<float> Rope(const SaapWeights& w, int64_t position, const std::vector<float>& x) {
  const int32_t half = w.head_dim / 2;
  std::vector<float> y(w.head_dim);
  for (int32_t i = 0; i < half; ++i) {
    const double a = static_cast<double>(position) * w.inv_freq[i];
    y[i] = static_cast<float>((x[i] * std::cos(a) - x[i + half] * std::sin(a)) * w.rope_scale);
    y[i + half] =
        static_cast<float>((x[i + half] * std::cos(a) + x[i] * std::sin(a)) * w.rope_scale);
  }
  return y;
}

TEST(SaapTest, FileRoundTripAndBadFiles) {
  const SaapWeights w = RandomSaapWeights(2, 8, 2, 16, 6, 5, 1);
  auto bytes = SerializeSaapWeights(w);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(bytes->size(), 40 + 4 * (8 + 2 * 2 * 6 * 16 + 2 * 8 * (5 * 16 + 5 + 6 * 5 + 6)));
  auto back = ParseSaapWeights(*bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->centroids, w.centroids);
  EXPECT_EQ(back->w1, w.w1);
  EXPECT_EQ(back->b2, w.b2);
  EXPECT_EQ(back->inv_freq, w.inv_freq);
  for (const std::string& bad : {bytes->substr(0, bytes->size() - 4), *bytes + "x",
                                 "KVSPHASH" + bytes->substr(8), bytes->substr(0, 20)}) {
    EXPECT_EQ(ParseSaapWeights(bad).status().code(), absl::StatusCode::kInvalidArgument);
  }
  std::string wrong_version = *bytes;
  wrong_version[8] = 2;
  EXPECT_EQ(ParseSaapWeights(wrong_version).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ReadSaapWeights("/nonexistent/saap.bin").status().code(), absl::StatusCode::kNotFound);
  const std::string path = ::testing::TempDir() + "/saap.bin";
  ASSERT_TRUE(WriteSaapWeights(w, path).ok());
  auto read = ReadSaapWeights(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->w2, w.w2);
  SaapWeights odd = w;
  odd.num_kv_heads = 3;  // does not divide H
  EXPECT_EQ(SerializeSaapWeights(odd).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(SaapTest, UnropeInvertsRopeAndAssignmentIgnoresPosition) {
  SaapWeights w = RandomSaapWeights(1, 4, 1, 64, 16, 8, 2);
  w.rope_scale = 1.25f;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<float> x(64);
    for (float& v : x) v = normal(rng);
    int32_t first = -1;
    for (int64_t pos : {0, 1, 17, 4095, 100000}) {
      const std::vector<float> y = Rope(w, pos, x);
      std::vector<float> back(64);
      SaapUnrope(w, pos, y.data(), back.data());
      for (int i = 0; i < 64; ++i) ASSERT_NEAR(back[i], x[i], 2e-4f * (1 + std::fabs(x[i])));
      std::vector<float> scratch;
      const int32_t c = SaapAssignKey(w, 0, 0, pos, y.data(), &scratch);
      if (first < 0) first = c;
      EXPECT_EQ(c, first) << "the same pre-RoPE key lands in one bucket at every position";
    }
    // The nearest centroid by cosine.
    float best = -1e30f;
    int32_t want = 0;
    for (int32_t c = 0; c < w.clusters; ++c) {
      float dot = 0.f;
      for (int i = 0; i < 64; ++i) dot += w.centroid(0, 0, c)[i] * x[i];
      if (dot > best) best = dot, want = c;
    }
    EXPECT_EQ(first, want);
  }
}

// Keys planted on buckets (pre-RoPE key of token t along centroid bucket_of(t), RoPE'd at t) and
// a classifier that ignores its input (W1 = 0: the logits are b2): the group visits the
// `probes` buckets of largest b2, and the rows are sink + window + exactly those buckets' keys.
TEST(SaapTest, SelectsSinkWindowAndTheVisitedBucketsKeys) {
  const int32_t h = 8, hkv = 2, d = 32, c = 8, n = 300;
  SaapWeights w = RandomSaapWeights(1, h, hkv, d, c, 4, 4);
  std::fill(w.centroids.begin(), w.centroids.end(), 0.f);
  for (int32_t j = 0; j < hkv; ++j) {
    for (int32_t x = 0; x < c; ++x) w.centroids[(j * c + x) * d + x] = 1.f;  // e_x
  }
  std::fill(w.w1.begin(), w.w1.end(), 0.f);
  std::fill(w.b1.begin(), w.b1.end(), 0.f);
  for (int32_t hh = 0; hh < h; ++hh) {
    for (int32_t x = 0; x < c; ++x) w.b2[hh * c + x] = x == 3 || x == 5 ? 2.f : 0.f;
  }
  auto bucket_of = [&](int32_t j, int32_t t) { return (t * 7 + j) % c; };
  std::vector<float> k(static_cast<size_t>(n) * hkv * d), v(k.size()), q(h * d, 0.5f);
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int32_t t = 0; t < n; ++t) {
    for (int32_t j = 0; j < hkv; ++j) {
      std::vector<float> x(d);
      for (float& e : x) e = 0.05f * normal(rng);
      x[bucket_of(j, t)] = 1.f;
      const std::vector<float> y = Rope(w, t, x);
      std::copy(y.begin(), y.end(), &k[(static_cast<size_t>(t) * hkv + j) * d]);
      for (int32_t i = 0; i < d; ++i) v[(static_cast<size_t>(t) * hkv + j) * d + i] = normal(rng);
    }
  }
  std::vector<float> out(h * d);
  DecodeProblem p;
  p.batch = 1;
  p.num_q_heads = h;
  p.num_kv_heads = hkv;
  p.head_dim = d;
  p.dtype = DType::kFp32;
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.kv_layout = {static_cast<int64_t>(n) * hkv * d, d, static_cast<int64_t>(hkv) * d};
  const int32_t len = n;
  p.seq_lens = &len;
  p.scale = 1.f / std::sqrt(static_cast<float>(d));
  p.out = out.data();
  std::vector<int32_t> buckets;
  SaapBuckets view;
  ASSERT_TRUE(ComputeSaapBuckets(p, w, 0, &buckets, &view).ok());
  for (int32_t j = 0; j < hkv; ++j) {
    for (int32_t t = 0; t < n; ++t) ASSERT_EQ(buckets[j * view.head_stride + t], bucket_of(j, t));
  }
  SaapParams params;
  params.probes = 2;
  params.sink_tokens = 4;
  params.local_tokens = 16;
  RowSelection sel;
  ASSERT_TRUE(SaapDecodeCpu(p, params, w, 0, view, &sel).ok());
  for (int32_t j = 0; j < hkv; ++j) {
    std::vector<int32_t> want;
    int64_t from_buckets = 0;
    for (int32_t t = 0; t < n; ++t) {
      const bool fixed = t < 4 || t >= n - 16;
      const bool visited = bucket_of(j, t) == 3 || bucket_of(j, t) == 5;
      if (fixed || visited) want.push_back(t);
      from_buckets += !fixed && visited;
    }
    EXPECT_EQ(sel.at(0, j).tokens, want) << "kv head " << j;
    EXPECT_EQ(sel.at(0, j).budgets, std::vector<int64_t>(h / hkv, from_buckets));
  }
  // Every bucket visited: every row, the output of dense attention.
  params.probes = c;
  ASSERT_TRUE(SaapDecodeCpu(p, params, w, 0, view, &sel).ok());
  for (int32_t j = 0; j < hkv; ++j) EXPECT_EQ(sel.at(0, j).num_rows(), n);
  std::vector<double> dense;
  ASSERT_TRUE(DenseDecodeFloat64(p, &dense).ok());
  double num = 0, den = 0;
  for (size_t i = 0; i < dense.size(); ++i) {
    num += (out[i] - dense[i]) * (out[i] - dense[i]);
    den += dense[i] * dense[i];
  }
  EXPECT_LT(std::sqrt(num / den), 1e-5);
  params.probes = c + 1;
  EXPECT_EQ(SaapSelectCpu(p, params, w, 0, view, &sel).code(), absl::StatusCode::kInvalidArgument);
  params.probes = 1;
  EXPECT_EQ(SaapSelectCpu(p, params, w, 1, view, &sel).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvsparse::kernels
