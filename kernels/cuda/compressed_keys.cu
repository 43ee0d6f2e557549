#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/compressed_keys.h"
#include "kernels/key_quantization.h"

namespace kvsparse::kernels::cuda {
namespace {

__device__ __forceinline__ float Half(uint16_t bits) {
  return __half2float(__ushort_as_half(bits));
}

// A warp per (group or the open group, kv head, sequence), up to kGroupsPerBlock of a kv head's
// groups to a block (they share the query; fewer where the shared memory would not fit). The
// open group's tokens are scored from their exact rows by the reference's arithmetic (single
// roundings, each sum in channel order): ScoreOpenGroup, shared by both kernels below.
//
// Closed groups of 1- and 2-bit keys (CompressedScoresMmaKernel) on the tensor cores: with
// w_c = q_c * step_c (the reference's product), q . k~_t - base = sum_c w_c code_tc is a
// [group x d] by [d x G] product whose left operand, the codes, is a small integer. Each head's
// w is scaled by 2^-e (e from frexp of max_c |w_c|) and written as three base-128 int8 digits,
// 64 w 2^-e = W1 + W2 / 128 + W3 / 128^2 + r (|W| <= 64, |r| <= 2^-15), so int8 mma.m16n8k32
// takes 16 tokens x 32 channels against the heads' digit columns with exact int32 sums, and the
// codes go to the A fragments without a conversion: (word >> shift) & 0x03030303 (0x01010101 for
// one bit) puts four channels' codes in the four bytes of a register, the MMA's k-slots ordered
// to match (ChannelOf). The base sum_c q_c lo_c is a butterfly over the lanes. A score
// differs from the reference's channel-order fp32 sums by rounding only (compressed_keys.h
// states the bound). The group's lo, step and codes are staged in shared memory first (one
// round trip of cp.async), its digits written once per group in the B fragments' order.
//
// Closed groups of 4- and 8-bit keys (CompressedScoresKernel): each lane scores kTokensPerLane
// tokens for every query head of the GQA group side by side, by the reference's arithmetic term
// by term (bit for bit its scores): bound by the instruction issue of those sums.
constexpr int kGroupsPerBlock = 4;
constexpr int kTokensPerLane = 4;

template <int G>
__device__ __forceinline__ void LoadHeads(const float* p, float (&v)[G]) {
  if constexpr (G % 4 == 0) {
#pragma unroll
    for (int h = 0; h < G; h += 4) {
      const float4 x = *reinterpret_cast<const float4*>(p + h);
      v[h] = x.x;
      v[h + 1] = x.y;
      v[h + 2] = x.z;
      v[h + 3] = x.w;
    }
  } else if constexpr (G == 2) {
    const float2 x = *reinterpret_cast<const float2*>(p);
    v[0] = x.x;
    v[1] = x.y;
  } else {
#pragma unroll
    for (int h = 0; h < G; ++h) v[h] = p[h];
  }
}

// Shared memory of CompressedScoresKernel for G heads of head_dim d and `warps` warps a block, in
// floats: qf [d][G], then per warp qs [d][G] and base [8] (8: what follows stays 16-byte
// aligned).
__host__ __device__ constexpr int64_t ScoreSmemFloats(int64_t G, int64_t d, int64_t warps) {
  return G * d + warps * (G * d + 8);
}
// The tensor-core kernel's n-tiles (per four heads: digits 1 and 2 of each head in one tile,
// digit 3 in the next) and shared memory: qf [d][G], then per warp a header (base [8], exponent
// [8]), the B fragments [d / 32][n-tiles][32 lanes] of two 32-bit registers, the group's lo and
// step (2 d fp16) and kStageWords words of its codes (a chunk of its tokens, all of them for
// d * bits <= 256).
constexpr int64_t kStageWords = 1024;
__host__ __device__ constexpr int MmaNTiles(int64_t G) { return 2 * static_cast<int>((G + 3) / 4); }
__host__ __device__ constexpr int64_t MmaWarpFloats(int64_t G, int64_t d) {
  return 16 + d / 32 * MmaNTiles(G) * 64 + d + kStageWords;
}
__host__ __device__ constexpr int64_t MmaSmemFloats(int64_t G, int64_t d, int64_t warps) {
  return G * d + warps * MmaWarpFloats(G, d);
}
constexpr int64_t kScoreSmemBytes = 48 * 1024;  // what a block takes without opting in

// The code as a float without a conversion instruction: 2^23 + code, less 2^23 (exact).
__device__ __forceinline__ float CodeAsFloat(uint32_t code) {
  return __fsub_rn(__uint_as_float(0x4B000000u | code), 8388608.f);
}

// The block's queries as floats, channel-major with the group's heads side by side ([d][G]: one
// vector load gives a channel's G values), and where the (b, j)'s scores go. With a channel map,
// stored channel v's entry is q[channel[v]] (kernels/key_widths.h): what the closed groups'
// codes are scored against.
template <typename T, int G>
__device__ __forceinline__ float* LoadGroupQueries(const CompressedScoreParams& p, float* qf) {
  const int32_t d = p.head_dim, b = blockIdx.z, h0 = blockIdx.y * G;
  const void* q = static_cast<const char*>(p.q) +
                  (static_cast<int64_t>(b) * p.num_q_heads + h0) * d * sizeof(T);
  const uint8_t* channel =
      p.map_channel == nullptr ? nullptr : p.map_channel + static_cast<int64_t>(blockIdx.y) * d;
  for (int32_t x = threadIdx.x; x < G * d; x += blockDim.x) {
    const int32_t v = x % d, h = x / d;  // q is [G][d]
    qf[v * G + h] = LoadElem<T>(q, h * d + (channel == nullptr ? v : channel[v]));
  }
  return p.scores + (static_cast<int64_t>(b) * p.num_q_heads + h0) * p.score_stride;
}

// The open group's tokens [closed_groups * group, n) from their exact rows, a lane a token. With
// a channel map (MAPPED), over the stored channels in order, each model channel the map keeps
// once (a widened channel at its high part; qf holds q through the map): ApproximateScores's
// sums; the map is read four channels a load (the launcher checks its tables are 4-byte aligned;
// d is a multiple of 4), so a row's loads do not each wait on a load of the map. The mapped
// variant is its own function (not inlined): the kernels' registers stay as they are without a
// map.
template <typename T, int G, bool MAPPED>
__device__ __forceinline__ void ScoreOpenRows(const CompressedScoreParams& p, const float* qf,
                                              float* out, int64_t slot, int32_t closed_groups,
                                              int32_t n, int lane) {
  const int32_t d = p.head_dim;
  const int32_t open = n - closed_groups * p.group;
  const void* rows = p.tails[slot];
  const int64_t m = static_cast<int64_t>(blockIdx.y) * d;
  const uint32_t* channel4 =
      MAPPED ? reinterpret_cast<const uint32_t*>(p.map_channel + m) : nullptr;
  const uint32_t* part4 = MAPPED ? reinterpret_cast<const uint32_t*>(p.map_part + m) : nullptr;
  for (int32_t i = lane; i < open; i += 32) {
    const void* row = static_cast<const char*>(rows) + static_cast<int64_t>(i) * d * sizeof(T);
    float s[G];
#pragma unroll
    for (int h = 0; h < G; ++h) s[h] = 0.f;
    if constexpr (MAPPED) {
#pragma unroll 2
      for (int32_t c4 = 0; c4 < d; c4 += 4) {
        const uint32_t ch = channel4[c4 / 4], pt = part4[c4 / 4];
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          if (((pt >> (8 * b)) & 0xffu) == 2u) continue;  // a widened channel's low part
          const float k = LoadElem<T>(row, static_cast<int32_t>((ch >> (8 * b)) & 0xffu));
          float qc[G];
          LoadHeads<G>(qf + (c4 + b) * G, qc);
#pragma unroll
          for (int h = 0; h < G; ++h) s[h] = __fadd_rn(s[h], __fmul_rn(qc[h], k));
        }
      }
    } else {
#pragma unroll 4
      for (int32_t c = 0; c < d; ++c) {
        const float k = LoadElem<T>(row, c);
        float qc[G];
        LoadHeads<G>(qf + c * G, qc);
#pragma unroll
        for (int h = 0; h < G; ++h) s[h] = __fadd_rn(s[h], __fmul_rn(qc[h], k));
      }
    }
#pragma unroll
    for (int h = 0; h < G; ++h) {
      out[h * p.score_stride + closed_groups * p.group + i] = __fmul_rn(s[h], p.scale);
    }
  }
}
template <typename T, int G>
__device__ __noinline__ void ScoreOpenRowsMapped(const CompressedScoreParams& p, const float* qf,
                                                 float* out, int64_t slot, int32_t closed_groups,
                                                 int32_t n, int lane) {
  ScoreOpenRows<T, G, true>(p, qf, out, slot, closed_groups, n, lane);
}
template <typename T, int G>
__device__ void ScoreOpenGroup(const CompressedScoreParams& p, const float* qf, float* out,
                               int64_t slot, int32_t closed_groups, int32_t n, int lane) {
  if (p.map_channel != nullptr) {
    ScoreOpenRowsMapped<T, G>(p, qf, out, slot, closed_groups, n, lane);
  } else {
    ScoreOpenRows<T, G, false>(p, qf, out, slot, closed_groups, n, lane);
  }
}

// What both kernels do first: the block's queries into qf (every warp of a block with a group to
// score takes part: the block's one barrier is here), the open group scored by the warp that has
// it. A (b, kv head j)'s items are its open group (item 0: the first block's first warp, so the
// longest warp, up to group - 1 exact rows, starts first instead of after every closed group)
// then its closed groups (item g + 1). The warp's closed group, or -1 where it has none (then the
// warp returns); out and slot are (b, j)'s scores and compressed keys.
template <typename T, int G>
__device__ __forceinline__ int32_t ClosedGroupOfWarp(const CompressedScoreParams& p, float* qf,
                                                     float*& out, int64_t& slot) {
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int32_t b = blockIdx.z, j = blockIdx.y;
  const int32_t item = blockIdx.x * warps + warp;
  const int32_t n = p.seq_lens[b];
  const int32_t closed_groups = n / p.group;
  if (static_cast<int32_t>(blockIdx.x) * warps > closed_groups) return -1;  // the whole block
  out = LoadGroupQueries<T, G>(p, qf);
  slot = static_cast<int64_t>(b) * p.num_kv_heads + j;
  __syncthreads();  // the block's last barrier: from here each warp goes its own way
  if (item > closed_groups) return -1;
  if (item == 0) {
    ScoreOpenGroup<T, G>(p, qf, out, slot, closed_groups, n, lane);
    return -1;
  }
  return item - 1;
}

// The group's base sum_c q_c lo_c per head, one lane a head, in channel order.
template <int G>
__device__ __forceinline__ void GroupBase(const float* qf, const uint16_t* lo, int32_t d, int lane,
                                          float* base) {
  if (lane < G) {
    float s = 0.f;
#pragma unroll 8
    for (int32_t c = 0; c < d; ++c) s = __fadd_rn(s, __fmul_rn(qf[c * G + lane], Half(lo[c])));
    base[lane] = s;
  }
}

// Issues the copy of `words` 32-bit words from global to shared memory over the warp: 16 bytes a
// lane and instruction where both ends allow it (cp.async: StageWait waits for it), else word by
// word (done on return).
__device__ __forceinline__ void StageIssue(uint32_t* dst, const uint32_t* src, int32_t words,
                                           int lane) {
  if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0 &&
      words % 4 == 0) {
    for (int32_t i = lane * 4; i < words; i += 32 * 4) CpAsync16(dst + i, src + i, true);
  } else {
    for (int32_t i = lane; i < words; i += 32) dst[i] = src[i];
  }
}
// Waits for every copy the lane issued, then for the warp's.
__device__ __forceinline__ void StageWait() {
  CpAsyncCommit();
  CpAsyncWait<0>();
  __syncwarp();
}

// The channel (within its 32-channel k-tile) whose code sits at mma.m16n8k32's k-slot of lane
// quad position t, register half `half` (k-slot 4t + i for half 0, 16 + 4t + i for half 1) and
// byte i: the byte CodeBytes puts that channel's code in, and where the B fragments put its
// digits.
template <int BITS>
__device__ __forceinline__ int32_t ChannelOf(int t, int half, int i) {
  if constexpr (BITS == 2) return 16 * half + 4 * i + t;
  return 8 * i + 4 * half + t;
}

// The A fragment register of k-tile half `half` for quad position t from the row's words of the
// k-tile (two words of 16 channels at 2 bits, one word of 32 at 1 bit): four codes, one a byte.
template <int BITS>
__device__ __forceinline__ uint32_t CodeBytes(uint32_t w0, uint32_t w1, int t, int half) {
  if constexpr (BITS == 2) return ((half == 0 ? w0 : w1) >> (2 * t)) & 0x03030303u;
  return (w0 >> (t + 4 * half)) & 0x01010101u;
}

// A score's sum_c w_c code_c from its three digit columns' int32 sums: (d1 + d2 / 128 + d3 /
// 128^2) 2^(e - 6) (each term exact in fp32, two roundings, and the power of two's product,
// which is what ldexpf gives: a product by a normal power of two is exact or rounds once, as
// ldexpf does; Pow2::f is 0 where 2^(e - 6) is not a normal float, and ldexpf is called then).
struct Pow2 {
  int e = 0;      // e - 6
  float f = 0.f;  // 2^(e - 6) where that is a normal float, else 0
};
__device__ __forceinline__ Pow2 Pow2Of(int e) {
  Pow2 p;
  p.e = e - 6;
  p.f = p.e >= -126 && p.e <= 127 ? __int_as_float((p.e + 127) << 23) : 0.f;
  return p;
}
__device__ __forceinline__ float DigitSum(int d1, int d2, int d3, const Pow2& p) {
  const float s = __fadd_rn(__fadd_rn(static_cast<float>(d1), static_cast<float>(d2) * 0x1p-7f),
                            static_cast<float>(d3) * 0x1p-14f);
  return p.f != 0.f ? __fmul_rn(s, p.f) : ldexpf(s, p.e);
}

// KT: the k-tiles d / 32 where the launcher fixed them (4: d = 128), so that a lane's products
// q_c step_c and its B fragments stay in registers; 0: any d, both read from shared memory.
template <typename T, int G, int BITS, int KT>
__global__ void __launch_bounds__(32 * kGroupsPerBlock)
    CompressedScoresMmaKernel(CompressedScoreParams p) {
  GridDependencyWait();  // LaunchDependent: the earlier kernels' writes first
  constexpr int NT = MmaNTiles(G), HG = NT / 2;  // n-tiles, groups of four heads
  extern __shared__ __align__(16) float smem[];
  const int32_t d = p.head_dim;
  float* qf = smem;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* base = qf + G * d + warp * MmaWarpFloats(G, d);
  int* expo = reinterpret_cast<int*>(base + 8);              // [G]
  uint32_t* bfrag = reinterpret_cast<uint32_t*>(base + 16);  // [d / 32][NT][32][2]
  const int32_t bwords = d / 32 * NT * 64;
  uint16_t* lo = reinterpret_cast<uint16_t*>(bfrag + bwords);  // [d], then step [d]
  const uint16_t* step = lo + d;
  uint32_t* codes = reinterpret_cast<uint32_t*>(lo + 2 * d);  // [kStageWords]
  float* out = nullptr;
  int64_t slot = 0;
  const int32_t g = ClosedGroupOfWarp<T, G>(p, qf, out, slot);
  if (g < 0) return;
  const uint8_t* block = p.group_heads[slot] + static_cast<int64_t>(g) * p.block_bytes;
  const int32_t words = d * BITS / 32;
  const uint32_t* gcodes = reinterpret_cast<const uint32_t*>(block);
  const int32_t chunk = min(p.group, static_cast<int32_t>(kStageWords) / words);
  // The group's lo and step, and its first chunk of codes, in one round trip.
  StageIssue(reinterpret_cast<uint32_t*>(lo), gcodes + static_cast<int64_t>(p.group) * words, d,
             lane);
  StageIssue(codes, gcodes, chunk * words, lane);
  StageWait();
  // Each head's base: lane x covers head x % G (G divides 32); the sums over the lanes' channels
  // by butterfly (an order of our own: within the bound, not the reference's).
  float part[G];
#pragma unroll
  for (int h = 0; h < G; ++h) part[h] = 0.f;
  for (int32_t c = lane; c < d; c += 32) {
    const float l = Half(lo[c]);
    float qc[G];
    LoadHeads<G>(qf + c * G, qc);
#pragma unroll
    for (int h = 0; h < G; ++h) part[h] = __fadd_rn(part[h], __fmul_rn(qc[h], l));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
    for (int h = 0; h < G; ++h)
      part[h] = __fadd_rn(part[h], __shfl_xor_sync(0xffffffffu, part[h], o));
  }
#pragma unroll
  for (int h = 0; h < G; ++h) {
    if (lane == h) base[h] = part[h];
  }
  // The B fragments, each lane its own: in n-tile 2 hg + D / 2, column 2 (h % 4) + D % 2 holds
  // digit D of head h = 4 hg + column / 2, so lane (column, t) needs, for its channels (ChannelOf),
  // digits 1 and 3 (an even column) or digit 2 and zeros (an odd one). Each lane of a column
  // pair computes the three digits of one register half's channels and the pair swaps halves.
  const int t = lane % 4, gid = lane / 4, odd = gid & 1;
#pragma unroll
  for (int hg = 0; hg < HG; ++hg) {
    const int h = hg * 4 + gid / 2;
    const bool live = h < G;
    const int hq = live ? h : 0;
    // The head's exponent: frexp of max_c |q_c step_c| over every channel (the lanes of its
    // column pair hold them all).
    float wk[KT > 0 ? KT : 1][4];  // the lane's products q_c step_c, where KT is fixed
    float mx = 0.f;
    for (int32_t kt = 0; kt < (KT > 0 ? KT : d / 32); ++kt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int32_t c = kt * 32 + ChannelOf<BITS>(t, odd, i);
        const float w = __fmul_rn(qf[c * G + hq], Half(step[c]));
        if constexpr (KT > 0) wk[kt][i] = w;
        mx = fmaxf(mx, fabsf(w));
      }
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
    int e = 0;
    frexpf(mx, &e);
    if (live && t == 0 && odd == 0) expo[h] = e;
    const float sc = ldexpf(64.f, -e);
    for (int32_t kt = 0; kt < (KT > 0 ? KT : d / 32); ++kt) {
      uint32_t d1 = 0u, d2 = 0u, d3 = 0u;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int32_t c = kt * 32 + ChannelOf<BITS>(t, odd, i);
        float w;
        if constexpr (KT > 0) {
          w = wk[kt][i];
        } else {
          w = __fmul_rn(qf[c * G + hq], Half(step[c]));
        }
        // |y| < 64; an absent head's digits are zeros.
        float y = live ? __fmul_rn(w, sc) : 0.f;
        const float w1 = rintf(y);
        y = __fmul_rn(__fsub_rn(y, w1), 128.f);  // exact: the remainder, scaled
        const float w2 = rintf(y);
        y = __fmul_rn(__fsub_rn(y, w2), 128.f);
        const float w3 = rintf(y);
        d1 |= (static_cast<uint32_t>(static_cast<int>(w1)) & 0xffu) << (8 * i);
        d2 |= (static_cast<uint32_t>(static_cast<int>(w2)) & 0xffu) << (8 * i);
        d3 |= (static_cast<uint32_t>(static_cast<int>(w3)) & 0xffu) << (8 * i);
      }
      // The even lane gets the odd one's digits 1 and 3 (its half 1), the odd lane the even
      // one's digit 2 (its half 0).
      const uint32_t r1 = __shfl_xor_sync(0xffffffffu, odd ? d1 : d2, 4);
      const uint32_t r3 = __shfl_xor_sync(0xffffffffu, d3, 4);
      uint2* frag = reinterpret_cast<uint2*>(bfrag) + (kt * NT + 2 * hg) * 32 + lane;
      frag[0] = odd ? make_uint2(r1, d2) : make_uint2(d1, r1);
      frag[32] = odd ? make_uint2(0u, 0u) : make_uint2(d3, r3);
    }
  }
  __syncwarp();
  // The heads this lane writes (nt * 4 + t for each group of four), their exponents.
  Pow2 ex[HG];
#pragma unroll
  for (int hg = 0; hg < HG; ++hg) ex[hg] = Pow2Of(expo[min(hg * 4 + t, G - 1)]);
  const uint2* bf = reinterpret_cast<const uint2*>(bfrag);
  uint2 bk[KT > 0 ? KT : 1][NT];  // the B fragments, where KT is fixed
  if constexpr (KT > 0) {
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) bk[kt][nt] = bf[(kt * NT + nt) * 32 + lane];
    }
  }
  for (int32_t c0 = 0; c0 < p.group; c0 += chunk) {
    if (c0 > 0) {    // the first chunk came with lo and step
      __syncwarp();  // the previous chunk's reads done
      StageIssue(codes, gcodes + static_cast<int64_t>(c0) * words, chunk * words, lane);
      StageWait();
    }
    for (int32_t mt = 0; mt < chunk / 16; ++mt) {
      const int32_t r0 = mt * 16 + gid, r1 = r0 + 8;
      int acc[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0;
#pragma unroll 4
      for (int32_t kt = 0; kt < (KT > 0 ? KT : d / 32); ++kt) {
        uint32_t x0a, x0b = 0u, x1a, x1b = 0u;
        if constexpr (BITS == 2) {
          const uint2 y0 = *reinterpret_cast<const uint2*>(codes + r0 * words + 2 * kt);
          const uint2 y1 = *reinterpret_cast<const uint2*>(codes + r1 * words + 2 * kt);
          x0a = y0.x, x0b = y0.y, x1a = y1.x, x1b = y1.y;
        } else {
          x0a = codes[r0 * words + kt];
          x1a = codes[r1 * words + kt];
        }
        const uint32_t a0 = CodeBytes<BITS>(x0a, x0b, t, 0), a1 = CodeBytes<BITS>(x1a, x1b, t, 0);
        const uint32_t a2 = CodeBytes<BITS>(x0a, x0b, t, 1), a3 = CodeBytes<BITS>(x1a, x1b, t, 1);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          uint2 bb;
          if constexpr (KT > 0) {
            bb = bk[kt][nt];
          } else {
            bb = bf[(kt * NT + nt) * 32 + lane];
          }
          MmaInt8(acc[nt], a0, a1, a2, a3, bb.x, bb.y);
        }
      }
      // acc[2 hg][0..1]: head hg * 4 + t's digits 1 and 2 at token r0, acc[2 hg + 1][0] its
      // digit 3; [2..3] at r1.
#pragma unroll
      for (int hg = 0; hg < HG; ++hg) {
        const int h = hg * 4 + t;
        if (h >= G) continue;
        const int64_t at = h * p.score_stride + static_cast<int64_t>(g) * p.group + c0;
        const int* d12 = acc[2 * hg];
        const int* d3 = acc[2 * hg + 1];
        const float s0 = DigitSum(d12[0], d12[1], d3[0], ex[hg]);
        const float s1 = DigitSum(d12[2], d12[3], d3[2], ex[hg]);
        out[at + r0] = __fmul_rn(__fadd_rn(base[h], s0), p.scale);
        out[at + r1] = __fmul_rn(__fadd_rn(base[h], s1), p.scale);
      }
    }
  }
}

template <typename T, int G>
__global__ void __launch_bounds__(32 * kGroupsPerBlock)
    CompressedScoresKernel(CompressedScoreParams p) {
  GridDependencyWait();  // LaunchDependent: the earlier kernels' writes first
  extern __shared__ __align__(16) float smem[];
  const int32_t d = p.head_dim;
  float* qf = smem;  // [d][G] the queries as floats
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* qs = qf + G * d + warp * (G * d + 8);  // [d][G] q_c * step_c of the warp's group
  float* base = qs + G * d;                     // [G] sum_c q_c lo_c
  float* out = nullptr;
  int64_t slot = 0;
  const int32_t g = ClosedGroupOfWarp<T, G>(p, qf, out, slot);
  if (g < 0) return;
  const uint8_t* block = p.group_heads[slot] + static_cast<int64_t>(g) * p.block_bytes;
  const int32_t bits = p.bits;
  const int32_t words = d * bits / 32;
  const uint32_t* codes = reinterpret_cast<const uint32_t*>(block);
  const uint16_t* lo =
      reinterpret_cast<const uint16_t*>(block + static_cast<int64_t>(p.group) * words * 4);
  const uint16_t* step = lo + d;
  for (int32_t x = lane; x < G * d; x += 32) qs[x] = __fmul_rn(qf[x], Half(step[x / G]));
  GroupBase<G>(qf, lo, d, lane, base);
  __syncwarp();
  const uint32_t mask = (1u << bits) - 1;
  const int32_t per_word = 32 / bits;
  // The lane's tokens lane, lane + 32, ...: kTokensPerLane of them per round, each round's
  // stores coalesced over the warp.
  for (int32_t i0 = 0; i0 < p.group; i0 += 32 * kTokensPerLane) {
    float s[kTokensPerLane][G];
    bool live[kTokensPerLane];
#pragma unroll
    for (int t = 0; t < kTokensPerLane; ++t) {
      live[t] = i0 + t * 32 + lane < p.group;
#pragma unroll
      for (int h = 0; h < G; ++h) s[t][h] = 0.f;
    }
    for (int32_t k = 0; k < words; ++k) {
      uint32_t x[kTokensPerLane];
#pragma unroll
      for (int t = 0; t < kTokensPerLane; ++t) {
        const int64_t i = i0 + t * 32 + lane;
        x[t] = live[t] ? codes[i * words + k] : 0u;
      }
      const float* qk = qs + k * per_word * G;
#pragma unroll 2
      for (int32_t l = 0; l < per_word; ++l) {
        float qc[G];
        LoadHeads<G>(qk + l * G, qc);
#pragma unroll
        for (int t = 0; t < kTokensPerLane; ++t) {
          const float code = CodeAsFloat((x[t] >> (l * bits)) & mask);
#pragma unroll
          for (int h = 0; h < G; ++h) s[t][h] = __fadd_rn(s[t][h], __fmul_rn(qc[h], code));
        }
      }
    }
#pragma unroll
    for (int t = 0; t < kTokensPerLane; ++t) {
      if (!live[t]) continue;
      const int64_t i = i0 + t * 32 + lane;
#pragma unroll
      for (int h = 0; h < G; ++h) {
        out[h * p.score_stride + static_cast<int64_t>(g) * p.group + i] =
            __fmul_rn(__fadd_rn(base[h], s[t][h]), p.scale);
      }
    }
  }
}

// The tensor-core kernel takes 1- and 2-bit keys of a head_dim that is a multiple of 32 in groups
// of a multiple of 16 tokens.
inline bool ScoresOnTensorCores(const CompressedScoreParams& p) {
  return (p.bits == 1 || p.bits == 2) && p.head_dim % 32 == 0 && p.group % 16 == 0;
}

template <typename T, int G>
cudaError_t LaunchScoresG(const CompressedScoreParams& p, cudaStream_t stream) {
  const bool mma = ScoresOnTensorCores(p);
  auto smem_floats = [&](int w) {
    return mma ? MmaSmemFloats(G, p.head_dim, w) : ScoreSmemFloats(G, p.head_dim, w);
  };
  int warps = kGroupsPerBlock;
  while (warps > 1 && smem_floats(warps) * 4 > kScoreSmemBytes) warps /= 2;
  const dim3 grid((p.max_groups + warps) / warps, p.num_kv_heads, p.num_seqs);
  const size_t smem = smem_floats(warps) * sizeof(float);
  if (!mma) {
    return LaunchDependent(&CompressedScoresKernel<T, G>, grid, dim3(32 * warps), smem, stream, p);
  }
  // d = 128 (Llama's, the flagship's) with its k-tiles fixed; any other d reads them from shared
  // memory.
  const bool d128 = p.head_dim == 128;
  if (p.bits == 1) {
    return d128 ? LaunchDependent(&CompressedScoresMmaKernel<T, G, 1, 4>, grid, dim3(32 * warps),
                                  smem, stream, p)
                : LaunchDependent(&CompressedScoresMmaKernel<T, G, 1, 0>, grid, dim3(32 * warps),
                                  smem, stream, p);
  }
  return d128 ? LaunchDependent(&CompressedScoresMmaKernel<T, G, 2, 4>, grid, dim3(32 * warps),
                                smem, stream, p)
              : LaunchDependent(&CompressedScoresMmaKernel<T, G, 2, 0>, grid, dim3(32 * warps),
                                smem, stream, p);
}

template <typename T>
cudaError_t LaunchScores(const CompressedScoreParams& p, int group_heads, cudaStream_t stream) {
  switch (group_heads) {
    case 1:
      return LaunchScoresG<T, 1>(p, stream);
    case 2:
      return LaunchScoresG<T, 2>(p, stream);
    case 4:
      return LaunchScoresG<T, 4>(p, stream);
    case 8:
      return LaunchScoresG<T, 8>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

constexpr int kStepThreads = 128;

// Channel c's range over the group's G rows, in token order (std::min's and std::max's
// comparisons, for signed zeros).
template <typename T>
__device__ __forceinline__ void ChannelRange(const char* rows, int64_t row, int32_t G, int32_t c,
                                             float* mn, float* mx) {
  float lo = LoadElem<T>(rows, c), hi = lo;
  for (int32_t t = 1; t < G; ++t) {
    const float x = LoadElem<T>(rows + t * row, c);
    lo = x < lo ? x : lo;
    hi = hi < x ? x : hi;
  }
  *mn = lo;
  *mx = hi;
}

// One group's quantization by a block (kernels/compressed_keys.cc, CompressKeyGroup, operation
// for operation: channel ranges in token order, codes and the squared error in channel order):
// rows [G, d] of T at `rows` (`row` bytes apart) into `block`. `scale`: 2 d floats of shared
// memory. Every thread of the block calls it.
template <typename T>
__device__ __forceinline__ void QuantizeGroup(const char* rows, int64_t row, int32_t G, int32_t d,
                                              int32_t bits, uint8_t* block, float* scale) {
  const keyq::GroupLayout lay = keyq::LayoutOf(G, d, bits);
  auto* lo16 = reinterpret_cast<uint16_t*>(block + lay.lo);
  auto* step16 = reinterpret_cast<uint16_t*>(block + lay.step);
  auto* err16 = reinterpret_cast<uint16_t*>(block + lay.err);
  float* lo = scale;
  float* step = scale + d;
  const uint32_t levels = (1u << bits) - 1;
  for (int32_t c = threadIdx.x; c < d; c += blockDim.x) {
    float mn, mx;
    ChannelRange<T>(rows, row, G, c, &mn, &mx);
    const keyq::ChannelScale sc = keyq::ScaleOf(mn, mx, levels);
    lo16[c] = sc.lo16;
    step16[c] = sc.step16;
    lo[c] = keyq::Half(sc.lo16);
    step[c] = keyq::Half(sc.step16);
  }
  __syncthreads();
  const int32_t words = d * bits / 32, per_word = 32 / bits;
  for (int32_t t = threadIdx.x; t < G; t += blockDim.x) {
    const char* k = rows + t * row;
    uint32_t* w = reinterpret_cast<uint32_t*>(block) + static_cast<int64_t>(t) * words;
    double err2 = 0;
    for (int32_t x = 0; x < words; ++x) {
      uint32_t word = 0;
      for (int32_t l = 0; l < per_word; ++l) {
        const int32_t c = x * per_word + l;
        const float v = LoadElem<T>(k, c);
        const uint32_t code = keyq::CodeOf(v, lo[c], step[c], levels);
        word |= code << (l * bits);
        err2 = keyq::AddSquaredError(err2, v, lo[c], step[c], code);
      }
      w[x] = word;
    }
    err16[t] = keyq::HalfBound(keyq::Sqrt(err2));
  }
}

// Shared memory of QuantizeGroupMapped, in floats: each model channel's lo and step at its width
// (2 d), its width and its first stored channel (2 d int32).
constexpr int64_t MappedScaleFloats(int32_t d) { return 4 * static_cast<int64_t>(d); }

// The same with a channel map (kernels/key_widths.h; CompressKeyGroup with KeyCompression::map,
// operation for operation): each model channel's scale at its width (twice the bits where
// widened), the stored channels' scales (a widened channel's high part steps 2^bits of its low
// part, the low part's lo 0), each stored channel's code (the model channel's, or its high or
// low digit), and the squared error over the model's channels (a left-out one's whole value; a
// widened one against what its two parts give back, in the host's order).
template <typename T>
__device__ __forceinline__ void QuantizeGroupMapped(const char* rows, int64_t row, int32_t G,
                                                    int32_t d, int32_t bits, uint8_t* block,
                                                    float* smem, const uint8_t* channel,
                                                    const uint8_t* part) {
  const keyq::GroupLayout lay = keyq::LayoutOf(G, d, bits);
  auto* lo16 = reinterpret_cast<uint16_t*>(block + lay.lo);
  auto* step16 = reinterpret_cast<uint16_t*>(block + lay.step);
  auto* err16 = reinterpret_cast<uint16_t*>(block + lay.err);
  float* mlo = smem;
  float* mstep = smem + d;
  auto* width = reinterpret_cast<int32_t*>(smem + 2 * d);  // 0 out, 1 whole, 2 wide
  int32_t* first = width + d;                              // a channel's first stored channel
  const uint32_t levels = (1u << bits) - 1, wide_levels = (1u << (2 * bits)) - 1;
  for (int32_t c = threadIdx.x; c < d; c += blockDim.x) width[c] = 0;
  __syncthreads();
  for (int32_t v = threadIdx.x; v < d; v += blockDim.x) {
    if (part[v] != 2) {  // the whole part or the high one: the channel's first stored channel
      width[channel[v]] = part[v] == 0 ? 1 : 2;
      first[channel[v]] = v;
    }
  }
  __syncthreads();
  for (int32_t c = threadIdx.x; c < d; c += blockDim.x) {
    if (width[c] == 0) continue;
    float mn, mx;
    ChannelRange<T>(rows, row, G, c, &mn, &mx);
    const keyq::ChannelScale sc = keyq::ScaleOf(mn, mx, width[c] == 2 ? wide_levels : levels);
    mlo[c] = keyq::Half(sc.lo16);
    mstep[c] = keyq::Half(sc.step16);
    const int32_t v = first[c];
    lo16[v] = sc.lo16;
    step16[v] = width[c] == 2
                    ? keyq::HalfNearest(__fmul_rn(mstep[c], static_cast<float>(1u << bits)))
                    : sc.step16;
    if (width[c] == 2) {
      lo16[v + 1] = 0;
      step16[v + 1] = sc.step16;
    }
  }
  __syncthreads();
  const int32_t words = d * bits / 32, per_word = 32 / bits;
  for (int32_t t = threadIdx.x; t < G; t += blockDim.x) {
    const char* k = rows + t * row;
    uint32_t* w = reinterpret_cast<uint32_t*>(block) + static_cast<int64_t>(t) * words;
    for (int32_t x = 0; x < words; ++x) {
      uint32_t word = 0;
      for (int32_t l = 0; l < per_word; ++l) {
        const int32_t v = x * per_word + l, c = channel[v];
        const uint32_t top = width[c] == 2 ? wide_levels : levels;
        const uint32_t code = keyq::CodeOf(LoadElem<T>(k, c), mlo[c], mstep[c], top);
        const uint32_t cv = part[v] == 0 ? code : part[v] == 1 ? code >> bits : code & levels;
        word |= cv << (l * bits);
      }
      w[x] = word;
    }
    double err2 = 0;
    for (int32_t c = 0; c < d; ++c) {
      const float xv = LoadElem<T>(k, c);
      if (width[c] == 1) {
        const uint32_t code = keyq::CodeOf(xv, mlo[c], mstep[c], levels);
        err2 = keyq::AddSquaredError(err2, xv, mlo[c], mstep[c], code);
      } else if (width[c] == 0) {
        err2 = keyq::AddSquaredError(err2, xv, 0.f, 0.f, 0);
      } else {  // what the two stored parts give back: 0 + high, then + low, as the host adds
        const uint32_t code = keyq::CodeOf(xv, mlo[c], mstep[c], wide_levels);
        const int32_t v = first[c];
        const float hi =
            __fadd_rn(keyq::Half(lo16[v]),
                      __fmul_rn(keyq::Half(step16[v]), static_cast<float>(code >> bits)));
        const float lo =
            __fadd_rn(keyq::Half(lo16[v + 1]),
                      __fmul_rn(keyq::Half(step16[v + 1]), static_cast<float>(code & levels)));
        err2 = keyq::AddSquaredError(err2, xv, __fadd_rn(__fadd_rn(0.f, hi), lo), 0.f, 0);
      }
    }
    err16[t] = keyq::HalfBound(keyq::Sqrt(err2));
  }
}

// One block per (sequence, kv head): the new key into its open group's row, then, where the
// group fills, its quantization (with kv head j's channel map where there is one).
template <typename T, bool MAPPED>
__global__ void __launch_bounds__(kStepThreads) CompressedKeyStepKernel(CompressedKeyStepParams p) {
  GridDependencyWait();             // LaunchDependent: the earlier kernels' writes first
  extern __shared__ float scale[];  // QuantizeGroup's or QuantizeGroupMapped's
  const int32_t i = blockIdx.x, b = i / p.num_kv_heads;
  const int32_t n = p.seq_lens[b];
  if (n <= 0) return;
  const int32_t d = p.head_dim, G = p.group;
  const int64_t row = static_cast<int64_t>(d) * sizeof(T);
  char* tail = static_cast<char*>(p.tails[i]);
  const T* src = reinterpret_cast<const T*>(static_cast<const char*>(p.new_k) + i * row);
  T* dst = reinterpret_cast<T*>(tail + static_cast<int64_t>((n - 1) % G) * row);
  for (int32_t c = threadIdx.x; c < d; c += blockDim.x) dst[c] = src[c];
  if (n % G != 0) return;
  __syncthreads();  // the block's writes of the row, visible to its threads
  uint8_t* block = p.group_heads[i] + static_cast<int64_t>(n / G - 1) * p.block_bytes;
  if constexpr (MAPPED) {
    const int64_t m = static_cast<int64_t>(i % p.num_kv_heads) * d;
    QuantizeGroupMapped<T>(tail, row, G, d, p.bits, block, scale, p.map_channel + m,
                           p.map_part + m);
  } else {
    QuantizeGroup<T>(tail, row, G, d, p.bits, block, scale);
  }
}

// One block per (kv head, group) of a chunk of closed groups.
template <typename T>
__global__ void __launch_bounds__(kStepThreads)
    CompressKeyGroupsKernel(const __grid_constant__ CompressKeyGroupsParams p) {
  extern __shared__ float scale[];
  const int32_t j = blockIdx.x / p.groups, g = blockIdx.x % p.groups;
  const int64_t row = static_cast<int64_t>(p.head_dim) * sizeof(T);
  const char* rows = static_cast<const char*>(p.rows) + j * p.head_stride +
                     static_cast<int64_t>(g) * p.group * row;
  uint8_t* block = p.blocks + j * p.block_head_stride + static_cast<int64_t>(g) * p.block_bytes;
  if (p.map_channel != nullptr) {
    const int64_t m = static_cast<int64_t>(j) * p.head_dim;
    QuantizeGroupMapped<T>(rows, row, p.group, p.head_dim, p.bits, block, scale, p.map_channel + m,
                           p.map_part + m);
    return;
  }
  QuantizeGroup<T>(rows, row, p.group, p.head_dim, p.bits, block, scale);
}

bool ValidBlock(int32_t head_dim, int32_t bits, int32_t group, int64_t block_bytes) {
  return head_dim > 0 && head_dim <= 1024 && (bits == 1 || bits == 2 || bits == 4 || bits == 8) &&
         (head_dim * bits) % 32 == 0 && group > 0 && group <= 1024 && block_bytes % 4 == 0 &&
         block_bytes >= static_cast<int64_t>(group) * (head_dim * bits / 8 + 2) +
                            4 * static_cast<int64_t>(head_dim);
}

// A channel map's two tables come together, for 1-, 2- or 4-bit keys of at most 256 channels
// (a stored channel's model channel is a byte; kernels/key_widths.h), or not at all.
bool ValidMap(const uint8_t* channel, const uint8_t* part, int32_t head_dim, int32_t bits) {
  if (channel == nullptr || part == nullptr) return channel == part;
  return bits != 8 && head_dim <= 256;
}

// Shared memory of a block that quantizes a group, in bytes.
size_t QuantizeSmemBytes(int32_t head_dim, bool mapped) {
  return (mapped ? MappedScaleFloats(head_dim) : 2 * static_cast<int64_t>(head_dim)) *
         sizeof(float);
}

}  // namespace

cudaError_t AppendCompressedKeyStep(const CompressedKeyStepParams& p, cudaStream_t stream) {
  if (p.batch <= 0 || p.num_kv_heads <= 0 ||
      !ValidBlock(p.head_dim, p.bits, p.group, p.block_bytes) || p.new_k == nullptr ||
      p.seq_lens == nullptr || p.tails == nullptr || p.group_heads == nullptr ||
      !ValidMap(p.map_channel, p.map_part, p.head_dim, p.bits)) {
    return cudaErrorInvalidValue;
  }
  const int blocks = p.batch * p.num_kv_heads;
  const bool mapped = p.map_channel != nullptr;
  const size_t smem = QuantizeSmemBytes(p.head_dim, mapped);
  auto launch = [&](auto kernel) {
    return LaunchDependent(kernel, dim3(blocks), dim3(kStepThreads), smem, stream, p);
  };
  switch (p.dtype) {
    case DType::kBf16:
      KVSPARSE_CUDA_RETURN_IF_ERROR(mapped ? launch(&CompressedKeyStepKernel<Bf16, true>)
                                           : launch(&CompressedKeyStepKernel<Bf16, false>));
      break;
    case DType::kFp16:
      KVSPARSE_CUDA_RETURN_IF_ERROR(mapped ? launch(&CompressedKeyStepKernel<Fp16, true>)
                                           : launch(&CompressedKeyStepKernel<Fp16, false>));
      break;
    case DType::kFp32:
      KVSPARSE_CUDA_RETURN_IF_ERROR(mapped ? launch(&CompressedKeyStepKernel<float, true>)
                                           : launch(&CompressedKeyStepKernel<float, false>));
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t CompressKeyGroups(const CompressKeyGroupsParams& p, cudaStream_t stream) {
  if (p.num_kv_heads <= 0 || p.groups < 0 ||
      !ValidBlock(p.head_dim, p.bits, p.group, p.block_bytes) || p.rows == nullptr ||
      p.blocks == nullptr || p.head_stride < 0 || p.block_head_stride < 0 ||
      !ValidMap(p.map_channel, p.map_part, p.head_dim, p.bits)) {
    return cudaErrorInvalidValue;
  }
  if (p.groups == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(p.num_kv_heads * p.groups));
  const size_t smem = QuantizeSmemBytes(p.head_dim, p.map_channel != nullptr);
  switch (p.dtype) {
    case DType::kBf16:
      CompressKeyGroupsKernel<Bf16><<<grid, kStepThreads, smem, stream>>>(p);
      break;
    case DType::kFp16:
      CompressKeyGroupsKernel<Fp16><<<grid, kStepThreads, smem, stream>>>(p);
      break;
    case DType::kFp32:
      CompressKeyGroupsKernel<float><<<grid, kStepThreads, smem, stream>>>(p);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t CompressedScores(const CompressedScoreParams& p, cudaStream_t stream) {
  if (p.num_seqs < 0 || p.num_kv_heads <= 0 || p.num_q_heads <= 0 ||
      p.num_q_heads % p.num_kv_heads != 0 || p.head_dim <= 0 || p.head_dim > 1024 ||
      std::max(ScoreSmemFloats(p.num_q_heads / p.num_kv_heads, p.head_dim, 1),
               MmaSmemFloats(p.num_q_heads / p.num_kv_heads, p.head_dim, 1)) *
              4 >
          kScoreSmemBytes ||
      !ValidBlock(p.head_dim, p.bits, p.group, p.block_bytes) || p.max_groups < 0 ||
      !ValidMap(p.map_channel, p.map_part, p.head_dim, p.bits) ||
      ((reinterpret_cast<uintptr_t>(p.map_channel) | reinterpret_cast<uintptr_t>(p.map_part)) &
       3) != 0) {  // the open group reads the map four channels a load
    return cudaErrorInvalidValue;
  }
  if (p.num_seqs == 0) return cudaSuccess;
  const int group_heads = p.num_q_heads / p.num_kv_heads;
  switch (p.dtype) {
    case DType::kBf16:
      return LaunchScores<Bf16>(p, group_heads, stream);
    case DType::kFp16:
      return LaunchScores<Fp16>(p, group_heads, stream);
    case DType::kFp32:
      return LaunchScores<float>(p, group_heads, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace kvsparse::kernels::cuda
