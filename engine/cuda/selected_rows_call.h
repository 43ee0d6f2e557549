// The GPU path of a method that selects rows per (sequence, kv head) and takes exact softmax
// attention over them, optionally weighted (hash top-k, SAAP, top-k by compressed keys, S2ANTA
// over compressed keys). The method's selection kernels write, per (b, j), the
// union of its query heads' rows and each head's positions in it (kernels/cuda/selected_rows.h);
// the rest is shared and lives here:
//   PlaceRows           which rows the row cache holds from the last step, and which must cross
//                       (not launched where no sequence has a row cache: every union row crosses,
//                       in union order, into the overflow rows);
//   FetchRows           only those rows, over the host link (into cache slots, or overflow rows
//                       in the scratch when the cache is full); from a store in another
//                       process the rows are gathered into pinned staging first
//                       (LaunchPlan::StageListed) and read from there;
//   SelectedRowsDecode  the estimate over the union's rows.
// A selection whose heads' rows overlap little and are not cached (ReadsInPlace) skips the union,
// PlaceRows and FetchRows: SelectedRowsDecode reads each head's rows by token where they live;
// one whose G heads select the same rows (SharesRows) reads each row once for the group there.
// The row cache (DeviceState::GrowCache) holds row_cache_fraction of each sequence's tokens per
// kv head; consecutive steps select mostly the same rows, which then stay on the device (for the
// selections whose rows repeat: RowsRepeat).
// Statistics blocks: 0 the rows read per (b, j) (first B * Hkv entries: the union's, or in place
// the heads' rows summed, or the group's shared rows once), 1 each query head's rows, 2 its
// budget, 3 the cache hits per (b, j).
#ifndef KVSPARSE_ENGINE_CUDA_SELECTED_ROWS_CALL_H_
#define KVSPARSE_ENGINE_CUDA_SELECTED_ROWS_CALL_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/cuda/gpu_runner.h"
#include "kernels/cuda/selected_rows.h"

namespace kvsparse::engine::gpu {

class SelectedRowsCall : public MethodCall {
 public:
  absl::Status Plan(LaunchPlan& lp) final;
  void FillTables(LaunchPlan& lp) final;
  absl::Status Enqueue(LaunchPlan& lp, Carver& c) final;
  void FillScratchTables(LaunchPlan& lp) final;
  absl::Status Download(LaunchPlan& lp) final;
  void Stats(const LaunchPlan& lp, int32_t b, int32_t j, HeadStats* hs) const final;

 protected:
  // Where a selection writes (device; null in the sizing pass): each (b, j)'s union (tokens
  // ascending and count, capacity rows_cap), every query head's positions in it [B, H,
  // max_selected], its row count and its budget [B, H].
  struct Selection {
    kernels::cuda::RowSetTables rows;
    int32_t* positions = nullptr;
    int32_t* counts = nullptr;
    int32_t* budgets = nullptr;
    int32_t max_selected = 0;
    // [B, H, max_selected] beside the selection's indices, when RowWeights(): each row's weight
    // in log2 units (SelectedRowsParams::log2_weights).
    float* log2_weights = nullptr;
    // [B, H, max_selected] beside them, when StatesStandardError() outside a captured step:
    // each row's draws (SelectedRowsParams::row_counts).
    int32_t* row_counts = nullptr;
  };
  // The union over each GQA group of per-query-head selections (indices [B, H, max_selected],
  // ascending, and counts [B, H], on the device) into the selection's row sets and positions:
  // UnionSelected's parameters and workspace (carved from c; PlanUnion in both passes), then
  // EnqueueUnion in the run pass, after the kernels that write the indices. The row sets hold
  // UnionBound's rows (the kernel is told so).
  struct Union {
    kernels::cuda::UnionSelectedParams params;
    void* workspace = nullptr;
    size_t workspace_bytes = 0;
  };
  // Where the rows are read in place (ReadsInPlace), PlanUnion carves nothing and EnqueueUnion
  // launches nothing: SelectedRowsDecode reads the indices.
  Union PlanUnion(const LaunchPlan& lp, Carver& c, const Selection& s, const int32_t* indices,
                  const int32_t* counts);
  absl::Status EnqueueUnion(const LaunchPlan& lp, const Union& u) const;
  // In Plan: the bound of any query head's rows (host), after the method's own checks and
  // uploads.
  virtual absl::StatusOr<int32_t> PlanSelection(LaunchPlan& lp) = 0;
  // Carves the selection's own buffers and, in the run pass, enqueues its kernels.
  virtual absl::Status EnqueueSelection(LaunchPlan& lp, Carver& c, const Selection& s) = 0;
  // The entries of host tables the selection added in PlanSelection (after the shared ones).
  virtual void FillSelectionTables(LaunchPlan& lp) {}
  // The longest union of a GQA group's selections of at most max_sel rows each: by default
  // the G heads' rows apart (at most the sequence); a selection shared by the group's heads
  // says less (it sizes the union's buffers and the row cache, which holds the union).
  virtual int32_t UnionBound(const LaunchPlan& lp, int32_t max_sel) const;
  // Whether the selection weights its rows (Selection::log2_weights); else every weight is 1.
  virtual bool RowWeights() const { return false; }
  // Whether consecutive steps select mostly the same rows, so that the row cache keeps them on
  // the device; a selection that draws afresh each step says no: no cache is grown or consulted
  // for it and PlaceRows is not launched.
  virtual bool RowsRepeat() const { return true; }
  // Whether the G heads' selections overlap so little that reading each head's rows by token,
  // once per head, beats their union and a fetch (SelectedRowsParams::tokens): done where no row
  // cache is kept and the device reads the rows where they live (not staged).
  virtual bool ReadsInPlace() const { return false; }
  // Whether the G heads of a kv head select the same rows (positions and counts of its first
  // head stand for all; each head its own weights): read in place, once for the group
  // (SelectedRowsParams::shared_rows).
  virtual bool SharesRows() const { return false; }
  // Whether the rows are draws spread over the tokens in order (S2ANTA's systematic samples),
  // whose estimate states its standard error (HeadStats::standard_error) where they are read in
  // place per head (SelectedRowsParams::standard_errors); not in captured steps.
  virtual bool StatesStandardError() const { return false; }
  // Device bytes the selection reads for sequence b per kv head: by default every token's key
  // signature (hash top-k, SAAP buckets).
  virtual uint64_t SelectionDeviceBytes(const LaunchPlan& lp, int32_t b) const {
    return static_cast<uint64_t>(lp.len(b)) * lp.words * 4;
  }

 private:
  // The row cache's tables per (b, j), in this order: tokens, slots, count, K rows, V rows.
  static constexpr int kCacheTables = 5;
  // The call's row tables per (b, j): union tokens, union count; fetch tokens, fetch count,
  // destinations; overflow K, V rows.
  static constexpr int kCallTables = 7;
  // Scratch offsets of the per-call rows (recorded while sizing; their pointer tables are
  // filled once the scratch is placed): each (b, j)'s union, the rows to fetch and their
  // locations, and overflow rows for misses beyond the row cache.
  struct CallRows {
    size_t union_tokens = 0, fetch_tokens = 0, fetch_count = 0, dest = 0, overflow = 0;
    int32_t overflow_cap = 0;  // rows per (b, j)
  };
  // SelectedRowsDecode's parameters over the fetched rows (fp's), or in place (in_place_).
  kernels::cuda::SelectedRowsParams AttentionParams(const Selection& sel,
                                                    const kernels::cuda::FetchRowsParams& fp) const;
  // In place: the attention reads each head's rows where they live (no union, no fetch).
  absl::Status EnqueueInPlace(LaunchPlan& lp, kernels::cuda::SelectedRowsParams& srp,
                              void* workspace, size_t workspace_bytes) const;
  template <typename T>
  static T* const* Table(const LaunchPlan& lp, size_t off) {
    return lp.Dev<T* const>(off);
  }

  int32_t max_sel_ = 0, rows_cap_ = 0, cache_cap_ = 0, min_cache_ = 0;
  bool in_place_ = false;              // this call reads its rows in place (set by Enqueue)
  const int32_t* selected_ = nullptr;  // the selection's indices [B, H, max_selected] (PlanUnion)
  size_t cache_off_[kCacheTables] = {}, cache_slots_off_ = 0, call_off_[kCallTables] = {};
  CallRows cr_;
  float* se_ = nullptr;                // the call's standard errors [B, H] (device), or null
  Downloaded<float> standard_errors_;  // their download, NaN where not stated
};

}  // namespace kvsparse::engine::gpu

#endif  // KVSPARSE_ENGINE_CUDA_SELECTED_ROWS_CALL_H_
