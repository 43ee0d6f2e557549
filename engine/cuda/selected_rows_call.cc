#include "engine/cuda/selected_rows_call.h"

#include <algorithm>
#include <cmath>

#include "engine/cuda/row_cache.h"

namespace kvsparse::engine::gpu {

namespace kc = kernels::cuda;

absl::Status SelectedRowsCall::Plan(LaunchPlan& lp) {
  absl::StatusOr<int32_t> max_sel = PlanSelection(lp);
  if (!max_sel.ok()) return max_sel.status();
  max_sel_ = std::max(1, *max_sel);
  rows_cap_ = UnionBound(lp, max_sel_);
  // A selection whose rows do not repeat keeps no cache (cache_cap_ stays 0, every union row an
  // overflow row); the layers' caches are left alone.
  const bool repeat = RowsRepeat();
  min_cache_ = repeat ? rows_cap_ : 0;
  for (int32_t b = 0; b < lp.B && repeat; ++b) {
    DeviceLayer& l = lp.layer(b);
    const int32_t want = RowCacheSlots(lp.state().options().gpu.row_cache, lp.len(b), rows_cap_);
    if (l.cache_cap < want) {
      if (absl::Status s = GrowRowCache(&lp.state().memory(), lp.sequence(b), &l, lp.hkv, want,
                                        lp.row, lp.busy());
          !s.ok()) {
        return s;
      }
    }
    cache_cap_ = std::max(cache_cap_, l.cache_cap);
    min_cache_ = std::min(min_cache_, l.cache_cap);
  }
  for (size_t& o : cache_off_) o = lp.AddHostTable<void*>(lp.BK);
  cache_slots_off_ = lp.AddHostTable<int32_t>(lp.BK);
  for (size_t& o : call_off_) o = lp.AddHostTable<void*>(lp.BK);
  return absl::OkStatus();
}

int32_t SelectedRowsCall::UnionBound(const LaunchPlan& lp, int32_t max_sel) const {
  return std::min(lp.n_max, lp.G * max_sel);
}

void SelectedRowsCall::FillTables(LaunchPlan& lp) {
  void** t[kCacheTables];
  for (int x = 0; x < kCacheTables; ++x) t[x] = lp.HostTable<void*>(cache_off_[x]);
  int32_t* slots = lp.HostTable<int32_t>(cache_slots_off_);
  const size_t row = lp.row;
  for (int32_t b = 0; b < lp.B; ++b) {
    const DeviceLayer& l = lp.layer(b);
    const RowsLayout cl = RowsLayout::Of(lp.hkv, l.cache_cap, row, true);
    for (int32_t j = 0; j < lp.hkv; ++j) {
      const int32_t i = b * lp.hkv + j;
      slots[i] = l.cache_cap;
      if (l.cache_cap == 0) continue;
      char* cb = l.cache.as<char>();
      const size_t ints = sizeof(int32_t) * j * l.cache_cap;
      t[0][i] = cb + cl.tokens + ints;
      t[1][i] = cb + cl.slots + ints;
      t[2][i] = cb + cl.count + sizeof(int32_t) * j;
      t[3][i] = cb + cl.k + row * j * l.cache_cap;
      t[4][i] = cb + cl.v + row * j * l.cache_cap;
    }
  }
  FillSelectionTables(lp);
}

absl::Status SelectedRowsCall::Enqueue(LaunchPlan& lp, Carver& c) {
  const int32_t BH = lp.BH, BK = lp.BK;
  int32_t* stats = lp.stats();
  const size_t method_off = lp.method_offset();
  Selection sel;
  sel.max_selected = max_sel_;
  // Each head's rows read by token where nothing is kept and the device can read the store's rows:
  // no union, no fetch lists, no rows in the scratch.
  in_place_ = ReadsInPlace() && cache_cap_ == 0 && !lp.staged();
  const size_t rows_all = in_place_ ? 0 : static_cast<size_t>(BK) * rows_cap_;
  cr_.overflow_cap = in_place_ ? 0 : std::max(0, rows_cap_ - min_cache_);  // misses past the cache
  cr_.union_tokens = method_off + c.used();
  c.Take<int32_t>(rows_all);
  cr_.fetch_tokens = method_off + c.used();
  c.Take<int32_t>(rows_all);
  cr_.fetch_count = method_off + c.used();
  c.Take<int32_t>(BK);
  cr_.dest = method_off + c.used();
  c.Take<int32_t>(rows_all);
  cr_.overflow = method_off + c.used();
  c.Take<uint8_t>(2 * lp.row * BK * cr_.overflow_cap);
  sel.rows.tokens = Table<int32_t>(lp, call_off_[0]);
  sel.rows.count = Table<int32_t>(lp, call_off_[1]);  // the first BK statistics
  sel.rows.capacity = rows_cap_;
  sel.positions = in_place_ ? nullptr : c.Take<int32_t>(static_cast<size_t>(BH) * max_sel_);
  sel.counts = stats == nullptr ? nullptr : stats + BH;
  sel.budgets = stats == nullptr ? nullptr : stats + 2 * BH;
  sel.log2_weights = RowWeights() ? c.Take<float>(static_cast<size_t>(BH) * max_sel_) : nullptr;
  const bool errors = StatesStandardError() && !lp.captured();
  sel.row_counts = errors ? c.Take<int32_t>(static_cast<size_t>(BH) * max_sel_) : nullptr;
  se_ = errors ? c.Take<float>(BH) : nullptr;
  standard_errors_.device = se_;

  kc::PlaceRowsParams pp;
  pp.batch = lp.B;
  pp.num_q_heads = lp.H;
  pp.num_kv_heads = lp.hkv;
  pp.rows = sel.rows;
  if (cache_cap_ > 0) {
    pp.cache.tokens = Table<int32_t>(lp, cache_off_[0]);
    pp.cache.slots = Table<int32_t>(lp, cache_off_[1]);
    pp.cache.count = Table<int32_t>(lp, cache_off_[2]);
    pp.cache.k = Table<void>(lp, cache_off_[3]);
    pp.cache.v = Table<void>(lp, cache_off_[4]);
    pp.cache.capacity = cache_cap_;
    pp.cache.capacities = lp.Dev<const int32_t>(cache_slots_off_);
  }
  pp.positions = sel.positions;
  pp.counts = sel.counts;
  pp.max_selected = max_sel_;
  pp.fetch.tokens = Table<int32_t>(lp, call_off_[2]);
  pp.fetch.count = Table<int32_t>(lp, call_off_[3]);
  pp.fetch.capacity = rows_cap_;
  pp.fetch_dest = Table<int32_t>(lp, call_off_[4]);
  pp.hits = stats == nullptr ? nullptr : stats + 3 * BH;
  // No row cache on any sequence (or a selection whose rows do not repeat): nothing to place, no
  // workspace carved for it.
  const bool place = cache_cap_ > 0;
  const size_t pw = place ? kc::PlaceRowsWorkspaceBytes(pp) : 0;
  void* pws = place ? c.Take<char>(pw) : nullptr;

  kc::FetchRowsParams fp;
  fp.shape = lp.shape();
  fp.max_rows = rows_cap_;
  fp.out = pp.fetch;  // the rows to fetch, into cache slots or overflow rows
  fp.out.k = Table<void>(lp, cache_off_[3]);
  fp.out.v = Table<void>(lp, cache_off_[4]);
  fp.dest = pp.fetch_dest;
  if (cr_.overflow_cap > 0) {
    fp.second.k = Table<void>(lp, call_off_[5]);
    fp.second.v = Table<void>(lp, call_off_[6]);
  }
  // Without a row cache the union's rows are fetched in union order into the overflow rows, where
  // the union positions find them (PlaceRows is not launched).
  if (!place) {
    fp.out = sel.rows;
    fp.out.k = fp.second.k;
    fp.out.v = fp.second.v;
    fp.dest = nullptr;
    fp.second = {};
  }

  kc::SelectedRowsParams srp = AttentionParams(sel, fp);
  const size_t sw = kc::SelectedRowsWorkspaceBytes(srp);
  void* sws = c.Take<char>(sw);

  if (absl::Status s = EnqueueSelection(lp, c, sel); !s.ok()) return s;
  const cudaStream_t stream = lp.stream();
  if (in_place_) return EnqueueInPlace(lp, srp, sws, sw);
  if (place && lp.running()) KVS_CUDA_OK(kc::PlaceRows(pp, pws, pw, stream), "PlaceRows");
  if (absl::Status s = lp.Mark(1); !s.ok()) return s;
  if (lp.staged() && lp.running()) {  // the missed rows come from the row source, listed order
    // The list: PlaceRows' misses, or without a cache the union (its counts: statistics block 0).
    const size_t listed = place ? cr_.fetch_tokens : cr_.union_tokens;
    const size_t counts = place ? cr_.fetch_count : lp.stats_offset();
    if (absl::Status s = lp.StageListed(lp.Dev<const int32_t>(listed), rows_cap_,
                                        lp.Dev<const int32_t>(counts), &fp.shape);
        !s.ok()) {
      return s;
    }
    fp.source_by_position = true;
  }
  if (lp.running()) KVS_CUDA_OK(kc::FetchRows(fp, stream), "FetchRows");
  if (absl::Status s = lp.Mark(2); !s.ok()) return s;
  if (lp.running()) KVS_CUDA_OK(kc::SelectedRowsDecode(srp, sws, sw, stream), "SelectedRowsDecode");
  return absl::OkStatus();
}

kc::SelectedRowsParams SelectedRowsCall::AttentionParams(const Selection& sel,
                                                         const kc::FetchRowsParams& fp) const {
  kc::SelectedRowsParams srp;
  srp.shape = fp.shape;
  srp.counts = sel.counts;
  srp.max_selected = max_sel_;
  srp.log2_weights = sel.log2_weights;
  srp.row_counts = sel.row_counts;
  srp.standard_errors = se_;
  if (in_place_) {  // positions: the selection's indices, once EnqueueSelection has carved them
    srp.in_place = true;
    srp.shared_rows = SharesRows();
    srp.rows_read = sel.rows.count;
    return srp;
  }
  srp.rows.k = fp.out.k;
  srp.rows.v = fp.out.v;
  srp.second = fp.second;
  srp.positions = sel.positions;
  return srp;
}

absl::Status SelectedRowsCall::EnqueueInPlace(LaunchPlan& lp, kc::SelectedRowsParams& srp,
                                              void* workspace, size_t workspace_bytes) const {
  // No fetch: the attention's marks fall together.
  if (absl::Status s = lp.Mark(1); !s.ok()) return s;
  if (absl::Status s = lp.Mark(2); !s.ok()) return s;
  srp.positions = selected_;  // each head's tokens, read where the rows live
  if (lp.running()) {
    KVS_CUDA_OK(kc::SelectedRowsDecode(srp, workspace, workspace_bytes, lp.stream()),
                "SelectedRowsDecode in place");
  }
  return absl::OkStatus();
}

void SelectedRowsCall::FillScratchTables(LaunchPlan& lp) {
  void** t[kCallTables];
  for (int x = 0; x < kCallTables; ++x) t[x] = lp.HostTable<void*>(call_off_[x]);
  char* base = lp.base();
  const size_t ints = sizeof(int32_t), row = lp.row;
  for (int32_t i = 0; i < lp.BK; ++i) {
    t[0][i] = base + cr_.union_tokens + ints * i * rows_cap_;
    t[1][i] = base + lp.stats_offset() + ints * i;
    t[2][i] = base + cr_.fetch_tokens + ints * i * rows_cap_;
    t[3][i] = base + cr_.fetch_count + ints * i;
    t[4][i] = base + cr_.dest + ints * i * rows_cap_;
    t[5][i] = base + cr_.overflow + row * i * cr_.overflow_cap;
    t[6][i] = base + cr_.overflow + row * (lp.BK + i) * cr_.overflow_cap;
  }
}

SelectedRowsCall::Union SelectedRowsCall::PlanUnion(const LaunchPlan& lp, Carver& c,
                                                    const Selection& s, const int32_t* indices,
                                                    const int32_t* counts) {
  selected_ = indices;
  Union u;
  if (in_place_) return u;  // read by token: EnqueueUnion launches nothing
  kc::UnionSelectedParams& up = u.params;
  up.batch = lp.B;
  up.num_q_heads = lp.H;
  up.num_kv_heads = lp.hkv;
  up.indices = indices;
  up.counts = counts;
  up.max_selected = s.max_selected;
  up.seq_lens = lp.shape().seq_lens;
  up.max_seq_len = lp.n_max;
  up.max_union = rows_cap_;
  up.out = s.rows;
  up.positions = s.positions;
  u.workspace_bytes = kc::UnionSelectedWorkspaceBytes(up);
  u.workspace = c.Take<char>(u.workspace_bytes);
  return u;
}

absl::Status SelectedRowsCall::EnqueueUnion(const LaunchPlan& lp, const Union& u) const {
  if (in_place_) return absl::OkStatus();
  KVS_CUDA_OK(kc::UnionSelected(u.params, u.workspace, u.workspace_bytes, lp.stream()),
              "UnionSelected");
  return absl::OkStatus();
}

absl::Status SelectedRowsCall::Download(LaunchPlan& lp) {
  if (standard_errors_.device == nullptr) return absl::OkStatus();
  return standard_errors_.Fetch(lp.BH, lp.stream());
}

void SelectedRowsCall::Stats(const LaunchPlan& lp, int32_t b, int32_t j, HeadStats* hs) const {
  const int32_t* st = lp.host_stats();
  const int32_t BH = lp.BH, i = b * lp.hkv + j;
  const uint64_t fetched = static_cast<uint64_t>(st[i]);  // the union's rows
  const uint64_t hits = static_cast<uint64_t>(st[3 * BH + i]);
  for (int32_t g = 0; g < lp.G; ++g) {
    const int32_t bh = b * lp.H + j * lp.G + g;
    hs->rows_selected += static_cast<uint64_t>(st[BH + bh]);
    hs->budgets.push_back(static_cast<uint64_t>(st[2 * BH + bh]));
    // NaN: this path states none (SelectedRowsParams::standard_errors).
    if (standard_errors_.device != nullptr && !std::isnan(standard_errors_.host[bh])) {
      hs->standard_error.push_back(standard_errors_.host[bh]);
    }
  }
  hs->rows_fetched = fetched;
  hs->rows_cached = hits;
  hs->bytes[kDeviceTier] += SelectionDeviceBytes(lp, b) + hits * 2 * lp.row;
  hs->bytes[lp.k_tier()] += (fetched - hits) * lp.row;
  hs->bytes[lp.v_tier()] += (fetched - hits) * lp.row;
}

}  // namespace kvsparse::engine::gpu
