// Philox4x32-10 counter-based random numbers, shared verbatim by the CPU references and the CUDA
// kernels (every function is KVSPARSE_HD), plus the *stream mapping* that turns
// (seed, sequence, head, purpose, draw index) into a Philox key and counter. Every random draw
// of every method in kernels/ goes through this file, so a GPU kernel that evaluates the same
// draws gets bit-identical random numbers and hence the same sampled indices.
//
// Generator: Philox4x32 with 10 rounds (Salmon et al., "Parallel random numbers: as easy as
// 1, 2, 3", SC'11), exactly as Random123's philox4x32_R(10, ctr, key): multipliers
// 0xD2511F53 / 0xCD9E8D57, Weyl key increments 0x9E3779B9 / 0xBB67AE85. Checked against the
// Random123 known-answer vectors in philox_test.cc.
//
// ---------------------------------------------------------------------------------------------
// Stream mapping (the contract with kernels/cuda/)
// ---------------------------------------------------------------------------------------------
//   key     = { lo32(seed), hi32(seed) }                      seed: the request's uint64 seed
//   counter = { block, lane, sequence, (tag << 16) | head }
// where
//   tag       purpose of the draws (RngTag below, 16 bits); distinct purposes never share a
//             counter, so e.g. the base sample and the final sample of vAttention are
//             independent.
//   head      query head h in [0, H) for per-query-head draws, or kv head in [0, Hkv) for draws
//             shared by a GQA group (the tag says which); < 65536.
//   sequence  batch row b of the decode problem (for SimHash planes: the layer index).
//   lane      a second index for 2-D streams (Bernoulli qK^T feature, SimHash bit); 0 otherwise.
//   block     the Philox block index, derived from the draw index i as below.
// Two ways to read a stream, each purpose uses exactly one of them:
//   Draw32(i): 32-bit word (i & 3) of block (i >> 2); i < 2^34.
//   Draw64(i): block i, (uint64(word0) << 32) | word1;       i < 2^32.
// Uniforms:
//   Uniform(i)   = float((Draw32(i) >> 8) * 2^-24), in [0, 1 - 2^-24]: the top 24 bits, exact in
//                  fp32 (no rounding anywhere), so CPU and GPU agree bit for bit.
// Per purpose (S = samples, t = tile, m = stratum, n = token, j = bit, c = coordinate):
//   kSantaIid         head h   Uniform(s), s in [0, S): the s-th i.i.d. draw.
//   kSantaStratified  head h   Uniform(m), m in [0, S): offset inside stratum m.
//   kSantaSystematic  head h   Uniform(0): the single offset U * (1/S).
//   kPropTileOffset   head h   Uniform(t): a0_{h,t} of Algorithm 4 (prop), tile t.
//   kFlashTileOffset  head h   Uniform(t): a0_{h,t} of Algorithm 7 (flash), tile t.
//   kVattBase         head h   Draw64(n): priority key of token n for the base sample.
//   kVattDynamic      head h   Draw64(n): priority key of token n for the final sample.
//   kVattImportanceBase    head h   Draw64(j): j-th i.i.d. draw of vAttention's importance base
//                     sample, u = (Draw64(j) >> 11) * 2^-53 into the proposal's cumulative sums.
//   kVattImportanceDynamic head h   Draw64(j): the same for the final sample.
//   kBernoulliHead    head h   lane = feature i, Uniform(r), r in [0, B): r-th Bernoulli draw.
//   kBernoulliGroup   kv head  lane = feature i, Uniform(r): mean-group-query draws.
//   kSimHashPlane     key = signature seed, sequence = layer, head = signature head,
//                     lane = bit j, GaussianPair(p) gives coordinates 2p and 2p+1 of plane j.
//   kSequenceSeed     sequence = index i of a sequence in a multi-sequence call, head 0:
//                     Draw64(0) is the seed of that sequence's batch-1 problem (SequenceSeed).
// ---------------------------------------------------------------------------------------------
#ifndef KVSPARSE_KERNELS_PHILOX_H_
#define KVSPARSE_KERNELS_PHILOX_H_

#include <math.h>

#include <cstdint>

#include "kernels/dtype.h"  // KVSPARSE_HD

namespace kvsparse::kernels {

struct Philox4x32 {
  uint32_t v[4];
};

namespace philox_internal {
constexpr uint32_t kM0 = 0xD2511F53u;
constexpr uint32_t kM1 = 0xCD9E8D57u;
constexpr uint32_t kW0 = 0x9E3779B9u;
constexpr uint32_t kW1 = 0xBB67AE85u;

KVSPARSE_HD void MulHiLo(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  const uint64_t p = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  *hi = static_cast<uint32_t>(p >> 32);
  *lo = static_cast<uint32_t>(p);
}

KVSPARSE_HD Philox4x32 Round(Philox4x32 c, uint32_t k0, uint32_t k1) {
  uint32_t hi0, lo0, hi1, lo1;
  MulHiLo(kM0, c.v[0], &hi0, &lo0);
  MulHiLo(kM1, c.v[2], &hi1, &lo1);
  return Philox4x32{{hi1 ^ c.v[1] ^ k0, lo1, hi0 ^ c.v[3] ^ k1, lo0}};
}
}  // namespace philox_internal

// Philox4x32-10: the block function itself (Random123 philox4x32_R(10, ...)).
// Written out round by round (a loop is not unrolled at -O2 and runs ~4x slower on the host).
KVSPARSE_HD Philox4x32 Philox4x32_10(Philox4x32 counter, uint32_t key0, uint32_t key1) {
  using philox_internal::kW0;
  using philox_internal::kW1;
  using philox_internal::Round;
  Philox4x32 c = Round(counter, key0, key1);
  c = Round(c, key0 + 1 * kW0, key1 + 1 * kW1);
  c = Round(c, key0 + 2 * kW0, key1 + 2 * kW1);
  c = Round(c, key0 + 3 * kW0, key1 + 3 * kW1);
  c = Round(c, key0 + 4 * kW0, key1 + 4 * kW1);
  c = Round(c, key0 + 5 * kW0, key1 + 5 * kW1);
  c = Round(c, key0 + 6 * kW0, key1 + 6 * kW1);
  c = Round(c, key0 + 7 * kW0, key1 + 7 * kW1);
  c = Round(c, key0 + 8 * kW0, key1 + 8 * kW1);
  return Round(c, key0 + 9 * kW0, key1 + 9 * kW1);
}

// Purpose tags (the `tag` field of the counter). Values are part of the contract: never reuse or
// renumber; append new ones.
enum class RngTag : uint16_t {
  kSantaIid = 1,
  kSantaStratified = 2,
  kSantaSystematic = 3,
  kPropTileOffset = 4,
  kFlashTileOffset = 5,
  kVattBase = 6,
  kVattDynamic = 7,
  kBernoulliHead = 8,
  kBernoulliGroup = 9,
  kSimHashPlane = 10,
  kSequenceSeed = 11,
  kPropRounding = 12,           // S2ANTA-prop: the offset of the tile budgets' systematic rounding
  kVattImportanceBase = 13,     // vAttention, importance sampler: base sample draws
  kVattImportanceDynamic = 14,  // vAttention, importance sampler: final sample draws
};

// 2^-24 and 2^-53 as exact constants.
constexpr float kTwoPowMinus24 = 5.9604644775390625e-08f;
constexpr double kTwoPowMinus53 = 1.1102230246251565404236316680908203125e-16;

// The top 24 bits of x as a float in [0, 1 - 2^-24]: (x >> 8) * 2^-24, exact.
KVSPARSE_HD float U32ToUniformFloat(uint32_t x) {
  return static_cast<float>(x >> 8) * kTwoPowMinus24;
}

// One stream: fixed key and counter words 1..3; the draw index selects the block and word.
struct PhiloxStream {
  uint32_t key0 = 0;
  uint32_t key1 = 0;
  uint32_t lane = 0;
  uint32_t sequence = 0;
  uint32_t tag_head = 0;  // (tag << 16) | head

  KVSPARSE_HD static PhiloxStream Make(uint64_t seed, RngTag tag, uint32_t sequence, uint32_t head,
                                       uint32_t lane = 0) {
    PhiloxStream s;
    s.key0 = static_cast<uint32_t>(seed);
    s.key1 = static_cast<uint32_t>(seed >> 32);
    s.lane = lane;
    s.sequence = sequence;
    s.tag_head = (static_cast<uint32_t>(tag) << 16) | (head & 0xffffu);
    return s;
  }

  // The same stream with another lane.
  KVSPARSE_HD PhiloxStream WithLane(uint32_t new_lane) const {
    PhiloxStream s = *this;
    s.lane = new_lane;
    return s;
  }

  KVSPARSE_HD Philox4x32 Block(uint32_t block) const {
    return Philox4x32_10(Philox4x32{{block, lane, sequence, tag_head}}, key0, key1);
  }

  // Word (i & 3) of block (i >> 2).
  KVSPARSE_HD uint32_t Draw32(uint64_t i) const {
    const Philox4x32 r = Block(static_cast<uint32_t>(i >> 2));
    return r.v[i & 3];
  }

  // (word0 << 32) | word1 of block i.
  KVSPARSE_HD uint64_t Draw64(uint32_t i) const {
    const Philox4x32 r = Block(i);
    return (static_cast<uint64_t>(r.v[0]) << 32) | r.v[1];
  }

  // (Draw32(i) >> 8) * 2^-24, in [0, 1 - 2^-24].
  KVSPARSE_HD float Uniform(uint64_t i) const { return U32ToUniformFloat(Draw32(i)); }
};

// Two independent standard normals from block p of a stream (Box-Muller in float64, rounded to
// float):
//   k1 = (w0 << 21) | (w1 >> 11)  (53 bits),  u1 = (k1 + 1) * 2^-53  in (0, 1]
//   k2 = (w2 << 21) | (w3 >> 11)  (53 bits),  u2 = k2 * 2^-53        in [0, 1)
//   r = sqrt(-2 log u1);  z0 = float(r * cos(2 pi u2));  z1 = float(r * sin(2 pi u2)).
// The uniforms are exact; log/sin/cos are not correctly rounded on every platform, but their
// float64 results differ by at most an ulp or two, which changes the rounded float only when it
// lies within ~2^-29 relative of a rounding boundary. A GPU that regenerates SimHash planes
// therefore agrees with the CPU except with probability ~1e-8 per coordinate; uploading the
// CPU-generated planes (MakeSimHashPlanes) is exact.
KVSPARSE_HD void GaussianPair(const PhiloxStream& s, uint32_t p, float* z0, float* z1) {
  const Philox4x32 r = s.Block(p);
  const uint64_t k1 = (static_cast<uint64_t>(r.v[0]) << 21) | (r.v[1] >> 11);
  const uint64_t k2 = (static_cast<uint64_t>(r.v[2]) << 21) | (r.v[3] >> 11);
  const double u1 = static_cast<double>(k1 + 1) * kTwoPowMinus53;
  const double u2 = static_cast<double>(k2) * kTwoPowMinus53;
  const double rad = ::sqrt(-2.0 * ::log(u1));
  const double ang = 6.283185307179586476925286766559 * u2;
  *z0 = static_cast<float>(rad * ::cos(ang));
  *z1 = static_cast<float>(rad * ::sin(ang));
}

// The seed of the i-th sequence of a call that runs each sequence as its own batch-1 problem
// (the decode worker does): Draw64(0) of stream (seed, kSequenceSeed, sequence = i, head 0).
// Distinct sequences of one call get independent streams; any backend derives the same seeds.
KVSPARSE_HD uint64_t SequenceSeed(uint64_t seed, uint32_t i) {
  return PhiloxStream::Make(seed, RngTag::kSequenceSeed, i, 0).Draw64(0);
}

}  // namespace kvsparse::kernels

#endif  // KVSPARSE_KERNELS_PHILOX_H_
