// GPU SANTA / S2ANTA against the CPU references (kernels/santa.h). Given its random numbers a
// sampler is deterministic, and the kernels draw the same Philox numbers as the CPU, so the
// per-token sample counts must agree; they may differ only where the GPU's differently rounded
// scores move a cumulative sum across a sampling threshold (tolerated: <= 0.5% of the samples).
// Statistically: S2ANTA-flash and SANTA iid are unbiased (the mean over seeds converges to
// dense attention); prop's expectation is SantaExpectedWeights (checked on the CPU side).
#include "kernels/cuda/santa.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_test_util.h"
#include "kernels/dense.h"
#include "kernels/santa.h"
#include "kernels/synthetic.h"

namespace kvsparse::kernels::cuda {
namespace {

enum class Method { kIid, kProp, kFlash };

const char* Name(Method m) {
  return m == Method::kIid ? "iid" : m == Method::kProp ? "prop" : "flash";
}

kernels::SantaParams CpuParams(Method m, int samples) {
  kernels::SantaParams c;
  c.samples = samples;
  c.tile_size = kSantaTile;
  if (m == Method::kIid) {
    c.sampler = SantaSampler::kIid;
    c.allocation = SantaAllocation::kGlobal;
  } else {
    c.sampler = SantaSampler::kSystematic;
    c.allocation = m == Method::kProp ? SantaAllocation::kProp : SantaAllocation::kFlash;
  }
  return c;
}

size_t WorkspaceBytes(Method m, const SantaLaunchParams& p) {
  switch (m) {
    case Method::kIid:
      return SantaIidWorkspaceBytes(p);
    case Method::kProp:
      return S2antaPropWorkspaceBytes(p);
    case Method::kFlash:
      return S2antaFlashWorkspaceBytes(p);
  }
  return 0;
}

cudaError_t RunMethod(Method m, const SantaLaunchParams& p, DeviceBuffer& ws, cudaStream_t stream) {
  switch (m) {
    case Method::kIid:
      return SantaIid(p, ws.get(), ws.size(), stream);
    case Method::kProp:
      return S2antaProp(p, ws.get(), ws.size(), stream);
    case Method::kFlash:
      return S2antaFlash(p, ws.get(), ws.size(), stream);
  }
  return cudaErrorInvalidValue;
}

// Peaked synthetic options with 8 query heads over 2 kv heads, one sequence per length.
SyntheticOptions SmallGroups(std::vector<int32_t> lens) {
  SyntheticOptions o;
  o.batch = static_cast<int32_t>(lens.size());
  o.num_q_heads = 8;
  o.num_kv_heads = 2;
  o.seq_lens = std::move(lens);
  return o;
}

struct Outcome {
  int64_t samples = 0;     // CPU samples (sum of counts)
  int64_t mismatched = 0;  // sum over tokens of |gpu count - cpu count|
  double out_err = 0;      // GPU output vs CPU output, relative L2
  double dense_err = 0;    // GPU output vs dense attention, relative L2
  int64_t non_finite = 0;
};

// Runs one method on the GPU and on the CPU with the same seed and compares.
Outcome Compare(Method m, const DecodeProblem& hp, size_t kv_elems, int samples, uint64_t seed) {
  Outcome r;
  DeviceProblem d = DeviceProblem::Upload(hp, kv_elems);
  const int64_t bh = static_cast<int64_t>(hp.batch) * hp.num_q_heads;
  const int32_t n_max = d.shape.max_seq_len;
  SantaLaunchParams p;
  p.shape = d.shape;
  p.num_samples = samples;
  p.seed = seed;
  DeviceBuffer counts(sizeof(int32_t) * std::max<int64_t>(1, bh * n_max));
  DeviceBuffer indices(sizeof(int32_t) * std::max<int64_t>(1, bh * samples));
  EXPECT_EQ(counts.Poison(0), cudaSuccess);
  EXPECT_EQ(indices.Poison(), cudaSuccess);
  if (m == Method::kIid) {
    p.indices = indices.as<int32_t>();
  } else {
    p.sample_counts = counts.as<int32_t>();
  }
  DeviceBuffer ws(WorkspaceBytes(m, p));
  EXPECT_EQ(ws.Poison(), cudaSuccess);
  EXPECT_EQ(RunMethod(m, p, ws, nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<double> gpu_out = d.OutputAsDouble(&r.non_finite);

  // GPU counts per (b, h, token).
  std::vector<int32_t> gpu_counts(static_cast<size_t>(bh) * n_max, 0);
  if (m == Method::kIid) {
    const std::vector<int32_t> idx = ToHost<int32_t>(indices, static_cast<size_t>(bh) * samples);
    for (int64_t i = 0; i < bh; ++i) {
      for (int s = 0; s < samples; ++s) {
        const int32_t t = idx[i * samples + s];
        if (t >= 0 && t < n_max) ++gpu_counts[i * n_max + t];
      }
    }
  } else {
    gpu_counts = ToHost<int32_t>(counts, static_cast<size_t>(bh) * n_max);
  }

  // CPU selection and output.
  std::vector<uint8_t> cpu_out_buf(static_cast<size_t>(bh) * hp.head_dim * DTypeSize(hp.dtype));
  DecodeProblem cp = hp;
  cp.out = cpu_out_buf.data();
  RowSelection sel;
  EXPECT_TRUE(SantaDecodeCpu(cp, CpuParams(m, samples), seed, &sel).ok());
  std::vector<int32_t> cpu_counts(static_cast<size_t>(bh) * n_max, 0);
  const int g_size = hp.num_q_heads / hp.num_kv_heads;
  for (int b = 0; b < hp.batch; ++b) {
    for (int j = 0; j < hp.num_kv_heads; ++j) {
      const KvHeadSelection& ks = sel.at(b, j);
      for (int g = 0; g < g_size; ++g) {
        const int64_t h = static_cast<int64_t>(b) * hp.num_q_heads + j * g_size + g;
        for (int r2 = 0; r2 < ks.num_rows(); ++r2) {
          cpu_counts[h * n_max + ks.tokens[r2]] += ks.head_counts[g * ks.num_rows() + r2];
        }
      }
    }
  }
  for (size_t i = 0; i < cpu_counts.size(); ++i) {
    r.samples += cpu_counts[i];
    r.mismatched += std::abs(cpu_counts[i] - gpu_counts[i]);
  }
  r.out_err = RelativeL2(OutputAsDouble(cp), gpu_out);
  std::vector<double> dense;
  EXPECT_TRUE(DenseDecodeFloat64(hp, &dense).ok());
  r.dense_err = RelativeL2(dense, gpu_out);
  return r;
}

TEST(SantaCudaTest, MatchesCpuIndicesAcrossShapes) {
  KVSPARSE_REQUIRE_GPU();
  const std::vector<std::vector<int32_t>> length_sets = {{1, 3, 255, 256, 257, 1000}, {4097}};
  int config = 0;
  for (Method m : {Method::kProp, Method::kFlash, Method::kIid}) {
    for (DType t : {DType::kBf16, DType::kFp16}) {
      for (int d : {64, 128, 256}) {
        for (int g : {1, 2, 4, 8}) {
          const auto& lens = length_sets[(config++) % length_sets.size()];
          SyntheticOptions o;
          o.family = static_cast<ScoreFamily>(config % 3);
          o.batch = static_cast<int32_t>(lens.size());
          o.num_kv_heads = 2;
          o.num_q_heads = 2 * g;
          o.head_dim = d;
          o.seq_lens = lens;
          o.dtype = t;
          o.seed = 100 + config;
          SyntheticProblem sp = SyntheticProblem::Make(o);
          const int samples = m == Method::kFlash ? 256 : 64;
          const Outcome r = Compare(m, sp.problem, sp.k.size() / DTypeSize(t), samples, 7 + config);
          const std::string what = std::string(Name(m)) + " " + std::string(DTypeName(t)) +
                                   " d=" + std::to_string(d) + " G=" + std::to_string(g);
          EXPECT_EQ(r.non_finite, 0) << what;
          EXPECT_GT(r.samples, 0) << what;
          EXPECT_LE(r.mismatched, std::max<int64_t>(2, r.samples / 200)) << what;
          // Same rows and weights: the outputs differ by rounding (and the rare mismatch).
          EXPECT_LT(r.out_err, r.mismatched == 0 ? 2e-2 : 0.1) << what;
        }
      }
    }
  }
}

// Llama-8B shapes at 32k tokens, the benchmark's operating points.
TEST(SantaCudaTest, OperatingPointsAt32k) {
  KVSPARSE_REQUIRE_GPU();
  SyntheticOptions o;
  o.family = ScoreFamily::kPeaked;
  o.batch = 2;
  o.num_q_heads = 32;
  o.num_kv_heads = 8;
  o.seq_lens = {32768, 20000};
  SyntheticProblem sp = SyntheticProblem::Make(o);
  const Outcome prop = Compare(Method::kProp, sp.problem, sp.k.size() / 2, 128, 1);
  const Outcome flash = Compare(Method::kFlash, sp.problem, sp.k.size() / 2, 2048, 2);
  for (const Outcome* r : {&prop, &flash}) {
    EXPECT_EQ(r->non_finite, 0);
    EXPECT_LE(r->mismatched, std::max<int64_t>(2, r->samples / 200));
    EXPECT_LT(r->out_err, 0.05);
  }
  // Accuracy against dense attention on peaked scores (the paper's operating points).
  EXPECT_LT(prop.dense_err, 0.35);
  EXPECT_LT(flash.dense_err, 0.35);
  printf(
      "32k peaked: prop S=128 rel err %.4f (%lld of %lld counts moved), flash S=2048 rel err "
      "%.4f (%lld of %lld moved)\n",
      prop.dense_err, static_cast<long long>(prop.mismatched), static_cast<long long>(prop.samples),
      flash.dense_err, static_cast<long long>(flash.mismatched),
      static_cast<long long>(flash.samples));
}

// Prop's budgets when every full tile has the same weight (K = 0: every score is 0): systematic
// rounding of equal quotas gives each tile floor or ceil of S / T, the same tiles as the CPU
// (fixed-point prefix sums: the block's order of summation does not matter).
TEST(SantaCudaTest, PropBudgetsOfEqualTiles) {
  KVSPARSE_REQUIRE_GPU();
  // 37 equal tiles; 600 and a short one (> 512 tiles)
  SyntheticProblem sp = SyntheticProblem::Make(SmallGroups({37 * 256, 600 * 256 + 5}));
  std::fill(sp.k.begin(), sp.k.end(), uint8_t{0});
  for (int samples : {64, 128, 1000}) {
    const Outcome r = Compare(Method::kProp, sp.problem, sp.k.size() / 2, samples, 3);
    EXPECT_EQ(r.non_finite, 0) << samples;
    EXPECT_EQ(r.mismatched, 0) << samples;
    EXPECT_LT(r.out_err, 2e-2) << samples;
  }
}

// Flash, prop and iid are unbiased: averaging the GPU output over seeds approaches dense
// attention (error of the mean well below the single-draw error; prop with S = 32 over 12 tiles
// gives most tiles a quota below one, which its budgets sample with that probability).
TEST(SantaCudaTest, FlashPropAndIidAreUnbiasedOverSeeds) {
  KVSPARSE_REQUIRE_GPU();
  SyntheticOptions o;
  o.family = ScoreFamily::kZipf;
  o.batch = 1;
  o.num_q_heads = 8;
  o.num_kv_heads = 2;
  o.seq_lens = {3000};
  SyntheticProblem sp = SyntheticProblem::Make(o);
  std::vector<double> dense;
  ASSERT_TRUE(DenseDecodeFloat64(sp.problem, &dense).ok());
  for (Method m : {Method::kFlash, Method::kProp, Method::kIid}) {
    DeviceProblem d = DeviceProblem::Upload(sp.problem, sp.k.size() / 2);
    SantaLaunchParams p;
    p.shape = d.shape;
    p.num_samples = 32;
    DeviceBuffer ws(WorkspaceBytes(m, p));
    constexpr int kSeeds = 256;
    std::vector<double> mean(dense.size(), 0.0);
    double single = 0;
    for (int s = 0; s < kSeeds; ++s) {
      p.seed = 1000 + s;
      KVSPARSE_ASSERT_CUDA(RunMethod(m, p, ws, nullptr));
      KVSPARSE_ASSERT_CUDA(cudaDeviceSynchronize());
      const std::vector<double> out = d.OutputAsDouble(nullptr);
      single += RelativeL2(dense, out) / kSeeds;
      for (size_t i = 0; i < out.size(); ++i) mean[i] += out[i] / kSeeds;
    }
    const double mean_err = RelativeL2(dense, mean);
    // sqrt(256) = 16 for pure noise; bf16 output rounding adds ~4e-3.
    EXPECT_LT(mean_err, single / 6 + 5e-3) << Name(m) << " single " << single;
  }
}

TEST(SantaCudaTest, GraphCaptureProp) {
  KVSPARSE_REQUIRE_GPU();
  SyntheticProblem sp = SyntheticProblem::Make(SmallGroups({5000, 700}));
  DeviceProblem d = DeviceProblem::Upload(sp.problem, sp.k.size() / 2);
  SantaLaunchParams p;
  p.shape = d.shape;
  p.num_samples = 128;
  p.seed = 5;
  DeviceBuffer ws(std::max(S2antaPropWorkspaceBytes(p), S2antaFlashWorkspaceBytes(p)));
  cudaStream_t stream;
  KVSPARSE_ASSERT_CUDA(cudaStreamCreate(&stream));
  KVSPARSE_ASSERT_CUDA(S2antaProp(p, ws.get(), ws.size(), stream));
  KVSPARSE_ASSERT_CUDA(cudaStreamSynchronize(stream));
  const std::vector<double> direct = d.OutputAsDouble(nullptr);
  cudaGraph_t graph;
  KVSPARSE_ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  KVSPARSE_ASSERT_CUDA(S2antaProp(p, ws.get(), ws.size(), stream));
  KVSPARSE_ASSERT_CUDA(S2antaFlash(p, ws.get(), ws.size(), stream));
  KVSPARSE_ASSERT_CUDA(S2antaProp(p, ws.get(), ws.size(), stream));
  KVSPARSE_ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  KVSPARSE_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 3; ++rep) {
    KVSPARSE_ASSERT_CUDA(d.out.Poison());
    KVSPARSE_ASSERT_CUDA(cudaGraphLaunch(exec, stream));
    KVSPARSE_ASSERT_CUDA(cudaStreamSynchronize(stream));
    int64_t bad = 0;
    EXPECT_LT(RelativeL2(direct, d.OutputAsDouble(&bad)), 1e-2);  // fp32 atomics reorder
    EXPECT_EQ(bad, 0);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace kvsparse::kernels::cuda
