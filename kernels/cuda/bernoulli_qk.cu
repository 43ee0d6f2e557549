#include "kernels/cuda/bernoulli_qk.h"
#include "kernels/cuda/common.cuh"

namespace kvsparse::kernels::cuda {
namespace {

struct Where {
  uint64_t key;  // the Philox key: seeds[b] or seed
  uint32_t seq;  // the stream's sequence: 0 with seeds, else b
  int64_t base;  // element of (b, first head of the group, feature 0)
  int32_t G, d, kvh;
};

// Eqs. 8-9: each head samples its own features. Returns (pairs read, features read by any head)
// through the block-wide counts.
template <typename T>
__device__ void PerHead(const BernoulliQueriesParams& p, const Where& w, float* red,
                        int* head_count, int* group_count) {
  const int i = threadIdx.x;
  const float fb = static_cast<float>(p.params.samples);
  bool any = false;
  for (int g = 0; g < w.G; ++g) {
    const int64_t o = w.base + static_cast<int64_t>(g) * w.d + i;
    const float q = LoadElem<T>(p.q, o);
    const float norm = BlockMax(fabsf(q), red);
    float out = 0.f;
    int c = 0;
    if (norm > 0.f) {
      const PhiloxStream s = PhiloxStream::Make(w.key, RngTag::kBernoulliHead, w.seq,
                                                static_cast<uint32_t>(w.kvh * w.G + g))
                                 .WithLane(static_cast<uint32_t>(i));
      c = BernoulliCountOnes(s, __fdiv_rn(fabsf(q), norm), p.params.samples, p.params.sampler);
      if (c > 0) {
        const float mag = __fdiv_rn(__fmul_rn(norm, static_cast<float>(c)), fb);
        out = q < 0.f ? -mag : mag;
      }
    }
    static_cast<uint16_t*>(p.q_eff)[o] = FloatToBits<T>(out);
    *head_count += __syncthreads_count(c > 0);
    any = any || c > 0;
  }
  *group_count = __syncthreads_count(any);
}

// Eqs. 10-13: one feature set for the group, from the mean of |q| over its heads.
template <typename T>
__device__ void MeanGroup(const BernoulliQueriesParams& p, const Where& w, float* red,
                          int* head_count, int* group_count) {
  const int i = threadIdx.x;
  float sum = 0.f;
  for (int g = 0; g < w.G; ++g) {
    sum = __fadd_rn(sum, fabsf(LoadElem<T>(p.q, w.base + static_cast<int64_t>(g) * w.d + i)));
  }
  const float m = __fdiv_rn(sum, static_cast<float>(w.G));
  const float norm = BlockMax(m, red);
  int c = 0;
  if (norm > 0.f && m > 0.f) {
    const PhiloxStream s =
        PhiloxStream::Make(w.key, RngTag::kBernoulliGroup, w.seq, static_cast<uint32_t>(w.kvh))
            .WithLane(static_cast<uint32_t>(i));
    c = BernoulliCountOnes(s, __fdiv_rn(m, norm), p.params.samples, p.params.sampler);
  }
  const float m_hat = c > 0 ? __fdiv_rn(__fmul_rn(norm, static_cast<float>(c)),
                                        static_cast<float>(p.params.samples))
                            : 0.f;
  for (int g = 0; g < w.G; ++g) {
    const int64_t o = w.base + static_cast<int64_t>(g) * w.d + i;
    const float out = c > 0 ? __fdiv_rn(__fmul_rn(m_hat, LoadElem<T>(p.q, o)), m) : 0.f;
    static_cast<uint16_t*>(p.q_eff)[o] = FloatToBits<T>(out);
  }
  *group_count = __syncthreads_count(c > 0);
  *head_count = w.G * *group_count;
}

template <typename T>
__global__ void BernoulliQueriesKernel(BernoulliQueriesParams p) {
  __shared__ float red[8];
  const int bk = blockIdx.x;
  Where w;
  const int b = bk / p.num_kv_heads;
  w.kvh = bk % p.num_kv_heads;
  w.G = p.num_q_heads / p.num_kv_heads;
  w.d = p.head_dim;
  w.key = p.seeds != nullptr ? p.seeds[b] : p.seed;
  w.seq = p.seeds != nullptr ? 0u : static_cast<uint32_t>(b);
  w.base = (static_cast<int64_t>(b) * p.num_q_heads + static_cast<int64_t>(w.kvh) * w.G) * w.d;
  int head_count = 0, group_count = 0;
  if (p.params.mode == BernoulliQkMode::kPerHead) {
    PerHead<T>(p, w, red, &head_count, &group_count);
  } else {
    MeanGroup<T>(p, w, red, &head_count, &group_count);
  }
  if (p.features != nullptr && threadIdx.x == 0) {
    p.features[2 * bk] = head_count;
    p.features[2 * bk + 1] = group_count;
  }
}

}  // namespace

cudaError_t SampleBernoulliQueries(const BernoulliQueriesParams& p, cudaStream_t stream) {
  if (p.batch < 1 || p.num_kv_heads < 1 || p.num_q_heads % p.num_kv_heads != 0 || p.head_dim < 32 ||
      p.head_dim > 256 || p.head_dim % 32 != 0 || p.dtype == DType::kFp32 || p.q == nullptr ||
      p.q_eff == nullptr || p.params.samples < 1) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(p.batch * p.num_kv_heads));
  return ByDtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, float>) {
      BernoulliQueriesKernel<T><<<grid, p.head_dim, 0, stream>>>(p);
    }
  });
}

}  // namespace kvsparse::kernels::cuda
