// Dense attention on the GPU: DenseDecode over every row. With K and V resident it reads them in
// place; with a half in host memory every row crosses first (FetchRows into a dense staging
// area in the scratch), then DenseDecode reads the staged rows; from a store in another process
// the host halves' rows are gathered into pinned staging (LaunchPlan::StageAll), which
// DenseDecode reads in place.
#include <algorithm>
#include <vector>

#include "engine/cuda/gpu_runner.h"
#include "engine/cuda/row_cache.h"
#include "kernels/cuda/dense_decode.h"
#include "kernels/cuda/selected_rows.h"

namespace kvsparse::engine::gpu {
namespace {

namespace kc = kernels::cuda;

class DenseCall final : public MethodCall {
 public:
  explicit DenseCall(const Method&) {}
  static absl::Status Supports(const Method&, const SequenceDesc&, const GpuCaps&) {
    return absl::OkStatus();
  }
  // Captured steps: K and V resident (staging every host row uploads a table per call).
  static bool Capturable(const Method&, const SequenceDesc& d) {
    return d.placement.k_tier == kvstore::Tier::kDevice &&
           d.placement.v_tier == kvstore::Tier::kDevice;
  }

  absl::Status Plan(LaunchPlan& lp) override {
    resident_ = std::all_of(lp.descs().begin(), lp.descs().end(), [](const SequenceDesc& s) {
      return s.placement.k_tier == kvstore::Tier::kDevice &&
             s.placement.v_tier == kvstore::Tier::kDevice;
    });
    return absl::OkStatus();
  }

  absl::Status Enqueue(LaunchPlan& lp, Carver& c) override {
    kc::DecodeShape ds = lp.shape();
    if (absl::Status s = lp.Mark(1); !s.ok()) return s;  // no selection
    if (!resident_) {                                    // every row crosses first
      // From another process: gathered into pinned staging (nothing carved); else fetched into
      // a dense staging area in the scratch.
      absl::Status s =
          lp.staged() ? (lp.running() ? lp.StageAll(&ds) : absl::OkStatus()) : Stage(lp, c, &ds);
      if (!s.ok()) return s;
    }
    const size_t wb = kc::DenseDecodeWorkspaceBytes(ds);
    void* ws = c.Take<char>(wb);
    if (absl::Status s = lp.Mark(2); !s.ok()) return s;
    if (lp.running()) KVS_CUDA_OK(kc::DenseDecode(ds, ws, wb, lp.stream()), "DenseDecode");
    return absl::OkStatus();
  }

  void Stats(const LaunchPlan& lp, int32_t b, int32_t j, HeadStats* hs) const override {
    const uint64_t n = static_cast<uint64_t>(lp.len(b));
    hs->rows_selected = n * lp.G;
    hs->rows_fetched = n;
    hs->budgets.assign(lp.G, n);
    hs->bytes[lp.k_tier()] += n * lp.row;
    hs->bytes[lp.v_tier()] += n * lp.row;
  }

 private:
  // Every row of every (b, j) into a row set in the scratch (FetchRows over the pages); ds then
  // reads the row sets.
  absl::Status Stage(LaunchPlan& lp, Carver& c, kc::DecodeShape* ds) {
    const int32_t BK = lp.BK;
    const int32_t rows_cap = lp.n_max;  // rows per (b, j)
    const RowsLayout rl = RowsLayout::Of(1, rows_cap, lp.row, false);
    char* sets = c.Take<char>(rl.total * BK);
    void** tab = c.Take<void*>(4 * static_cast<size_t>(BK));
    std::vector<void*> ht(4 * BK);
    for (int32_t i = 0; i < BK && sets != nullptr; ++i) {
      char* sb = sets + rl.total * i;
      ht[i] = sb + rl.tokens;
      ht[BK + i] = sb + rl.count;
      ht[2 * BK + i] = sb + rl.k;
      ht[3 * BK + i] = sb + rl.v;
    }
    kc::RowSetTables t;
    if (tab != nullptr) {
      t.tokens = reinterpret_cast<int32_t* const*>(tab);
      t.count = reinterpret_cast<int32_t* const*>(tab + BK);
      t.k = tab + 2 * BK;
      t.v = tab + 3 * BK;
    }
    t.capacity = rows_cap;
    kc::FetchRowsParams fp;
    fp.shape = lp.shape();
    fp.all_tokens = true;
    fp.seq_lens = lp.shape().seq_lens;
    fp.max_seq_len = lp.n_max;
    fp.max_rows = lp.n_max;
    fp.out = t;
    if (lp.running()) {
      KVS_CUDA_OK(cudaMemcpyAsync(tab, ht.data(), sizeof(void*) * 4 * BK, cudaMemcpyHostToDevice,
                                  lp.stream()),
                  "row tables");
      KVS_CUDA_OK(kc::FetchRows(fp, lp.stream()), "FetchRows");
    }
    ds->k = ds->v = nullptr;
    ds->k_pages = ds->v_pages = kc::PagedRows();
    ds->k_heads = reinterpret_cast<const void* const*>(t.k);
    ds->v_heads = reinterpret_cast<const void* const*>(t.v);
    return absl::OkStatus();
  }

  bool resident_ = false;  // K and V of every sequence on the device
};

}  // namespace

const GpuRunner& DenseRunner() {
  static const RunnerOf<DenseCall> runner;
  return runner;
}

}  // namespace kvsparse::engine::gpu
