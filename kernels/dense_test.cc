#include "kernels/dense.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace kvsparse::kernels {
namespace {

struct Case {
  DType dtype;
  int batch, heads, kv_heads, dim;
  std::vector<int32_t> lens;
};

// Fills a buffer of n elements of dtype t with N(0, sigma) values.
std::vector<uint8_t> RandomRows(size_t n, DType t, float sigma, std::mt19937_64& rng) {
  std::vector<uint8_t> buf(n * DTypeSize(t));
  std::normal_distribution<float> dist(0.f, sigma);
  for (size_t i = 0; i < n; ++i) StoreFromFloat(buf.data(), i, t, dist(rng));
  return buf;
}

double RelL2(const std::vector<double>& ref, const std::vector<double>& got) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num += (ref[i] - got[i]) * (ref[i] - got[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// fp32 accumulation against float64 over dtypes, GQA groups, ragged and tiny lengths.
// Tolerance: the output is rounded to the dtype, so the bound is the dtype's unit roundoff
// (fp32 1e-6 with accumulation slack, fp16 1e-3, bf16 8e-3) relative in L2.
TEST(DenseDecodeTest, MatchesFloat64) {
  std::mt19937_64 rng(7);
  const std::vector<Case> cases = {
      {DType::kFp32, 2, 8, 2, 64, {1, 300}},   {DType::kFp16, 3, 4, 4, 128, {17, 0, 1000}},
      {DType::kBf16, 1, 32, 8, 128, {2048}},   {DType::kBf16, 2, 6, 1, 256, {5, 129}},
      {DType::kFp32, 1, 1, 1, 64, {1}},
  };
  for (const Case& c : cases) {
    int32_t n_max = 0;
    for (int32_t l : c.lens) n_max = std::max(n_max, l);
    // [B, n, Hkv, d] layout, the sequence-major cache.
    const size_t kv_elems = static_cast<size_t>(c.batch) * n_max * c.kv_heads * c.dim;
    auto q = RandomRows(static_cast<size_t>(c.batch) * c.heads * c.dim, c.dtype, 1.f, rng);
    auto k = RandomRows(kv_elems, c.dtype, 1.f, rng);
    auto v = RandomRows(kv_elems, c.dtype, 1.f, rng);
    std::vector<uint8_t> out(static_cast<size_t>(c.batch) * c.heads * c.dim * DTypeSize(c.dtype));
    DecodeProblem p;
    p.batch = c.batch;
    p.num_q_heads = c.heads;
    p.num_kv_heads = c.kv_heads;
    p.head_dim = c.dim;
    p.dtype = c.dtype;
    p.q = q.data();
    p.k = k.data();
    p.v = v.data();
    p.kv_layout = {static_cast<int64_t>(n_max) * c.kv_heads * c.dim, c.dim,
                   static_cast<int64_t>(c.kv_heads) * c.dim};
    p.seq_lens = c.lens.data();
    p.scale = 1.f / std::sqrt(static_cast<float>(c.dim));
    p.out = out.data();
    ASSERT_TRUE(DenseDecodeCpu(p).ok());
    std::vector<double> ref;
    ASSERT_TRUE(DenseDecodeFloat64(p, &ref).ok());
    std::vector<double> got(ref.size());
    for (size_t i = 0; i < got.size(); ++i) got[i] = LoadAsFloat(out.data(), i, c.dtype);
    const double tol = c.dtype == DType::kFp32 ? 1e-5 : c.dtype == DType::kFp16 ? 1e-3 : 8e-3;
    EXPECT_LT(RelL2(ref, got), tol) << DTypeName(c.dtype) << " d=" << c.dim;
    // A zero-length sequence gives zeros.
    for (int32_t b = 0; b < c.batch; ++b) {
      if (c.lens[b] != 0) continue;
      for (int i = 0; i < c.heads * c.dim; ++i) {
        EXPECT_EQ(got[static_cast<size_t>(b) * c.heads * c.dim + i], 0.0);
      }
    }
  }
}

TEST(DenseDecodeTest, RejectsBadShapes) {
  DecodeProblem p;
  p.batch = 1;
  p.num_q_heads = 6;
  p.num_kv_heads = 4;  // 6 is not a multiple of 4
  p.head_dim = 64;
  p.scale = 1.f;
  EXPECT_EQ(DenseDecodeCpu(p).code(), absl::StatusCode::kInvalidArgument);
  p.num_q_heads = 8;
  EXPECT_EQ(DenseDecodeCpu(p).code(), absl::StatusCode::kInvalidArgument);  // null pointers
}

}  // namespace
}  // namespace kvsparse::kernels
