#include "kernels/key_widths.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/binary_io.h"
#include "kernels/compressed_keys.h"
#include "kernels/cpu_util.h"

namespace kvsparse::kernels {
namespace {

using W = ChannelWidth;

// d = 64: channels 0, 8, ..., 56 wide, 4, 12, ..., 60 left out, the rest whole.
std::vector<W> MixedWidths(int32_t d) {
  std::vector<W> w(d, W::kWhole);
  for (int32_t c = 0; c < d; c += 8) {
    w[c] = W::kWide;
    w[c + 4] = W::kOut;
  }
  return w;
}

TEST(KeyWidthsTest, AMapStoresEveryKeptChannelOnceAndAWideOneTwice) {
  const std::vector<W> w = MixedWidths(64);
  absl::StatusOr<KeyChannelMap> m = ChannelMapOf(w);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->channel.size(), 64u);
  EXPECT_EQ(m->channel[0], 0);
  EXPECT_EQ(m->part[0], StoredPart::kHigh);
  EXPECT_EQ(m->channel[1], 0);
  EXPECT_EQ(m->part[1], StoredPart::kLow);
  EXPECT_EQ(m->channel[2], 1);
  EXPECT_EQ(m->part[2], StoredPart::kWhole);
  for (uint8_t c : m->channel) EXPECT_NE(c % 8, 4) << "a left-out channel is stored";
  // Widening without leaving as many out stores more than d channels.
  std::vector<W> over = w;
  over[4] = W::kWhole;
  EXPECT_EQ(ChannelMapOf(over).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ChannelMapOf({}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(KeyWidthsTest, TheFileRoundTripsAndABadOneIsRefused) {
  std::vector<std::vector<W>> maps(2 * 3, MixedWidths(64));
  maps[4] = std::vector<W>(64, W::kWhole);
  absl::StatusOr<KeyWidths> w = MakeKeyWidths(2, 3, 64, 2, maps);
  ASSERT_TRUE(w.ok()) << w.status();
  const std::string bytes = SerializeKeyWidths(*w);
  EXPECT_EQ(bytes.size(), 8u + 5 * 4 + 6 * 64);
  absl::StatusOr<KeyWidths> back = ParseKeyWidths(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->widths, w->widths);
  EXPECT_EQ(back->map(1, 1).channel, w->map(1, 1).channel);
  EXPECT_EQ(back->bits, 2);
  const std::string path = testing::TempDir() + "/kvsparse_key_widths.bin";
  ASSERT_TRUE(WriteWholeFile(path, bytes).ok());
  EXPECT_TRUE(ReadKeyWidths(path).ok());
  EXPECT_EQ(ReadKeyWidths(path + ".missing").status().code(), absl::StatusCode::kNotFound);
  std::string bad = bytes;
  bad[0] = 'X';
  EXPECT_EQ(ParseKeyWidths(bad).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseKeyWidths(bytes.substr(0, bytes.size() - 1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  bad = bytes;
  bad[8 + 5 * 4 + 64 + 1] = static_cast<char>(W::kWide);  // map 1 stores 65 channels
  absl::Status s = ParseKeyWidths(bad).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("layer 0 kv head 1"), std::string::npos) << s;
  EXPECT_EQ(MakeKeyWidths(2, 3, 64, 8, maps).status().code(), absl::StatusCode::kInvalidArgument);
}

// Keys [n, 64] with per-channel offsets and spreads (a few channels wide), bf16.
std::vector<Bf16> RandomRows(int64_t n, int32_t d, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> z;
  std::vector<float> offset(d), spread(d);
  for (int32_t c = 0; c < d; ++c) {
    offset[c] = 2.f * z(rng);
    spread[c] = c % 16 == 0 ? 8.f : 1.f;
  }
  std::vector<Bf16> rows(n * d);
  for (int64_t i = 0; i < n * d; ++i) rows[i] = FloatToBf16(offset[i % d] + spread[i % d] * z(rng));
  return rows;
}

CompressedKeys CompressRows(const std::vector<Bf16>& rows, int64_t n, int32_t d, int32_t bits,
                            const KeyChannelMap* map) {
  CompressedKeys c(KeyCompression{bits, 128, map}, d, DType::kBf16);
  for (int64_t t = 0; t < n; ++t) c.Append(rows.data() + t * d);
  return c;
}

// The identity map gives the uniform format's blocks bit for bit, and the same scores.
TEST(KeyWidthsTest, TheIdentityMapIsTheUniformFormat) {
  const int32_t d = 64;
  const int64_t n = 300;
  const std::vector<Bf16> rows = RandomRows(n, d, 3);
  absl::StatusOr<KeyChannelMap> id = ChannelMapOf(std::vector<W>(d, W::kWhole));
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(ValidateKeyCompression({2, 128, &*id}, d).ok());
  const CompressedKeys plain = CompressRows(rows, n, d, 2, nullptr);
  const CompressedKeys mapped = CompressRows(rows, n, d, 2, &*id);
  const CompressedKeysView a = plain.view(), b = mapped.view();
  const size_t block = KeyGroupBytes({2, 128}, d);
  for (int64_t g = 0; g < a.closed / a.group; ++g) {
    EXPECT_EQ(std::memcmp(a.groups[g], b.groups[g], block), 0) << "group " << g;
  }
  std::vector<float> q(d), sa(n), sb(n);
  std::mt19937 rng(5);
  std::normal_distribution<float> z;
  for (float& x : q) x = z(rng);
  ApproximateScores(a, q.data(), 0.125f, sa.data());
  ApproximateScores(b, q.data(), 0.125f, sb.data());
  EXPECT_EQ(sa, sb);
  for (int64_t t = 0; t < n; ++t) EXPECT_EQ(KeyErrorBound(b, t), KeyErrorBound(a, t)) << t;
}

// Channels at different widths: a wide channel quantized at twice the bits (its error at most
// half its step, a quarter of a whole channel's at 2 bits), a left-out one 0; the scores are
// q . k~ over the stored channels through the map (the tail's over the kept channels); the
// stored norm bounds |q . k - q . k~| for every token, the tail's left-out channels included;
// UpperScores bounds every exact logit. A map with 8 bits, or of the wrong size, is refused.
TEST(KeyWidthsTest, ChannelWidthsScoreThroughTheMapAndTheBoundsHold) {
  const int32_t d = 64;
  const int64_t n = 300;  // two closed groups and an open one
  const std::vector<Bf16> rows = RandomRows(n, d, 7);
  const std::vector<W> widths = MixedWidths(d);
  absl::StatusOr<KeyChannelMap> map = ChannelMapOf(widths);
  ASSERT_TRUE(map.ok());
  EXPECT_EQ(ValidateKeyCompression({8, 128, &*map}, d).code(), absl::StatusCode::kInvalidArgument);
  KeyChannelMap short_map = *map;
  short_map.channel.pop_back();
  EXPECT_EQ(ValidateKeyCompression({2, 128, &short_map}, d).code(),
            absl::StatusCode::kInvalidArgument);
  const CompressedKeys ck = CompressRows(rows, n, d, 2, &*map);
  const CompressedKeysView v = ck.view();
  ASSERT_EQ(v.closed, 256);
  // Each error relative to its channel's range over the group: about 1/60 at 4 bits (a uniform
  // error over a step of range / 15), 1/12 at 2 bits.
  double wide_err = 0, whole_err = 0;
  std::vector<float> kq(d);
  for (int64_t t = 0; t < v.closed; ++t) {
    DecompressKey(v, t, kq.data());
    const int64_t g0 = t / 128 * 128;
    for (int32_t c = 0; c < d; ++c) {
      float mn = INFINITY, mx = -INFINITY;
      for (int64_t u = g0; u < g0 + 128; ++u) {
        mn = std::min(mn, Bf16ToFloat(rows[u * d + c]));
        mx = std::max(mx, Bf16ToFloat(rows[u * d + c]));
      }
      const double e = std::fabs(Bf16ToFloat(rows[t * d + c]) - kq[c]) / (mx - mn);
      if (widths[c] == W::kOut) {
        EXPECT_EQ(kq[c], 0.f) << "a left-out channel";
      } else {
        (widths[c] == W::kWide ? wide_err : whole_err) += e;
      }
    }
  }
  wide_err /= 8.0 * v.closed;
  whole_err /= 48.0 * v.closed;
  EXPECT_LT(wide_err, 0.3 * whole_err) << "4 bits against 2 (a fifth of the step)";
  std::mt19937 rng(11);
  std::normal_distribution<float> z;
  std::vector<float> q(d), approx(n);
  std::vector<double> upper(n);
  for (int trial = 0; trial < 20; ++trial) {
    for (float& x : q) x = z(rng);
    const float scale = 0.125f;
    ApproximateScores(v, q.data(), scale, approx.data());
    UpperScores(v, q.data(), scale, approx.data(), upper.data());
    double qn = 0;
    for (float x : q) qn += static_cast<double>(x) * x;
    qn = std::sqrt(qn);
    for (int64_t t = 0; t < n; ++t) {
      double exact = 0, want = 0;
      if (t < v.closed) DecompressKey(v, t, kq.data());
      for (int32_t c = 0; c < d; ++c) {
        const double k = Bf16ToFloat(rows[t * d + c]);
        exact += static_cast<double>(q[c]) * k;
        // The closed tokens' dequantized keys; the tail's exact rows with left-out channels 0.
        want +=
            static_cast<double>(q[c]) * (t < v.closed ? kq[c] : (widths[c] == W::kOut ? 0.0 : k));
      }
      EXPECT_NEAR(approx[t], scale * want, 1e-3 * (1 + std::fabs(scale * want))) << t;
      EXPECT_LE(std::fabs(exact - want), qn * KeyErrorBound(v, t) * (1 + 1e-6) + 1e-5) << t;
      EXPECT_GE(upper[t], scale * exact) << "token " << t;
    }
  }
}

}  // namespace
}  // namespace kvsparse::kernels
