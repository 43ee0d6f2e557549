#include "kernels/philox.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace kvsparse::kernels {
namespace {

struct Kat {
  uint32_t ctr[4];
  uint32_t key[2];
  uint32_t expected[4];
};

// Random123 kat_vectors, philox4x32 with 10 rounds.
TEST(PhiloxTest, MatchesRandom123KnownAnswers) {
  const Kat kats[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
      {{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
       {0xffffffffu, 0xffffffffu},
       {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
      {{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
       {0xa4093822u, 0x299f31d0u},
       {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
  };
  for (const Kat& k : kats) {
    const Philox4x32 r =
        Philox4x32_10(Philox4x32{{k.ctr[0], k.ctr[1], k.ctr[2], k.ctr[3]}}, k.key[0], k.key[1]);
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(r.v[i], k.expected[i]) << std::hex << "word " << i << " ctr " << k.ctr[0];
    }
  }
}

// The stream mapping is exactly key = seed halves, counter = {block, lane, sequence, tag|head}.
TEST(PhiloxTest, StreamMappingIsTheDocumentedCounter) {
  const uint64_t seed = 0x0123456789abcdefull;
  const PhiloxStream s = PhiloxStream::Make(seed, RngTag::kPropTileOffset, /*sequence=*/3,
                                            /*head=*/17, /*lane=*/5);
  const uint64_t i = 4 * 1000 + 2;  // block 1000, word 2
  const Philox4x32 direct =
      Philox4x32_10(Philox4x32{{1000u, 5u, 3u, (4u << 16) | 17u}}, 0x89abcdefu, 0x01234567u);
  EXPECT_EQ(s.Draw32(i), direct.v[2]);
  EXPECT_EQ(s.Uniform(i), static_cast<float>(direct.v[2] >> 8) * std::ldexp(1.0f, -24));
  const Philox4x32 b7 =
      Philox4x32_10(Philox4x32{{7u, 5u, 3u, (4u << 16) | 17u}}, 0x89abcdefu, 0x01234567u);
  EXPECT_EQ(s.Draw64(7), (static_cast<uint64_t>(b7.v[0]) << 32) | b7.v[1]);
}

TEST(PhiloxTest, UniformRangeIsExact) {
  EXPECT_EQ(U32ToUniformFloat(0u), 0.0f);
  EXPECT_EQ(U32ToUniformFloat(0xffffffffu), 1.0f - std::ldexp(1.0f, -24));
  EXPECT_LT(U32ToUniformFloat(0xffffffffu), 1.0f);
  EXPECT_EQ(U32ToUniformFloat(0x80000000u), 0.5f);
}

// Different tags, heads, sequences or lanes give different streams; moments are right.
TEST(PhiloxTest, StreamsAreDistinctAndUniform) {
  const PhiloxStream a = PhiloxStream::Make(42, RngTag::kSantaIid, 0, 0);
  const PhiloxStream variants[] = {
      PhiloxStream::Make(42, RngTag::kSantaStratified, 0, 0),
      PhiloxStream::Make(42, RngTag::kSantaIid, 1, 0),
      PhiloxStream::Make(42, RngTag::kSantaIid, 0, 1),
      PhiloxStream::Make(42, RngTag::kSantaIid, 0, 0, 1),
      PhiloxStream::Make(43, RngTag::kSantaIid, 0, 0),
  };
  for (const PhiloxStream& v : variants) {
    int same = 0;
    for (uint64_t i = 0; i < 64; ++i) same += a.Draw32(i) == v.Draw32(i);
    EXPECT_EQ(same, 0);
  }
  // 2^16 uniforms: mean 1/2 and variance 1/12 within 5 standard errors; 16-bin chi-square.
  const int n = 1 << 16;
  double sum = 0, sum2 = 0;
  std::vector<int> bins(16, 0);
  for (int i = 0; i < n; ++i) {
    const double u = a.Uniform(i);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    sum += u;
    sum2 += u * u;
    ++bins[static_cast<int>(u * 16)];
  }
  const double mean = sum / n;
  EXPECT_NEAR(mean, 0.5, 5 * std::sqrt(1.0 / 12 / n));
  EXPECT_NEAR(sum2 / n - mean * mean, 1.0 / 12, 5 * std::sqrt(1.0 / 180 / n));
  double chi2 = 0;
  for (int c : bins) chi2 += (c - n / 16.0) * (c - n / 16.0) / (n / 16.0);
  EXPECT_LT(chi2, 45.0);  // 15 degrees of freedom: P(chi2 > 45) ~ 7e-5
}

TEST(PhiloxTest, GaussianPairMoments) {
  const PhiloxStream s = PhiloxStream::Make(7, RngTag::kSimHashPlane, 0, 0);
  const int pairs = 1 << 15;
  double sum = 0, sum2 = 0, sum4 = 0;
  for (int p = 0; p < pairs; ++p) {
    float z[2];
    GaussianPair(s, p, &z[0], &z[1]);
    for (float x : z) {
      ASSERT_TRUE(std::isfinite(x));
      sum += x;
      sum2 += double{x} * x;
      sum4 += double{x} * x * x * x;
    }
  }
  const int n = 2 * pairs;
  EXPECT_NEAR(sum / n, 0.0, 5 / std::sqrt(n));
  EXPECT_NEAR(sum2 / n, 1.0, 5 * std::sqrt(2.0 / n));
  EXPECT_NEAR(sum4 / n, 3.0, 5 * std::sqrt(96.0 / n));
}

}  // namespace
}  // namespace kvsparse::kernels
