// The flagship's selection kernels alone on the GPU (S2ANTA-prop S = 128 over 2-bit compressed
// keys): the compressed scores (kernels/cuda/compressed_keys.h) and the prop sampler over them
// (kernels/cuda/santa_scores.h), then S2ANTA's group mixture over the same scores (S = 512), at a
// decode step's shapes of a Llama-3.1-8B-shaped model (32 query / 8 kv heads, d = 128, bf16
// queries, groups of 128 tokens), on random codes. Each call is timed alone by CUDA events with the
// L2 cache flushed before it (a layer's call finds its keys in HBM, the other layers' traffic
// between), median of `reps` calls; one line per (kernel, n, B) with the bytes the call must read
// or write and the GB/s that gives.
//
//   selection_bench [lens=32768,131072] [batches=1,8] [reps=30]
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/compressed_keys.h"
#include "kernels/cuda/compressed_keys.h"
#include "kernels/cuda/santa.h"
#include "kernels/cuda/santa_scores.h"
#include "kernels/key_quantization.h"
#include "tests/gpu/bench_util.h"

namespace kvsparse::bench {
namespace {

namespace kc = kernels::cuda;

constexpr int kH = 32, kHkv = 8, kD = 128, kBits = 2, kGroup = 128, kSamples = 128;

std::vector<int> ParseList(const char* s) {
  std::vector<int> out;
  std::stringstream in(s);
  std::string x;
  while (std::getline(in, x, ',')) out.push_back(std::stoi(x));
  return out;
}

// A device buffer freed at scope end.
struct Buf {
  void* p = nullptr;
  explicit Buf(size_t bytes) { KVSPARSE_BENCH_CK(cudaMalloc(&p, bytes)); }
  ~Buf() { cudaFree(p); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

// Median ms of `reps` calls of fn, each after a write of `flush` (256 MiB: more than the L2).
template <typename Fn>
float TimeMs(Fn fn, int reps, const Buf& flush, size_t flush_bytes) {
  cudaEvent_t e0, e1;
  KVSPARSE_BENCH_CK(cudaEventCreate(&e0));
  KVSPARSE_BENCH_CK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int i = 0; i < reps + 2; ++i) {
    KVSPARSE_BENCH_CK(cudaMemsetAsync(flush.p, i & 0xff, flush_bytes));
    KVSPARSE_BENCH_CK(cudaEventRecord(e0));
    fn();
    KVSPARSE_BENCH_CK(cudaEventRecord(e1));
    KVSPARSE_BENCH_CK(cudaEventSynchronize(e1));
    float t = 0;
    KVSPARSE_BENCH_CK(cudaEventElapsedTime(&t, e0, e1));
    if (i >= 2) ms.push_back(t);
  }
  KVSPARSE_BENCH_CK(cudaEventDestroy(e0));
  KVSPARSE_BENCH_CK(cudaEventDestroy(e1));
  return Median(ms);
}

void Row(const char* what, int n, int B, float ms, double bytes) {
  std::printf("%-22s n=%-7d B=%d  %8.2f us  %7.1f MB  %7.0f GB/s\n", what, n, B, ms * 1e3,
              bytes / 1e6, bytes / (ms * 1e-3) / 1e9);
}

// PropFromScores over `rows` rows of scores a sequence (each drawing `samples` rows for
// heads_per_row query heads), timed alone; then a checksum of the selection, so that two builds'
// rows can be compared by eye.
void BenchProp(const char* what, const float* scores, int rows, int heads_per_row, int samples,
               const Buf& lens, int n, int B, int reps, const Buf& flush, size_t flush_bytes) {
  kc::PropFromScoresParams pp;
  pp.batch = B;
  pp.num_q_heads = rows;
  pp.num_kv_heads = kHkv;
  pp.heads_per_row = heads_per_row;
  pp.scores = scores;
  pp.score_stride = n;
  pp.seq_lens = lens.as<int32_t>();
  pp.max_seq_len = n;
  pp.num_samples = samples;
  pp.tile_size = kc::kSantaTile;
  pp.seed = 11;
  pp.max_selected = samples + 1;
  Buf idx(static_cast<size_t>(B) * kH * pp.max_selected * 4);
  Buf lw(static_cast<size_t>(B) * kH * pp.max_selected * 4);
  Buf counts(static_cast<size_t>(B) * kH * 4), budgets(static_cast<size_t>(B) * kH * 4);
  pp.indices = idx.as<int32_t>();
  pp.log2_weights = lw.as<float>();
  pp.counts = counts.as<int32_t>();
  pp.budgets = budgets.as<int32_t>();
  const size_t wb = kc::PropFromScoresWorkspaceBytes(pp);
  Buf ws(wb);
  const float ms = TimeMs([&] { KVSPARSE_BENCH_CK(kc::PropFromScores(pp, ws.p, wb, nullptr)); },
                          reps, flush, flush_bytes);
  Row(what, n, B, ms, static_cast<double>(B) * rows * n * 4);
  std::vector<int32_t> c_h(static_cast<size_t>(B) * kH);
  KVSPARSE_BENCH_CK(cudaMemcpy(c_h.data(), counts.p, c_h.size() * 4, cudaMemcpyDeviceToHost));
  std::vector<int32_t> i_h(static_cast<size_t>(B) * kH * pp.max_selected);
  KVSPARSE_BENCH_CK(cudaMemcpy(i_h.data(), idx.p, i_h.size() * 4, cudaMemcpyDeviceToHost));
  uint64_t sum = 0, total = 0;
  for (size_t bh = 0; bh < c_h.size(); ++bh) {
    total += c_h[bh];
    for (int r = 0; r < c_h[bh]; ++r) sum = sum * 1000003u + i_h[bh * pp.max_selected + r];
  }
  std::printf("  selection: %llu rows, checksum %016llx\n", static_cast<unsigned long long>(total),
              static_cast<unsigned long long>(sum));
}

// S2ANTA's group mixture over the same scores (kernels/cuda/santa_scores.h, as
// engine/cuda/santa_compressed_call.cc runs it): the mean of each kv head's G softmaxes, then one
// prop sample of kGroupSamples rows per kv head for its G query heads; each timed alone, as the
// per-head sampler above (the candidate flagship reads its bytes and takes longer: which part).
constexpr int kGroupSamples = 512;

void BenchGroupMixture(const Buf& scores, const Buf& lens, int n, int B, int reps, const Buf& flush,
                       size_t flush_bytes) {
  const int G = kH / kHkv;
  kc::GroupMixtureParams gm;
  gm.batch = B;
  gm.num_q_heads = kH;
  gm.num_kv_heads = kHkv;
  gm.scores = scores.as<float>();
  gm.score_stride = n;
  gm.seq_lens = lens.as<int32_t>();
  gm.max_seq_len = n;
  Buf mixture(static_cast<size_t>(B) * kHkv * n * sizeof(float));
  gm.mixture = mixture.as<float>();
  gm.mixture_stride = n;
  const size_t gwb = kc::GroupMixtureWorkspaceBytes(gm);
  Buf gws(std::max<size_t>(gwb, 256));
  const float mix_ms =
      TimeMs([&] { KVSPARSE_BENCH_CK(kc::GroupMixtureFromScores(gm, gws.p, gwb, nullptr)); }, reps,
             flush, flush_bytes);
  Row("GroupMixture", n, B, mix_ms,
      static_cast<double>(B) * kH * n * 4 * 2 + static_cast<double>(B) * kHkv * n * 4);
  BenchProp("PropFromScores, group", mixture.as<float>(), kHkv, G, kGroupSamples, lens, n, B, reps,
            flush, flush_bytes);
}

void BenchShape(int n, int B, int reps, const Buf& flush, size_t flush_bytes) {
  const kernels::KeyCompression comp{kBits, kGroup};
  const int64_t block_bytes = static_cast<int64_t>(kernels::KeyGroupBytes(comp, kD));
  const int groups = n / kGroup;  // closed groups; the open group is empty (n a multiple)
  const int slots = B * kHkv;
  // The closed groups' blocks: random codes, lo in [-2, -1), step in [2^-6, 2^-5) (fp16).
  std::mt19937 rng(7);
  std::vector<uint8_t> host(static_cast<size_t>(groups) * block_bytes);
  const kernels::keyq::GroupLayout lay = kernels::keyq::LayoutOf(kGroup, kD, kBits);
  for (int g = 0; g < groups; ++g) {
    uint8_t* blk = host.data() + static_cast<size_t>(g) * block_bytes;
    for (int64_t i = 0; i < lay.lo; ++i) blk[i] = static_cast<uint8_t>(rng());
    auto* lo = reinterpret_cast<__half*>(blk + lay.lo);
    auto* step = reinterpret_cast<__half*>(blk + lay.step);
    for (int c = 0; c < kD; ++c) {
      lo[c] = __float2half(-1.f - (rng() % 1024) / 1024.f);
      step[c] = __float2half((1.f + (rng() % 1024) / 1024.f) / 64.f);
    }
  }
  Buf keys(static_cast<size_t>(slots) * host.size());
  for (int s = 0; s < slots; ++s) {
    KVSPARSE_BENCH_CK(cudaMemcpy(keys.as<uint8_t>() + s * host.size(), host.data(), host.size(),
                                 cudaMemcpyHostToDevice));
  }
  Buf tails(static_cast<size_t>(slots) * kGroup * kD * 2);
  std::vector<const uint8_t*> heads_h(slots);
  std::vector<const void*> tails_h(slots);
  for (int s = 0; s < slots; ++s) {
    heads_h[s] = keys.as<uint8_t>() + s * host.size();
    tails_h[s] = tails.as<char>() + static_cast<size_t>(s) * kGroup * kD * 2;
  }
  Buf heads_d(slots * sizeof(void*)), tails_d(slots * sizeof(void*));
  KVSPARSE_BENCH_CK(
      cudaMemcpy(heads_d.p, heads_h.data(), slots * sizeof(void*), cudaMemcpyHostToDevice));
  KVSPARSE_BENCH_CK(
      cudaMemcpy(tails_d.p, tails_h.data(), slots * sizeof(void*), cudaMemcpyHostToDevice));
  std::vector<__nv_bfloat16> q_h(static_cast<size_t>(B) * kH * kD);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (auto& x : q_h) x = __float2bfloat16(normal(rng));
  Buf q(q_h.size() * 2);
  KVSPARSE_BENCH_CK(cudaMemcpy(q.p, q_h.data(), q_h.size() * 2, cudaMemcpyHostToDevice));
  std::vector<int32_t> lens_h(B, n);
  Buf lens(B * sizeof(int32_t));
  KVSPARSE_BENCH_CK(cudaMemcpy(lens.p, lens_h.data(), B * 4, cudaMemcpyHostToDevice));
  Buf scores(static_cast<size_t>(B) * kH * n * sizeof(float));

  kc::CompressedScoreParams sp;
  sp.num_seqs = B;
  sp.num_q_heads = kH;
  sp.num_kv_heads = kHkv;
  sp.head_dim = kD;
  sp.bits = kBits;
  sp.group = kGroup;
  sp.max_groups = groups;
  sp.scale = 0.088f;
  sp.q = q.p;
  sp.group_heads = heads_d.as<const uint8_t* const>();
  sp.block_bytes = block_bytes;
  sp.tails = tails_d.as<const void* const>();
  sp.seq_lens = lens.as<int32_t>();
  sp.scores = scores.as<float>();
  sp.score_stride = n;
  const float score_ms = TimeMs([&] { KVSPARSE_BENCH_CK(kc::CompressedScores(sp, nullptr)); }, reps,
                                flush, flush_bytes);
  Row("CompressedScores", n, B, score_ms,
      static_cast<double>(slots) * host.size() + static_cast<double>(B) * kH * n * 4);

  BenchProp("PropFromScores", scores.as<float>(), kH, 1, kSamples, lens, n, B, reps, flush,
            flush_bytes);
  BenchGroupMixture(scores, lens, n, B, reps, flush, flush_bytes);
}

}  // namespace
}  // namespace kvsparse::bench

int main(int argc, char** argv) {
  using namespace kvsparse::bench;
  const std::vector<int> lens = ParseList(argc > 1 ? argv[1] : "32768,131072");
  const std::vector<int> batches = ParseList(argc > 2 ? argv[2] : "1,8");
  const int reps = argc > 3 ? std::atoi(argv[3]) : 30;
  cudaDeviceProp prop;
  KVSPARSE_BENCH_CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
  const size_t flush_bytes = 256ull << 20;
  Buf flush(flush_bytes);
  for (int n : lens) {
    for (int B : batches) BenchShape(n, B, reps, flush, flush_bytes);
  }
  return 0;
}
