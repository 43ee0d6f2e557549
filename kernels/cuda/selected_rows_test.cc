// GPU selected-row attention (selected_rows.h) and the row addressing modes of DecodeShape
// (per-(sequence, kv head) bases, paged rows) against the CPU references:
//   - HashTopK -> UnionSelected -> FetchRows (from pages in device or pinned, mapped host memory)
//     -> SelectedRowsDecode equals HashTopKDecodeCpu (union lists token for token, fetched rows
//     byte for byte, output within rounding), and so does SelectedRowsDecode reading each head's
//     rows in place from the pages;
//   - over a run of steps with drifting selections, PlaceRows with a row cache (large, and small
//     enough to overflow) gives outputs bit-identical to the uncached path, the hits and the
//     cache contents a host model of the policy predicts, and slots holding their tokens' rows;
//   - reading each head's rows in place, the kernel states each head's standard error as the CPU
//     reference does for ordered draws;
//   - WarmPagedRows reads each page a length covers once, and none after its stop word;
//   - dense, S2ANTA (prop, flash, iid) and vAttention read through k_heads / v_heads / pages
//     give what they give on the strided layout.
#include "kernels/cuda/selected_rows.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_test_util.h"
#include "kernels/cuda/dense_decode.h"
#include "kernels/cuda/hash_topk.h"
#include "kernels/cuda/santa.h"
#include "kernels/cuda/vattention.h"
#include "kernels/hash_topk.h"
#include "kernels/row_selection.h"
#include "kernels/synthetic.h"

namespace kvsparse::kernels::cuda {
namespace {

// A problem's K and V copied into pages of 2^shift tokens (slot = K row then V row, as the
// store lays them out), the pages of all (b, kv head) shuffled in one pool, in device memory or
// in pinned, mapped host memory; plus the page tables.
class PagedKv {
 public:
  PagedKv(const DecodeProblem& p, int shift, bool host, uint64_t seed) : host_(host) {
    const size_t row = static_cast<size_t>(p.head_dim) * DTypeSize(p.dtype);
    const int page_tokens = 1 << shift;
    const int n_max = std::max(1, *std::max_element(p.seq_lens, p.seq_lens + p.batch));
    max_pages_ = (n_max + page_tokens - 1) / page_tokens;
    const int sets = p.batch * p.num_kv_heads;
    const size_t page_bytes = page_tokens * 2 * row;
    const size_t pages = static_cast<size_t>(sets) * max_pages_;
    std::vector<size_t> order(pages);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937_64(seed));
    std::vector<uint8_t> pool(pages * page_bytes, 0x5a);
    const size_t es = DTypeSize(p.dtype);
    for (int b = 0; b < p.batch; ++b) {
      for (int j = 0; j < p.num_kv_heads; ++j) {
        for (int t = 0; t < p.seq_lens[b]; ++t) {
          const size_t pg =
              order[(static_cast<size_t>(b) * p.num_kv_heads + j) * max_pages_ + t / page_tokens];
          uint8_t* slot = pool.data() + pg * page_bytes + (t % page_tokens) * 2 * row;
          const int64_t off = b * p.kv_layout.batch_stride + j * p.kv_layout.head_stride +
                              t * p.kv_layout.token_stride;
          std::memcpy(slot, static_cast<const uint8_t*>(p.k) + off * es, row);
          std::memcpy(slot + row, static_cast<const uint8_t*>(p.v) + off * es, row);
        }
      }
    }
    char* base = nullptr;
    if (host_) {
      EXPECT_EQ(
          cudaHostAlloc(reinterpret_cast<void**>(&host_pool_), pool.size(), cudaHostAllocMapped),
          cudaSuccess);
      std::memcpy(host_pool_, pool.data(), pool.size());
      void* dev = nullptr;
      EXPECT_EQ(cudaHostGetDevicePointer(&dev, host_pool_, 0), cudaSuccess);
      base = static_cast<char*>(dev);
    } else {
      dev_pool_ = ToDevice(pool);
      base = dev_pool_.as<char>();
    }
    std::vector<const void*> lists(pages);
    for (size_t i = 0; i < pages; ++i) lists[i] = base + order[i] * page_bytes;
    lists_ = ToDevice(lists);
    std::vector<const void* const*> tables(sets);
    for (int i = 0; i < sets; ++i) {
      tables[i] = lists_.as<const void*>() + static_cast<size_t>(i) * max_pages_;
    }
    tables_ = ToDevice(tables);
    k_.tables = tables_.as<const void* const*>();
    k_.page_shift = shift;
    k_.slot_bytes = static_cast<int32_t>(2 * row);
    k_.offset_bytes = 0;
    v_ = k_;
    v_.offset_bytes = static_cast<int32_t>(row);
  }
  ~PagedKv() {
    if (host_pool_ != nullptr) cudaFreeHost(host_pool_);
  }
  const PagedRows& k() const { return k_; }
  const PagedRows& v() const { return v_; }

 private:
  bool host_;
  int max_pages_ = 0;
  void* host_pool_ = nullptr;
  DeviceBuffer dev_pool_, lists_, tables_;
  PagedRows k_, v_;
};

// A bf16 problem of head dim 128 from the peaked synthetic family, one sequence per length.
SyntheticProblem Problem128(int32_t heads, int32_t kv_heads, std::vector<int32_t> lens,
                            uint64_t seed = 1) {
  SyntheticOptions o;
  o.batch = static_cast<int32_t>(lens.size());
  o.num_q_heads = heads;
  o.num_kv_heads = kv_heads;
  o.head_dim = 128;
  o.seq_lens = std::move(lens);
  o.seed = seed;
  return SyntheticProblem::Make(o);
}

// Row sets for every (b, j): one allocation each for tokens, counts, K and V, and the tables.
// UnionSelected's parameters for B sequences of H query heads over hkv kv heads: their selections
// (indices [B, H, max_sel], counts [B, H], device) of sequences no longer than max_seq_len.
UnionSelectedParams UnionParams(int B, int H, int hkv, const int32_t* indices,
                                const int32_t* counts, int max_sel, const int32_t* seq_lens,
                                int max_seq_len) {
  UnionSelectedParams up;
  up.batch = B;
  up.num_q_heads = H;
  up.num_kv_heads = hkv;
  up.indices = indices;
  up.counts = counts;
  up.max_selected = max_sel;
  up.seq_lens = seq_lens;
  up.max_seq_len = max_seq_len;
  return up;
}

struct RowSets {
  DeviceBuffer tokens, count, k, v, t_tab, c_tab, k_tab, v_tab;
  RowSetTables tables;
  RowSets(int sets, int capacity, size_t row_bytes) {
    tokens = DeviceBuffer(sizeof(int32_t) * sets * capacity);
    count = DeviceBuffer(sizeof(int32_t) * sets);
    k = DeviceBuffer(row_bytes * sets * capacity);
    v = DeviceBuffer(row_bytes * sets * capacity);
    EXPECT_EQ(tokens.Poison(), cudaSuccess);
    EXPECT_EQ(count.Poison(), cudaSuccess);
    EXPECT_EQ(k.Poison(), cudaSuccess);
    EXPECT_EQ(v.Poison(), cudaSuccess);
    std::vector<int32_t*> tp(sets), cp(sets);
    std::vector<void*> kp(sets), vp(sets);
    for (int i = 0; i < sets; ++i) {
      tp[i] = tokens.as<int32_t>() + static_cast<size_t>(i) * capacity;
      cp[i] = count.as<int32_t>() + i;
      kp[i] = k.as<char>() + row_bytes * i * capacity;
      vp[i] = v.as<char>() + row_bytes * i * capacity;
    }
    t_tab = ToDevice(tp);
    c_tab = ToDevice(cp);
    k_tab = ToDevice(kp);
    v_tab = ToDevice(vp);
    tables.tokens = t_tab.as<int32_t* const>();
    tables.count = c_tab.as<int32_t* const>();
    tables.k = k_tab.as<void* const>();
    tables.v = v_tab.as<void* const>();
    tables.capacity = capacity;
  }
};

// Runs SANTA iid (method 0), S2ANTA-prop (1) or S2ANTA-flash (2) and waits for it.
void RunSanta(int method, const SantaLaunchParams& p) {
  const size_t bytes = method == 0   ? SantaIidWorkspaceBytes(p)
                       : method == 1 ? S2antaPropWorkspaceBytes(p)
                                     : S2antaFlashWorkspaceBytes(p);
  DeviceBuffer ws(bytes);
  const cudaError_t e = method == 0   ? SantaIid(p, ws.get(), bytes, nullptr)
                        : method == 1 ? S2antaProp(p, ws.get(), bytes, nullptr)
                                      : S2antaFlash(p, ws.get(), bytes, nullptr);
  EXPECT_EQ(e, cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// Runs SelectedRowsDecode with a workspace of its own and waits for it; the first error.
cudaError_t RunSelectedRows(const SelectedRowsParams& sr) {
  DeviceBuffer ws(SelectedRowsWorkspaceBytes(sr));
  const cudaError_t e = SelectedRowsDecode(sr, ws.get(), ws.size(), nullptr);
  const cudaError_t s = cudaDeviceSynchronize();
  return e != cudaSuccess ? e : s;
}

struct HashCase {
  DType dtype;
  int d, hkv, g;
  std::vector<int32_t> lens;
  int top_k;  // 0: 5% of each sequence (the CPU reference needs k <= n)
  bool host_pages;
};

void RunHashPipeline(const HashCase& c) {
  const std::string what = std::string(DTypeName(c.dtype)) + " d=" + std::to_string(c.d) +
                           " hkv=" + std::to_string(c.hkv) + " G=" + std::to_string(c.g) +
                           (c.host_pages ? " host pages" : " device pages");
  SyntheticOptions o;
  o.batch = static_cast<int32_t>(c.lens.size());
  o.num_q_heads = c.hkv * c.g;
  o.num_kv_heads = c.hkv;
  o.head_dim = c.d;
  o.seq_lens = c.lens;
  o.dtype = c.dtype;
  o.seed = 5 + c.d + c.g;
  SyntheticProblem sp = SyntheticProblem::Make(o);
  DecodeProblem& p = sp.problem;
  SimHashConfig cfg;
  cfg.seed = 7;
  cfg.bits = 32;
  Signatures sigs;
  ASSERT_TRUE(ComputeSimHashSignatures(p, cfg, &sigs).ok());
  kernels::HashTopKParams cp;
  cp.bits = 32;
  cp.fixed.sink_tokens = 16;
  cp.fixed.local_tokens = 32;
  cp.fixed.top_k = c.top_k;
  cp.fixed.top_k_fraction = c.top_k > 0 ? 0.f : 0.05f;
  RowSelection sel;
  ASSERT_TRUE(HashTopKSelectCpu(p, cp, sigs.view, &sel).ok());
  std::vector<uint8_t> ref_out(sp.out.size());
  DecodeProblem rp = p;
  rp.out = ref_out.data();
  ASSERT_TRUE(HashTopKDecodeCpu(rp, cp, sigs.view).ok());

  DeviceProblem dp = DeviceProblem::Upload(p, KvElements(p));
  const int B = p.batch, H = p.num_q_heads, hkv = p.num_kv_heads, sets = B * hkv;
  const int n_max = std::max(1, *std::max_element(c.lens.begin(), c.lens.end()));
  DeviceBuffer qs = ToDevice(sigs.q), ks = ToDevice(sigs.k);
  HashTopKLaunchParams tp;
  tp.batch = B;
  tp.num_q_heads = H;
  tp.key_heads = sigs.view.key_heads;
  tp.bits = 32;
  tp.q_sigs = qs.as<uint32_t>();
  tp.k_sigs = ks.as<uint32_t>();
  tp.k_batch_stride = sigs.view.batch_stride;
  tp.k_head_stride = sigs.view.head_stride;
  tp.k_token_stride = sigs.view.token_stride;
  tp.seq_lens = dp.seq_lens.as<int32_t>();
  tp.max_seq_len = n_max;
  tp.fixed = cp.fixed;
  const int max_sel = std::max(1, tp.MaxSelected());
  DeviceBuffer idx(sizeof(int32_t) * B * H * max_sel), cnt(sizeof(int32_t) * B * H);
  tp.indices = idx.as<int32_t>();
  tp.counts = cnt.as<int32_t>();
  DeviceBuffer tws(HashTopKWorkspaceBytes(tp));
  ASSERT_EQ(HashTopK(tp, tws.get(), tws.size(), nullptr), cudaSuccess) << what;

  const size_t row = static_cast<size_t>(c.d) * DTypeSize(c.dtype);
  const int cap = std::min(n_max, c.g * max_sel);
  RowSets rows(sets, cap, row);
  UnionSelectedParams up =
      UnionParams(B, H, hkv, tp.indices, tp.counts, max_sel, tp.seq_lens, n_max);
  up.out = rows.tables;
  DeviceBuffer pos(sizeof(int32_t) * B * H * max_sel);
  up.positions = pos.as<int32_t>();
  DeviceBuffer uws(UnionSelectedWorkspaceBytes(up));
  ASSERT_EQ(uws.Poison(), cudaSuccess);
  ASSERT_EQ(UnionSelected(up, uws.get(), uws.size(), nullptr), cudaSuccess) << what;

  PagedKv paged(p, /*shift=*/4, c.host_pages, 11);
  FetchRowsParams fp;
  fp.shape = dp.shape;
  fp.shape.k = fp.shape.v = nullptr;
  fp.shape.k_pages = paged.k();
  fp.shape.v_pages = paged.v();
  fp.max_rows = cap;
  fp.out = rows.tables;
  ASSERT_EQ(FetchRows(fp, nullptr), cudaSuccess) << what;

  SelectedRowsParams sr;
  sr.shape = dp.shape;
  sr.rows = rows.tables;
  sr.positions = up.positions;
  sr.counts = tp.counts;
  sr.max_selected = max_sel;
  ASSERT_EQ(RunSelectedRows(sr), cudaSuccess) << what;

  // Union lists and fetched rows.
  const auto got_tok = ToHost<int32_t>(rows.tokens, static_cast<size_t>(sets) * cap);
  const auto got_cnt = ToHost<int32_t>(rows.count, sets);
  const auto got_k = ToHost<uint8_t>(rows.k, row * sets * cap);
  const auto got_v = ToHost<uint8_t>(rows.v, row * sets * cap);
  const size_t es = DTypeSize(c.dtype);
  for (int b = 0; b < B; ++b) {
    for (int j = 0; j < hkv; ++j) {
      const int i = b * hkv + j;
      const auto& want = sel.at(b, j).tokens;
      ASSERT_EQ(got_cnt[i], static_cast<int32_t>(want.size())) << what << " set " << i;
      for (size_t r = 0; r < want.size(); ++r) {
        ASSERT_EQ(got_tok[static_cast<size_t>(i) * cap + r], want[r]) << what;
        const int64_t off = b * p.kv_layout.batch_stride + j * p.kv_layout.head_stride +
                            want[r] * p.kv_layout.token_stride;
        ASSERT_EQ(0, std::memcmp(got_k.data() + (static_cast<size_t>(i) * cap + r) * row,
                                 static_cast<const uint8_t*>(p.k) + off * es, row))
            << what;
        ASSERT_EQ(0, std::memcmp(got_v.data() + (static_cast<size_t>(i) * cap + r) * row,
                                 static_cast<const uint8_t*>(p.v) + off * es, row))
            << what;
      }
    }
  }
  // The same lists with their rows staged in list order (as rows gathered from a store whose
  // pages the GPU cannot read), fetched by position: the same rows again.
  {
    std::vector<uint8_t> sk(row * sets * cap), sv(row * sets * cap);
    std::vector<void*> kp(sets), vp(sets);
    for (int i = 0; i < sets; ++i) {
      const int b = i / hkv, j = i % hkv;
      for (int r = 0; r < got_cnt[i]; ++r) {
        const int64_t off = b * p.kv_layout.batch_stride + j * p.kv_layout.head_stride +
                            got_tok[static_cast<size_t>(i) * cap + r] * p.kv_layout.token_stride;
        const size_t to = (static_cast<size_t>(i) * cap + r) * row;
        std::memcpy(sk.data() + to, static_cast<const uint8_t*>(p.k) + off * es, row);
        std::memcpy(sv.data() + to, static_cast<const uint8_t*>(p.v) + off * es, row);
      }
    }
    const DeviceBuffer dk = ToDevice(sk), dv = ToDevice(sv);
    for (int i = 0; i < sets; ++i) {
      kp[i] = dk.as<char>() + row * i * cap;
      vp[i] = dv.as<char>() + row * i * cap;
    }
    const DeviceBuffer kt = ToDevice(kp), vt = ToDevice(vp);
    RowSets again(sets, cap, row);
    FetchRowsParams fs;
    fs.shape = dp.shape;
    fs.shape.k = fs.shape.v = nullptr;
    fs.shape.kv.token_stride = c.d;  // rows packed
    fs.shape.k_heads = kt.as<const void* const>();
    fs.shape.v_heads = vt.as<const void* const>();
    fs.max_rows = cap;
    fs.out = rows.tables;  // the lists
    fs.out.k = again.tables.k;
    fs.out.v = again.tables.v;
    fs.source_by_position = true;
    ASSERT_EQ(FetchRows(fs, nullptr), cudaSuccess) << what;
    const auto k2 = ToHost<uint8_t>(again.k, row * sets * cap);
    const auto v2 = ToHost<uint8_t>(again.v, row * sets * cap);
    for (int i = 0; i < sets; ++i) {
      const size_t at = static_cast<size_t>(i) * cap * row, len = got_cnt[i] * row;
      ASSERT_EQ(0, std::memcmp(k2.data() + at, got_k.data() + at, len)) << what << " staged K";
      ASSERT_EQ(0, std::memcmp(v2.data() + at, got_v.data() + at, len)) << what << " staged V";
    }
  }
  // Output against the CPU reference (same rows, fp32 sums in another order).
  int64_t non_finite = 0;
  const std::vector<double> got = dp.OutputAsDouble(&non_finite);
  DecodeProblem refp = p;
  refp.out = ref_out.data();
  const double err = RelativeL2(OutputAsDouble(refp), got);
  EXPECT_EQ(non_finite, 0) << what;
  EXPECT_LT(err, c.dtype == DType::kBf16 ? 8e-3 : 2e-3) << what;

  // Each head's rows read in place by token from the pages (no union, no fetch): the same output
  // within rounding, and the rows read per (b, j) are its heads' counts summed.
  SelectedRowsParams ip;
  ip.shape = fp.shape;
  ip.positions = tp.indices;
  ip.counts = tp.counts;
  ip.max_selected = max_sel;
  ip.in_place = true;
  RowSets read(sets, 1, row);
  ip.rows_read = read.tables.count;
  ASSERT_EQ(RunSelectedRows(ip), cudaSuccess) << what;
  const std::vector<double> in_place = dp.OutputAsDouble(&non_finite);
  EXPECT_EQ(non_finite, 0) << what << " in place";
  EXPECT_LT(RelativeL2(OutputAsDouble(refp), in_place), c.dtype == DType::kBf16 ? 8e-3 : 2e-3)
      << what << " in place";
  const auto heads = ToHost<int32_t>(cnt, static_cast<size_t>(B) * H);
  const auto rows_read = ToHost<int32_t>(read.count, sets);
  for (int i = 0; i < sets; ++i) {
    int want = 0;
    for (int g = 0; g < c.g; ++g) want += heads[static_cast<size_t>(i) * c.g + g];
    EXPECT_EQ(rows_read[i], want) << what << " rows read, set " << i;
  }
}

TEST(SelectedRowsCudaTest, HashTopKFromPagesMatchesCpu) {
  KVSPARSE_REQUIRE_GPU();
  const std::vector<HashCase> cases = {
      {DType::kBf16, 128, 2, 4, {3000, 1, 700}, 0, false},
      {DType::kBf16, 128, 8, 4, {9000}, 450, true},
      {DType::kFp16, 64, 4, 2, {0, 513}, 0, true},
      {DType::kFp16, 256, 1, 8, {2048, 4000}, 300, false},
      {DType::kBf16, 64, 2, 1, {40, 1100}, 10, true},  // sink + window cover the short one
  };
  for (const HashCase& c : cases) RunHashPipeline(c);
}

// SelectedRowsDecode reading each head's rows in place from paged K/V: the lists (idx, cnt: tokens
// [B, H, max_sel] and their counts) with their log2 weights.
SelectedRowsParams InPlaceParams(const DeviceProblem& dp, const PagedKv& paged,
                                 const DeviceBuffer& idx, const DeviceBuffer& cnt,
                                 const DeviceBuffer& lw, int max_sel) {
  SelectedRowsParams sr;
  sr.shape = dp.shape;
  sr.shape.k = sr.shape.v = nullptr;
  sr.shape.k_pages = paged.k();
  sr.shape.v_pages = paged.v();
  sr.positions = idx.as<int32_t>();
  sr.counts = cnt.as<int32_t>();
  sr.max_selected = max_sel;
  sr.log2_weights = lw.as<float>();
  sr.in_place = true;
  return sr;
}

// A synthetic problem of hkv kv heads with g query heads each, one sequence per length.
SyntheticProblem GroupProblem(DType dtype, int d, int hkv, int g, const std::vector<int32_t>& lens,
                              uint64_t seed) {
  SyntheticOptions o;
  o.batch = static_cast<int32_t>(lens.size());
  o.num_q_heads = hkv * g;
  o.num_kv_heads = hkv;
  o.head_dim = d;
  o.seq_lens = lens;
  o.dtype = dtype;
  o.seed = seed;
  return SyntheticProblem::Make(o);
}

// S2ANTA's group mixture gives a kv head's G query heads the same rows, each head its own
// weights: read in place once for the group (SelectedRowsParams::shared_rows, a block per kv head
// scoring each row against the G queries) gives what reading the same list once per head gives
// (the per-head kernel above, checked against the CPU), and counts each row once for the group.
// Lists of up to 1,025 rows (the group mixture at S = 1024: more rows than a cluster of blocks
// loads in one round), a short one, an empty one, tokens past the sequence skipped.
void RunSharedRows(DType dtype, int d, int hkv, int g, const std::vector<int32_t>& lens,
                   bool host_pages) {
  const std::string what = std::string(DTypeName(dtype)) + " d=" + std::to_string(d) +
                           " hkv=" + std::to_string(hkv) + " G=" + std::to_string(g);
  SyntheticProblem sp = GroupProblem(dtype, d, hkv, g, lens, 31 + d + g);
  DecodeProblem& p = sp.problem;
  DeviceProblem dp = DeviceProblem::Upload(p, KvElements(p));
  const int B = p.batch, H = p.num_q_heads, sets = B * hkv;
  constexpr int kMaxSel = 1025;
  std::mt19937 rng(9 + g);
  std::vector<int32_t> idx(static_cast<size_t>(B) * H * kMaxSel, 0), cnt(B * H, 0);
  std::vector<float> lw(idx.size(), 0.f);
  std::uniform_real_distribution<float> weight(-3.f, 1.f);
  for (int b = 0; b < B; ++b) {
    for (int j = 0; j < hkv; ++j) {
      // Every other kv head a long list; sequence 0's first kv head no rows at all.
      const int n = lens[b];
      const int want = b == 0 && j == 0 ? 0 : std::min(n, (j % 2 == 0) ? kMaxSel : 40 + 7 * j);
      std::vector<int32_t> all(n);
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      std::vector<int32_t> list(all.begin(), all.begin() + want);
      std::sort(list.begin(), list.end());
      if (!list.empty() && b == 1) list.back() = n + 5;  // past the sequence: skipped
      for (int x = 0; x < g; ++x) {
        const size_t bh = static_cast<size_t>(b) * H + j * g + x;
        cnt[bh] = static_cast<int32_t>(list.size());
        for (size_t r = 0; r < list.size(); ++r) {
          idx[bh * kMaxSel + r] = list[r];
          lw[bh * kMaxSel + r] = weight(rng);
        }
      }
    }
  }
  const DeviceBuffer didx = ToDevice(idx), dcnt = ToDevice(cnt), dlw = ToDevice(lw);
  PagedKv paged(p, /*shift=*/4, host_pages, 13);
  SelectedRowsParams sr = InPlaceParams(dp, paged, didx, dcnt, dlw, kMaxSel);
  const size_t row = static_cast<size_t>(d) * DTypeSize(dtype);
  RowSets per_read(sets, 1, row), shared_read(sets, 1, row);
  sr.rows_read = per_read.tables.count;
  ASSERT_EQ(RunSelectedRows(sr), cudaSuccess) << what;
  int64_t non_finite = 0;
  const std::vector<double> per_head = dp.OutputAsDouble(&non_finite);
  ASSERT_EQ(non_finite, 0) << what;
  ASSERT_EQ(cudaMemset(dp.out.get(), 0xff, dp.out.size()), cudaSuccess);  // NaNs until written
  sr.shared_rows = true;
  sr.rows_read = shared_read.tables.count;
  ASSERT_EQ(RunSelectedRows(sr), cudaSuccess) << what << " shared";
  const std::vector<double> shared = dp.OutputAsDouble(&non_finite);
  EXPECT_EQ(non_finite, 0) << what << " shared";
  EXPECT_LT(RelativeL2(per_head, shared), dtype == DType::kBf16 ? 8e-3 : 2e-3) << what;
  const auto per = ToHost<int32_t>(per_read.count, sets),
             once = ToHost<int32_t>(shared_read.count, sets);
  for (int i = 0; i < sets; ++i) {
    EXPECT_EQ(per[i], g * cnt[static_cast<size_t>(i) * g]) << what << " set " << i;
    EXPECT_EQ(once[i], cnt[static_cast<size_t>(i) * g]) << what << " set " << i;
  }
}

TEST(SelectedRowsCudaTest, SharedRowsInPlaceReadEachRowOnceForTheGroup) {
  KVSPARSE_REQUIRE_GPU();
  RunSharedRows(DType::kBf16, 128, 4, 4, {3000, 1500}, true);
  RunSharedRows(DType::kBf16, 128, 2, 8, {2100, 900}, false);
  RunSharedRows(DType::kFp16, 64, 4, 2, {1200, 1300}, true);
  RunSharedRows(DType::kFp16, 256, 2, 1, {1100, 2000}, false);
}

// Each head's standard error read in place (SelectedRowsParams::standard_errors) is the one the
// CPU reference states for ordered draws (EstimateInPlace's draw_standard_errors over the same
// rows, weights 2^{log2 weight} and draws): ascending per-head lists of 0, 1 (drawn once: no
// spread to see, infinite; drawn three times: 0) and many rows (up to the 8 rounds a cluster
// holds: 449 at d = 128), draws of 1 to 3 a row, host or device pages; the output is the one the
// kernel without it gives. A list past 8 rounds states none: NaN.
void RunStandardError(DType dtype, int d, int hkv, int g, const std::vector<int32_t>& lens,
                      int max_sel, bool host_pages) {
  const std::string what = std::string(DTypeName(dtype)) + " d=" + std::to_string(d) +
                           " G=" + std::to_string(g) + " max_sel=" + std::to_string(max_sel);
  SyntheticProblem sp = GroupProblem(dtype, d, hkv, g, lens, 41 + d + g);
  DecodeProblem& p = sp.problem;
  DeviceProblem dp = DeviceProblem::Upload(p, KvElements(p));
  const int B = p.batch, H = p.num_q_heads;
  std::mt19937 rng(17 + d);
  std::uniform_real_distribution<float> weight(-3.f, 1.f);
  std::uniform_int_distribution<int> draws(1, 3);
  std::vector<int32_t> idx(static_cast<size_t>(B) * H * max_sel, 0), cnt(B * H, 0);
  std::vector<int32_t> rc(idx.size(), 0);
  std::vector<float> lw(idx.size(), 0.f);
  RowSelection sel;
  sel.Reset(EstimateKind::kSoftmax, B, hkv, g);
  sel.ordered_draws = true;
  for (int b = 0; b < B; ++b) {
    for (int j = 0; j < hkv; ++j) {
      std::vector<HeadRows> heads(g);
      for (int x = 0; x < g; ++x) {
        const size_t bh = static_cast<size_t>(b) * H + j * g + x;
        const int n = lens[b];
        const int hi = static_cast<int>(bh);
        const int want = hi == 0 ? 0 : hi <= 2 ? 1 : std::min(n, hi % 3 == 0 ? max_sel : 37);
        std::vector<int32_t> all(n);
        std::iota(all.begin(), all.end(), 0);
        std::shuffle(all.begin(), all.end(), rng);
        std::vector<int32_t> list(all.begin(), all.begin() + want);
        std::sort(list.begin(), list.end());
        cnt[bh] = want;
        for (int r = 0; r < want; ++r) {
          const size_t at = bh * max_sel + r;
          idx[at] = list[r];
          lw[at] = weight(rng);
          rc[at] = hi == 1 ? 1 : hi == 2 ? 3 : draws(rng);
          heads[x].Push(list[r], rc[at], std::exp2(lw[at]));
        }
      }
      MergeGroup(heads, &sel.at(b, j));
    }
  }
  std::vector<float> want_se;
  ASSERT_TRUE(EstimateInPlace(p, sel, &want_se).ok()) << what;
  const DeviceBuffer didx = ToDevice(idx), dcnt = ToDevice(cnt), dlw = ToDevice(lw),
                     drc = ToDevice(rc);
  PagedKv paged(p, /*shift=*/4, host_pages, 23);
  SelectedRowsParams sr = InPlaceParams(dp, paged, didx, dcnt, dlw, max_sel);
  ASSERT_EQ(RunSelectedRows(sr), cudaSuccess) << what;
  int64_t non_finite = 0;
  const std::vector<double> plain = dp.OutputAsDouble(&non_finite);
  ASSERT_EQ(non_finite, 0) << what;
  DeviceBuffer dse(sizeof(float) * B * H);
  ASSERT_EQ(dse.Poison(), cudaSuccess);
  sr.standard_errors = dse.as<float>();
  sr.row_counts = drc.as<int32_t>();
  ASSERT_EQ(cudaMemset(dp.out.get(), 0xff, dp.out.size()), cudaSuccess);  // NaNs until written
  ASSERT_EQ(RunSelectedRows(sr), cudaSuccess) << what << " with the standard error";
  const std::vector<double> stated = dp.OutputAsDouble(&non_finite);
  ASSERT_EQ(non_finite, 0) << what;
  EXPECT_LT(RelativeL2(plain, stated), dtype == DType::kBf16 ? 8e-3 : 2e-3) << what;
  const auto se = ToHost<float>(dse, static_cast<size_t>(B) * H);
  const int round = 8 * (32 / (d / 8)) * 4;  // rows a block loads at once
  const bool stated_here = max_sel <= 8 * round;
  for (int bh = 0; bh < B * H; ++bh) {
    SCOPED_TRACE(testing::Message() << what << " head " << bh << " (" << cnt[bh] << " rows)");
    if (!stated_here) {
      EXPECT_TRUE(std::isnan(se[bh]));
      continue;
    }
    if (std::isinf(want_se[bh]) || want_se[bh] == 0.f) {
      EXPECT_EQ(se[bh], want_se[bh]);
      continue;
    }
    EXPECT_NEAR(se[bh], want_se[bh], 2e-3 * want_se[bh] + 1e-6);
  }
}

TEST(SelectedRowsCudaTest, InPlaceStatesTheCpusStandardError) {
  KVSPARSE_REQUIRE_GPU();
  RunStandardError(DType::kBf16, 128, 4, 4, {3000, 1500}, 449, true);
  RunStandardError(DType::kBf16, 128, 2, 2, {700}, 129, false);
  RunStandardError(DType::kFp16, 64, 2, 8, {2100, 900}, 600, true);
  RunStandardError(DType::kFp16, 256, 2, 1, {1100}, 250, false);
  RunStandardError(DType::kBf16, 128, 2, 4, {1200}, 600, true);  // 10 rounds: none stated
}

// A per-(b, j) pointer table into one allocation: entry i = base + i * stride_bytes.
DeviceBuffer PointerTable(const DeviceBuffer& base, int sets, size_t stride_bytes) {
  std::vector<void*> t(sets);
  for (int i = 0; i < sets; ++i) t[i] = base.as<char>() + stride_bytes * i;
  return ToDevice(t);
}

// Steps of drifting selections through the cached path (UnionSelected -> PlaceRows ->
// FetchRows into cache slots and overflow rows -> SelectedRowsDecode) against the uncached one
// (UnionSelected -> FetchRows into a full row set -> SelectedRowsDecode), for a cache that holds
// every union, one that overflows, and none (C = 0).
void RunCachedSteps(int C_per_cap_percent) {
  SyntheticProblem sp = Problem128(8, 2, {3000, 700}, 21);
  const DecodeProblem& p = sp.problem;
  DeviceProblem dp = DeviceProblem::Upload(p, KvElements(p));
  const int B = p.batch, H = p.num_q_heads, hkv = p.num_kv_heads, G = H / hkv, sets = B * hkv;
  const int max_sel = 200;
  const int cap = G * max_sel;  // longest union
  const int C = cap * C_per_cap_percent / 100;
  const std::string what = "C = " + std::to_string(C) + " of " + std::to_string(cap);
  const size_t row = 128 * 2;
  std::mt19937_64 rng(77);
  // Per (b, h): a selection of 200 (b = 0) or 60 (b = 1) tokens; each step replaces ~15%.
  std::vector<std::vector<int32_t>> sel(B * H);
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      std::vector<int32_t> all(p.seq_lens[b]);
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      sel[b * H + h].assign(all.begin(), all.begin() + (b == 0 ? 200 : 60));
    }
  }
  RowSets full(sets, cap, row), uni(sets, cap, row), fetch(sets, cap, row), over(sets, cap, row);
  RowSets cache(sets, std::max(C, 1), row);
  DeviceBuffer slots(sizeof(int32_t) * sets * std::max(C, 1));
  DeviceBuffer slot_tab = PointerTable(slots, sets, sizeof(int32_t) * std::max(C, 1));
  DeviceBuffer dest(sizeof(int32_t) * sets * cap);
  DeviceBuffer dest_tab = PointerTable(dest, sets, sizeof(int32_t) * cap);
  ASSERT_EQ(cudaMemset(cache.count.get(), 0, cache.count.size()), cudaSuccess);  // empty
  std::vector<std::vector<int32_t>> model(sets);  // host model of each cache's tokens
  for (int step = 0; step < 6; ++step) {
    std::vector<int32_t> idx(static_cast<size_t>(B) * H * max_sel, -1), cnt(B * H);
    for (int bh = 0; bh < B * H; ++bh) {
      std::vector<int32_t>& s_bh = sel[bh];
      if (step > 0) {
        const int n = p.seq_lens[bh / H];
        for (int32_t& t : s_bh) {
          if (rng() % 100 < 15) t = static_cast<int32_t>(rng() % n);
        }
      }
      std::vector<int32_t> sorted = s_bh;
      std::sort(sorted.begin(), sorted.end());
      sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
      cnt[bh] = static_cast<int32_t>(sorted.size());
      std::copy(sorted.begin(), sorted.end(), idx.begin() + static_cast<size_t>(bh) * max_sel);
    }
    DeviceBuffer didx = ToDevice(idx), dcnt = ToDevice(cnt);
    UnionSelectedParams up = UnionParams(B, H, hkv, didx.as<int32_t>(), dcnt.as<int32_t>(), max_sel,
                                         dp.seq_lens.as<int32_t>(), 3000);
    DeviceBuffer uws(UnionSelectedWorkspaceBytes(up));
    // Uncached: the union's rows into a full row set.
    up.out = full.tables;
    DeviceBuffer pos_full(sizeof(int32_t) * B * H * max_sel);
    up.positions = pos_full.as<int32_t>();
    ASSERT_EQ(UnionSelected(up, uws.get(), uws.size(), nullptr), cudaSuccess);
    FetchRowsParams fp;
    fp.shape = dp.shape;
    fp.max_rows = cap;
    fp.out = full.tables;
    ASSERT_EQ(FetchRows(fp, nullptr), cudaSuccess);
    SelectedRowsParams sr;
    sr.shape = dp.shape;
    sr.rows = full.tables;
    sr.positions = up.positions;
    sr.counts = up.counts;
    sr.max_selected = max_sel;
    ASSERT_EQ(RunSelectedRows(sr), cudaSuccess);
    const auto want_out = ToHost<uint8_t>(dp.out, dp.out.size());
    const auto uni_tok = ToHost<int32_t>(full.tokens, static_cast<size_t>(sets) * cap);
    const auto uni_cnt = ToHost<int32_t>(full.count, sets);
    ASSERT_EQ(dp.out.Poison(), cudaSuccess);

    // Cached.
    up.out = uni.tables;
    DeviceBuffer pos(sizeof(int32_t) * B * H * max_sel);
    up.positions = pos.as<int32_t>();
    ASSERT_EQ(UnionSelected(up, uws.get(), uws.size(), nullptr), cudaSuccess);
    PlaceRowsParams pp;
    pp.batch = B;
    pp.num_q_heads = H;
    pp.num_kv_heads = hkv;
    pp.rows = uni.tables;
    if (C > 0) {
      pp.cache.tokens = cache.tables.tokens;
      pp.cache.slots = slot_tab.as<int32_t* const>();
      pp.cache.count = cache.tables.count;
      pp.cache.k = cache.tables.k;
      pp.cache.v = cache.tables.v;
      pp.cache.capacity = C;
    }
    pp.positions = up.positions;
    pp.counts = up.counts;
    pp.max_selected = max_sel;
    pp.fetch = fetch.tables;
    pp.fetch_dest = dest_tab.as<int32_t* const>();
    DeviceBuffer hits(sizeof(int32_t) * sets);
    pp.hits = hits.as<int32_t>();
    DeviceBuffer pws(PlaceRowsWorkspaceBytes(pp));
    ASSERT_EQ(pws.Poison(), cudaSuccess);
    ASSERT_EQ(PlaceRows(pp, pws.get(), pws.size(), nullptr), cudaSuccess) << what;
    FetchRowsParams fc;
    fc.shape = dp.shape;
    fc.max_rows = cap;
    fc.out = fetch.tables;  // the list; rows to the cache slots, or to the overflow rows
    fc.out.k = cache.tables.k;
    fc.out.v = cache.tables.v;
    fc.dest = pp.fetch_dest;
    fc.second.k = over.tables.k;
    fc.second.v = over.tables.v;
    ASSERT_EQ(FetchRows(fc, nullptr), cudaSuccess) << what;
    SelectedRowsParams sc = sr;
    sc.rows.k = fc.out.k;
    sc.rows.v = fc.out.v;
    sc.second = fc.second;
    sc.positions = pp.positions;
    ASSERT_EQ(RunSelectedRows(sc), cudaSuccess) << what;
    EXPECT_EQ(ToHost<uint8_t>(dp.out, dp.out.size()), want_out) << what << " step " << step;

    // Hits, fetch lists and cache contents against the host model of the policy.
    const auto got_hits = ToHost<int32_t>(hits, sets);
    const auto got_fetch = ToHost<int32_t>(fetch.count, sets);
    const int cs = std::max(C, 1);
    const auto c_tok = ToHost<int32_t>(cache.tokens, static_cast<size_t>(sets) * cs);
    const auto c_cnt = ToHost<int32_t>(cache.count, sets);
    const auto c_slot = ToHost<int32_t>(slots, static_cast<size_t>(sets) * cs);
    const auto c_k = ToHost<uint8_t>(cache.k, row * sets * cs);
    for (int i = 0; i < sets; ++i) {
      const std::vector<int32_t> u(uni_tok.begin() + static_cast<size_t>(i) * cap,
                                   uni_tok.begin() + static_cast<size_t>(i) * cap + uni_cnt[i]);
      std::vector<int32_t> held, missed;
      for (int32_t t : u) {
        (std::binary_search(model[i].begin(), model[i].end(), t) ? held : missed).push_back(t);
      }
      ASSERT_EQ(got_hits[i], static_cast<int32_t>(held.size())) << what << " step " << step;
      ASSERT_EQ(got_fetch[i], static_cast<int32_t>(missed.size())) << what;
      const size_t take = std::min(missed.size(), static_cast<size_t>(C) - held.size());
      held.insert(held.end(), missed.begin(), missed.begin() + take);
      std::sort(held.begin(), held.end());
      model[i] = held;
      if (C == 0) continue;
      ASSERT_EQ(c_cnt[i], static_cast<int32_t>(held.size())) << what;
      std::vector<bool> slot_used(C, false);
      const int b = i / hkv, j = i % hkv;
      for (size_t x = 0; x < held.size(); ++x) {
        ASSERT_EQ(c_tok[static_cast<size_t>(i) * cs + x], held[x]) << what;
        const int slot = c_slot[static_cast<size_t>(i) * cs + x];
        ASSERT_TRUE(slot >= 0 && slot < C && !slot_used[slot]) << what << " slot " << slot;
        slot_used[slot] = true;
        const int64_t off = b * p.kv_layout.batch_stride + j * p.kv_layout.head_stride +
                            held[x] * p.kv_layout.token_stride;
        ASSERT_EQ(0, std::memcmp(c_k.data() + (static_cast<size_t>(i) * cs + slot) * row,
                                 static_cast<const uint8_t*>(p.k) + off * 2, row))
            << what << " token " << held[x];
      }
    }
  }
}

TEST(SelectedRowsCudaTest, RowCacheOverStepsMatchesUncached) {
  KVSPARSE_REQUIRE_GPU();
  RunCachedSteps(100);  // holds every union: from step 1 on, only the drift is fetched
  RunCachedSteps(30);   // overflows on the long sequence
  RunCachedSteps(0);    // no cache: every row fetched into overflow rows
}

TEST(SelectedRowsCudaTest, FetchAllTokensCopiesEveryRow) {
  KVSPARSE_REQUIRE_GPU();
  SyntheticProblem sp = Problem128(8, 2, {1000, 77});
  const DecodeProblem& p = sp.problem;
  DeviceProblem dp = DeviceProblem::Upload(p, KvElements(p));
  PagedKv paged(p, 6, /*host=*/true, 3);
  const size_t row = 128 * 2;
  RowSets rows(4, 1000, row);
  FetchRowsParams fp;
  fp.shape = dp.shape;
  fp.shape.k = fp.shape.v = nullptr;
  fp.shape.k_pages = paged.k();
  fp.shape.v_pages = paged.v();
  fp.all_tokens = true;
  fp.seq_lens = dp.seq_lens.as<int32_t>();
  fp.max_seq_len = 1000;
  fp.max_rows = 1000;
  fp.out = rows.tables;
  ASSERT_EQ(FetchRows(fp, nullptr), cudaSuccess);
  // Dense attention over the fetched rows (per-head bases) equals dense on the original layout.
  DecodeShape s = dp.shape;
  std::vector<const void*> kh(4), vh(4);
  for (int i = 0; i < 4; ++i) {
    kh[i] = rows.k.as<char>() + row * i * 1000;
    vh[i] = rows.v.as<char>() + row * i * 1000;
  }
  DeviceBuffer dkh = ToDevice(kh), dvh = ToDevice(vh);
  s.k = s.v = nullptr;
  s.k_heads = dkh.as<const void*>();
  s.v_heads = dvh.as<const void*>();
  s.kv.token_stride = 128;
  DeviceBuffer out2(dp.out.size());
  s.out = out2.get();
  DeviceBuffer ws1(DenseDecodeWorkspaceBytes(dp.shape)), ws2(DenseDecodeWorkspaceBytes(s));
  ASSERT_EQ(DenseDecode(dp.shape, ws1.get(), ws1.size(), nullptr), cudaSuccess);
  ASSERT_EQ(DenseDecode(s, ws2.get(), ws2.size(), nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(ToHost<int32_t>(rows.count, 4), (std::vector<int32_t>{1000, 1000, 77, 77}));
  EXPECT_EQ(ToHost<uint8_t>(dp.out, dp.out.size()), ToHost<uint8_t>(out2, out2.size()));
}

// WarmPagedRows reads one word of each page a sequence's length covers, per (b, j), once, all
// at once or in chains (its counts; compute-sanitizer's memcheck sees the reads), the length
// clipped to the host bound; it reads nothing once its stop word has reached stop_at; bad
// parameters are refused.
TEST(SelectedRowsCudaTest, WarmPagedRowsReadsEachCoveredPageOnce) {
  KVSPARSE_REQUIRE_GPU();
  SyntheticProblem sp = Problem128(4, 2, {1000, 64, 65, 1});
  const DecodeProblem& p = sp.problem;
  DeviceProblem dp = DeviceProblem::Upload(p, KvElements(p));
  PagedKv paged(p, 6, /*host=*/true, 5);
  DeviceBuffer read(sizeof(int32_t) * 8), stop(sizeof(int32_t));
  WarmPagedRowsParams wp;
  wp.batch = 4;
  wp.num_kv_heads = 2;
  wp.pages = paged.k();
  wp.seq_lens = dp.seq_lens.as<int32_t>();
  wp.pages_read = read.as<int32_t>();
  const auto run = [&](const WarmPagedRowsParams& w) {
    EXPECT_EQ(cudaMemset(read.get(), 0, read.size()), cudaSuccess);
    EXPECT_EQ(WarmPagedRows(w, nullptr), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return ToHost<int32_t>(read, 8);
  };
  const std::vector<int32_t> all{16, 16, 1, 1, 2, 2, 1, 1};
  for (const int chains : {0, 1, 3, 64, 1000}) {
    SCOPED_TRACE(chains);
    wp.chains = chains;
    wp.max_seq_len = 1000;
    EXPECT_EQ(run(wp), all);
    wp.max_seq_len = 100;  // lengths past the bound are read up to it
    EXPECT_EQ(run(wp), (std::vector<int32_t>{2, 2, 1, 1, 2, 2, 1, 1}));
  }
  wp.max_seq_len = 1000;
  wp.chains = 3;
  wp.stop = stop.as<int32_t>();
  wp.stop_at = 5;
  const int32_t below = 4, at = 5;
  ASSERT_EQ(cudaMemcpy(stop.get(), &below, sizeof below, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(run(wp), all);
  ASSERT_EQ(cudaMemcpy(stop.get(), &at, sizeof at, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(run(wp), std::vector<int32_t>(8, 0));
  WarmPagedRowsParams bad = wp;
  bad.pages = PagedRows{};
  EXPECT_EQ(WarmPagedRows(bad, nullptr), cudaErrorInvalidValue);
  bad = wp;
  bad.seq_lens = nullptr;
  EXPECT_EQ(WarmPagedRows(bad, nullptr), cudaErrorInvalidValue);
  bad = wp;
  bad.num_kv_heads = 0;
  EXPECT_EQ(WarmPagedRows(bad, nullptr), cudaErrorInvalidValue);
  bad = wp;
  bad.chains = -1;
  EXPECT_EQ(WarmPagedRows(bad, nullptr), cudaErrorInvalidValue);
  cudaGetLastError();
}

// The checks of UnionOfSharedSelectionsFitsOneHeadsRows for sequences of n tokens.
void CheckSharedSelectionsUnion(int n) {
  const int B = 2, H = 8, hkv = 2, G = H / hkv, max_sel = 6, sets = B * hkv;
  std::vector<int32_t> idx(static_cast<size_t>(B) * H * max_sel), cnt(B * H, max_sel);
  for (int bh = 0; bh < B * H; ++bh) {
    const int set = (bh / H) * hkv + (bh % H) / G;
    for (int r = 0; r < max_sel; ++r) idx[bh * max_sel + r] = 3 + 7 * r + set;
  }
  const std::vector<int32_t> lens(B, n);
  DeviceBuffer di = ToDevice(idx), dc = ToDevice(cnt), dl = ToDevice(lens);
  DeviceBuffer pos(sizeof(int32_t) * B * H * max_sel);
  RowSets rows(sets, max_sel, 16);
  UnionSelectedParams up =
      UnionParams(B, H, hkv, di.as<int32_t>(), dc.as<int32_t>(), max_sel, dl.as<int32_t>(), n);
  up.out = rows.tables;
  up.positions = pos.as<int32_t>();
  DeviceBuffer ws(UnionSelectedWorkspaceBytes(up));
  EXPECT_EQ(UnionSelected(up, ws.get(), ws.size(), nullptr), cudaErrorInvalidValue);
  cudaGetLastError();
  up.max_union = max_sel;
  ASSERT_EQ(UnionSelected(up, ws.get(), ws.size(), nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  auto toks = ToHost<int32_t>(rows.tokens, static_cast<size_t>(sets) * max_sel);
  auto count = ToHost<int32_t>(rows.count, sets);
  auto where = ToHost<int32_t>(pos, static_cast<size_t>(B) * H * max_sel);
  for (int bh = 0; bh < B * H; ++bh) {
    const int set = (bh / H) * hkv + (bh % H) / G;
    ASSERT_EQ(count[set], max_sel);
    for (int r = 0; r < max_sel; ++r) {
      EXPECT_EQ(toks[set * max_sel + r], idx[bh * max_sel + r]) << "set " << set;
      EXPECT_EQ(where[bh * max_sel + r], r) << "head " << bh;
    }
  }
  // The last head of each group takes other tokens: a union of 2 max_sel rows, cut at max_sel.
  for (int bh = G - 1; bh < B * H; bh += G) {
    for (int r = 0; r < max_sel; ++r) idx[bh * max_sel + r] = 60 + r;
  }
  ASSERT_EQ(cudaMemcpy(di.get(), idx.data(), di.size(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(UnionSelected(up, ws.get(), ws.size(), nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  count = ToHost<int32_t>(rows.count, sets);
  where = ToHost<int32_t>(pos, static_cast<size_t>(B) * H * max_sel);
  for (int set = 0; set < sets; ++set) EXPECT_EQ(count[set], max_sel);
  for (int bh = G - 1; bh < B * H; bh += G) {
    for (int r = 0; r < max_sel; ++r) EXPECT_EQ(where[bh * max_sel + r], -1) << "head " << bh;
  }
}

// A GQA group whose heads share one selection (S2ANTA's group mixture) has a union of one head's
// rows: with max_union saying so, a union buffer of max_selected rows is enough, the union is the
// shared list and every head's positions are 0, 1, ...; without it the same buffer is refused.
// A promise the selections break is cut at the buffer (never written past: memcheck), not
// overrun. A short and a long sequence (its bitmap in shared memory, and past what fits there).
TEST(SelectedRowsCudaTest, UnionOfSharedSelectionsFitsOneHeadsRows) {
  KVSPARSE_REQUIRE_GPU();
  for (const int n : {100, 200000}) {
    SCOPED_TRACE(n);
    CheckSharedSelectionsUnion(n);
  }
}

// Sample counts and outputs of the SANTA kernels with K through per-head bases and V read from
// pages, against the same kernels on the strided layout.
TEST(SelectedRowsCudaTest, SantaWithPerHeadKAndPagedVMatchesStrided) {
  KVSPARSE_REQUIRE_GPU();
  SyntheticProblem sp = Problem128(16, 4, {5000, 300, 2500});
  const DecodeProblem& p = sp.problem;
  DeviceProblem dp = DeviceProblem::Upload(p, KvElements(p));
  PagedKv paged(p, 7, /*host=*/true, 9);
  const int B = p.batch, H = p.num_q_heads, hkv = p.num_kv_heads, n_max = 5000;
  std::vector<const void*> kh(B * hkv);
  for (int b = 0; b < B; ++b) {
    for (int j = 0; j < hkv; ++j) {
      kh[b * hkv + j] =
          dp.k.as<uint16_t>() + b * p.kv_layout.batch_stride + j * p.kv_layout.head_stride;
    }
  }
  DeviceBuffer dkh = ToDevice(kh);
  for (int method = 0; method < 3; ++method) {
    SantaLaunchParams a;
    a.shape = dp.shape;
    a.num_samples = 128;
    a.seed = 42;
    DeviceBuffer ca(sizeof(int32_t) * B * H * n_max), cb(sizeof(int32_t) * B * H * n_max);
    ASSERT_EQ(cudaMemset(ca.get(), 0, ca.size()), cudaSuccess);
    ASSERT_EQ(cudaMemset(cb.get(), 0, cb.size()), cudaSuccess);
    SantaLaunchParams bp = a;
    bp.shape.k = nullptr;
    bp.shape.v = nullptr;
    bp.shape.k_heads = dkh.as<const void*>();
    bp.shape.v_pages = paged.v();
    DeviceBuffer out_b(dp.out.size());
    bp.shape.out = out_b.get();
    if (method != 0) {
      a.sample_counts = ca.as<int32_t>();
      bp.sample_counts = cb.as<int32_t>();
    }
    RunSanta(method, a);
    RunSanta(method, bp);
    EXPECT_EQ(ToHost<int32_t>(ca, ca.size() / 4), ToHost<int32_t>(cb, cb.size() / 4))
        << "method " << method;
    int64_t nf = 0;
    const std::vector<double> want = dp.OutputAsDouble(&nf);
    std::vector<uint8_t> hb = ToHost<uint8_t>(out_b, out_b.size());
    DecodeProblem hp = p;
    hp.out = hb.data();
    EXPECT_LT(RelativeL2(want, OutputAsDouble(hp)), 1e-5) << "method " << method;
  }
  // K read through pages is refused by the streaming kernels.
  SantaLaunchParams bad;
  bad.shape = dp.shape;
  bad.shape.k_pages = paged.k();
  EXPECT_EQ(S2antaProp(bad, nullptr, 0, nullptr), cudaErrorInvalidValue);
}

TEST(SelectedRowsCudaTest, VAttentionFromPagesMatchesStrided) {
  KVSPARSE_REQUIRE_GPU();
  SyntheticProblem sp = Problem128(8, 2, {6000, 2100});
  const DecodeProblem& p = sp.problem;
  SimHashConfig cfg;
  cfg.seed = 3;
  Signatures sigs;
  ASSERT_TRUE(ComputeSimHashSignatures(p, cfg, &sigs).ok());
  DeviceProblem dp = DeviceProblem::Upload(p, KvElements(p));
  PagedKv paged(p, 5, /*host=*/true, 4);
  DeviceBuffer qs = ToDevice(sigs.q), ks = ToDevice(sigs.k);
  VAttentionLaunchParams a;
  a.shape = dp.shape;
  a.seed = 8;
  a.q_sigs = qs.as<uint32_t>();
  a.k_sigs = ks.as<uint32_t>();
  a.k_batch_stride = sigs.view.batch_stride;
  a.k_head_stride = sigs.view.head_stride;
  a.k_token_stride = sigs.view.token_stride;
  a.key_heads = sigs.view.key_heads;
  VAttentionLaunchParams bp = a;
  bp.shape.k = bp.shape.v = nullptr;
  bp.shape.k_pages = paged.k();
  bp.shape.v_pages = paged.v();
  DeviceBuffer out_b(dp.out.size());
  bp.shape.out = out_b.get();
  DeviceBuffer wa(VAttentionWorkspaceBytes(a)), wb(VAttentionWorkspaceBytes(bp));
  ASSERT_EQ(VAttentionDecode(a, wa.get(), wa.size(), nullptr), cudaSuccess);
  ASSERT_EQ(VAttentionDecode(bp, wb.get(), wb.size(), nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(ToHost<uint8_t>(dp.out, dp.out.size()), ToHost<uint8_t>(out_b, out_b.size()));
  const VAttentionSelectionView va = VAttentionSelection(a, wa.get());
  const VAttentionSelectionView vb = VAttentionSelection(bp, wb.get());
  std::vector<int64_t> ba(16), bb(16);
  ASSERT_EQ(cudaMemcpy(ba.data(), va.budget, 16 * 8, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(bb.data(), vb.budget, 16 * 8, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(ba, bb);
}

// Per-sequence seeds: sequence b of a batch draws exactly what a batch-1 call with seeds[b]
// draws (the decode worker's SequenceSeed contract), for every SANTA kernel.
TEST(SelectedRowsCudaTest, PerSequenceSeedsMatchBatchOneCalls) {
  KVSPARSE_REQUIRE_GPU();
  SyntheticProblem sp = Problem128(8, 2, {3000, 700, 1500});
  const DecodeProblem& p = sp.problem;
  DeviceProblem dp = DeviceProblem::Upload(p, KvElements(p));
  const int B = 3, H = 8, n_max = 3000;
  const std::vector<uint64_t> seeds = {11, 0x9e3779b97f4a7c15ull, 5};
  DeviceBuffer dseeds = ToDevice(seeds);
  for (int method = 0; method < 3; ++method) {
    SantaLaunchParams all;
    all.shape = dp.shape;
    all.num_samples = 64;
    all.seeds = dseeds.as<uint64_t>();
    DeviceBuffer c_all(sizeof(int32_t) * B * H * n_max), idx_all(sizeof(int32_t) * B * H * 64);
    ASSERT_EQ(cudaMemset(c_all.get(), 0, c_all.size()), cudaSuccess);
    if (method == 0) {
      all.indices = idx_all.as<int32_t>();
    } else {
      all.sample_counts = c_all.as<int32_t>();
    }
    RunSanta(method, all);
    const auto counts_all = ToHost<int32_t>(c_all, c_all.size() / 4);
    const auto idx_host = ToHost<int32_t>(idx_all, idx_all.size() / 4);
    for (int b = 0; b < B; ++b) {
      SantaLaunchParams one = all;
      one.seeds = nullptr;
      one.seed = seeds[b];
      one.shape.batch = 1;
      one.shape.q = static_cast<const uint16_t*>(dp.shape.q) + static_cast<size_t>(b) * H * 128;
      one.shape.k = static_cast<const uint16_t*>(dp.shape.k) + b * p.kv_layout.batch_stride;
      one.shape.v = static_cast<const uint16_t*>(dp.shape.v) + b * p.kv_layout.batch_stride;
      one.shape.seq_lens = dp.seq_lens.as<int32_t>() + b;
      one.shape.max_seq_len = n_max;
      DeviceBuffer out1(sizeof(uint16_t) * H * 128), c1(sizeof(int32_t) * H * n_max),
          i1(sizeof(int32_t) * H * 64);
      ASSERT_EQ(cudaMemset(c1.get(), 0, c1.size()), cudaSuccess);
      one.shape.out = out1.get();
      one.sample_counts = method == 0 ? nullptr : c1.as<int32_t>();
      one.indices = method == 0 ? i1.as<int32_t>() : nullptr;
      RunSanta(method, one);
      if (method == 0) {
        const auto got = ToHost<int32_t>(i1, H * 64);
        EXPECT_TRUE(std::equal(got.begin(), got.end(), idx_host.begin() + b * H * 64))
            << "iid sequence " << b;
      } else {
        const auto got = ToHost<int32_t>(c1, static_cast<size_t>(H) * n_max);
        EXPECT_TRUE(std::equal(got.begin(), got.end(),
                               counts_all.begin() + static_cast<size_t>(b) * H * n_max))
            << "method " << method << " sequence " << b;
      }
    }
  }
}

}  // namespace
}  // namespace kvsparse::kernels::cuda
