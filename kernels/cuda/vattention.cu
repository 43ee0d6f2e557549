#include <algorithm>
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/hash_topk.h"
#include "kernels/cuda/score_topk.h"
#include "kernels/cuda/selected_rows.h"
#include "kernels/cuda/vattention.h"
#include "kernels/philox.h"

namespace kvsparse::kernels::cuda {
namespace {

constexpr int kSampleThreads = 1024;
constexpr int kSampleWarps = kSampleThreads / 32;
constexpr int kBuckets = 4096;  // top 12 bits of the 64-bit priority keys
constexpr int kCand = 2048;     // keys in the threshold bucket we can resolve
constexpr int kRowThreads = 256;
constexpr int kDeltaGrid = 1024;  // as the CPU reference
constexpr int kMaxLen = 1 << 22;

struct Layout {
  int32_t fixed_stride = 0;
  int32_t list_stride = 0;
  int32_t* fixed = nullptr;
  int32_t* fixed_count = nullptr;
  int32_t* base = nullptr;
  int32_t* base_count = nullptr;
  int32_t* dyn = nullptr;
  int32_t* dyn_count = nullptr;
  int64_t* budget = nullptr;
  float* epsilon = nullptr;  // [B * H]: the relative error the final sample promises (Step 6)
  uint64_t* keys = nullptr;
  float* logits = nullptr;
  // Importance mode only (p.scores set): per (b, h), the residual's tokens in order and the
  // float64 cumulative sums of e^{s~ - m} over them (cdf aliases keys, which this mode does not
  // use), draws per residual rank, and L = ln(Z~ / n_s).
  int32_t* prop_tok = nullptr;
  double* cdf = nullptr;
  int32_t* draws = nullptr;
  double* log_scale = nullptr;
  // The union of each (b, j)'s G query heads' rows (every row read once for the group), in two
  // parts: A = U_g (I_f u B) (read for the statistics), then R = U_g (I_f u I_dyn) \ A (read
  // for the estimate). Per (b, j) = k: membership bits and exclusive popcount prefixes over
  // words; the tokens of A and R, ascending; their counts; R's rows go after A's (dest).
  int32_t words = 0;
  uint32_t* bits_a = nullptr;
  uint32_t* bits_r = nullptr;
  int32_t* pref_a = nullptr;
  int32_t* pref_r = nullptr;
  int32_t* tokens_a = nullptr;  // [B * Hkv, list_stride]
  int32_t* tokens_r = nullptr;
  int32_t* dest_r = nullptr;
  int32_t* count_a = nullptr;  // [B * Hkv]
  int32_t* count_r = nullptr;
  int32_t* fetched = nullptr;  // [B * Hkv]: |A| + |R|
  // Each selected row's location in its (b, j)'s row set: [B * H, fixed_stride] / [list_stride].
  int32_t* pos_fixed = nullptr;
  int32_t* pos_base = nullptr;
  int32_t* pos_dyn = nullptr;
  // The row set: K and V rows of (b, j) at [k * list_stride + location] rows of head_dim.
  void* rows_k = nullptr;
  void* rows_v = nullptr;
  // FetchRows' tables, per part: tokens, count, k, v (and dest for R) of each (b, j).
  int32_t** tab_tokens = nullptr;  // [2 * B * Hkv]
  int32_t** tab_count = nullptr;
  void** tab_k = nullptr;
  void** tab_v = nullptr;
  int32_t** tab_dest = nullptr;  // [B * Hkv]
  void* topk_ws = nullptr;
  size_t topk_bytes = 0;
  size_t total = 0;
};

// The fields the two top-k selectors (HashTopKLaunchParams, ScoreTopKLaunchParams) share: shape,
// lengths, sink, window and k.
template <typename T>
T SelectorParams(const VAttentionLaunchParams& p) {
  T t;
  t.batch = p.shape.batch;
  t.num_q_heads = p.shape.num_q_heads;
  t.seq_lens = p.shape.seq_lens;
  t.max_seq_len = p.shape.max_seq_len;
  t.fixed = p.fixed;
  return t;
}

HashTopKLaunchParams TopkParams(const VAttentionLaunchParams& p) {
  HashTopKLaunchParams t = SelectorParams<HashTopKLaunchParams>(p);
  t.key_heads = p.key_heads;
  t.bits = p.bits;
  t.q_sigs = p.q_sigs;
  t.k_sigs = p.k_sigs;
  t.k_sig_heads = p.k_sig_heads;
  t.k_batch_stride = p.k_batch_stride;
  t.k_head_stride = p.k_head_stride;
  t.k_token_stride = p.k_token_stride;
  return t;
}

ScoreTopKLaunchParams ScoreParams(const VAttentionLaunchParams& p) {
  ScoreTopKLaunchParams t = SelectorParams<ScoreTopKLaunchParams>(p);
  t.scores = p.scores;
  t.score_stride = p.scores_stride;
  return t;
}

Layout MakeLayout(const VAttentionLaunchParams& p, void* base) {
  Layout l;
  const size_t bh = static_cast<size_t>(p.shape.batch) * p.shape.num_q_heads;
  const bool importance = VAttentionImportance(p);
  const HashTopKLaunchParams tp = TopkParams(p);
  l.fixed_stride = std::max(1, importance ? ScoreParams(p).MaxSelected() : tp.MaxSelected());
  l.list_stride = std::max(1, p.shape.max_seq_len);
  char* c = static_cast<char*>(base);
  size_t used = 0;
  auto take = [&](size_t bytes) -> void* {
    void* r = c == nullptr ? nullptr : c + used;
    used += AlignUp(bytes, 256);
    return r;
  };
  l.fixed = static_cast<int32_t*>(take(bh * l.fixed_stride * 4));
  l.fixed_count = static_cast<int32_t*>(take(bh * 4));
  l.base = static_cast<int32_t*>(take(bh * l.list_stride * 4));
  l.base_count = static_cast<int32_t*>(take(bh * 4));
  l.dyn = static_cast<int32_t*>(take(bh * l.list_stride * 4));
  l.dyn_count = static_cast<int32_t*>(take(bh * 4));
  l.budget = static_cast<int64_t*>(take(bh * 8));
  l.epsilon = static_cast<float*>(take(bh * 4));
  l.keys = static_cast<uint64_t*>(take(bh * l.list_stride * 8));
  l.logits = static_cast<float*>(
      take(bh * (static_cast<size_t>(l.fixed_stride) + static_cast<size_t>(l.list_stride)) * 4));
  if (importance) {
    l.cdf = reinterpret_cast<double*>(l.keys);
    l.prop_tok = static_cast<int32_t*>(take(bh * l.list_stride * 4));
    l.draws = static_cast<int32_t*>(take(bh * l.list_stride * 4));
    l.log_scale = static_cast<double*>(take(bh * 8));
  }
  const size_t bk = static_cast<size_t>(p.shape.batch) * p.shape.num_kv_heads;
  const size_t row_bytes = static_cast<size_t>(p.shape.head_dim) * DTypeSize(p.shape.dtype);
  l.words = (l.list_stride + 31) / 32;
  l.bits_a = static_cast<uint32_t*>(take(bk * l.words * 4));
  l.bits_r = static_cast<uint32_t*>(take(bk * l.words * 4));
  l.pref_a = static_cast<int32_t*>(take(bk * l.words * 4));
  l.pref_r = static_cast<int32_t*>(take(bk * l.words * 4));
  l.tokens_a = static_cast<int32_t*>(take(bk * l.list_stride * 4));
  l.tokens_r = static_cast<int32_t*>(take(bk * l.list_stride * 4));
  l.dest_r = static_cast<int32_t*>(take(bk * l.list_stride * 4));
  l.count_a = static_cast<int32_t*>(take(bk * 4));
  l.count_r = static_cast<int32_t*>(take(bk * 4));
  l.fetched = static_cast<int32_t*>(take(bk * 4));
  l.pos_fixed = static_cast<int32_t*>(take(bh * l.fixed_stride * 4));
  l.pos_base = static_cast<int32_t*>(take(bh * l.list_stride * 4));
  l.pos_dyn = static_cast<int32_t*>(take(bh * l.list_stride * 4));
  l.rows_k = take(bk * l.list_stride * row_bytes);
  l.rows_v = take(bk * l.list_stride * row_bytes);
  l.tab_tokens = static_cast<int32_t**>(take(2 * bk * sizeof(void*)));
  l.tab_count = static_cast<int32_t**>(take(2 * bk * sizeof(void*)));
  l.tab_k = static_cast<void**>(take(2 * bk * sizeof(void*)));
  l.tab_v = static_cast<void**>(take(2 * bk * sizeof(void*)));
  l.tab_dest = static_cast<int32_t**>(take(bk * sizeof(void*)));
  l.topk_bytes = importance ? 0 : HashTopKWorkspaceBytes(tp);
  l.topk_ws = take(l.topk_bytes);
  l.total = used;
  return l;
}

// (b, h)'s fixed set (fcount tokens at fx) as a bitmap of `words` 32-token words in shared memory.
// Ends with a barrier: every thread sees the whole set.
__device__ void MarkFixed(uint32_t* bitmap, int words, const int32_t* fx, int fcount) {
  for (int i = threadIdx.x; i < words; i += blockDim.x) bitmap[i] = 0u;
  __syncthreads();
  for (int i = threadIdx.x; i < fcount; i += blockDim.x) {
    atomicOr(&bitmap[fx[i] / 32], 1u << (fx[i] % 32));
  }
  __syncthreads();
}

// Whether token t is in the residual (not in the fixed set MarkFixed drew).
__device__ __forceinline__ bool Residual(const uint32_t* bitmap, int t) {
  return ((bitmap[t / 32] >> (t % 32)) & 1u) == 0;
}

// Uniform sample without replacement of `count` residual tokens ([0, n) minus the fixed set):
// the count smallest (Draw64(t), t) pairs of the (tag, b, h) stream, written ascending (the
// CPU reference's SampleWithoutReplacement). kBase: count = min(n_s, max(2, round(rate n_s)));
// otherwise count = budget[bh]. out_count[bh] = -1 if the threshold bucket overflows kCand.
template <bool kBase>
__global__ void __launch_bounds__(kSampleThreads)
    VattSampleKernel(VAttentionLaunchParams p, Layout l, int32_t* __restrict__ out,
                     int32_t* __restrict__ out_count) {
  extern __shared__ uint64_t dsm64[];
  uint64_t* ck = dsm64;                                             // [kCand] candidate keys
  int* ct = reinterpret_cast<int*>(ck + kCand);                     // [kCand] their tokens
  int* hist = ct + kCand;                                           // [kBuckets]
  uint32_t* bitmap = reinterpret_cast<uint32_t*>(hist + kBuckets);  // fixed-set membership
  __shared__ int ws[32];
  __shared__ int sm_tau, sm_below, sm_ncand, sm_thr_tok;
  __shared__ unsigned long long sm_thr_key;
  const int64_t bh = blockIdx.x;
  const int b = static_cast<int>(bh / p.shape.num_q_heads);
  const int h = static_cast<int>(bh % p.shape.num_q_heads);
  const int tid = threadIdx.x;
  const int n = p.shape.seq_lens[b];
  const int words = (n + 31) / 32;
  const int fcount = l.fixed_count[bh];
  const int64_t n_s = n - fcount;
  int64_t count;
  if (kBase) {
    count = min(
        n_s,
        max(int64_t{2}, static_cast<int64_t>(floor(static_cast<double>(p.base_rate) * n_s + 0.5))));
  } else {
    count = l.budget[bh];
  }
  int32_t* dst = out + bh * l.list_stride;
  if (n_s <= 0 || count <= 0) {
    if (tid == 0) out_count[bh] = 0;
    return;
  }
  const bool all = count >= n_s;
  for (int i = tid; i < kBuckets; i += kSampleThreads) hist[i] = 0;
  if (tid == 0) sm_ncand = 0;
  MarkFixed(bitmap, words, l.fixed + bh * l.fixed_stride, fcount);
  auto residual = [&](int t) { return Residual(bitmap, t); };
  uint64_t* keys = l.keys + bh * l.list_stride;
  const PhiloxStream rng =
      SequenceStream({p.seed, p.seeds}, kBase ? RngTag::kVattBase : RngTag::kVattDynamic, b, h);
  if (!all) {
    for (int t = tid; t < n; t += kSampleThreads) {
      if (!residual(t)) continue;
      const uint64_t key = rng.Draw64(static_cast<uint32_t>(t));
      keys[t] = key;
      atomicAdd(&hist[key >> 52], 1);
    }
    __syncthreads();
    // Threshold bucket: the first whose cumulative count reaches `count`.
    constexpr int kPerThread = kBuckets / kSampleThreads;
    int local = 0;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) local += hist[tid * kPerThread + i];
    int total = 0;
    int cum = BlockExclusiveSum<kSampleWarps>(local, ws, &total);
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int c = hist[tid * kPerThread + i];
      if (cum < count && cum + c >= count) {
        sm_tau = tid * kPerThread + i;
        sm_below = cum;
      }
      cum += c;
    }
    __syncthreads();
    const int tau = sm_tau;
    for (int t = tid; t < n; t += kSampleThreads) {
      if (!residual(t) || static_cast<int>(keys[t] >> 52) != tau) continue;
      const int slot = atomicAdd(&sm_ncand, 1);
      if (slot < kCand) {
        ck[slot] = keys[t];
        ct[slot] = t;
      }
    }
    __syncthreads();
    if (sm_ncand > kCand) {
      if (tid == 0) out_count[bh] = -1;
      return;
    }
    const int m = sm_ncand;
    const int need = static_cast<int>(count) - sm_below;  // in [1, m]
    for (int i = tid; i < m; i += kSampleThreads) {
      int r = 0;
      for (int j = 0; j < m; ++j) r += (ck[j] < ck[i] || (ck[j] == ck[i] && ct[j] < ct[i])) ? 1 : 0;
      if (r == need - 1) {
        sm_thr_key = ck[i];
        sm_thr_tok = ct[i];
      }
    }
    __syncthreads();
  }
  const uint64_t thr_key = all ? 0 : sm_thr_key;
  const int thr_tok = all ? 0 : sm_thr_tok;
  constexpr int kPer = 4;
  int carry = 0;
  for (int c0 = 0; c0 < n; c0 += kSampleThreads * kPer) {
    const int t0 = c0 + tid * kPer;
    int flags = 0, local = 0;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int t = t0 + i;
      bool sel = false;
      if (t < n && residual(t)) {
        if (all) {
          sel = true;
        } else {
          const uint64_t key = keys[t];
          sel = key < thr_key || (key == thr_key && t <= thr_tok);
        }
      }
      if (sel) {
        flags |= 1 << i;
        ++local;
      }
    }
    int total = 0;
    int pos = carry + BlockExclusiveSum<kSampleWarps>(local, ws, &total);
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      if (flags & (1 << i)) dst[pos++] = t0 + i;
    }
    carry += total;
  }
  if (tid == 0) out_count[bh] = carry;
}

// Importance mode, the proposal (one block per (b, h), after the fixed set): the residual's
// tokens in order (prop_tok[r] for rank r), cdf[r] = sum over ranks <= r of e^{s~_t - m} in
// float64 (m: the residual's largest s~, as the CPU's ImportanceProposal), and
// L = m + ln(Z~) - ln(n_s) with Z~ = cdf[n_s - 1].
__global__ void __launch_bounds__(kSampleThreads)
    VattProposalKernel(VAttentionLaunchParams p, Layout l) {
  extern __shared__ uint32_t pbitmap[];  // fixed-set membership
  __shared__ int ws[32];
  __shared__ double dws[32];
  __shared__ float fred[32];
  const int64_t bh = blockIdx.x;
  const int b = static_cast<int>(bh / p.shape.num_q_heads);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int n = p.shape.seq_lens[b];
  const int words = (n + 31) / 32;
  const int fcount = l.fixed_count[bh];
  const int n_s = n - fcount;
  if (n_s <= 0) {
    if (tid == 0) l.log_scale[bh] = 0.0;
    return;
  }
  MarkFixed(pbitmap, words, l.fixed + bh * l.fixed_stride, fcount);
  auto residual = [&](int t) { return Residual(pbitmap, t); };
  const float* sc = p.scores + bh * p.scores_stride;
  float mx = -HUGE_VALF;
  for (int t = tid; t < n; t += kSampleThreads) {
    if (residual(t)) mx = fmaxf(mx, sc[t]);
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if (lane == 0) fred[warp] = mx;
  __syncthreads();
  float m = -HUGE_VALF;
  for (int w = 0; w < kSampleThreads / 32; ++w) m = fmaxf(m, fred[w]);
  const double md = static_cast<double>(m);
  int32_t* tok = l.prop_tok + bh * l.list_stride;
  double* cdf = l.cdf + bh * l.list_stride;
  constexpr int kPer = 4;
  int rcarry = 0;
  double dcarry = 0.0;
  for (int c0 = 0; c0 < n; c0 += kSampleThreads * kPer) {
    const int t0 = c0 + tid * kPer;
    double e[kPer];
    int flags = 0, cnt = 0;
    double part = 0.0;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int t = t0 + i;
      e[i] = 0.0;
      if (t < n && residual(t)) {
        e[i] = exp(static_cast<double>(sc[t]) - md);
        part += e[i];
        flags |= 1 << i;
        ++cnt;
      }
    }
    int rtot = 0;
    int r = rcarry + BlockExclusiveSum<kSampleWarps>(cnt, ws, &rtot);
    double dtot = 0.0;
    double acc = dcarry + BlockExclusiveSum<kSampleWarps>(part, dws, &dtot);
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      if (flags & (1 << i)) {
        acc += e[i];
        cdf[r] = acc;
        tok[r++] = t0 + i;
      }
    }
    rcarry += rtot;
    dcarry += dtot;
  }
  __syncthreads();  // cdf[n_s - 1] written
  if (tid == 0) {
    l.log_scale[bh] = md + log(cdf[n_s - 1]) - log(static_cast<double>(n_s));
  }
}

// Importance mode, a sample (one block per (b, h)): `count` i.i.d. draws from the proposal,
// draw j the first rank whose cdf exceeds u_j = (Draw64(j) >> 11) 2^-53 Z~ (the CPU's
// ImportanceProposal::Draw), written as tokens ascending with repeats. kBase: count = min(n_s,
// max(2, round(rate n_s))); otherwise count = budget[bh], and b >= n_s lists the residual once.
template <bool kBase>
__global__ void __launch_bounds__(kSampleThreads)
    VattDrawKernel(VAttentionLaunchParams p, Layout l, int32_t* __restrict__ out,
                   int32_t* __restrict__ out_count) {
  __shared__ int ws[32];
  const int64_t bh = blockIdx.x;
  const int b = static_cast<int>(bh / p.shape.num_q_heads);
  const int h = static_cast<int>(bh % p.shape.num_q_heads);
  const int tid = threadIdx.x;
  const int n = p.shape.seq_lens[b];
  const int n_s = n - l.fixed_count[bh];
  int64_t count;
  if (kBase) {
    count = min(
        static_cast<int64_t>(n_s),
        max(int64_t{2}, static_cast<int64_t>(floor(static_cast<double>(p.base_rate) * n_s + 0.5))));
  } else {
    count = l.budget[bh];
  }
  int32_t* dst = out + bh * l.list_stride;
  if (n_s <= 0 || count <= 0) {
    if (tid == 0) out_count[bh] = 0;
    return;
  }
  const int32_t* tok = l.prop_tok + bh * l.list_stride;
  const double* cdf = l.cdf + bh * l.list_stride;
  if (!kBase && count >= n_s) {  // the exact residual, weight 1
    for (int r = tid; r < n_s; r += kSampleThreads) dst[r] = tok[r];
    if (tid == 0) out_count[bh] = n_s;
    return;
  }
  int32_t* dr = l.draws + bh * l.list_stride;
  for (int r = tid; r < n_s; r += kSampleThreads) dr[r] = 0;
  __syncthreads();
  const double total = cdf[n_s - 1];
  const PhiloxStream rng =
      SequenceStream({p.seed, p.seeds},
                     kBase ? RngTag::kVattImportanceBase : RngTag::kVattImportanceDynamic, b, h);
  for (int64_t j = tid; j < count; j += kSampleThreads) {
    const double u =
        static_cast<double>(rng.Draw64(static_cast<uint32_t>(j)) >> 11) * 0x1p-53 * total;
    int lo = 0, hi = n_s;  // the first rank with cdf > u
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (cdf[mid] > u) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    atomicAdd(&dr[min(lo, n_s - 1)], 1);
  }
  __syncthreads();
  constexpr int kPer = 4;
  int carry = 0;
  for (int c0 = 0; c0 < n_s; c0 += kSampleThreads * kPer) {
    const int r0 = c0 + tid * kPer;
    int m[kPer], local = 0;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      m[i] = r0 + i < n_s ? dr[r0 + i] : 0;
      local += m[i];
    }
    int total_c = 0;
    int pos = carry + BlockExclusiveSum<kSampleWarps>(local, ws, &total_c);
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      for (int k = 0; k < m[i]; ++k) dst[pos++] = tok[r0 + i];
    }
    carry += total_c;
  }
  if (tid == 0) out_count[bh] = carry;
}

// The rows a (b, j) reads, once for its G query heads (one block per (b, j)). Part A (kDyn
// false): A = U_g (I_f u B); writes A's tokens (ascending) and each fixed and base row's location
// in the row set (its rank in A). Part R (kDyn true): R = U_g I_dyn \ A, placed after A's rows
// (I_f is in A); writes R's tokens, their destinations |A| + rank and each dyn row's location.
// Also FetchRows' tables of the part and, after R, the rows fetched |A| + |R|.
template <bool kDyn>
__global__ void __launch_bounds__(kSampleThreads)
    VattUnionKernel(VAttentionLaunchParams p, Layout l) {
  __shared__ int ws[32];
  const int k = blockIdx.x;
  const int hkv = p.shape.num_kv_heads, H = p.shape.num_q_heads, G = H / hkv;
  const int b = k / hkv, j = k % hkv;
  const int tid = threadIdx.x;
  const int n = p.shape.seq_lens[b];
  const int words = (n + 31) / 32;
  const int64_t kw = static_cast<int64_t>(k) * l.words;
  const int64_t kl = static_cast<int64_t>(k) * l.list_stride;
  uint32_t* bits = (kDyn ? l.bits_r : l.bits_a) + kw;
  int32_t* pref = (kDyn ? l.pref_r : l.pref_a) + kw;
  int32_t* tokens = (kDyn ? l.tokens_r : l.tokens_a) + kl;
  const uint32_t* bits_a = l.bits_a + kw;
  const int32_t* pref_a = l.pref_a + kw;
  for (int w = tid; w < words; w += kSampleThreads) bits[w] = 0u;
  __syncthreads();
  auto in_a = [&](int t) { return ((bits_a[t / 32] >> (t % 32)) & 1u) != 0; };
  auto rank = [&](const uint32_t* bm, const int32_t* pf, int t) {
    return pf[t / 32] + __popc(bm[t / 32] & ((1u << (t % 32)) - 1u));
  };
  for (int g = 0; g < G; ++g) {
    const int64_t bh = static_cast<int64_t>(b) * H + j * G + g;
    if (kDyn) {
      const int32_t* dy = l.dyn + bh * l.list_stride;
      const int nd = max(l.dyn_count[bh], 0);
      for (int i = tid; i < nd; i += kSampleThreads) {
        const int t = dy[i];
        if (!in_a(t)) atomicOr(&bits[t / 32], 1u << (t % 32));
      }
    } else {
      const int32_t* fx = l.fixed + bh * l.fixed_stride;
      const int32_t* bs = l.base + bh * l.list_stride;
      const int nf = l.fixed_count[bh], nb = max(l.base_count[bh], 0);
      for (int i = tid; i < nf + nb; i += kSampleThreads) {
        const int t = i < nf ? fx[i] : bs[i - nf];
        atomicOr(&bits[t / 32], 1u << (t % 32));
      }
    }
  }
  __syncthreads();
  // Ranks: an exclusive popcount scan over the words, listing the set bits in order.
  const int offset = kDyn ? l.count_a[k] : 0;
  int carry = 0;
  for (int w0 = 0; w0 < words; w0 += kSampleThreads) {
    const int w = w0 + tid;
    const uint32_t word = w < words ? bits[w] : 0u;
    int total = 0;
    int pos = carry + BlockExclusiveSum<kSampleWarps>(__popc(word), ws, &total);
    if (w < words) pref[w] = pos;
    for (uint32_t x = word; x != 0u; x &= x - 1u) {
      const int t = w * 32 + __ffs(x) - 1;
      if (kDyn) l.dest_r[kl + pos] = offset + pos;
      tokens[pos++] = t;
    }
    carry += total;
  }
  __syncthreads();  // pref complete
  for (int g = 0; g < G; ++g) {
    const int64_t bh = static_cast<int64_t>(b) * H + j * G + g;
    if (kDyn) {
      const int32_t* dy = l.dyn + bh * l.list_stride;
      int32_t* pd = l.pos_dyn + bh * l.list_stride;
      const int nd = max(l.dyn_count[bh], 0);
      for (int i = tid; i < nd; i += kSampleThreads) {
        const int t = dy[i];
        pd[i] = in_a(t) ? rank(bits_a, pref_a, t) : offset + rank(bits, pref, t);
      }
    } else {
      const int32_t* fx = l.fixed + bh * l.fixed_stride;
      const int32_t* bs = l.base + bh * l.list_stride;
      int32_t* pf = l.pos_fixed + bh * l.fixed_stride;
      int32_t* pb = l.pos_base + bh * l.list_stride;
      const int nf = l.fixed_count[bh], nb = max(l.base_count[bh], 0);
      for (int i = tid; i < nf; i += kSampleThreads) pf[i] = rank(bits, pref, fx[i]);
      for (int i = tid; i < nb; i += kSampleThreads) pb[i] = rank(bits, pref, bs[i]);
    }
  }
  if (tid == 0) {
    const int64_t bk = static_cast<int64_t>(p.shape.batch) * hkv;
    const int64_t e = (kDyn ? bk : 0) + k;
    const size_t row_bytes = static_cast<size_t>(p.shape.head_dim) * 2;
    (kDyn ? l.count_r : l.count_a)[k] = carry;
    l.tab_tokens[e] = tokens;
    l.tab_count[e] = (kDyn ? l.count_r : l.count_a) + k;
    l.tab_k[e] = static_cast<char*>(l.rows_k) + kl * row_bytes;
    l.tab_v[e] = static_cast<char*>(l.rows_v) + kl * row_bytes;
    if (kDyn) {
      l.tab_dest[k] = l.dest_r + kl;
      l.fetched[k] = offset + carry;
    }
  }
}

// Phi^{-1} (Acklam plus one Halley step), as the CPU reference.
__device__ double NormalQuantileDev(double p) {
  if (!(p > 0.0 && p < 1.0)) return p == 0.0 ? -HUGE_VAL : p == 1.0 ? HUGE_VAL : nan("");
  const double a[] = {-3.969683028665376e+01, 2.209460984245205e+02,  -2.759285104469687e+02,
                      1.383577518672690e+02,  -3.066479806614716e+01, 2.506628277459239e+00};
  const double bb[] = {-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
                       6.680131188771972e+01, -1.328068155288572e+01};
  const double c[] = {-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
                      -2.549732539343734e+00, 4.374664141464968e+00,  2.938163982698783e+00};
  const double d[] = {7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
                      3.754408661907416e+00};
  const double plow = 0.02425;
  double x;
  if (p < plow) {
    const double q = sqrt(-2 * log(p));
    x = (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
        ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1);
  } else if (p <= 1 - plow) {
    const double q = p - 0.5, r = q * q;
    x = (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q /
        (((((bb[0] * r + bb[1]) * r + bb[2]) * r + bb[3]) * r + bb[4]) * r + 1);
  } else {
    const double q = sqrt(-2 * log1p(-p));
    x = -(((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
        ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1);
  }
  const double e = 0.5 * erfc(-x / sqrt(2.0)) - p;
  const double u = e * 2.5066282746310002 * exp(x * x / 2);
  return x - u / (1 + x * u / 2);
}

__device__ double AlphaD(bool clt, double dl) {
  return clt ? NormalQuantileDev(1.0 - dl / 2.0) : sqrt(log(2.0 / dl) / 2.0);
}
__device__ double AlphaN(bool clt, double dl) {
  return clt ? NormalQuantileDev(1.0 - dl / 2.0) : sqrt(2.0 * log(2.0 / dl));
}

// Statistics of I_f and the base sample in float64 and the budget b (steps 4-5), one block per
// (b, h). Logits are stashed in l.logits so that c = their max shifts every exponential.
template <typename T, int D>
__global__ void __launch_bounds__(kRowThreads) VattStatsKernel(VAttentionLaunchParams p, Layout l) {
  constexpr int L = D / 8, R = 32 / L, NW = kRowThreads / 32;
  __shared__ float red[NW];
  __shared__ double dred[NW][6];
  // Per coordinate: sum x v (fixed); sum y, sum y^2, sum x y (base).
  __shared__ double dims[4][D];
  __shared__ double best_v[kRowThreads];
  __shared__ int best_j[kRowThreads];
  const DecodeShape& s = p.shape;
  const int64_t bh = blockIdx.x;
  const int b = static_cast<int>(bh / s.num_q_heads);
  const int h = static_cast<int>(bh % s.num_q_heads);
  const int G = s.num_q_heads / s.num_kv_heads;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, row = lane / L, lr = lane % L;
  const int n = s.seq_lens[b];
  const int nf = l.fixed_count[bh], nb = max(l.base_count[bh], 0);
  const int rows = nf + nb;
  const int64_t n_s = n - nf;
  // Rows from the group's row set (VattUnionKernel, FetchRows): locations, not tokens.
  const int32_t* fx = l.pos_fixed + bh * l.fixed_stride;
  const int32_t* bs = l.pos_base + bh * l.list_stride;
  float* logits = l.logits + bh * (static_cast<int64_t>(l.fixed_stride) + l.list_stride);
  // Importance mode: a base draw's effective logit s_t - s~_t + L (its token from the list).
  const bool importance = p.scores != nullptr;
  const int32_t* base_tok = l.base + bh * l.list_stride;
  const float* approx = importance ? p.scores + bh * p.scores_stride : nullptr;
  const double log_scale = importance ? l.log_scale[bh] : 0.0;
  const int64_t set = (static_cast<int64_t>(b) * s.num_kv_heads + h / G) * l.list_stride;
  const uint16_t* krows = static_cast<const uint16_t*>(l.rows_k) + set * D + lr * 8;
  const uint16_t* vrows = static_cast<const uint16_t*>(l.rows_v) + set * D + lr * 8;
  float qf[8];
  Unpack8<T>(*reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(s.q) + bh * D + lr * 8),
             qf);
  for (int i = tid; i < D; i += kRowThreads)
    dims[0][i] = dims[1][i] = dims[2][i] = dims[3][i] = 0.0;
  // Logits of every row, natural units.
  float mx = -HUGE_VALF;
  for (int i0 = warp * R; i0 < rows; i0 += NW * R) {  // uniform over the warp (shuffles)
    const int i = i0 + row;
    const bool valid = i < rows;
    const int loc = !valid ? 0 : i < nf ? fx[i] : bs[i - nf];
    float kf[8];
    Unpack8<T>(valid ? LoadStream16(krows + static_cast<int64_t>(loc) * D) : make_uint4(0, 0, 0, 0),
               kf);
    float dot = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) dot = fmaf(qf[e], kf[e], dot);
#pragma unroll
    for (int o = L / 2; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    dot *= s.scale;
    if (importance && valid && i >= nf) {
      dot = static_cast<float>(static_cast<double>(dot) - approx[base_tok[i - nf]] + log_scale);
    }
    if (valid) {
      if (lr == 0) logits[i] = dot;
      mx = fmaxf(mx, dot);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if (lane == 0) red[warp] = mx;
  __syncthreads();
  float cf = -HUGE_VALF;
  for (int w = 0; w < NW; ++w) cf = fmaxf(cf, red[w]);
  const double c = isfinite(cf) ? static_cast<double>(cf) : 0.0;
  // Sums (x = e^{s - c}, y = x V): fixed D_f and N_f; base sum/sum^2 of x and y, max x, max |V|.
  double df = 0, sx = 0, sxx = 0, xmax = 0, vmax = 0;
  double nfv[8] = {}, sy[8] = {}, syy[8] = {}, sxy[8] = {};
  __syncthreads();                                    // logits written by other warps
  for (int i0 = warp * R; i0 < rows; i0 += NW * R) {  // uniform over the warp (shuffles)
    const int i = i0 + row;
    const bool valid = i < rows;
    const int loc = !valid ? 0 : i < nf ? fx[i] : bs[i - nf];
    float vf[8];
    Unpack8<T>(valid ? LoadStream16(vrows + static_cast<int64_t>(loc) * D) : make_uint4(0, 0, 0, 0),
               vf);
    const double x = valid ? exp(static_cast<double>(logits[i]) - c) : 0.0;
    double vn2 = 0;
#pragma unroll
    for (int e = 0; e < 8; ++e) vn2 += static_cast<double>(vf[e]) * vf[e];
#pragma unroll
    for (int o = L / 2; o > 0; o /= 2) vn2 += __shfl_xor_sync(0xffffffffu, vn2, o);
    if (!valid) continue;
    if (i < nf) {
      if (lr == 0) df += x;
#pragma unroll
      for (int e = 0; e < 8; ++e) nfv[e] += x * vf[e];
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const double y = x * vf[e];
        sy[e] += y;
        syy[e] += y * y;
        sxy[e] += x * y;
      }
      if (lr == 0) {
        sx += x;
        sxx += x * x;
        xmax = fmax(xmax, x);
        vmax = fmax(vmax, sqrt(vn2));
      }
    }
  }
  // Per-coordinate sums: over the rows of the warp, then shared-memory atomics over warps.
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    for (int o = L; o < 32; o *= 2) {
      nfv[e] += __shfl_xor_sync(0xffffffffu, nfv[e], o);
      sy[e] += __shfl_xor_sync(0xffffffffu, sy[e], o);
      syy[e] += __shfl_xor_sync(0xffffffffu, syy[e], o);
      sxy[e] += __shfl_xor_sync(0xffffffffu, sxy[e], o);
    }
  }
  __syncthreads();  // dims zeroed
  if (row == 0) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      atomicAdd(&dims[0][lr * 8 + e], nfv[e]);
      atomicAdd(&dims[1][lr * 8 + e], sy[e]);
      atomicAdd(&dims[2][lr * 8 + e], syy[e]);
      atomicAdd(&dims[3][lr * 8 + e], sxy[e]);
    }
  }
  double sc[5] = {df, sx, sxx, xmax, vmax};
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
#pragma unroll
    for (int k = 0; k < 3; ++k) sc[k] += __shfl_xor_sync(0xffffffffu, sc[k], o);
    sc[3] = fmax(sc[3], __shfl_xor_sync(0xffffffffu, sc[3], o));
    sc[4] = fmax(sc[4], __shfl_xor_sync(0xffffffffu, sc[4], o));
  }
  if (lane == 0) {
    for (int k = 0; k < 5; ++k) dred[warp][k] = sc[k];
  }
  __syncthreads();
  double tot[5] = {0, 0, 0, 0, 0};
  for (int w = 0; w < NW; ++w) {
    for (int k = 0; k < 3; ++k) tot[k] += dred[w][k];
    tot[3] = fmax(tot[3], dred[w][3]);
    tot[4] = fmax(tot[4], dred[w][4]);
  }
  const double dnb = nb, ns = static_cast<double>(n_s);
  const double mean_x = nb > 0 ? tot[1] / dnb : 0.0;
  const double d_hat = tot[0] + ns * mean_x;
  const double var_x = nb > 1 ? fmax(0.0, (tot[2] - tot[1] * mean_x) / (dnb - 1)) : 0.0;
  double n2 = 0, tr = 0, tr_z = 0;
  for (int a = 0; a < D; ++a) {
    const double my = nb > 0 ? dims[1][a] / dnb : 0.0;
    const double na = dims[0][a] + ns * my;
    n2 += na * na;
    if (nb > 1) {
      const double var_y = fmax(0.0, (dims[2][a] - dims[1][a] * my) / (dnb - 1));
      const double cov = (dims[3][a] - tot[1] * my) / (dnb - 1);
      const double oa = d_hat > 0 ? na / d_hat : 0.0;  // o^ = N^ / D^
      tr += var_y;
      tr_z += var_y - 2 * oa * cov + oa * oa * var_x;
    }
  }
  tr_z = fmax(tr_z, 0.0);
  const double n_hat = sqrt(n2);
  const double sigma = sqrt(var_x);
  const double x_max = tot[3], y_max = tot[3] * tot[4];
  // Budget (ComputeVAttentionBudget).
  const bool clt = p.bound != 2;  // 1 CLT, 3 CLT on the ratio
  const double eps = p.epsilon, delta = p.delta;
  const double cd = d_hat > 0 ? (clt ? sigma : x_max) / d_hat : HUGE_VAL;
  const double cn = n_hat > 0 ? (clt ? sqrt(tr) : 2 * y_max) / n_hat : HUGE_VAL;
  double raw;
  if (p.target == 1) {
    const double v = ns * AlphaD(clt, delta) * cd / eps;
    raw = v * v;
  } else if (p.target == 2) {
    const double v = ns * AlphaN(clt, delta) * cn / eps;
    raw = v * v;
  } else if (p.bound == 3) {  // target output, the delta method on N^ / D^
    const double v = n_hat > 0 ? ns * AlphaD(true, delta) * sqrt(tr_z) / (eps * n_hat) : HUGE_VAL;
    raw = v * v;
  } else {
    double bv = HUGE_VAL;
    int bj = kDeltaGrid;
    for (int j = 1 + tid; j < kDeltaGrid; j += kRowThreads) {
      const double dl = delta * j / kDeltaGrid;
      const double v = AlphaD(clt, dl) * cd + AlphaN(clt, delta - dl) * cn;
      if (v < bv) {
        bv = v;
        bj = j;
      }
    }
    best_v[tid] = bv;
    best_j[tid] = bj;
    __syncthreads();
    bv = HUGE_VAL;
    bj = kDeltaGrid;
    for (int i = 0; i < kRowThreads; ++i) {  // the first minimum, as the sequential reference
      if (best_v[i] < bv || (best_v[i] == bv && best_j[i] < bj)) {
        bv = best_v[i];
        bj = best_j[i];
      }
    }
    const double v = 2 * ns * bv / eps;
    raw = v * v;
  }
  if (isnan(raw)) raw = HUGE_VAL;
  if (tid == 0) {
    int64_t bud = 0;
    if (n_s > 0) {
      const double lower = dnb;
      const double r = isfinite(raw) ? ceil(raw) : ns;
      bud = static_cast<int64_t>(fmin(ns, fmax(lower, r)));
    }
    l.budget[bh] = bud;
    // What the final sample promises at 1 - delta (the CPU engine's PromisedEpsilon): every
    // bound's budget grows as 1 / epsilon^2, so b rows give epsilon sqrt(min(b_raw, b) / b); a
    // residual read whole (b = n_s) gives 0.
    l.epsilon[bh] = bud > 0 && bud < n_s
                        ? static_cast<float>(eps * sqrt(fmin(raw, static_cast<double>(bud)) /
                                                        static_cast<double>(bud)))
                        : 0.f;
  }
}

// Step 7: out = (sum_{I_f} e^s V + (n_s / b) sum_{I_dyn} e^s V) / (the same without V), fp32
// with a running maximum per row slot, merged over the block.
template <typename T, int D>
__global__ void __launch_bounds__(kRowThreads, 2)
    VattEstimateKernel(VAttentionLaunchParams p, Layout l) {
  constexpr int L = D / 8, R = 32 / L, NW = kRowThreads / 32;
  __shared__ SlotSoftmax<D, NW * R, false> slots;
  const DecodeShape& s = p.shape;
  const int64_t bh = blockIdx.x;
  const int b = static_cast<int>(bh / s.num_q_heads);
  const int h = static_cast<int>(bh % s.num_q_heads);
  const int G = s.num_q_heads / s.num_kv_heads;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, row = lane / L, lr = lane % L;
  const int n = s.seq_lens[b];
  const int nf = l.fixed_count[bh], nd = l.dyn_count[bh];
  const int64_t bud = l.budget[bh];
  const float w_dyn = bud > 0 ? static_cast<float>(static_cast<double>(n - nf) / bud) : 0.f;
  // Importance mode with b < n_s: a draw of token t weighs (n_s / b) e^{L - s~_t} = 1 / (b p_t).
  const bool reweight = p.scores != nullptr && bud < n - nf;
  const double per_draw = bud > 0 ? static_cast<double>(n - nf) / bud : 0.0;
  const int32_t* dyn_tok = l.dyn + bh * l.list_stride;
  const float* approx = p.scores != nullptr ? p.scores + bh * p.scores_stride : nullptr;
  const double log_scale = p.scores != nullptr ? l.log_scale[bh] : 0.0;
  // Rows from the group's row set: locations, not tokens.
  const int32_t* fx = l.pos_fixed + bh * l.fixed_stride;
  const int32_t* dy = l.pos_dyn + bh * l.list_stride;
  const int64_t set = (static_cast<int64_t>(b) * s.num_kv_heads + h / G) * l.list_stride;
  const uint16_t* krows = static_cast<const uint16_t*>(l.rows_k) + set * D + lr * 8;
  const uint16_t* vrows = static_cast<const uint16_t*>(l.rows_v) + set * D + lr * 8;
  float qf[8];
  Unpack8<T>(*reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(s.q) + bh * D + lr * 8),
             qf);
  float m = kNegInf, lsum = 0.f, acc[8] = {};
  const int rows = nf + max(nd, 0);
  for (int i0 = warp * R; i0 < rows; i0 += NW * R) {  // uniform over the warp (shuffles)
    const int i = i0 + row;
    const bool valid = i < rows;
    const int loc = !valid ? 0 : i < nf ? fx[i] : dy[i - nf];
    float w = i < nf ? 1.f : w_dyn;
    if (reweight && valid && i >= nf) {
      w = static_cast<float>(per_draw * exp(log_scale - approx[dyn_tok[i - nf]]));
    }
    float kf[8], vf[8];
    Unpack8<T>(valid ? LoadStream16(krows + static_cast<int64_t>(loc) * D) : make_uint4(0, 0, 0, 0),
               kf);
    Unpack8<T>(valid ? LoadStream16(vrows + static_cast<int64_t>(loc) * D) : make_uint4(0, 0, 0, 0),
               vf);
    float dot = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) dot = fmaf(qf[e], kf[e], dot);
#pragma unroll
    for (int o = L / 2; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    if (!valid) continue;
    const float sc = dot * s.scale;
    const float mn = fmaxf(m, sc);
    const float a = m == kNegInf ? 0.f : expf(m - mn);
    const float pw = w * expf(sc - mn);
    lsum = lsum * a + pw;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = acc[e] * a + pw * vf[e];
    m = mn;
  }
  slots.Put(warp * R + row, lr, m, lsum, acc);
  __syncthreads();
  slots.Merge(tid, kRowThreads, [&](int dim, float num, float den, float) {
    static_cast<uint16_t*>(s.out)[bh * D + dim] = FloatToBits<T>(den > 0.f ? num / den : 0.f);
  });
}

struct RowKernels {
  const VAttentionLaunchParams& p;
  Layout l;
  bool estimate;
  cudaStream_t stream;
  template <typename T, int D, int G>
  cudaError_t operator()() const {
    const int blocks = p.shape.batch * p.shape.num_q_heads;
    if (estimate) {
      VattEstimateKernel<T, D><<<blocks, kRowThreads, 0, stream>>>(p, l);
    } else {
      VattStatsKernel<T, D><<<blocks, kRowThreads, 0, stream>>>(p, l);
    }
    return cudaGetLastError();
  }
};

cudaError_t LaunchProposal(const VAttentionLaunchParams& p, const Layout& l, cudaStream_t stream) {
  const size_t smem = static_cast<size_t>((p.shape.max_seq_len + 31) / 32) * 4 + 64;
  return LaunchWithSmem(&VattProposalKernel, dim3(p.shape.batch * p.shape.num_q_heads),
                        dim3(kSampleThreads), smem, stream, p, l);
}

template <bool kBase>
cudaError_t LaunchSample(const VAttentionLaunchParams& p, const Layout& l, int32_t* out,
                         int32_t* out_count, cudaStream_t stream) {
  const size_t smem = static_cast<size_t>((p.shape.max_seq_len + 31) / 32) * 4 + kBuckets * 4 +
                      kCand * (8 + 4) + 64;
  return LaunchWithSmem(&VattSampleKernel<kBase>, dim3(p.shape.batch * p.shape.num_q_heads),
                        dim3(kSampleThreads), smem, stream, p, l, out, out_count);
}

// A sample of the residual: uniform without replacement (priority keys), or in importance mode
// i.i.d. draws from the proposal.
template <bool kBase>
cudaError_t LaunchResidualSample(const VAttentionLaunchParams& p, const Layout& l, int32_t* out,
                                 int32_t* out_count, cudaStream_t stream) {
  if (!VAttentionImportance(p)) return LaunchSample<kBase>(p, l, out, out_count, stream);
  VattDrawKernel<kBase>
      <<<p.shape.batch * p.shape.num_q_heads, kSampleThreads, 0, stream>>>(p, l, out, out_count);
  return cudaGetLastError();
}

}  // namespace

size_t VAttentionWorkspaceBytes(const VAttentionLaunchParams& p) {
  return MakeLayout(p, nullptr).total;
}

VAttentionSelectionView VAttentionSelection(const VAttentionLaunchParams& p,
                                            const void* workspace) {
  const Layout l = MakeLayout(p, const_cast<void*>(workspace));
  VAttentionSelectionView v;
  v.max_list = l.list_stride;
  v.fixed_stride = l.fixed_stride;
  v.fixed = l.fixed;
  v.fixed_count = l.fixed_count;
  v.base = l.base;
  v.base_count = l.base_count;
  v.dyn = l.dyn;
  v.dyn_count = l.dyn_count;
  v.budget = l.budget;
  v.epsilon = l.epsilon;
  v.union_a = l.tokens_a;
  v.union_a_count = l.count_a;
  v.union_r = l.tokens_r;
  v.union_r_count = l.count_r;
  v.fetched = l.fetched;
  return v;
}

namespace {

cudaError_t CheckCall(const VAttentionLaunchParams& p, void* workspace, size_t workspace_bytes) {
  // K and V are read by FetchRows alone (from p.shape or the caller's source).
  KVSPARSE_CUDA_RETURN_IF_ERROR(ValidateShape(p.shape, /*k_paged_ok=*/true, /*v_paged_ok=*/true,
                                              /*kv_required=*/false));
  if (!(p.epsilon > 0.f && p.epsilon < 1.f) || !(p.delta > 0.f && p.delta < 1.f) ||
      !(p.base_rate > 0.f && p.base_rate < 1.f) || (p.bound < 1 || p.bound > 3) || p.target < 1 ||
      p.target > 3 || p.shape.max_seq_len > kMaxLen || DTypeSize(p.shape.dtype) != 2) {
    return cudaErrorInvalidValue;
  }
  if ((p.scores != nullptr) != VAttentionImportance(p) ||
      (p.scores != nullptr && (p.bound == 2 || p.scores_stride < p.shape.max_seq_len))) {
    return cudaErrorInvalidValue;  // importance mode: scores and stride; no Hoeffding range
  }
  if (p.shape.batch > 0 &&
      (workspace == nullptr || workspace_bytes < MakeLayout(p, nullptr).total)) {
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

// Copies a part's rows (A or R) of every (b, j) into the row set.
cudaError_t FetchPart(const VAttentionLaunchParams& p, const Layout& l, bool dyn,
                      const VAttentionRowSource& src, cudaStream_t stream) {
  const int64_t bk = static_cast<int64_t>(p.shape.batch) * p.shape.num_kv_heads;
  const int64_t e = dyn ? bk : 0;
  FetchRowsParams f;
  f.shape = src.shape != nullptr ? *src.shape : p.shape;
  f.source_by_position = src.by_position;
  f.out.tokens = l.tab_tokens + e;
  f.out.count = l.tab_count + e;
  f.out.k = l.tab_k + e;
  f.out.v = l.tab_v + e;
  f.out.capacity = l.list_stride;
  if (dyn) {
    f.dest = l.tab_dest;
    f.max_rows = l.list_stride;
  } else {
    // |A| <= G (|I_f| + |B|) of the longest sequence, at most its length.
    const int G = p.shape.num_q_heads / p.shape.num_kv_heads;
    const int64_t base_max = std::max<int64_t>(
        2, static_cast<int64_t>(
               std::floor(static_cast<double>(p.base_rate) * p.shape.max_seq_len + 0.5)));
    f.max_rows = static_cast<int32_t>(
        std::min<int64_t>(l.list_stride, G * (static_cast<int64_t>(l.fixed_stride) + base_max)));
  }
  return FetchRows(f, stream);
}

}  // namespace

cudaError_t VAttentionSelect(const VAttentionLaunchParams& p, void* workspace,
                             size_t workspace_bytes, cudaStream_t stream) {
  KVSPARSE_CUDA_RETURN_IF_ERROR(CheckCall(p, workspace, workspace_bytes));
  if (p.shape.batch == 0) return cudaSuccess;
  const Layout l = MakeLayout(p, workspace);
  if (VAttentionImportance(p)) {
    ScoreTopKLaunchParams sp = ScoreParams(p);
    sp.indices = l.fixed;
    sp.counts = l.fixed_count;
    KVSPARSE_CUDA_RETURN_IF_ERROR(ScoreTopK(sp, stream));
    KVSPARSE_CUDA_RETURN_IF_ERROR(LaunchProposal(p, l, stream));
  } else {
    HashTopKLaunchParams tp = TopkParams(p);
    tp.indices = l.fixed;
    tp.counts = l.fixed_count;
    KVSPARSE_CUDA_RETURN_IF_ERROR(HashTopK(tp, l.topk_ws, l.topk_bytes, stream));
  }
  KVSPARSE_CUDA_RETURN_IF_ERROR(LaunchResidualSample<true>(p, l, l.base, l.base_count, stream));
  VattUnionKernel<false><<<p.shape.batch * p.shape.num_kv_heads, kSampleThreads, 0, stream>>>(p, l);
  return cudaGetLastError();
}

cudaError_t VAttentionVerify(const VAttentionLaunchParams& p, const VAttentionRowSource& src,
                             void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  KVSPARSE_CUDA_RETURN_IF_ERROR(CheckCall(p, workspace, workspace_bytes));
  if (p.shape.batch == 0) return cudaSuccess;
  const Layout l = MakeLayout(p, workspace);
  KVSPARSE_CUDA_RETURN_IF_ERROR(FetchPart(p, l, false, src, stream));
  const DecodeShape& s = p.shape;
  KVSPARSE_CUDA_RETURN_IF_ERROR(
      DispatchDecode(s.dtype, s.head_dim, 1, RowKernels{p, l, false, stream}));
  KVSPARSE_CUDA_RETURN_IF_ERROR(LaunchResidualSample<false>(p, l, l.dyn, l.dyn_count, stream));
  VattUnionKernel<true><<<s.batch * s.num_kv_heads, kSampleThreads, 0, stream>>>(p, l);
  return cudaGetLastError();
}

cudaError_t VAttentionEstimate(const VAttentionLaunchParams& p, const VAttentionRowSource& src,
                               void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  KVSPARSE_CUDA_RETURN_IF_ERROR(CheckCall(p, workspace, workspace_bytes));
  if (p.shape.batch == 0) return cudaSuccess;
  const Layout l = MakeLayout(p, workspace);
  KVSPARSE_CUDA_RETURN_IF_ERROR(FetchPart(p, l, true, src, stream));
  const DecodeShape& s = p.shape;
  return DispatchDecode(s.dtype, s.head_dim, 1, RowKernels{p, l, true, stream});
}

cudaError_t VAttentionDecode(const VAttentionLaunchParams& p, void* workspace,
                             size_t workspace_bytes, cudaStream_t stream) {
  KVSPARSE_CUDA_RETURN_IF_ERROR(VAttentionSelect(p, workspace, workspace_bytes, stream));
  KVSPARSE_CUDA_RETURN_IF_ERROR(VAttentionVerify(p, {}, workspace, workspace_bytes, stream));
  return VAttentionEstimate(p, {}, workspace, workspace_bytes, stream);
}

}  // namespace kvsparse::kernels::cuda
