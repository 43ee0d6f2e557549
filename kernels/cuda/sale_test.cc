// SALE on the GPU (kernels/cuda/sale.h) against the CPU reference (kernels/sale.h). Selection
// (kernels::SaleSelect): on prompts with heavy keys scattered among ordinary ones, the masks
// agree block for block wherever the pass decides nothing near a threshold, the sink, local and
// past-the-diagonal blocks always, every head at tau = 0 selects every causal block; bf16 and
// fp16, GQA, prompts shorter than sink + local, one block, and a ragged last query block.
// Computation (kernels::SaleAttend): the same output over the reference's mask, and dense
// causal attention with every block selected.
#include "kernels/cuda/sale.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_test_util.h"
#include "kernels/dtype.h"
#include "kernels/sale.h"
#include "kernels/synthetic.h"

namespace kvsparse::kernels::cuda {
namespace {

struct Prompt {
  int32_t n = 0, H = 0, hkv = 0, d = 0;
  DType dtype = DType::kBf16;
  std::vector<uint8_t> q, k;
};

// Queries near a per-head direction; keys noise, with every 97th key (and a run of them) along
// that direction, so that a few middle blocks carry real mass.
Prompt MakePrompt(int32_t n, int32_t H, int32_t hkv, int32_t d, DType dtype, uint32_t seed) {
  Prompt p{n, H, hkv, d, dtype, {}, {}};
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  const size_t es = DTypeSize(dtype);
  p.q.resize(static_cast<size_t>(H) * n * d * es);
  p.k.resize(static_cast<size_t>(hkv) * n * d * es);
  std::vector<float> dir(static_cast<size_t>(hkv) * d);
  for (float& x : dir) x = nd(rng);
  for (int32_t h = 0; h < H; ++h) {
    const float* u = dir.data() + static_cast<size_t>(h / (H / hkv)) * d;
    for (int32_t t = 0; t < n; ++t) {
      for (int32_t e = 0; e < d; ++e) {
        StoreFromFloat(p.q.data(), (static_cast<size_t>(h) * n + t) * d + e, dtype,
                       0.8f * u[e] + 0.6f * nd(rng));
      }
    }
  }
  for (int32_t j = 0; j < hkv; ++j) {
    const float* u = dir.data() + static_cast<size_t>(j) * d;
    for (int32_t t = 0; t < n; ++t) {
      const bool heavy = t % 97 == 5 || (t >= 600 && t < 610);
      for (int32_t e = 0; e < d; ++e) {
        StoreFromFloat(p.k.data(), (static_cast<size_t>(j) * n + t) * d + e, dtype,
                       heavy ? 0.5f * u[e] + 0.2f * nd(rng) : nd(rng));
      }
    }
  }
  return p;
}

// The reference's view of a prompt (no v, no output).
SalePrefill PrefillOf(const Prompt& pr) {
  SalePrefill p;
  p.tokens = pr.n;
  p.num_q_heads = pr.H;
  p.num_kv_heads = pr.hkv;
  p.head_dim = pr.d;
  p.dtype = pr.dtype;
  p.scale = 1.f / std::sqrt(static_cast<float>(pr.d));
  p.q = pr.q.data();
  p.k = pr.k.data();
  return p;
}

struct Compared {
  int64_t middle = 0, mismatched = 0, selected_cpu = 0, selected_gpu = 0;
  int64_t unwritten = 0;    // mask bytes the pass left as they were
  int64_t fixed_wrong = 0;  // sink, local or past-the-diagonal blocks that differ
};

// Runs both passes; expects the exact regions and the blocks past the diagonal equal, counts
// the middle blocks where they differ.
Compared Compare(const Prompt& pr, const SaleParams& params, const std::vector<float>& tau) {
  Compared out;
  SalePrefill p = PrefillOf(pr);
  SaleMask want;
  EXPECT_TRUE(kernels::SaleSelect(p, params, tau, &want).ok());
  DeviceBuffer dq(pr.q.size()), dk(pr.k.size()), dtau(tau.size() * sizeof(float));
  EXPECT_EQ(dq.Upload(pr.q.data(), pr.q.size()), cudaSuccess);
  EXPECT_EQ(dk.Upload(pr.k.data(), pr.k.size()), cudaSuccess);
  EXPECT_EQ(dtau.Upload(tau.data(), tau.size() * sizeof(float)), cudaSuccess);
  DeviceBuffer dmask(want.selected.size());
  EXPECT_EQ(dmask.Poison(0xAB), cudaSuccess);
  SaleSelectParams sp;
  sp.prompt = p;
  sp.prompt.q = dq.get();
  sp.prompt.k = dk.get();
  sp.tau = dtau.as<float>();
  sp.blocks = params;
  sp.mask = dmask.as<uint8_t>();
  DeviceBuffer ws(SaleSelectWorkspaceBytes(sp));
  EXPECT_EQ(SaleSelect(sp, ws.get(), ws.size(), nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint8_t> got(want.selected.size());
  EXPECT_EQ(dmask.Download(got.data(), got.size()), cudaSuccess);
  const int32_t bq = params.block_q, bk = params.block_k;
  for (int32_t h = 0; h < want.heads; ++h) {
    for (int32_t i = 0; i < want.q_blocks; ++i) {
      const int32_t last = (std::min(pr.n, (i + 1) * bq) - 1) / bk;
      const int32_t local_first = std::max(0, last + 1 - params.local_tokens / bk);
      const int32_t sink_end = std::min(params.sink_tokens / bk, last + 1);
      for (int32_t j = 0; j < want.k_blocks; ++j) {
        const size_t x = (static_cast<size_t>(h) * want.q_blocks + i) * want.k_blocks + j;
        if (got[x] > 1) ++out.unwritten;
        const bool middle = j >= sink_end && j < local_first;
        if (!middle) {
          if (got[x] != want.selected[x] && ++out.fixed_wrong <= 5) {
            ADD_FAILURE() << "h " << h << " i " << i << " j " << j << ": gpu " << int{got[x]}
                          << ", cpu " << int{want.selected[x]};
          }
          continue;
        }
        ++out.middle;
        out.selected_cpu += want.selected[x];
        out.selected_gpu += got[x];
        out.mismatched += got[x] != want.selected[x];
      }
    }
  }
  EXPECT_EQ(out.unwritten, 0);
  EXPECT_EQ(out.fixed_wrong, 0);
  return out;
}

TEST(SaleCudaTest, SelectionMatchesTheCpuReference) {
  KVSPARSE_REQUIRE_GPU();
  // bf16 and fp16 score the exact regions on the tensor cores; fp32 as the reference does.
  for (DType dtype : {DType::kBf16, DType::kFp16, DType::kFp32}) {
    const Prompt pr = MakePrompt(1500, 8, 2, 128, dtype, 11);
    SaleParams params;  // the paper's geometry: 64 / 32, sink 32, local 256
    // One head of each kind: dense (tau 0), permissive, the paper's default, strict.
    const std::vector<float> tau = {0.f, 1e-4f, 1e-3f, 4e-3f, 8e-3f, 2e-2f, 5e-2f, 0.2f};
    const Compared c = Compare(pr, params, tau);
    ASSERT_GT(c.middle, 0);
    // Between all and none: the thresholds decide something here.
    EXPECT_GT(c.selected_cpu, c.middle / 16);
    EXPECT_LT(c.selected_cpu, c.middle);
    // Rounding (the exact regions' sums in another order) may flip a block whose estimate sits
    // on its threshold; on these prompts none or almost none does.
    EXPECT_LE(c.mismatched, c.middle / 500 + 1)
        << c.mismatched << " of " << c.middle << " middle blocks differ";
    std::printf(
        "SALE selection %s: %lld of %lld middle blocks differ; selected cpu %lld gpu %lld\n",
        dtype == DType::kBf16   ? "bf16"
        : dtype == DType::kFp16 ? "fp16"
                                : "fp32",
        static_cast<long long>(c.mismatched), static_cast<long long>(c.middle),
        static_cast<long long>(c.selected_cpu), static_cast<long long>(c.selected_gpu));
  }
}

// The paper's geometry estimates the middle blocks in tiles of query heads of one kv head and
// query blocks (8 per tile: heads x blocks): every GQA group size takes another tiling (1: 1 x
// 8, 2: 2 x 4, 3: 1 x 8, 8: 8 x 1), and prompts whose last tile is partly past the prompt.
TEST(SaleCudaTest, SelectionMatchesTheCpuReferenceForEveryGroupSize) {
  KVSPARSE_REQUIRE_GPU();
  SaleParams params;
  struct Case {
    int32_t H, hkv, n;
  };
  for (const Case& cs : {Case{2, 2, 1100}, Case{4, 2, 1250}, Case{6, 2, 1000}, Case{8, 1, 1400}}) {
    const Prompt pr = MakePrompt(cs.n, cs.H, cs.hkv, 128, DType::kBf16, 29 + cs.H);
    std::vector<float> tau(cs.H);
    for (int32_t h = 0; h < cs.H; ++h) tau[h] = h % 2 == 0 ? 2e-2f : 0.2f;
    const Compared c = Compare(pr, params, tau);
    ASSERT_GT(c.middle, 0);
    // Between all and none: the thresholds decide something here.
    EXPECT_GT(c.selected_cpu, 0) << "H " << cs.H << " Hkv " << cs.hkv;
    EXPECT_LT(c.selected_cpu, c.middle) << "H " << cs.H << " Hkv " << cs.hkv;
    EXPECT_LE(c.mismatched, c.middle / 500 + 1)
        << "H " << cs.H << " Hkv " << cs.hkv << ": " << c.mismatched << " of " << c.middle;
  }
}

TEST(SaleCudaTest, DenseAtTauZeroAndShortPrompts) {
  KVSPARSE_REQUIRE_GPU();
  SaleParams params;
  const std::vector<float> zero(4, 0.f), some(4, 1e-2f);
  // 1 token; one key block; shorter than sink + local; a ragged last query block.
  for (int32_t n : {1, 20, 200, 777}) {
    const Prompt pr = MakePrompt(n, 4, 1, 64, DType::kBf16, 5 + n);
    const Compared dense = Compare(pr, params, zero);
    EXPECT_EQ(dense.mismatched, 0) << "n " << n;
    EXPECT_EQ(dense.selected_gpu, dense.middle) << "n " << n;
    const Compared sparse = Compare(pr, params, some);
    EXPECT_LE(sparse.mismatched, sparse.middle / 500 + 1) << "n " << n;
  }
  // Another geometry: smaller blocks, no sink.
  SaleParams small;
  small.block_q = 32;
  small.block_k = 16;
  small.sink_tokens = 0;
  small.local_tokens = 64;
  const Prompt pr = MakePrompt(900, 4, 2, 64, DType::kFp16, 3);
  const Compared c = Compare(pr, small, some);
  EXPECT_GT(c.middle, 0);
  EXPECT_LE(c.mismatched, c.middle / 500 + 1);
}

// Prompt `pr` with its v, the GPU computation pass over `mask` (as the CPU's) against
// kernels::SaleAttend; returns the relative L2 error of the output.
double AttendError(const Prompt& pr, const SaleParams& params, const SaleMask& mask,
                   uint32_t seed) {
  const size_t es = DTypeSize(pr.dtype);
  std::vector<uint8_t> v(pr.k.size()), want(pr.q.size()), got(pr.q.size());
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (size_t x = 0; x < v.size() / es; ++x) StoreFromFloat(v.data(), x, pr.dtype, nd(rng));
  SalePrefill p = PrefillOf(pr);
  p.v = v.data();
  p.out = want.data();
  EXPECT_TRUE(kernels::SaleAttend(p, params, mask).ok());
  DeviceBuffer dq(pr.q.size()), dk(pr.k.size()), dv(v.size()), dout(got.size()),
      dmask(mask.selected.size());
  EXPECT_EQ(dq.Upload(pr.q.data(), pr.q.size()), cudaSuccess);
  EXPECT_EQ(dk.Upload(pr.k.data(), pr.k.size()), cudaSuccess);
  EXPECT_EQ(dv.Upload(v.data(), v.size()), cudaSuccess);
  EXPECT_EQ(dmask.Upload(mask.selected.data(), mask.selected.size()), cudaSuccess);
  EXPECT_EQ(dout.Poison(), cudaSuccess);
  SaleAttendParams ap;
  ap.prompt = p;
  ap.prompt.q = dq.get();
  ap.prompt.k = dk.get();
  ap.prompt.v = dv.get();
  ap.prompt.out = dout.get();
  ap.blocks = params;
  ap.mask = dmask.as<uint8_t>();
  EXPECT_EQ(cuda::SaleAttend(ap, nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(dout.Download(got.data(), got.size()), cudaSuccess);
  std::vector<double> ref(got.size() / es), out(got.size() / es);
  for (size_t x = 0; x < ref.size(); ++x) {
    ref[x] = LoadAsFloat(want.data(), x, pr.dtype);
    out[x] = LoadAsFloat(got.data(), x, pr.dtype);
  }
  return RelativeL2(ref, out);
}

SaleMask CpuMask(const Prompt& pr, const SaleParams& params, const std::vector<float>& tau) {
  SalePrefill p = PrefillOf(pr);
  SaleMask m;
  EXPECT_TRUE(kernels::SaleSelect(p, params, tau, &m).ok());
  return m;
}

// The computation pass equals the reference's over the same blocks (within the dtype's rounding
// of P and of the output), and with every block selected, dense causal attention.
TEST(SaleCudaTest, AttendMatchesTheCpuReferenceOverTheSameBlocks) {
  KVSPARSE_REQUIRE_GPU();
  SaleParams params;
  for (DType dtype : {DType::kBf16, DType::kFp16}) {
    for (int32_t d : {64, 128}) {
      for (int32_t n : {1, 40, 777, 1500}) {
        const Prompt pr = MakePrompt(n, 8, 2, d, dtype, 17 + n + d);
        const std::vector<float> tau = {0.f, 1e-4f, 1e-3f, 4e-3f, 8e-3f, 2e-2f, 5e-2f, 0.2f};
        const SaleMask sparse = CpuMask(pr, params, tau);
        const double tol = dtype == DType::kBf16 ? 1.5e-2 : 4e-3;
        const double e_sparse = AttendError(pr, params, sparse, 3);
        EXPECT_LT(e_sparse, tol) << "sparse, n " << n << " d " << d;
        const double e_dense = AttendError(pr, params, SaleFullMask(PrefillOf(pr), params), 4);
        EXPECT_LT(e_dense, tol) << "dense, n " << n << " d " << d;
        if (n == 1500) {
          std::printf(
              "SALE attend %s d=%d n=%d: rel L2 %.2e sparse (%.0f%% of blocks skipped), "
              "%.2e dense\n",
              dtype == DType::kBf16 ? "bf16" : "fp16", d, n, e_sparse, 100.0 * sparse.sparsity(),
              e_dense);
        }
      }
    }
  }
}

// A long prompt's rows with few selected blocks (whole runs of key blocks skipped between the
// ones the pass's compacted block list holds): the same output as the reference.
TEST(SaleCudaTest, AttendOverSparseRowsOfALongPrompt) {
  KVSPARSE_REQUIRE_GPU();
  SaleParams params;
  const Prompt pr = MakePrompt(4100, 4, 1, 128, DType::kBf16, 41);
  SaleMask mask = SaleFullMask(PrefillOf(pr), params);
  std::mt19937 rng(7);
  std::bernoulli_distribution keep(0.03);
  for (int32_t h = 0; h < mask.heads; ++h) {
    for (int32_t i = 0; i < mask.q_blocks; ++i) {
      // Keep the first and the last two blocks of the row's causal span, a few between.
      const int32_t last = (std::min(pr.n, (i + 1) * params.block_q) - 1) / params.block_k;
      for (int32_t blk = 1; blk + 2 <= last; ++blk) {
        uint8_t& x =
            mask.selected[(static_cast<size_t>(h) * mask.q_blocks + i) * mask.k_blocks + blk];
        x = keep(rng) ? 1 : 0;
      }
    }
  }
  EXPECT_LT(AttendError(pr, params, mask, 5), 1.5e-2);
}

// Rows longer than the computation pass's block list holds at once (2,048 mask bytes a refill,
// from the row's 16-byte-aligned start): blocks on both sides of every refill, rows at each
// alignment (2,100 blocks a row), the same output as the reference.
TEST(SaleCudaTest, AttendWalksRowsLongerThanOneBlockList) {
  KVSPARSE_REQUIRE_GPU();
  SaleParams params;
  const int32_t k_blocks = 2100;
  const Prompt pr = MakePrompt(k_blocks * params.block_k, 1, 1, 64, DType::kBf16, 43);
  SaleMask mask = SaleFullMask(PrefillOf(pr), params);
  ASSERT_EQ(mask.k_blocks, k_blocks);
  std::mt19937 rng(9);
  std::bernoulli_distribution keep(0.01), near(0.5);
  for (int32_t i = 0; i < mask.q_blocks; ++i) {
    const int32_t last = (std::min(pr.n, (i + 1) * params.block_q) - 1) / params.block_k;
    for (int32_t blk = 1; blk + 2 <= last; ++blk) {
      const bool at_refill = std::abs(blk - 2040) < 24;  // the refill falls in 2,033-2,048
      mask.selected[static_cast<size_t>(i) * mask.k_blocks + blk] =
          (at_refill ? near(rng) : keep(rng)) ? 1 : 0;
    }
  }
  EXPECT_LT(AttendError(pr, params, mask, 6), 1.5e-2);
}

TEST(SaleCudaTest, RefusesWhatItDoesNotTake) {
  SaleSelectParams sp;
  sp.prompt.tokens = 10;
  sp.prompt.num_q_heads = 2;
  sp.prompt.num_kv_heads = 1;
  sp.prompt.scale = 0.125f;
  sp.prompt.head_dim = 66;  // not a multiple of 32
  EXPECT_EQ(SaleSelect(sp, nullptr, 0, nullptr), cudaErrorInvalidValue);
  sp.prompt.head_dim = 64;
  sp.blocks.block_q = 128;  // more than the kernel's 64
  EXPECT_EQ(SaleSelect(sp, nullptr, 0, nullptr), cudaErrorInvalidValue);
  EXPECT_FALSE(SaleSupports(sp.blocks, 64));
  sp.blocks.block_q = 64;
  sp.prompt.tokens =
      0;  // an empty prompt is nothing to do, but not with a scale the reference refuses
  EXPECT_EQ(SaleSelect(sp, nullptr, 0, nullptr), cudaSuccess);
  sp.prompt.scale = 0.f;
  EXPECT_EQ(SaleSelect(sp, nullptr, 0, nullptr), cudaErrorInvalidValue);
  sp.prompt.scale = 0.125f;
  sp.prompt.tokens = 10;
  SaleAttendParams ap;
  ap.prompt = sp.prompt;
  ap.prompt.head_dim = 96;  // the pass takes 64 and 128
  EXPECT_EQ(cuda::SaleAttend(ap, nullptr), cudaErrorInvalidValue);
  EXPECT_FALSE(SaleAttendSupports(ap.blocks, 96, DType::kBf16));
  EXPECT_FALSE(SaleAttendSupports(ap.blocks, 128, DType::kFp32));
  // Operands off 16-byte alignment (the kernels' vector loads and cp.async need it): refused
  // before anything is read (the pointers are never dereferenced).
  alignas(16) static char base[64];
  float tau = 0.01f;
  uint8_t mask_byte = 0;
  sp.prompt.q = base + 8;
  sp.prompt.k = base;
  sp.tau = &tau;
  sp.mask = &mask_byte;
  EXPECT_EQ(SaleSelect(sp, base, size_t{1} << 30, nullptr), cudaErrorInvalidValue);
  sp.prompt.q = base;
  EXPECT_EQ(SaleSelect(sp, base + 8, size_t{1} << 30, nullptr), cudaErrorInvalidValue);
  sp.prompt.q = base + 8;
  ap.prompt = sp.prompt;
  ap.prompt.head_dim = 64;
  ap.prompt.v = base;
  ap.prompt.out = base;
  ap.mask = &mask_byte;
  EXPECT_EQ(cuda::SaleAttend(ap, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace kvsparse::kernels::cuda
