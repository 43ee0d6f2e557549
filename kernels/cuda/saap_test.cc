// SAAP on the GPU (saap.h) against the CPU reference (kernels/saap.h): every key's bucket
// (SaapAssignKeys, also over two appends at different first positions) equals
// ComputeSaapBuckets', and the selection (SaapSelect: rows, counts, budgets, identity positions)
// equals SaapSelectCpu's token for token, for bf16 and fp16, a ragged batch with an empty
// sequence, GQA groups of 4.
#include "kernels/cuda/saap.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_test_util.h"
#include "kernels/dtype.h"
#include "kernels/saap.h"
#include "kernels/synthetic.h"

namespace kvsparse::kernels::cuda {
namespace {

TEST(SaapCudaTest, BucketsAndSelectionMatchTheCpuReference) {
  KVSPARSE_REQUIRE_GPU();
  const int32_t B = 3, H = 8, Hkv = 2, G = H / Hkv, d = 128, C = 64, hid = 32, layer = 1;
  const std::vector<int32_t> lens = {700, 0, 1500};
  const int32_t n_max = 1500;
  SaapWeights w = RandomSaapWeights(2, H, Hkv, d, C, hid, 7);
  w.rope_scale = 1.25f;
  ASSERT_TRUE(SaapSupports(w));
  std::vector<float> packed;
  PackSaapLayer(w, layer, &packed);
  ASSERT_EQ(packed.size(), SaapLayerFloats(w));
  DeviceBuffer dw = ToDevice(packed);
  const SaapLayerWeights view = SaapLayerView(w, dw.as<float>());
  SaapParams params;
  params.probes = 5;
  params.sink_tokens = 16;
  params.local_tokens = 32;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (DType t : {DType::kBf16, DType::kFp16}) {
    SCOPED_TRACE(DTypeName(t));
    const size_t es = DTypeSize(t);
    // Host q [B, H, d] and K [B, n_max, Hkv, d] in the dtype.
    std::vector<uint8_t> q(static_cast<size_t>(B) * H * d * es);
    std::vector<uint8_t> k(static_cast<size_t>(B) * n_max * Hkv * d * es);
    for (size_t i = 0; i < q.size() / es; ++i) StoreFromFloat(q.data(), i, t, normal(rng));
    for (size_t i = 0; i < k.size() / es; ++i) StoreFromFloat(k.data(), i, t, normal(rng));
    std::vector<uint8_t> out(q.size());
    DecodeProblem p;
    p.batch = B;
    p.num_q_heads = H;
    p.num_kv_heads = Hkv;
    p.head_dim = d;
    p.dtype = t;
    p.q = q.data();
    p.k = k.data();
    p.v = k.data();
    p.kv_layout = {static_cast<int64_t>(n_max) * Hkv * d, d, static_cast<int64_t>(Hkv) * d};
    p.seq_lens = lens.data();
    p.scale = 1.f / std::sqrt(static_cast<float>(d));
    p.out = out.data();
    std::vector<int32_t> want_buckets;
    SaapBuckets bview;
    ASSERT_TRUE(ComputeSaapBuckets(p, w, layer, &want_buckets, &bview).ok());

    // Buckets on the GPU, (b, j) at [(b * Hkv + j) * n_max, ...), each in two appends.
    DeviceBuffer buckets(sizeof(uint32_t) * B * Hkv * n_max);
    KVSPARSE_ASSERT_CUDA(buckets.Poison(0));
    for (int32_t b = 0; b < B; ++b) {
      for (int32_t j = 0; j < Hkv; ++j) {
        const int32_t n = lens[b];
        std::vector<uint8_t> rows(static_cast<size_t>(n) * d * es);
        for (int32_t tok = 0; tok < n; ++tok) {
          std::copy_n(&k[((static_cast<size_t>(b) * n_max + tok) * Hkv + j) * d * es], d * es,
                      &rows[static_cast<size_t>(tok) * d * es]);
        }
        DeviceBuffer dx = ToDevice(rows);
        const int32_t split = n / 3;
        for (const auto& [first, count] :
             {std::pair<int32_t, int32_t>{0, split}, {split, n - split}}) {
          SaapAssignParams ap;
          ap.w = view;
          ap.kv_head = j;
          ap.num_keys = count;
          ap.first_position = first;
          ap.dtype = t;
          ap.x = dx.as<uint8_t>() + static_cast<size_t>(first) * d * es;
          ap.out = buckets.as<uint32_t>() + (static_cast<size_t>(b) * Hkv + j) * n_max + first;
          KVSPARSE_ASSERT_CUDA(SaapAssignKeys(ap, nullptr));
        }
      }
    }
    KVSPARSE_ASSERT_CUDA(cudaDeviceSynchronize());
    const std::vector<uint32_t> got_buckets =
        ToHost<uint32_t>(buckets, static_cast<size_t>(B) * Hkv * n_max);
    int mismatched = 0;
    for (int32_t b = 0; b < B; ++b) {
      for (int32_t j = 0; j < Hkv; ++j) {
        for (int32_t tok = 0; tok < lens[b]; ++tok) {
          const uint32_t got = got_buckets[(static_cast<size_t>(b) * Hkv + j) * n_max + tok];
          const int32_t want = want_buckets[b * bview.batch_stride + j * bview.head_stride + tok];
          mismatched += got != static_cast<uint32_t>(want);
        }
      }
    }
    EXPECT_EQ(mismatched, 0);

    // The selection, from the GPU's buckets.
    RowSelection sel;
    ASSERT_TRUE(SaapSelectCpu(p, params, w, layer, bview, &sel).ok());
    DeviceBuffer dq = ToDevice(q), dlens = ToDevice(lens);
    DeviceBuffer tokens(sizeof(int32_t) * B * Hkv * n_max), counts1(sizeof(int32_t) * B * Hkv);
    DeviceBuffer positions(sizeof(int32_t) * B * H * n_max), counts(sizeof(int32_t) * B * H);
    DeviceBuffer budgets(sizeof(int32_t) * B * H);
    std::vector<const uint32_t*> bucket_ptrs;
    std::vector<int32_t*> token_ptrs, count_ptrs;
    for (int32_t i = 0; i < B * Hkv; ++i) {
      bucket_ptrs.push_back(buckets.as<uint32_t>() + static_cast<size_t>(i) * n_max);
      token_ptrs.push_back(tokens.as<int32_t>() + static_cast<size_t>(i) * n_max);
      count_ptrs.push_back(counts1.as<int32_t>() + i);
    }
    DeviceBuffer dbp = ToDevice(bucket_ptrs), dtp = ToDevice(token_ptrs),
                 dcp = ToDevice(count_ptrs);
    for (DeviceBuffer* x : {&tokens, &counts1, &positions, &counts, &budgets}) {
      KVSPARSE_ASSERT_CUDA(x->Poison());
    }
    SaapSelectParams sp;
    sp.w = view;
    sp.batch = B;
    sp.dtype = t;
    sp.q = dq.get();
    sp.bucket_heads = dbp.as<const uint32_t* const>();
    sp.seq_lens = dlens.as<int32_t>();
    sp.max_seq_len = n_max;
    sp.probes = params.probes;
    sp.sink_tokens = params.sink_tokens;
    sp.local_tokens = params.local_tokens;
    sp.out.tokens = dtp.as<int32_t* const>();
    sp.out.count = dcp.as<int32_t* const>();
    sp.out.capacity = n_max;
    sp.positions = positions.as<int32_t>();
    sp.counts = counts.as<int32_t>();
    sp.budgets = budgets.as<int32_t>();
    DeviceBuffer ws(SaapSelectWorkspaceBytes(sp));
    KVSPARSE_ASSERT_CUDA(ws.Poison());
    KVSPARSE_ASSERT_CUDA(SaapSelect(sp, ws.get(), ws.size(), nullptr));
    KVSPARSE_ASSERT_CUDA(cudaDeviceSynchronize());
    const auto got_tokens = ToHost<int32_t>(tokens, static_cast<size_t>(B) * Hkv * n_max);
    const auto got_count = ToHost<int32_t>(counts1, static_cast<size_t>(B) * Hkv);
    const auto got_pos = ToHost<int32_t>(positions, static_cast<size_t>(B) * H * n_max);
    const auto got_counts = ToHost<int32_t>(counts, static_cast<size_t>(B) * H);
    const auto got_budgets = ToHost<int32_t>(budgets, static_cast<size_t>(B) * H);
    int64_t rows = 0, context = 0;
    for (int32_t b = 0; b < B; ++b) {
      for (int32_t j = 0; j < Hkv; ++j) {
        const int32_t i = b * Hkv + j;
        const KvHeadSelection& ks = sel.at(b, j);
        const int32_t n = static_cast<int32_t>(ks.tokens.size());
        ASSERT_EQ(got_count[i], n) << "b " << b << " j " << j;
        std::vector<int32_t> want(ks.tokens.begin(), ks.tokens.end());
        std::vector<int32_t> got(got_tokens.begin() + static_cast<size_t>(i) * n_max,
                                 got_tokens.begin() + static_cast<size_t>(i) * n_max + n);
        EXPECT_EQ(got, want) << "b " << b << " j " << j;
        rows += n;
        context += lens[b];
        for (int32_t g = 0; g < G; ++g) {
          const int32_t bh = b * H + j * G + g;
          EXPECT_EQ(got_counts[bh], n);
          EXPECT_EQ(got_budgets[bh], static_cast<int32_t>(ks.budgets[g]));
          for (int32_t r = 0; r < n; ++r) {
            ASSERT_EQ(got_pos[static_cast<size_t>(bh) * n_max + r], r);
          }
        }
      }
    }
    // Not trivially everything or nothing: probes 5 of 64 buckets.
    EXPECT_GT(rows, 0);
    EXPECT_LT(rows, context / 2);
  }
}

}  // namespace
}  // namespace kvsparse::kernels::cuda
