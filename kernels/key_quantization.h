// The arithmetic of one compressed-key group (kernels/compressed_keys.h, "Format"), written once
// for the host and the device: the CPU reference's CompressKeyGroup and the GPU's step append
// (kernels/cuda/compressed_keys.h, AppendCompressedKeyStep) both call these, so a group closed
// on either holds the same bits. Every operation rounds once: on the device the products and
// sums are the explicit round-to-nearest intrinsics, so no multiply-add is fused where the host
// rounds twice. Header-only, allocation-free (KVSPARSE_HD).
#ifndef KVSPARSE_KERNELS_KEY_QUANTIZATION_H_
#define KVSPARSE_KERNELS_KEY_QUANTIZATION_H_

#include <cmath>
#include <cstdint>

#include "kernels/dtype.h"

namespace kvsparse::kernels::keyq {

KVSPARSE_HD float Half(uint16_t bits) { return Fp16ToFloat(Fp16{bits}); }

// fp16 nearest to x, saturated to the finite range (NaN stays NaN).
KVSPARSE_HD uint16_t HalfNearest(float x) {
  constexpr float kMax = 65504.f;
  const float c = x < -kMax ? -kMax : (kMax < x ? kMax : x);
  return FloatToFp16(c).bits;
}

// The smallest fp16 >= x (x >= 0), saturated to the largest finite one.
KVSPARSE_HD uint16_t HalfUp(float x) {
  uint16_t h = HalfNearest(x);
  if (Half(h) < x && h < 0x7bffu) ++h;  // positive fp16 values order as their bits
  return h;
}

// An fp16 upper bound of x >= 0: the smallest fp16 >= x, or +inf past the finite range.
KVSPARSE_HD uint16_t HalfBound(double x) {
#if defined(__CUDA_ARCH__)
  const float f = nextafterf(__double2float_rn(x), INFINITY);
#else
  const float f = std::nextafter(static_cast<float>(x), INFINITY);
#endif
  if (!(f <= 65504.f)) return 0x7c00u;
  return HalfUp(f);
}

KVSPARSE_HD float Sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
KVSPARSE_HD float Div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// A channel's fp16 offset and step from its range over the group: lo = fp16(min) rounded to
// nearest, step = fp16 rounded up of (max - lo) / levels (never below 0).
struct ChannelScale {
  uint16_t lo16 = 0, step16 = 0;
};
KVSPARSE_HD ChannelScale ScaleOf(float mn, float mx, uint32_t levels) {
  ChannelScale s;
  s.lo16 = HalfNearest(mn);
  const float span = Div(Sub(mx, Half(s.lo16)), static_cast<float>(levels));
  s.step16 = HalfUp(span > 0.f ? span : 0.f);
  return s;
}

// A value's code: round((x - lo) / step) (halves to even), clamped to [0, levels]; 0 if step 0.
KVSPARSE_HD uint32_t CodeOf(float x, float lo, float step, uint32_t levels) {
  if (!(step > 0.f)) return 0;
#if defined(__CUDA_ARCH__)
  const float r = rintf(__fdiv_rn(__fsub_rn(x, lo), step));
#else
  const float r = std::nearbyint((x - lo) / step);
#endif
  const float top = static_cast<float>(levels);
  const float c = r < 0.f ? 0.f : (top < r ? top : r);
  return static_cast<uint32_t>(c);
}

// The squared error the code leaves, (x - (lo + step * code))^2 in double, added to err2.
KVSPARSE_HD double AddSquaredError(double err2, float x, float lo, float step, uint32_t code) {
#if defined(__CUDA_ARCH__)
  const float k = __fadd_rn(lo, __fmul_rn(step, static_cast<float>(code)));
  const double e = __dsub_rn(static_cast<double>(x), static_cast<double>(k));
  return __dadd_rn(err2, __dmul_rn(e, e));
#else
  const float k = lo + step * static_cast<float>(code);
  const double e = static_cast<double>(x) - static_cast<double>(k);
  return err2 + e * e;
#endif
}

KVSPARSE_HD double Sqrt(double x) {
#if defined(__CUDA_ARCH__)
  return __dsqrt_rn(x);
#else
  return std::sqrt(x);
#endif
}

// Offsets of a closed group's parts in its block (kernels/compressed_keys.h's layout):
// codes [group, words] u32 | lo [d] fp16 | step [d] fp16 | err [group] fp16.
struct GroupLayout {
  int64_t lo = 0, step = 0, err = 0;
};
KVSPARSE_HD GroupLayout LayoutOf(int32_t group, int32_t head_dim, int32_t bits) {
  GroupLayout g;
  g.lo = static_cast<int64_t>(group) * (head_dim * bits / 32) * 4;
  g.step = g.lo + 2 * static_cast<int64_t>(head_dim);
  g.err = g.step + 2 * static_cast<int64_t>(head_dim);
  return g;
}

}  // namespace kvsparse::kernels::keyq

#endif  // KVSPARSE_KERNELS_KEY_QUANTIZATION_H_
