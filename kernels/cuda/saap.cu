#include <algorithm>
#include <array>
#include <climits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/saap.h"

namespace kvsparse::kernels::cuda {
namespace {

constexpr int kAssignThreads = 128;
constexpr int kSelectThreads = 512;
constexpr int kSelectWarps = kSelectThreads / 32;
constexpr int kSaapChunk = 1024;  // tokens per block of the count and write kernels

size_t Aligned4(size_t n) { return (n + 3) / 4 * 4; }  // floats, to 16 bytes

// Coordinates i and i + d/2 of a post-RoPE vector at `position` back to pre-RoPE, as SaapUnrope:
// the angle in double, cos / sin rounded to float, separate multiplies and adds in fp32.
__device__ __forceinline__ void UnropePair(const SaapLayerWeights& w, int64_t position, int i,
                                           float inv_s, float y1, float y2, float* o1, float* o2) {
  const double a = static_cast<double>(position) * static_cast<double>(w.inv_freq[i]);
  const float c = static_cast<float>(cos(a)), s = static_cast<float>(sin(a));
  *o1 = __fmul_rn(__fadd_rn(__fmul_rn(y1, c), __fmul_rn(y2, s)), inv_s);
  *o2 = __fmul_rn(__fsub_rn(__fmul_rn(y2, c), __fmul_rn(y1, s)), inv_s);
}

// Vector row (d elements of T at x) un-RoPEd into x_out (shared).
template <typename T>
__device__ void UnropeRow(const SaapLayerWeights& w, const void* x, int64_t row, int64_t position,
                          float* x_out) {
  const int half = w.head_dim / 2;
  const float inv_s = __fdiv_rn(1.f, w.rope_scale);
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const int64_t base = row * w.head_dim;
    UnropePair(w, position, i, inv_s, LoadElem<T>(x, base + i), LoadElem<T>(x, base + i + half),
               &x_out[i], &x_out[i + half]);
  }
}

// Sequential fp32 dot product of column `col` of a row-major [n][stride] matrix (the packed,
// transposed weights: a warp's threads read consecutive columns, one coalesced load per
// coordinate) with b, ascending coordinates, separate multiply and add (the CPU's order).
__device__ __forceinline__ float ColumnDot(const float* __restrict__ m, int stride, int col,
                                           const float* b, int n) {
  float z = 0.f;
#pragma unroll 8
  for (int i = 0; i < n; ++i)
    z = __fadd_rn(z, __fmul_rn(m[static_cast<int64_t>(i) * stride + col], b[i]));
  return z;
}

// (value, index) pairs: larger value first, then the lower index.
__device__ __forceinline__ bool Beats(float v, int c, float ov, int oc) {
  return v > ov || (v == ov && c < oc);
}

// One block per key: un-RoPE, then each thread scores its centroids in ascending order and the
// block reduces to the best.
template <typename T>
__global__ void __launch_bounds__(kAssignThreads) SaapAssignKernel(SaapAssignParams p) {
  extern __shared__ float ssm[];  // x [d], then per warp (value, index)
  float* x = ssm;
  float* wv = x + p.w.head_dim;
  int* wi = reinterpret_cast<int*>(wv + kAssignThreads / 32);
  const int key = blockIdx.x;
  UnropeRow<T>(p.w, p.x, key, p.first_position + key, x);
  __syncthreads();
  const int d = p.w.head_dim, C = p.w.clusters;
  const float* cent = p.w.centroids + static_cast<int64_t>(p.kv_head) * C * d;  // [d][C]
  float best_v = kNegInf;
  int best_c = INT_MAX;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    const float dot = ColumnDot(cent, C, c, x, d);
    if (dot > best_v) {  // strict, ascending c: ties to the lower index
      best_v = dot;
      best_c = c;
    }
  }
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_down_sync(0xffffffffu, best_v, off);
    const int oc = __shfl_down_sync(0xffffffffu, best_c, off);
    if (Beats(ov, oc, best_v, best_c)) {
      best_v = ov;
      best_c = oc;
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    wv[warp] = best_v;
    wi[warp] = best_c;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kAssignThreads / 32; ++w) {
      if (Beats(wv[w], wi[w], best_v, best_c)) {
        best_v = wv[w];
        best_c = wi[w];
      }
    }
    p.out[key * p.out_stride] = best_c == INT_MAX ? 0u : static_cast<uint32_t>(best_c);
  }
}

// One block per (b, j): the group's bucket masses and the probes (visit[i * C + c]).
template <typename T>
__global__ void __launch_bounds__(kSelectThreads)
    SaapProbeKernel(SaapSelectParams p, uint8_t* visit_out) {
  const SaapLayerWeights& w = p.w;
  const int d = w.head_dim, C = w.clusters, hid = w.hidden;
  const int H = w.num_q_heads, Hkv = w.num_kv_heads, G = H / Hkv;
  const int i = blockIdx.x, b = i / Hkv, j = i % Hkv;
  extern __shared__ double dsm[];
  double* mass = dsm;                             // [C]
  float* e = reinterpret_cast<float*>(mass + C);  // [C]
  float* x = e + C;                               // [d]
  float* hv = x + d;                              // [hid]
  float* red = hv + hid;                          // [kSelectWarps]
  __shared__ double sum_s;
  __shared__ float max_s;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n = min(p.seq_lens[b], p.max_seq_len);
  const int64_t position = n > 0 ? n - 1 : 0;
  for (int c = threadIdx.x; c < C; c += blockDim.x) mass[c] = 0.0;
  for (int g = 0; g < G; ++g) {
    const int h = j * G + g;
    UnropeRow<T>(w, p.q, static_cast<int64_t>(b) * H + h, position, x);
    __syncthreads();
    const float* w1 = w.w1 + static_cast<int64_t>(h) * hid * d;  // [d][hid]
    for (int o = threadIdx.x; o < hid; o += blockDim.x) {
      const float z = __fadd_rn(ColumnDot(w1, hid, o, x, d), w.b1[h * hid + o]);
      hv[o] = z > 0.f ? z : 0.f;  // std::max(0.f, z): NaN and -0 give +0
    }
    __syncthreads();
    const float* w2 = w.w2 + static_cast<int64_t>(h) * C * hid;  // [hid][C]
    float mx = kNegInf;
    for (int o = threadIdx.x; o < C; o += blockDim.x) {
      e[o] = __fadd_rn(ColumnDot(w2, C, o, hv, hid), w.b2[h * C + o]);
      mx = fmaxf(mx, e[o]);
    }
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    if (lane == 0) red[warp] = mx;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int k = 1; k < kSelectWarps; ++k) mx = fmaxf(mx, red[k]);
      max_s = mx;
    }
    __syncthreads();
    mx = max_s;
    for (int o = threadIdx.x; o < C; o += blockDim.x) {
      e[o] = static_cast<float>(exp(static_cast<double>(__fsub_rn(e[o], mx))));
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // the normaliser in the reference's order
      double s = 0.0;
      for (int o = 0; o < C; ++o) s += e[o];
      sum_s = s;
    }
    __syncthreads();
    for (int o = threadIdx.x; o < C; o += blockDim.x) {
      mass[o] += static_cast<double>(static_cast<float>(static_cast<double>(e[o]) / sum_s));
    }
    __syncthreads();
  }
  // The probes: the buckets of rank < probes by (mass descending, index ascending).
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    const double m = mass[c];
    int rank = 0;
    for (int o = 0; o < C && rank < p.probes; ++o) rank += mass[o] > m || (mass[o] == m && o < c);
    visit_out[static_cast<int64_t>(i) * C + c] = rank < p.probes;
  }
}

// Whether token t of (b, j) is a row, and whether it is one by its bucket (not sink / window).
struct Keep {
  bool row, from_bucket;
};
__device__ __forceinline__ Keep KeepToken(const SaapSelectParams& p, const uint32_t* kb,
                                          const uint8_t* visit, int n, int t) {
  if (t >= n) return {false, false};
  const int sink_end = min(p.sink_tokens, n);
  const int win_begin = max(sink_end, n - p.local_tokens);
  if (t < sink_end || t >= win_begin) return {true, false};
  const uint32_t bk = kb[t * p.bucket_stride];
  const bool in = bk < static_cast<uint32_t>(p.w.clusters) && visit[bk];
  return {in, in};
}

// Loads (b, j)'s visit flags into shared memory.
__device__ __forceinline__ void LoadVisit(const uint8_t* visit, int i, int C, uint8_t* out) {
  for (int c = threadIdx.x; c < C; c += blockDim.x) out[c] = visit[static_cast<int64_t>(i) * C + c];
  __syncthreads();
}

// Grid (chunks, B * Hkv): the rows and bucket rows of each chunk of kSaapChunk tokens.
__global__ void __launch_bounds__(kSelectThreads)
    SaapCountKernel(SaapSelectParams p, const uint8_t* visit, int32_t* chunk_rows,
                    int32_t* chunk_bucket_rows) {
  extern __shared__ uint8_t vsm[];
  __shared__ int wsum[kSelectWarps][2];
  const int i = blockIdx.y, b = i / p.w.num_kv_heads, ch = blockIdx.x, chunks = gridDim.x;
  LoadVisit(visit, i, p.w.clusters, vsm);
  const int n = min(p.seq_lens[b], p.max_seq_len);
  const uint32_t* kb = p.bucket_heads[i];
  int rows = 0, from_b = 0;
  for (int t = ch * kSaapChunk + threadIdx.x; t < min(n, (ch + 1) * kSaapChunk); t += blockDim.x) {
    const Keep k = KeepToken(p, kb, vsm, n, t);
    rows += k.row;
    from_b += k.from_bucket;
  }
  for (int off = 16; off > 0; off >>= 1) {
    rows += __shfl_xor_sync(0xffffffffu, rows, off);
    from_b += __shfl_xor_sync(0xffffffffu, from_b, off);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    wsum[warp][0] = rows;
    wsum[warp][1] = from_b;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int k = 1; k < kSelectWarps; ++k) {
      rows += wsum[k][0];
      from_b += wsum[k][1];
    }
    chunk_rows[static_cast<int64_t>(i) * chunks + ch] = rows;
    chunk_bucket_rows[static_cast<int64_t>(i) * chunks + ch] = from_b;
  }
}

// Grid (chunks, B * Hkv): each chunk's rows written in token order after the earlier chunks'
// (block-wide compaction), their positions for every query head of the group; the last chunk's
// block writes the totals.
__global__ void __launch_bounds__(kSelectThreads)
    SaapWriteKernel(SaapSelectParams p, const uint8_t* visit, const int32_t* chunk_rows,
                    const int32_t* chunk_bucket_rows) {
  extern __shared__ uint8_t vsm[];
  __shared__ int wcount[kSelectWarps];
  __shared__ int base_s;
  const int H = p.w.num_q_heads, Hkv = p.w.num_kv_heads, G = H / Hkv;
  const int i = blockIdx.y, b = i / Hkv, j = i % Hkv, ch = blockIdx.x, chunks = gridDim.x;
  LoadVisit(visit, i, p.w.clusters, vsm);
  const int32_t* cr = chunk_rows + static_cast<int64_t>(i) * chunks;
  if (threadIdx.x == 0) {
    int s = 0;
    for (int k = 0; k < ch; ++k) s += cr[k];
    base_s = s;
  }
  __syncthreads();
  const int first = base_s;
  const int n = min(p.seq_lens[b], p.max_seq_len);
  const uint32_t* kb = p.bucket_heads[i];
  int32_t* tokens = p.out.tokens[i];
  int written = first;
  for (int t0 = ch * kSaapChunk; t0 < (ch + 1) * kSaapChunk && t0 < n; t0 += blockDim.x) {
    const int t = t0 + threadIdx.x;
    const bool keep = t < (ch + 1) * kSaapChunk && KeepToken(p, kb, vsm, n, t).row;
    written += BlockCompactRound<kSelectWarps>(keep, t, tokens, written, wcount);
  }
  for (int g = 0; g < G; ++g) {
    int32_t* pos = p.positions + (static_cast<int64_t>(b) * H + j * G + g) * p.max_seq_len;
    for (int r = first + threadIdx.x; r < written; r += blockDim.x) pos[r] = r;
  }
  if (ch == chunks - 1 && threadIdx.x == 0) {
    const int32_t* cb = chunk_bucket_rows + static_cast<int64_t>(i) * chunks;
    int from_b = 0;
    for (int k = 0; k < chunks; ++k) from_b += cb[k];
    *p.out.count[i] = written;
    for (int g = 0; g < G; ++g) {
      const int64_t bh = static_cast<int64_t>(b) * H + j * G + g;
      p.counts[bh] = written;
      if (p.budgets != nullptr) p.budgets[bh] = from_b;
    }
  }
}

// The select workspace: visit flags [B * Hkv, C], then per (b, j) and chunk the rows and the
// bucket rows.
struct SelectSpace {
  uint8_t* visit = nullptr;
  int32_t* chunk_rows = nullptr;
  int32_t* chunk_bucket_rows = nullptr;
  size_t bytes = 0;
  int chunks = 0;
};
SelectSpace CarveSelect(const SaapSelectParams& p, void* base) {
  SelectSpace s;
  s.chunks = std::max(1, (p.max_seq_len + kSaapChunk - 1) / kSaapChunk);
  const size_t bk = static_cast<size_t>(p.batch) * p.w.num_kv_heads;
  auto align = [](size_t x) { return (x + 255) / 256 * 256; };
  char* at = static_cast<char*>(base);
  const size_t visit = align(bk * p.w.clusters), counts = align(sizeof(int32_t) * bk * s.chunks);
  if (at != nullptr) {
    s.visit = reinterpret_cast<uint8_t*>(at);
    s.chunk_rows = reinterpret_cast<int32_t*>(at + visit);
    s.chunk_bucket_rows = reinterpret_cast<int32_t*>(at + visit + counts);
  }
  s.bytes = visit + 2 * counts;
  return s;
}

bool ViewOk(const SaapLayerWeights& w) {
  return w.num_kv_heads > 0 && w.num_q_heads % w.num_kv_heads == 0 && w.head_dim >= 2 &&
         w.head_dim % 2 == 0 && w.head_dim <= 256 && w.clusters >= 2 &&
         w.clusters <= kSaapMaxClusters && w.hidden >= 1 && w.hidden <= kSaapMaxHidden &&
         w.inv_freq != nullptr && w.centroids != nullptr && w.w1 != nullptr && w.b1 != nullptr &&
         w.w2 != nullptr && w.b2 != nullptr;
}

}  // namespace

bool SaapSupports(const SaapWeights& w) {
  return w.clusters <= kSaapMaxClusters && w.hidden <= kSaapMaxHidden && w.head_dim <= 256;
}

// The six arrays of a packed layer in their order (inv_freq, centroids, w1, b1, w2, b2) and
// their float counts; each starts 16-byte aligned.
static std::array<size_t, 6> SaapArrayFloats(const SaapWeights& w) {
  const size_t d = w.head_dim, C = w.clusters, hid = w.hidden;
  const size_t H = w.num_q_heads, Hkv = w.num_kv_heads;
  return {d / 2, Hkv * C * d, H * hid * d, H * hid, H * C * hid, H * C};
}

size_t SaapLayerFloats(const SaapWeights& w) {
  size_t n = 0;
  for (size_t a : SaapArrayFloats(w)) n += Aligned4(a);
  return n;
}

void PackSaapLayer(const SaapWeights& w, int32_t layer, std::vector<float>* out) {
  const size_t d = w.head_dim, C = w.clusters, hid = w.hidden;
  const size_t H = w.num_q_heads, Hkv = w.num_kv_heads, l = layer;
  auto pad = [&](size_t n) { out->resize(out->size() + (Aligned4(n) - n), 0.f); };
  auto put = [&](const float* src, size_t n) {
    out->insert(out->end(), src, src + n);
    pad(n);
  };
  // `count` row-major [rows][cols] matrices, each transposed to [cols][rows].
  auto put_transposed = [&](const float* src, size_t count, size_t rows, size_t cols) {
    for (size_t m = 0; m < count; ++m) {
      const float* a = src + m * rows * cols;
      for (size_t c = 0; c < cols; ++c) {
        for (size_t r = 0; r < rows; ++r) out->push_back(a[r * cols + c]);
      }
    }
    pad(count * rows * cols);
  };
  put(w.inv_freq.data(), d / 2);
  put_transposed(w.centroids.data() + l * Hkv * C * d, Hkv, C, d);
  put_transposed(w.w1.data() + l * H * hid * d, H, hid, d);
  put(w.b1.data() + l * H * hid, H * hid);
  put_transposed(w.w2.data() + l * H * C * hid, H, C, hid);
  put(w.b2.data() + l * H * C, H * C);
}

SaapLayerWeights SaapLayerView(const SaapWeights& w, const float* packed) {
  SaapLayerWeights v;
  v.num_q_heads = w.num_q_heads;
  v.num_kv_heads = w.num_kv_heads;
  v.head_dim = w.head_dim;
  v.clusters = w.clusters;
  v.hidden = w.hidden;
  v.rope_scale = w.rope_scale;
  const float** arrays[] = {&v.inv_freq, &v.centroids, &v.w1, &v.b1, &v.w2, &v.b2};
  const std::array<size_t, 6> sizes = SaapArrayFloats(w);
  const float* at = packed;
  for (size_t i = 0; i < sizes.size(); ++i) {
    *arrays[i] = at;
    at += Aligned4(sizes[i]);
  }
  return v;
}

cudaError_t SaapAssignKeys(const SaapAssignParams& p, cudaStream_t stream) {
  if (!ViewOk(p.w) || p.num_keys < 0 || p.kv_head < 0 || p.kv_head >= p.w.num_kv_heads ||
      p.first_position < 0) {
    return cudaErrorInvalidValue;
  }
  if (p.num_keys == 0) return cudaSuccess;
  if (p.x == nullptr || p.out == nullptr) return cudaErrorInvalidValue;
  const size_t smem = sizeof(float) * p.w.head_dim + (sizeof(float) + sizeof(int)) * 4;
  return ByDtype(p.dtype, [&](auto tag) {
    SaapAssignKernel<decltype(tag)><<<p.num_keys, kAssignThreads, smem, stream>>>(p);
  });
}

size_t SaapSelectWorkspaceBytes(const SaapSelectParams& p) { return CarveSelect(p, nullptr).bytes; }

cudaError_t SaapSelect(const SaapSelectParams& p, void* workspace, size_t workspace_bytes,
                       cudaStream_t stream) {
  if (!ViewOk(p.w) || p.batch < 0 || p.probes < 1 || p.probes > p.w.clusters || p.sink_tokens < 0 ||
      p.local_tokens < 0 || p.max_seq_len < 0 || p.out.capacity < p.max_seq_len ||
      p.w.num_q_heads / p.w.num_kv_heads > 32) {
    return cudaErrorInvalidValue;
  }
  if (p.batch == 0) return cudaSuccess;
  const SelectSpace ws = CarveSelect(p, workspace);
  if (p.q == nullptr || p.bucket_heads == nullptr || p.seq_lens == nullptr ||
      p.out.tokens == nullptr || p.out.count == nullptr || p.positions == nullptr ||
      p.counts == nullptr || workspace == nullptr || workspace_bytes < ws.bytes) {
    return cudaErrorInvalidValue;
  }
  const int C = p.w.clusters;
  const unsigned bk = static_cast<unsigned>(p.batch) * p.w.num_kv_heads;
  const size_t smem = sizeof(double) * C + sizeof(float) * (C + p.w.head_dim + p.w.hidden) +
                      sizeof(float) * kSelectWarps;
  KVSPARSE_CUDA_RETURN_IF_ERROR(ByDtype(p.dtype, [&](auto tag) {
    SaapProbeKernel<decltype(tag)><<<bk, kSelectThreads, smem, stream>>>(p, ws.visit);
  }));
  const dim3 grid(ws.chunks, bk);
  SaapCountKernel<<<grid, kSelectThreads, C, stream>>>(p, ws.visit, ws.chunk_rows,
                                                       ws.chunk_bucket_rows);
  KVSPARSE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  SaapWriteKernel<<<grid, kSelectThreads, C, stream>>>(p, ws.visit, ws.chunk_rows,
                                                       ws.chunk_bucket_rows);
  return cudaGetLastError();
}

}  // namespace kvsparse::kernels::cuda
