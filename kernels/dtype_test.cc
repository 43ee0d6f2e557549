#include "kernels/dtype.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "gtest/gtest.h"

namespace kvsparse::kernels {
namespace {

// Every 16-bit pattern that is not NaN survives float and back unchanged.
TEST(DTypeTest, Fp16RoundTripsEveryPattern) {
  for (uint32_t b = 0; b < 65536; ++b) {
    Fp16 h{static_cast<uint16_t>(b)};
    float f = Fp16ToFloat(h);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(Fp16ToFloat(FloatToFp16(f))));
      continue;
    }
    EXPECT_EQ(FloatToFp16(f).bits, h.bits) << "pattern " << b;
  }
}

TEST(DTypeTest, Bf16RoundTripsEveryPattern) {
  for (uint32_t b = 0; b < 65536; ++b) {
    Bf16 h{static_cast<uint16_t>(b)};
    float f = Bf16ToFloat(h);
    if (std::isnan(f)) continue;
    EXPECT_EQ(FloatToBf16(f).bits, h.bits) << "pattern " << b;
  }
}

TEST(DTypeTest, RoundsToNearestEven) {
  // 1 + 2^-11 is halfway between two fp16 values: rounds to even (1.0).
  EXPECT_EQ(Fp16ToFloat(FloatToFp16(1.0f + std::ldexp(1.0f, -11))), 1.0f);
  EXPECT_EQ(Fp16ToFloat(FloatToFp16(1.0f + 3 * std::ldexp(1.0f, -11))), 1.0f + std::ldexp(1.0f, -9));
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f + std::ldexp(1.0f, -8))), 1.0f);
  EXPECT_TRUE(std::isinf(Fp16ToFloat(FloatToFp16(1e6f))));
  EXPECT_EQ(Fp16ToFloat(FloatToFp16(65504.f)), 65504.f);
  EXPECT_EQ(Fp16ToFloat(FloatToFp16(std::ldexp(1.0f, -24))), std::ldexp(1.0f, -24));
}

}  // namespace
}  // namespace kvsparse::kernels
