// Element types of K, V and q rows, and scalar conversions usable on host and device.
// Layer: kernels (no gRPC, no store). Everything here is header-only and allocation-free.
#ifndef KVSPARSE_KERNELS_DTYPE_H_
#define KVSPARSE_KERNELS_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>

#if defined(__CUDACC__)
#define KVSPARSE_HD __host__ __device__ __forceinline__
#else
#define KVSPARSE_HD inline
#endif

namespace kvsparse::kernels {

enum class DType : uint8_t {
  kFp32 = 0,
  kFp16 = 1,  // IEEE 754 binary16
  kBf16 = 2,  // bfloat16
};

// Bytes per element.
constexpr size_t DTypeSize(DType t) { return t == DType::kFp32 ? 4 : 2; }

constexpr const char* DTypeName(DType t) {
  switch (t) {
    case DType::kFp32:
      return "fp32";
    case DType::kFp16:
      return "fp16";
    case DType::kBf16:
      return "bf16";
  }
  return "?";
}

// The DType DTypeName spells `name` (bf16, fp16, fp32); false for any other name. Host only.
inline bool DTypeFromName(const char* name, DType* out) {
  for (DType d : {DType::kBf16, DType::kFp16, DType::kFp32}) {
    if (std::strcmp(name, DTypeName(d)) == 0) {
      *out = d;
      return true;
    }
  }
  return false;
}

// Raw 16-bit storage types. Distinct structs so overloads and templates can tell them apart;
// layout-compatible with __half / __nv_bfloat16.
struct Bf16 {
  uint16_t bits;
};
struct Fp16 {
  uint16_t bits;
};

KVSPARSE_HD float Bf16ToFloat(Bf16 h) {
  uint32_t u = static_cast<uint32_t>(h.bits) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even; NaN stays NaN (quiet).
KVSPARSE_HD Bf16 FloatToBf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return Bf16{static_cast<uint16_t>((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return Bf16{static_cast<uint16_t>(u >> 16)};
}

KVSPARSE_HD float Fp16ToFloat(Fp16 h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  const uint32_t exp = (h.bits >> 10) & 0x1fu;
  uint32_t mant = h.bits & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      u = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (mant & 0x3ffu) << 13;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | mant << 13;
  } else {
    u = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, overflow to infinity, NaN stays NaN.
KVSPARSE_HD Fp16 FloatToFp16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return Fp16{static_cast<uint16_t>(sign | 0x7e00u)};
  if (abs >= 0x477ff000u) return Fp16{static_cast<uint16_t>(sign | 0x7c00u)};  // >= 65520
  if (abs < 0x38800000u) {                     // below 2^-14: subnormal or zero
    if (abs < 0x33000000u) return Fp16{sign};  // < 2^-25 rounds to 0
    const uint32_t e = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14..24
    uint32_t half = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return Fp16{static_cast<uint16_t>(sign | half)};
  }
  uint32_t half = ((abs >> 13) - (112u << 10));
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) ++half;
  return Fp16{static_cast<uint16_t>(sign | half)};
}

KVSPARSE_HD float ToFloat(float x) { return x; }
KVSPARSE_HD float ToFloat(Bf16 x) { return Bf16ToFloat(x); }
KVSPARSE_HD float ToFloat(Fp16 x) { return Fp16ToFloat(x); }

template <typename T>
KVSPARSE_HD T FromFloat(float x);
template <>
KVSPARSE_HD float FromFloat<float>(float x) {
  return x;
}
template <>
KVSPARSE_HD Bf16 FromFloat<Bf16>(float x) {
  return FloatToBf16(x);
}
template <>
KVSPARSE_HD Fp16 FromFloat<Fp16>(float x) {
  return FloatToFp16(x);
}

// Reads element i of a row of dtype t as float (host-side convenience for references/tests).
inline float LoadAsFloat(const void* row, size_t i, DType t) {
  switch (t) {
    case DType::kFp32:
      return static_cast<const float*>(row)[i];
    case DType::kFp16:
      return Fp16ToFloat(static_cast<const Fp16*>(row)[i]);
    case DType::kBf16:
      return Bf16ToFloat(static_cast<const Bf16*>(row)[i]);
  }
  return 0.f;
}

inline void StoreFromFloat(void* row, size_t i, DType t, float x) {
  switch (t) {
    case DType::kFp32:
      static_cast<float*>(row)[i] = x;
      break;
    case DType::kFp16:
      static_cast<Fp16*>(row)[i] = FloatToFp16(x);
      break;
    case DType::kBf16:
      static_cast<Bf16*>(row)[i] = FloatToBf16(x);
      break;
  }
}

// x rounded to dtype t and back (x itself for fp32).
inline float RoundToDType(float x, DType t) {
  switch (t) {
    case DType::kFp32:
      return x;
    case DType::kFp16:
      return Fp16ToFloat(FloatToFp16(x));
    case DType::kBf16:
      return Bf16ToFloat(FloatToBf16(x));
  }
  return x;
}

// n elements of dtype `from` at src to dtype `to` at dst, through fp32 (a copy when the two
// agree). Host-side.
inline void ConvertElements(const void* src, DType from, void* dst, DType to, size_t n) {
  if (from == to) {
    std::memcpy(dst, src, n * DTypeSize(from));
    return;
  }
  for (size_t i = 0; i < n; ++i) StoreFromFloat(dst, i, to, LoadAsFloat(src, i, from));
}

// The values kvsparse accepts in q, K and V: finite, of magnitude below 2^32 (every attention
// score of such values, scale * sum_d q k over head dims up to 1024, stays far inside fp32's range:
// |s| < 2^74, so softmax, sampling and estimates never meet an infinity or a NaN).
// Whether all n elements at `data` are such values. Host-side, eight bytes at a time (SWAR): in
// each 16- or 32-bit lane, (x & ~sign) + (2^(w-1) - limit) sets the lane's top bit exactly when
// |x|'s bits reach `limit` (a float's magnitude orders as its bits; no carry leaves a lane), so
// one OR over the words decides. Loads go through memcpy: `data` may be any byte address.
inline bool AcceptedValues(const void* data, size_t n, DType t) {
  const unsigned char* b = static_cast<const unsigned char*>(data);
  const size_t es = DTypeSize(t);
  // fp32 and bf16: 2^32 and above, +-inf and NaN; fp16: every finite value is below 65504, so
  // only +-inf and NaN (exponent all ones).
  const uint32_t limit = t == DType::kFp32 ? 0x4F800000u : t == DType::kFp16 ? 0x7C00u : 0x4F80u;
  const uint64_t top = es == 4 ? 0x8000000080000000ull : 0x8000800080008000ull;
  const uint64_t add = es == 4 ? (0x80000000ull - limit) * 0x0000000100000001ull
                               : (0x8000ull - limit) * 0x0001000100010001ull;
  const size_t words = n * es / 8;
  uint64_t any = 0;
  for (size_t w = 0; w < words; ++w) {
    uint64_t x;
    std::memcpy(&x, b + 8 * w, 8);
    any |= (x & ~top) + add;
  }
  for (size_t i = words * 8 / es; i < n; ++i) {
    uint32_t x = 0;
    std::memcpy(&x, b + es * i, es);
    if ((x & (es == 4 ? 0x7FFFFFFFu : 0x7FFFu)) >= limit) return false;
  }
  return (any & top) == 0;
}

// Byte i of a buffer of elements (any dtype) made part of an accepted value: odd bytes hold every
// 2- and 4-byte little-endian element's top byte, and without its bit 6 the exponent stays small.
// For tests and benchmarks that fill K and V rows with arbitrary bytes.
inline uint8_t AcceptedByte(uint8_t byte, size_t i) {
  return i % 2 == 1 ? static_cast<uint8_t>(byte & 0xBF) : byte;
}

// The index of the first of n elements at `data` that is not an accepted value, or -1.
inline int64_t FirstUnacceptedValue(const void* data, size_t n, DType t) {
  if (AcceptedValues(data, n, t)) return -1;
  const size_t es = DTypeSize(t);
  for (size_t i = 0; i < n; ++i) {
    if (!AcceptedValues(static_cast<const unsigned char*>(data) + es * i, 1, t)) {
      return static_cast<int64_t>(i);
    }
  }
  return -1;
}

}  // namespace kvsparse::kernels

#endif  // KVSPARSE_KERNELS_DTYPE_H_
