// GPU dense decode against the float64 CPU reference over dtypes, head dims, GQA group sizes,
// KV layouts and ragged / tiny / empty lengths; plus replay under CUDA graph capture.
#include "kernels/cuda/dense_decode.h"

#include <cuda_runtime_api.h>

#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_test_util.h"
#include "kernels/dense.h"
#include "kernels/synthetic.h"

namespace kvsparse::kernels::cuda {
namespace {

std::vector<uint8_t> RandomRows(size_t n, DType t, std::mt19937_64& rng) {
  std::vector<uint8_t> buf(n * DTypeSize(t));
  std::normal_distribution<float> dist(0.f, 1.f);
  for (size_t i = 0; i < n; ++i) StoreFromFloat(buf.data(), i, t, dist(rng));
  return buf;
}

struct HostProblem {
  std::vector<uint8_t> q, k, v, out;
  std::vector<int32_t> lens;
  DecodeProblem p;
};

// Random N(0, 1) problem; hnd = [B, Hkv, n, d] layout instead of [B, n, Hkv, d].
HostProblem MakeProblem(DType t, int batch, int hkv, int group, int d, std::vector<int32_t> lens,
                        bool hnd, std::mt19937_64& rng) {
  HostProblem h;
  h.lens = std::move(lens);
  int32_t n_max = 1;
  for (int32_t l : h.lens) n_max = std::max(n_max, l);
  const int heads = hkv * group;
  const size_t kv = static_cast<size_t>(batch) * n_max * hkv * d;
  h.q = RandomRows(static_cast<size_t>(batch) * heads * d, t, rng);
  h.k = RandomRows(kv, t, rng);
  h.v = RandomRows(kv, t, rng);
  h.out.assign(static_cast<size_t>(batch) * heads * d * DTypeSize(t), 0);
  DecodeProblem& p = h.p;
  p.batch = batch;
  p.num_q_heads = heads;
  p.num_kv_heads = hkv;
  p.head_dim = d;
  p.dtype = t;
  p.q = h.q.data();
  p.k = h.k.data();
  p.v = h.v.data();
  p.out = h.out.data();
  p.seq_lens = h.lens.data();
  p.scale = 1.f / std::sqrt(static_cast<float>(d));
  if (hnd) {
    p.kv_layout = {static_cast<int64_t>(hkv) * n_max * d, static_cast<int64_t>(n_max) * d, d};
  } else {
    p.kv_layout = {static_cast<int64_t>(n_max) * hkv * d, d, static_cast<int64_t>(hkv) * d};
  }
  return h;
}

// Runs DenseDecode on the device copy of `h` and returns the relative L2 error against float64.
double RunAndCompare(const HostProblem& h, int64_t* non_finite) {
  DeviceProblem d = DeviceProblem::Upload(h.p, h.k.size() / DTypeSize(h.p.dtype));
  DeviceBuffer ws(DenseDecodeWorkspaceBytes(d.shape));
  EXPECT_EQ(ws.Poison(), cudaSuccess);
  EXPECT_EQ(DenseDecode(d.shape, ws.get(), ws.size(), nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<double> ref;
  EXPECT_TRUE(DenseDecodeFloat64(h.p, &ref).ok());
  return RelativeL2(ref, d.OutputAsDouble(non_finite));
}

// Tolerances: the output is rounded to the dtype (bf16 unit roundoff 2^-8, fp16 2^-11); fp32
// accumulation adds far less. Relative L2 over all outputs.
double Tolerance(DType t) { return t == DType::kBf16 ? 8e-3 : 1.5e-3; }

TEST(DenseDecodeCudaTest, SweepDtypeHeadDimGroupLayoutLengths) {
  KVSPARSE_REQUIRE_GPU();
  std::mt19937_64 rng(11);
  const std::vector<std::vector<int32_t>> length_sets = {{1, 7, 300, 1029}, {0, 64}, {2500}};
  for (DType t : {DType::kBf16, DType::kFp16}) {
    for (int d : {64, 128, 256}) {
      for (int g : {1, 2, 4, 8}) {
        for (size_t li = 0; li < length_sets.size(); ++li) {
          const bool hnd = (li + g) % 2 == 1;
          const auto& lens = length_sets[li];
          HostProblem h = MakeProblem(t, static_cast<int>(lens.size()), 2, g, d, lens, hnd, rng);
          int64_t bad = 0;
          const double err = RunAndCompare(h, &bad);
          EXPECT_EQ(bad, 0);
          EXPECT_LT(err, Tolerance(t)) << DTypeName(t) << " d=" << d << " G=" << g << " lens set "
                                       << li << (hnd ? " HND" : " NHD");
        }
      }
    }
  }
}

// Long sequences: many splits and the merge kernel, Llama-8B-like heads.
TEST(DenseDecodeCudaTest, LongSequencesManySplits) {
  KVSPARSE_REQUIRE_GPU();
  std::mt19937_64 rng(12);
  HostProblem h = MakeProblem(DType::kBf16, 2, 8, 4, 128, {40000, 17001}, false, rng);
  int64_t bad = 0;
  const double err = RunAndCompare(h, &bad);
  EXPECT_EQ(bad, 0);
  EXPECT_LT(err, Tolerance(DType::kBf16));
}

// Peaked attention (sinks, needles) from the synthetic generator.
TEST(DenseDecodeCudaTest, PeakedScores) {
  KVSPARSE_REQUIRE_GPU();
  SyntheticOptions o;
  o.family = ScoreFamily::kPeaked;
  o.batch = 2;
  o.num_q_heads = 16;
  o.num_kv_heads = 4;
  o.seq_lens = {9000, 333};
  SyntheticProblem sp = SyntheticProblem::Make(o);
  DeviceProblem d = DeviceProblem::Upload(sp.problem, sp.k.size() / 2);
  DeviceBuffer ws(DenseDecodeWorkspaceBytes(d.shape));
  KVSPARSE_ASSERT_CUDA(DenseDecode(d.shape, ws.get(), ws.size(), nullptr));
  KVSPARSE_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<double> ref;
  ASSERT_TRUE(DenseDecodeFloat64(sp.problem, &ref).ok());
  int64_t bad = 0;
  EXPECT_LT(RelativeL2(ref, d.OutputAsDouble(&bad)), Tolerance(DType::kBf16));
  EXPECT_EQ(bad, 0);
}

// The launcher records into a CUDA graph (no allocation, no synchronisation) and replays.
TEST(DenseDecodeCudaTest, GraphCaptureReplays) {
  KVSPARSE_REQUIRE_GPU();
  std::mt19937_64 rng(13);
  HostProblem h = MakeProblem(DType::kBf16, 3, 8, 4, 128, {5000, 1, 3000}, false, rng);
  DeviceProblem d = DeviceProblem::Upload(h.p, h.k.size() / 2);
  DeviceBuffer ws(DenseDecodeWorkspaceBytes(d.shape));
  cudaStream_t stream;
  KVSPARSE_ASSERT_CUDA(cudaStreamCreate(&stream));
  cudaGraph_t graph;
  KVSPARSE_ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  KVSPARSE_ASSERT_CUDA(DenseDecode(d.shape, ws.get(), ws.size(), stream));
  KVSPARSE_ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  KVSPARSE_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  std::vector<double> ref;
  ASSERT_TRUE(DenseDecodeFloat64(h.p, &ref).ok());
  for (int rep = 0; rep < 2; ++rep) {
    KVSPARSE_ASSERT_CUDA(d.out.Poison());
    KVSPARSE_ASSERT_CUDA(cudaGraphLaunch(exec, stream));
    KVSPARSE_ASSERT_CUDA(cudaStreamSynchronize(stream));
    int64_t bad = 0;
    EXPECT_LT(RelativeL2(ref, d.OutputAsDouble(&bad)), Tolerance(DType::kBf16));
    EXPECT_EQ(bad, 0);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(DenseDecodeCudaTest, RejectsUnsupportedShapes) {
  DecodeShape s;
  s.batch = 1;
  s.num_q_heads = 12;
  s.num_kv_heads = 4;  // G = 3
  s.head_dim = 128;
  s.max_seq_len = 10;
  alignas(16) static uint8_t dummy[64];
  s.q = s.k = s.v = dummy;
  s.out = dummy;
  s.seq_lens = reinterpret_cast<const int32_t*>(dummy);
  s.scale = 1.f;
  EXPECT_EQ(DenseDecode(s, nullptr, 0, nullptr), cudaErrorInvalidValue);
  s.num_q_heads = 8;
  s.head_dim = 96;
  EXPECT_EQ(DenseDecode(s, nullptr, 0, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace kvsparse::kernels::cuda
