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
// groups to a block (they share the query; fewer where the shared memory would not fit); each lane
// scores kTokensPerLane tokens for every query head of the GQA group side by side (G x
// kTokensPerLane independent sums: a channel's q_c * step_c of the G heads is read from shared
// memory once for the lane's tokens, the codes once for the heads). The arithmetic follows
// kernels/compressed_keys.cc ApproximateScores term by term (single roundings, each sum in channel
// order). What bounds it is the instruction issue of those sums (a multiplication and an addition
// per token, head and channel: no fused multiply-add, which would round differently from the
// reference): the shared-memory reads are amortised over the lane's tokens. BITS = 1, 2: the code
// width as a constant (the loops unrolled); 0: any width at run time.
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
constexpr int64_t kScoreSmemBytes = 48 * 1024;  // what a block takes without opting in

// The code as a float without a conversion instruction: 2^23 + code, less 2^23 (exact).
__device__ __forceinline__ float CodeAsFloat(uint32_t code) {
  return __fsub_rn(__uint_as_float(0x4B000000u | code), 8388608.f);
}

template <typename T, int G, int BITS>
__global__ void __launch_bounds__(32 * kGroupsPerBlock)
    CompressedScoresKernel(CompressedScoreParams p) {
  extern __shared__ __align__(16) float smem[];
  const int32_t d = p.head_dim;
  // Channel-major, the group's heads side by side: one vector load gives a channel's G values.
  float* qf = smem;  // [d][G] the queries as floats
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* qs = qf + G * d + warp * (G * d + 8);  // [d][G] q_c * step_c of the warp's group
  float* base = qs + G * d;                     // [G] sum_c q_c lo_c
  const int32_t b = blockIdx.z, j = blockIdx.y;
  const int32_t g = blockIdx.x * warps + warp;
  const int32_t n = p.seq_lens[b];
  const int32_t closed_groups = n / p.group;
  if (static_cast<int32_t>(blockIdx.x) * warps > closed_groups) return;  // the whole block
  const int32_t h0 = j * G;
  const void* q = static_cast<const char*>(p.q) +
                  (static_cast<int64_t>(b) * p.num_q_heads + h0) * d * sizeof(T);
  for (int32_t x = threadIdx.x; x < G * d; x += blockDim.x) {
    qf[(x % d) * G + x / d] = LoadElem<T>(q, x);  // q is [G][d]
  }
  float* out = p.scores + (static_cast<int64_t>(b) * p.num_q_heads + h0) * p.score_stride;
  const int64_t slot = static_cast<int64_t>(b) * p.num_kv_heads + j;
  __syncthreads();  // the block's last barrier: from here each warp goes its own way
  if (g > closed_groups) return;
  if (g == closed_groups) {  // the open group: exact rows
    const int32_t open = n - closed_groups * p.group;
    const void* rows = p.tails[slot];
    for (int32_t i = lane; i < open; i += 32) {
      const void* row = static_cast<const char*>(rows) + static_cast<int64_t>(i) * d * sizeof(T);
      float s[G];
#pragma unroll
      for (int h = 0; h < G; ++h) s[h] = 0.f;
#pragma unroll 4
      for (int32_t c = 0; c < d; ++c) {
        const float k = LoadElem<T>(row, c);
        float qc[G];
        LoadHeads<G>(qf + c * G, qc);
#pragma unroll
        for (int h = 0; h < G; ++h) s[h] = __fadd_rn(s[h], __fmul_rn(qc[h], k));
      }
#pragma unroll
      for (int h = 0; h < G; ++h) {
        out[h * p.score_stride + closed_groups * p.group + i] = __fmul_rn(s[h], p.scale);
      }
    }
    return;
  }
  const uint8_t* block = p.group_heads[slot] + static_cast<int64_t>(g) * p.block_bytes;
  const int32_t bits = BITS == 0 ? p.bits : BITS;
  const int32_t words = d * bits / 32;
  const uint32_t* codes = reinterpret_cast<const uint32_t*>(block);
  const uint16_t* lo =
      reinterpret_cast<const uint16_t*>(block + static_cast<int64_t>(p.group) * words * 4);
  const uint16_t* step = lo + d;
  for (int32_t x = lane; x < G * d; x += 32) qs[x] = __fmul_rn(qf[x], Half(step[x / G]));
  if (lane < G) {  // one lane a head: the base's sum in channel order
    float s = 0.f;
#pragma unroll 8
    for (int32_t c = 0; c < d; ++c) s = __fadd_rn(s, __fmul_rn(qf[c * G + lane], Half(lo[c])));
    base[lane] = s;
  }
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
      if constexpr (BITS != 0) {
#pragma unroll
        for (int l = 0; l < 32 / BITS; ++l) {
          float qc[G];
          LoadHeads<G>(qk + l * G, qc);
#pragma unroll
          for (int t = 0; t < kTokensPerLane; ++t) {
            const float code = CodeAsFloat((x[t] >> (l * BITS)) & ((1u << BITS) - 1));
#pragma unroll
            for (int h = 0; h < G; ++h) s[t][h] = __fadd_rn(s[t][h], __fmul_rn(qc[h], code));
          }
        }
      } else {
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

template <typename T, int G>
cudaError_t LaunchScoresG(const CompressedScoreParams& p, cudaStream_t stream) {
  int warps = kGroupsPerBlock;
  while (warps > 1 && ScoreSmemFloats(G, p.head_dim, warps) * 4 > kScoreSmemBytes) warps /= 2;
  const dim3 grid((p.max_groups + warps) / warps, p.num_kv_heads, p.num_seqs);
  const size_t smem = ScoreSmemFloats(G, p.head_dim, warps) * sizeof(float);
  switch (p.bits) {
    case 1:
      CompressedScoresKernel<T, G, 1><<<grid, 32 * warps, smem, stream>>>(p);
      break;
    case 2:
      CompressedScoresKernel<T, G, 2><<<grid, 32 * warps, smem, stream>>>(p);
      break;
    default:
      CompressedScoresKernel<T, G, 0><<<grid, 32 * warps, smem, stream>>>(p);
      break;
  }
  return cudaGetLastError();
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

// One block per (sequence, kv head): the new key into its open group's row, then, where the
// group fills, its quantization (kernels/compressed_keys.cc, CompressKeyGroup, operation for
// operation: channel ranges in token order, codes and the squared error in channel order).
template <typename T>
__global__ void __launch_bounds__(kStepThreads) CompressedKeyStepKernel(CompressedKeyStepParams p) {
  extern __shared__ float scale[];  // lo [d], then step [d], as floats
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
  const keyq::GroupLayout lay = keyq::LayoutOf(G, d, p.bits);
  auto* lo16 = reinterpret_cast<uint16_t*>(block + lay.lo);
  auto* step16 = reinterpret_cast<uint16_t*>(block + lay.step);
  auto* err16 = reinterpret_cast<uint16_t*>(block + lay.err);
  float* lo = scale;
  float* step = scale + d;
  const uint32_t levels = (1u << p.bits) - 1;
  for (int32_t c = threadIdx.x; c < d; c += blockDim.x) {
    float mn = LoadElem<T>(tail, c), mx = mn;
    for (int32_t t = 1; t < G; ++t) {
      const float x = LoadElem<T>(tail + t * row, c);
      mn = x < mn ? x : mn;  // std::min's and std::max's comparisons, for signed zeros
      mx = mx < x ? x : mx;
    }
    const keyq::ChannelScale sc = keyq::ScaleOf(mn, mx, levels);
    lo16[c] = sc.lo16;
    step16[c] = sc.step16;
    lo[c] = keyq::Half(sc.lo16);
    step[c] = keyq::Half(sc.step16);
  }
  __syncthreads();
  const int32_t words = d * p.bits / 32, per_word = 32 / p.bits;
  for (int32_t t = threadIdx.x; t < G; t += blockDim.x) {
    const char* k = tail + t * row;
    uint32_t* w = reinterpret_cast<uint32_t*>(block) + static_cast<int64_t>(t) * words;
    double err2 = 0;
    for (int32_t x = 0; x < words; ++x) {
      uint32_t word = 0;
      for (int32_t l = 0; l < per_word; ++l) {
        const int32_t c = x * per_word + l;
        const float v = LoadElem<T>(k, c);
        const uint32_t code = keyq::CodeOf(v, lo[c], step[c], levels);
        word |= code << (l * p.bits);
        err2 = keyq::AddSquaredError(err2, v, lo[c], step[c], code);
      }
      w[x] = word;
    }
    err16[t] = keyq::HalfBound(keyq::Sqrt(err2));
  }
}

}  // namespace

cudaError_t AppendCompressedKeyStep(const CompressedKeyStepParams& p, cudaStream_t stream) {
  if (p.batch <= 0 || p.num_kv_heads <= 0 || p.head_dim <= 0 || p.head_dim > 1024 ||
      (p.bits != 1 && p.bits != 2 && p.bits != 4 && p.bits != 8) ||
      (p.head_dim * p.bits) % 32 != 0 || p.group <= 0 || p.group > 1024 || p.new_k == nullptr ||
      p.seq_lens == nullptr || p.tails == nullptr || p.group_heads == nullptr ||
      p.block_bytes % 4 != 0 ||
      p.block_bytes < static_cast<int64_t>(p.group) * (p.head_dim * p.bits / 8 + 2) +
                          4 * static_cast<int64_t>(p.head_dim)) {
    return cudaErrorInvalidValue;
  }
  const int blocks = p.batch * p.num_kv_heads;
  const size_t smem = 2 * static_cast<size_t>(p.head_dim) * sizeof(float);
  switch (p.dtype) {
    case DType::kBf16:
      CompressedKeyStepKernel<Bf16><<<blocks, kStepThreads, smem, stream>>>(p);
      break;
    case DType::kFp16:
      CompressedKeyStepKernel<Fp16><<<blocks, kStepThreads, smem, stream>>>(p);
      break;
    case DType::kFp32:
      CompressedKeyStepKernel<float><<<blocks, kStepThreads, smem, stream>>>(p);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t CompressedScores(const CompressedScoreParams& p, cudaStream_t stream) {
  if (p.num_seqs < 0 || p.num_kv_heads <= 0 || p.num_q_heads <= 0 ||
      p.num_q_heads % p.num_kv_heads != 0 || p.head_dim <= 0 || p.head_dim > 1024 ||
      ScoreSmemFloats(p.num_q_heads / p.num_kv_heads, p.head_dim, 1) * 4 > kScoreSmemBytes ||
      (p.bits != 1 && p.bits != 2 && p.bits != 4 && p.bits != 8) ||
      (p.head_dim * p.bits) % 32 != 0 || p.group <= 0 || p.group > 1024 || p.max_groups < 0 ||
      p.block_bytes % 4 != 0 ||
      p.block_bytes < static_cast<int64_t>(p.group) * (p.head_dim * p.bits / 8 + 2) +
                          4 * static_cast<int64_t>(p.head_dim)) {
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
