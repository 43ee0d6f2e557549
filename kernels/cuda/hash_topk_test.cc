// GPU HashAttention against the CPU references: SimHash signatures bit for bit, and the
// sink + window + Hamming top-k selection token for token (the rule is a total order).
#include "kernels/cuda/hash_topk.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_test_util.h"
#include "kernels/hash_signatures.h"
#include "kernels/hash_topk.h"
#include "kernels/synthetic.h"

namespace kvsparse::kernels::cuda {
namespace {

// Per (b, h): the ascending tokens the CPU reference selects for query head h.
std::vector<std::vector<int32_t>> CpuLists(const DecodeProblem& p, const RowSelection& sel) {
  const int g_size = p.num_q_heads / p.num_kv_heads;
  std::vector<std::vector<int32_t>> lists(static_cast<size_t>(p.batch) * p.num_q_heads);
  for (int b = 0; b < p.batch; ++b) {
    for (int j = 0; j < p.num_kv_heads; ++j) {
      const KvHeadSelection& ks = sel.at(b, j);
      for (int g = 0; g < g_size; ++g) {
        auto& l = lists[static_cast<size_t>(b) * p.num_q_heads + j * g_size + g];
        for (int r = 0; r < ks.num_rows(); ++r) {
          if (ks.head_counts[g * ks.num_rows() + r] > 0) l.push_back(ks.tokens[r]);
        }
      }
    }
  }
  return lists;
}

void CheckTopK(const DecodeProblem& p, const Signatures& sigs, const kernels::HashTopKParams& cp,
               const std::string& what) {
  RowSelection sel;
  ASSERT_TRUE(HashTopKSelectCpu(p, cp, sigs.view, &sel).ok()) << what;
  const auto want = CpuLists(p, sel);
  DeviceBuffer q = ToDevice(sigs.q);
  DeviceBuffer k = ToDevice(sigs.k);
  DeviceBuffer lens = ToDevice(std::vector<int32_t>(p.seq_lens, p.seq_lens + p.batch));
  HashTopKLaunchParams gp;
  gp.batch = p.batch;
  gp.num_q_heads = p.num_q_heads;
  gp.key_heads = sigs.view.key_heads;
  gp.bits = sigs.view.bits;
  gp.q_sigs = q.as<uint32_t>();
  gp.k_sigs = k.as<uint32_t>();
  gp.k_batch_stride = sigs.view.batch_stride;
  gp.k_head_stride = sigs.view.head_stride;
  gp.k_token_stride = sigs.view.token_stride;
  gp.seq_lens = lens.as<int32_t>();
  gp.max_seq_len = *std::max_element(p.seq_lens, p.seq_lens + p.batch);
  gp.fixed = cp.fixed;
  const int bh = p.batch * p.num_q_heads;
  const int max_out = std::max(1, gp.MaxSelected());
  DeviceBuffer idx(sizeof(int32_t) * bh * max_out), counts(sizeof(int32_t) * bh);
  ASSERT_EQ(idx.Poison(), cudaSuccess);
  ASSERT_EQ(counts.Poison(), cudaSuccess);
  gp.indices = idx.as<int32_t>();
  gp.counts = counts.as<int32_t>();
  DeviceBuffer ws(HashTopKWorkspaceBytes(gp));
  ASSERT_EQ(ws.Poison(), cudaSuccess);
  ASSERT_EQ(HashTopK(gp, ws.get(), ws.size(), nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto got_idx = ToHost<int32_t>(idx, static_cast<size_t>(bh) * max_out);
  const auto got_cnt = ToHost<int32_t>(counts, bh);
  for (int i = 0; i < bh; ++i) {
    ASSERT_EQ(got_cnt[i], static_cast<int32_t>(want[i].size())) << what << " head " << i;
    const std::vector<int32_t> got(
        got_idx.begin() + static_cast<int64_t>(i) * max_out,
        got_idx.begin() + static_cast<int64_t>(i) * max_out + got_cnt[i]);
    EXPECT_EQ(got, want[i]) << what << " head " << i;
  }
}

TEST(HashTopKCudaTest, RandomSignaturesMatchCpuExactly) {
  KVSPARSE_REQUIRE_GPU();
  std::mt19937_64 rng(21);
  struct Case {
    int bits, hkv, g;
    std::vector<int32_t> lens;
    int sink, local, top_k;
    float frac;
  };
  const std::vector<Case> cases = {
      {32, 2, 4, {5000, 1, 300, 0}, 16, 32, 100, 0.f},
      {64, 1, 8, {20000}, 128, 128, 0, 0.05f},
      {128, 4, 1, {700, 260}, 4, 8, 256, 0.f},
      {256, 2, 2, {3000}, 0, 0, 1000, 0.f},
      {32, 8, 4, {70000}, 128, 128, 2048, 0.f},
      {32, 2, 2, {10, 200}, 128, 128, 5, 0.f},   // sink + window cover everything
      {32, 2, 4, {57, 1001}, 16, 32, 0, 0.05f},  // fraction * n rounds to nearest (2.85 -> 3)
  };
  for (const Case& c : cases) {
    const int words = c.bits / 32;
    const int heads = c.hkv * c.g;
    const int b_count = static_cast<int>(c.lens.size());
    const int n_max = std::max(1, *std::max_element(c.lens.begin(), c.lens.end()));
    Signatures sigs;
    sigs.q.resize(static_cast<size_t>(b_count) * heads * words);
    sigs.k.resize(static_cast<size_t>(b_count) * c.hkv * n_max * words);
    // Few distinct similarity values (bits small relative to n) force many ties.
    for (auto& w : sigs.q) w = static_cast<uint32_t>(rng());
    for (auto& w : sigs.k) w = static_cast<uint32_t>(rng());
    sigs.view = SignatureView{c.bits,
                              sigs.q.data(),
                              sigs.k.data(),
                              static_cast<int64_t>(c.hkv) * n_max * words,
                              static_cast<int64_t>(n_max) * words,
                              words,
                              c.hkv};
    DecodeProblem p;
    p.batch = b_count;
    p.num_q_heads = heads;
    p.num_kv_heads = c.hkv;
    p.head_dim = 64;
    p.seq_lens = c.lens.data();
    p.scale = 1.f;
    kernels::HashTopKParams cp;
    cp.bits = c.bits;
    cp.fixed.sink_tokens = c.sink;
    cp.fixed.local_tokens = c.local;
    cp.fixed.top_k = 0;
    cp.fixed.top_k_fraction = c.frac;
    if (c.top_k > 0) {
      // top_k must not exceed any sequence length for the CPU reference: clamp per case.
      cp.fixed.top_k =
          std::min(c.top_k, std::max(1, *std::min_element(c.lens.begin(), c.lens.end())));
      if (*std::min_element(c.lens.begin(), c.lens.end()) == 0) {
        cp.fixed.top_k = 0;
        cp.fixed.top_k_fraction = 0.1f;
      }
    }
    CheckTopK(p, sigs, cp, "bits=" + std::to_string(c.bits) + " n_max=" + std::to_string(n_max));
  }
}

// Learned MLP signatures (LearnedSign) against HashMlp::Sign, bit for bit: every dtype, a
// batch that is not a multiple of the kernel's vectors per block, MLPs shared by a GQA group.
TEST(HashTopKCudaTest, LearnedSignaturesMatchCpuBitForBit) {
  KVSPARSE_REQUIRE_GPU();
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (const std::vector<int32_t>& dims :
       {std::vector<int32_t>{128, 128, 128, 32}, std::vector<int32_t>{64, 256}}) {
    const int heads = 8, group = 4, mlps = heads / group, d = dims.front(), bits = dims.back();
    std::vector<HashMlp> m(mlps);
    std::vector<float> packed;
    for (HashMlp& x : m) {
      x.dims = dims;
      for (size_t i = 0; i + 1 < dims.size(); ++i) {
        const float scale = 1.f / std::sqrt(static_cast<float>(dims[i]));
        std::vector<float> w(static_cast<size_t>(dims[i]) * dims[i + 1]), b(dims[i + 1]);
        for (float& v : w) v = normal(rng) * scale;
        for (float& v : b) v = normal(rng) * 0.1f;
        x.weights.push_back(std::move(w));
        x.biases.push_back(std::move(b));
      }
      AppendPackedMlp(x, &packed);
    }
    ASSERT_TRUE(LearnedSignSupports(dims));
    ASSERT_EQ(static_cast<int64_t>(packed.size()),
              mlps * LearnedMlpFloats(dims.data(), static_cast<int32_t>(dims.size()) - 1));
    DeviceBuffer dm = ToDevice(packed);
    for (DType t : {DType::kBf16, DType::kFp16, DType::kFp32}) {
      const int batch = 37, words = bits / 32;
      const size_t es = DTypeSize(t), n = static_cast<size_t>(batch) * heads * d;
      std::vector<float> x(n);
      std::vector<uint8_t> raw(n * es);
      for (size_t i = 0; i < n; ++i) {
        const float v = normal(rng) * 2.f;
        StoreFromFloat(raw.data(), i, t, v);
        x[i] = LoadAsFloat(raw.data(), i, t);  // the value the GPU reads
      }
      DeviceBuffer dx = ToDevice(raw);
      DeviceBuffer out(sizeof(uint32_t) * batch * heads * words);
      LearnedSignParams p;
      p.num_seqs = batch;
      p.heads = heads;
      p.group = group;
      p.num_linear = static_cast<int32_t>(dims.size()) - 1;
      for (size_t i = 0; i < dims.size(); ++i) p.dims[i] = dims[i];
      p.dtype = t;
      p.x = dx.get();
      p.mlps = dm.as<float>();
      p.out = out.as<uint32_t>();
      p.out_batch_stride = static_cast<int64_t>(heads) * words;
      p.out_head_stride = words;
      ASSERT_EQ(LearnedSign(p, nullptr), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const auto got = ToHost<uint32_t>(out, static_cast<size_t>(batch) * heads * words);
      std::vector<float> scratch;
      std::vector<uint32_t> want(words);
      int mismatched = 0;
      for (int b = 0; b < batch; ++b) {
        for (int h = 0; h < heads; ++h) {
          m[h / group].Sign(&x[(static_cast<size_t>(b) * heads + h) * d], want.data(), &scratch);
          for (int w = 0; w < words; ++w) {
            mismatched += got[(static_cast<size_t>(b) * heads + h) * words + w] != want[w];
          }
        }
      }
      EXPECT_EQ(mismatched, 0) << DTypeName(t) << " bits " << bits;
    }
  }
}

TEST(HashTopKCudaTest, SimHashSignaturesMatchCpuBitForBit) {
  KVSPARSE_REQUIRE_GPU();
  for (DType t : {DType::kBf16, DType::kFp16}) {
    for (int bits : {32, 128}) {
      SyntheticOptions o;
      o.batch = 2;
      o.num_q_heads = 8;
      o.num_kv_heads = 2;
      o.head_dim = 128;
      o.seq_lens = {300, 41};
      o.dtype = t;
      SyntheticProblem sp = SyntheticProblem::Make(o);
      const DecodeProblem& p = sp.problem;
      SimHashConfig cfg;
      cfg.seed = 99;
      cfg.layer = 3;
      cfg.bits = bits;
      cfg.max_key_norm = {20.f, 25.f};
      Signatures cpu;
      ASSERT_TRUE(ComputeSimHashSignatures(p, cfg, &cpu).ok());
      const int words = bits / 32, d = p.head_dim;
      std::vector<float> planes;
      for (int j = 0; j < p.num_kv_heads; ++j) {
        SimHashPlanes pl;
        ASSERT_TRUE(MakeSimHashPlanes(cfg.seed, cfg.layer, j, bits, d, &pl).ok());
        planes.insert(planes.end(), pl.w.begin(), pl.w.end());
      }
      DeviceBuffer dplanes = ToDevice(planes);
      DeviceBuffer dnorm = ToDevice(cfg.max_key_norm);
      const size_t es = DTypeSize(t);
      // Queries: [B, H, d] as they are.
      DeviceBuffer dq(static_cast<size_t>(p.batch) * p.num_q_heads * d * es);
      ASSERT_EQ(dq.Upload(p.q, dq.size()), cudaSuccess);
      DeviceBuffer qsig(sizeof(uint32_t) * p.batch * p.num_q_heads * words);
      SimHashSignParams qp;
      qp.num_seqs = p.batch;
      qp.heads = p.num_q_heads;
      qp.group = p.num_q_heads / p.num_kv_heads;
      qp.dim = d;
      qp.bits = bits;
      qp.dtype = t;
      qp.x = dq.get();
      qp.planes = dplanes.as<float>();
      qp.out = qsig.as<uint32_t>();
      qp.out_batch_stride = static_cast<int64_t>(p.num_q_heads) * words;
      qp.out_head_stride = words;
      ASSERT_EQ(SimHashSign(qp, nullptr), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(ToHost<uint32_t>(qsig, cpu.q.size()), cpu.q);
      // Keys: the key of token t of every (b, kv head), appended at position t.
      const int n_max = 300;
      DeviceBuffer ksig(sizeof(uint32_t) * cpu.k.size());
      ASSERT_EQ(ksig.Poison(0), cudaSuccess);
      for (int t_pos : {0, 17, 40}) {
        std::vector<uint8_t> rows(static_cast<size_t>(p.batch) * p.num_kv_heads * d * es);
        for (int b = 0; b < p.batch; ++b) {
          for (int j = 0; j < p.num_kv_heads; ++j) {
            const int64_t off = b * p.kv_layout.batch_stride + j * p.kv_layout.head_stride +
                                static_cast<int64_t>(t_pos) * p.kv_layout.token_stride;
            std::memcpy(&rows[(static_cast<size_t>(b) * p.num_kv_heads + j) * d * es],
                        static_cast<const uint8_t*>(p.k) + off * es, d * es);
          }
        }
        DeviceBuffer dk = ToDevice(rows);
        DeviceBuffer pos = ToDevice(std::vector<int32_t>(p.batch, t_pos));
        SimHashSignParams kp = qp;
        kp.heads = p.num_kv_heads;
        kp.group = 1;
        kp.x = dk.get();
        kp.max_norm = dnorm.as<float>();
        kp.out = ksig.as<uint32_t>();
        kp.out_batch_stride = static_cast<int64_t>(p.num_kv_heads) * n_max * words;
        kp.out_head_stride = static_cast<int64_t>(n_max) * words;
        kp.out_token_stride = words;
        kp.positions = pos.as<int32_t>();
        ASSERT_EQ(SimHashSign(kp, nullptr), cudaSuccess);
      }
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const auto got = ToHost<uint32_t>(ksig, cpu.k.size());
      for (int b = 0; b < p.batch; ++b) {
        for (int j = 0; j < p.num_kv_heads; ++j) {
          for (int t_pos : {0, 17, 40}) {
            for (int w = 0; w < words; ++w) {
              const size_t i = b * cpu.view.batch_stride + j * cpu.view.head_stride +
                               t_pos * cpu.view.token_stride + w;
              EXPECT_EQ(got[i], cpu.k[i]) << "b " << b << " kvh " << j << " t " << t_pos;
            }
          }
        }
      }
      // End to end: GPU top-k on the CPU signatures of this problem.
      kernels::HashTopKParams cp;
      cp.bits = bits;
      cp.fixed.sink_tokens = 4;
      cp.fixed.local_tokens = 8;
      cp.fixed.top_k = 20;
      CheckTopK(p, cpu, cp, "simhash");
    }
  }
}

}  // namespace
}  // namespace kvsparse::kernels::cuda
