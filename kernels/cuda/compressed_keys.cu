#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/compressed_keys.h"
#include "kernels/key_quantization.h"

namespace kvsparse::kernels::cuda {
namespace {

__device__ __forceinline__ float Half(uint16_t bits) {
  return __half2float(__ushort_as_half(bits));
}

// One block per (group or the open group, kv head, sequence), one thread per token computing the
// scores of the kv head's G query heads side by side (G independent sums: the codes are read and
// unpacked once for the group). The arithmetic follows kernels/compressed_keys.cc
// ApproximateScores term by term (single roundings, each sum in channel order).
template <typename T, int G>
__global__ void __launch_bounds__(256, 4) CompressedScoresKernel(CompressedScoreParams p) {
  extern __shared__ __align__(16) float smem[];
  const int32_t d = p.head_dim;
  // Channel-major, the group's heads side by side: one vector load gives a channel's G values.
  float* qf = smem;           // [d][G] the queries as floats
  float* qs = smem + G * d;   // [d][G] q_c * step_c of the group
  float* ql = qs + G * d;     // [d][G] q_c * lo_c of the group
  float* base = ql + G * d;   // [G] sum_c q_c lo_c
  const int32_t b = blockIdx.z, j = blockIdx.y, g = blockIdx.x;
  const int32_t n = p.seq_lens[b];
  const int32_t closed_groups = n / p.group;
  if (g > closed_groups) return;
  const int32_t h0 = j * G;
  const void* q = static_cast<const char*>(p.q) +
                  (static_cast<int64_t>(b) * p.num_q_heads + h0) * d * sizeof(T);
  for (int32_t x = threadIdx.x; x < G * d; x += blockDim.x) {
    qf[(x % d) * G + x / d] = LoadElem<T>(q, x);  // q is [G][d]
  }
  float* out = p.scores + (static_cast<int64_t>(b) * p.num_q_heads + h0) * p.score_stride;
  const int64_t slot = static_cast<int64_t>(b) * p.num_kv_heads + j;
  __syncthreads();
  if (g == closed_groups) {  // the open group: exact rows
    const int32_t open = n - closed_groups * p.group;
    const void* rows = p.tails[slot];
    for (int32_t i = threadIdx.x; i < open; i += blockDim.x) {
      const void* row = static_cast<const char*>(rows) + static_cast<int64_t>(i) * d * sizeof(T);
      float s[G];
#pragma unroll
      for (int h = 0; h < G; ++h) s[h] = 0.f;
#pragma unroll 4
      for (int32_t c = 0; c < d; ++c) {
        const float k = LoadElem<T>(row, c);
#pragma unroll
        for (int h = 0; h < G; ++h) s[h] = __fadd_rn(s[h], __fmul_rn(qf[c * G + h], k));
      }
#pragma unroll
      for (int h = 0; h < G; ++h) {
        out[h * p.score_stride + closed_groups * p.group + i] = __fmul_rn(s[h], p.scale);
      }
    }
    return;
  }
  const uint8_t* block = p.group_heads[slot] + static_cast<int64_t>(g) * p.block_bytes;
  const int32_t words = d * p.bits / 32;
  const uint32_t* codes = reinterpret_cast<const uint32_t*>(block);
  const uint16_t* lo =
      reinterpret_cast<const uint16_t*>(block + static_cast<int64_t>(p.group) * words * 4);
  const uint16_t* step = lo + d;
  for (int32_t x = threadIdx.x; x < G * d; x += blockDim.x) {
    qs[x] = __fmul_rn(qf[x], Half(step[x / G]));
    ql[x] = __fmul_rn(qf[x], Half(lo[x / G]));
  }
  __syncthreads();
  if (threadIdx.x < G) {  // one thread a head: the base's sum in channel order
    float s = 0.f;
#pragma unroll 8
    for (int32_t c = 0; c < d; ++c) s = __fadd_rn(s, ql[c * G + threadIdx.x]);
    base[threadIdx.x] = s;
  }
  __syncthreads();
  const uint32_t mask = (1u << p.bits) - 1;
  const int32_t per_word = 32 / p.bits;
  for (int32_t i = threadIdx.x; i < p.group; i += blockDim.x) {
    const uint32_t* w = codes + static_cast<int64_t>(i) * words;
    float s[G];
#pragma unroll
    for (int h = 0; h < G; ++h) s[h] = 0.f;
    for (int32_t k = 0; k < words; ++k) {
      uint32_t x = w[k];
      const float* qk = qs + k * per_word * G;
#pragma unroll 4
      for (int32_t l = 0; l < per_word; ++l, x >>= p.bits) {
        // The code as a float without a conversion instruction: 2^23 + code, less 2^23 (exact).
        const float code = __fsub_rn(__uint_as_float(0x4B000000u | (x & mask)), 8388608.f);
        float qc[G];
#pragma unroll
        for (int h = 0; h < G; ++h) qc[h] = qk[l * G + h];
#pragma unroll
        for (int h = 0; h < G; ++h) s[h] = __fadd_rn(s[h], __fmul_rn(qc[h], code));
      }
    }
#pragma unroll
    for (int h = 0; h < G; ++h) {
      out[h * p.score_stride + static_cast<int64_t>(g) * p.group + i] =
          __fmul_rn(__fadd_rn(base[h], s[h]), p.scale);
    }
  }
}

template <typename T>
cudaError_t LaunchScores(const CompressedScoreParams& p, int group_heads, cudaStream_t stream) {
  const dim3 grid(p.max_groups + 1, p.num_kv_heads, p.num_seqs);
  const int threads = std::min(p.group, 256);
  const size_t smem = (3 * static_cast<size_t>(group_heads) * p.head_dim + 8) * sizeof(float);
  switch (group_heads) {
    case 1:
      CompressedScoresKernel<T, 1><<<grid, threads, smem, stream>>>(p);
      break;
    case 2:
      CompressedScoresKernel<T, 2><<<grid, threads, smem, stream>>>(p);
      break;
    case 4:
      CompressedScoresKernel<T, 4><<<grid, threads, smem, stream>>>(p);
      break;
    case 8:
      CompressedScoresKernel<T, 8><<<grid, threads, smem, stream>>>(p);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
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
      (3 * static_cast<int64_t>(p.num_q_heads / p.num_kv_heads) * p.head_dim + 8) * 4 >
          48 * 1024 ||
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
