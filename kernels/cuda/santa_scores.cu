#include <algorithm>
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/santa_scores.h"
#include "kernels/philox.h"
#include "kernels/santa.h"

namespace kvsparse::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr float kLog2E = 1.4426950408889634f;

struct Workspace {
  float* tile_max;                // [B * H, T_max]
  float* tile_sum;                // [B * H, T_max]
  unsigned long long* quota_cum;  // [B * H, T_max]
  int32_t* budget;                // [B * H, T_max]
  int32_t* first;                 // [B * H, T_max]: the tile's first output row
};

int32_t MaxTiles(const PropFromScoresParams& p) {
  return (p.max_seq_len + p.tile_size - 1) / p.tile_size;
}

Workspace Carve(const PropFromScoresParams& p, void* ws) {
  const size_t cells = static_cast<size_t>(p.batch) * p.num_q_heads * MaxTiles(p);
  char* c = static_cast<char*>(ws);
  Workspace w;
  w.tile_max = reinterpret_cast<float*>(c);
  c += AlignUp(cells * sizeof(float), 256);
  w.tile_sum = reinterpret_cast<float*>(c);
  c += AlignUp(cells * sizeof(float), 256);
  w.quota_cum = reinterpret_cast<unsigned long long*>(c);
  c += AlignUp(cells * sizeof(unsigned long long), 256);
  w.budget = reinterpret_cast<int32_t*>(c);
  c += AlignUp(cells * sizeof(int32_t), 256);
  w.first = reinterpret_cast<int32_t*>(c);
  return w;
}

// Systematic sampling inside tile [lo, hi) as kernels/santa.cc's SystematicTile: calls emit(i, c)
// for every token with c > 0, ascending.
template <typename Emit>
__device__ __forceinline__ void SampleTile(const float* s, int lo, int hi, float mt,
                                           float inv_delta, float a0, Emit emit) {
  float acc = 0.f;
  for (int i = lo; i < hi; ++i) {
    const float x = __fmul_rn(inv_delta, expf(s[i] - mt));
    const float f0 = __fadd_rn(a0, acc);
    const float f1 = __fadd_rn(f0, x);
    const int c = static_cast<int>(floorf(f1)) - static_cast<int>(floorf(f0));
    acc = __fadd_rn(acc, x);
    if (c > 0) emit(i, c);
  }
}

__global__ void __launch_bounds__(kThreads)
    PropFromScoresKernel(PropFromScoresParams p, Workspace w, int32_t t_max) {
  const int64_t bh = blockIdx.x;
  const int b = static_cast<int>(bh / p.num_q_heads);
  const int h = static_cast<int>(bh % p.num_q_heads);
  const int kvh = h / (p.num_q_heads / p.num_kv_heads);
  const int n = p.seq_lens[b];
  const int bt = p.tile_size;
  const int tiles = (n + bt - 1) / bt;
  const float* s = p.scores + bh * p.score_stride;
  float* tmax = w.tile_max + bh * t_max;
  float* tsum = w.tile_sum + bh * t_max;
  unsigned long long* qcum = w.quota_cum + bh * t_max;
  int32_t* bud = w.budget + bh * t_max;
  int32_t* first = w.first + bh * t_max;
  const int tid = threadIdx.x;
  // Tile statistics (kernels/santa.cc TileStatistics): one thread per tile, ascending tokens.
  for (int t = tid; t < tiles; t += kThreads) {
    const int lo = t * bt, hi = min(n, lo + bt);
    float m = -INFINITY;
    for (int i = lo; i < hi; ++i) m = fmaxf(m, s[i]);
    float l = 0.f;
    if (m != -INFINITY) {
      for (int i = lo; i < hi; ++i) l = __fadd_rn(l, expf(s[i] - m));
    }
    tmax[t] = m;
    tsum[t] = l;
  }
  __syncthreads();
  // W_t, Z (double, ascending tiles), quotas in fixed point and the budgets: one thread, as the
  // CPU does (T is n / 256: a few hundred steps).
  if (tid == 0) {
    float mstar = -INFINITY;
    for (int t = 0; t < tiles; ++t) mstar = fmaxf(mstar, tmax[t]);
    if (mstar != -INFINITY) {
      double z = 0.0;
      for (int t = 0; t < tiles; ++t)
        z += static_cast<double>(__fmul_rn(expf(tmax[t] - mstar), tsum[t]));
      unsigned long long c = 0;
      for (int t = 0; t < tiles; ++t) {
        const double wt = static_cast<double>(__fmul_rn(expf(tmax[t] - mstar), tsum[t])) / z;
        const double q = static_cast<double>(p.num_samples) * wt;
        c += static_cast<unsigned long long>(llround(q * kPropFixedOne));
        qcum[t] = c;
      }
      const SeedSource seeds{p.seed, p.seeds};
      const float u = SequenceStream(seeds, RngTag::kPropRounding, b, kvh).Uniform(0);
      const unsigned long long off =
          static_cast<unsigned long long>(static_cast<double>(u) * kPropFixedOne);
      unsigned long long before = off >> 32;
      for (int t = 0; t < tiles; ++t) {
        const unsigned long long upto = (qcum[t] + off) >> 32;
        bud[t] = static_cast<int32_t>(upto - before);
        before = upto;
      }
    } else {
      for (int t = 0; t < tiles; ++t) bud[t] = 0;  // no mass anywhere: no samples
    }
  }
  __syncthreads();
  const SeedSource seeds{p.seed, p.seeds};
  const PhiloxStream st = SequenceStream(seeds, RngTag::kPropTileOffset, b, h);
  // Rows each tile samples (distinct tokens), then where each tile's rows start.
  for (int t = tid; t < tiles; t += kThreads) {
    int rows = 0;
    if (bud[t] > 0) {
      const int lo = t * bt, hi = min(n, lo + bt);
      const float inv_delta = static_cast<float>(bud[t]) / tsum[t];
      SampleTile(s, lo, hi, tmax[t], inv_delta, st.Uniform(t), [&](int, int) { ++rows; });
    }
    first[t] = rows;
  }
  __syncthreads();
  if (tid == 0) {
    int at = 0;
    for (int t = 0; t < tiles; ++t) {
      const int r = first[t];
      first[t] = at;
      at += r;
    }
    p.counts[bh] = min(at, p.max_selected);
    if (p.budgets != nullptr) p.budgets[bh] = n > 0 ? p.num_samples : 0;
  }
  __syncthreads();
  int32_t* idx = p.indices + bh * p.max_selected;
  float* lw = p.log2_weights + bh * p.max_selected;
  for (int t = tid; t < tiles; t += kThreads) {
    if (bud[t] <= 0) continue;
    const int lo = t * bt, hi = min(n, lo + bt);
    const float inv_delta = static_cast<float>(bud[t]) / tsum[t];
    int at = first[t];
    SampleTile(s, lo, hi, tmax[t], inv_delta, st.Uniform(t), [&](int i, int c) {
      if (at < p.max_selected) {
        idx[at] = i;
        lw[at] = log2f(static_cast<float>(c)) - s[i] * kLog2E;
      }
      ++at;
    });
  }
}

}  // namespace

size_t PropFromScoresWorkspaceBytes(const PropFromScoresParams& p) {
  if (p.tile_size < 1) return 0;
  const size_t cells = static_cast<size_t>(std::max(p.batch, 0)) * std::max(p.num_q_heads, 0) *
                       std::max(MaxTiles(p), 0);
  return 4 * AlignUp(cells * sizeof(float), 256) + AlignUp(cells * sizeof(unsigned long long), 256);
}

cudaError_t PropFromScores(const PropFromScoresParams& p, void* workspace, size_t workspace_bytes,
                           cudaStream_t stream) {
  if (p.batch < 0 || p.num_q_heads < 1 || p.num_kv_heads < 1 ||
      p.num_q_heads % p.num_kv_heads != 0 || p.num_samples < 1 || p.tile_size < 1 ||
      p.max_selected < p.num_samples + 1 || p.scores == nullptr || p.seq_lens == nullptr ||
      p.indices == nullptr || p.counts == nullptr || p.log2_weights == nullptr ||
      p.score_stride < p.max_seq_len || workspace_bytes < PropFromScoresWorkspaceBytes(p) ||
      (PropFromScoresWorkspaceBytes(p) > 0 && workspace == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (p.batch == 0) return cudaSuccess;
  const int64_t bh = static_cast<int64_t>(p.batch) * p.num_q_heads;
  PropFromScoresKernel<<<static_cast<unsigned>(bh), kThreads, 0, stream>>>(p, Carve(p, workspace),
                                                                           MaxTiles(p));
  return cudaGetLastError();
}

}  // namespace kvsparse::kernels::cuda
