// HashAttention top-k on the GPU, one kernel sequence for the batch:
//   SimHashSign         the queries' signatures;
//   HashTopK            sink + local window + top-k by Hamming similarity per query head;
//   UnionSelected       the union over each GQA group (each row once per kv head);
//   PlaceRows           which rows the row cache holds from the last step, and which must cross;
//   FetchRows           only those rows, over the host link (into cache slots, or overflow rows
//                       in the scratch when the cache is full); from a store in another
//                       process the rows are gathered into pinned staging first
//                       (LaunchPlan::StageListed) and read from there;
//   SelectedRowsDecode  the estimate over the union's rows.
// The row cache (DeviceState::GrowCache) holds row_cache_fraction of each sequence's tokens per
// kv head; consecutive steps select mostly the same rows, which then stay on the device.
#include <algorithm>

#include "engine/cuda/gpu_runner.h"
#include "kernels/cuda/hash_topk.h"
#include "kernels/cuda/selected_rows.h"
#include "kernels/hash_topk.h"

namespace kvsparse::engine::gpu {
namespace {

namespace kc = kernels::cuda;

// The row cache's tables per (b, j), in this order: tokens, slots, count, K rows, V rows.
constexpr int kCacheTables = 5;
// The call's row tables per (b, j): union tokens, union count; fetch tokens, fetch count,
// destinations; overflow K, V rows.
constexpr int kCallTables = 7;

class HashTopKCall final : public MethodCall {
 public:
  explicit HashTopKCall(const Method& m) : params_(m.hash) {}
  // Signatures on the device (SimHash, or learned MLPs that fit: SignaturesOnGpu). Rows staged
  // from a store in another process: K and V in the same tier (the fetch reads both by list
  // position).
  static bool Supports(const Method& m, const SequenceDesc& desc, const GpuCaps& caps) {
    const kvstore::Placement& pl = desc.placement;
    if (caps.staged_rows &&
        (pl.k_tier == kvstore::Tier::kDevice) != (pl.v_tier == kvstore::Tier::kDevice)) {
      return false;
    }
    return SignaturesOnGpu(m, desc, caps);
  }

  absl::Status Plan(LaunchPlan& lp) override;
  void FillTables(LaunchPlan& lp) override;
  absl::Status Enqueue(LaunchPlan& lp, Carver& c) override;
  void FillScratchTables(LaunchPlan& lp) override;
  void Stats(const LaunchPlan& lp, int32_t b, int32_t j, HeadStats* hs) const override;

 private:
  // Scratch offsets of the per-call rows (recorded while sizing; their pointer tables are
  // filled once the scratch is placed): each (b, j)'s union, the rows to fetch and their
  // locations, and overflow rows for misses beyond the row cache.
  struct CallRows {
    size_t union_tokens = 0, fetch_tokens = 0, fetch_count = 0, dest = 0, overflow = 0;
    int32_t overflow_cap = 0;  // rows per (b, j)
  };
  template <typename T>
  static T* const* Table(const LaunchPlan& lp, size_t off) {
    return lp.Dev<T* const>(off);
  }

  const kernels::HashTopKParams params_;
  kc::HashTopKParams tk_;
  int32_t max_sel_ = 0, rows_cap_ = 0, cache_cap_ = 0, min_cache_ = 0;
  size_t cache_off_[kCacheTables] = {}, cache_slots_off_ = 0, call_off_[kCallTables] = {};
  CallRows cr_;
};

absl::Status HashTopKCall::Plan(LaunchPlan& lp) {
  for (int32_t b = 0; b < lp.B; ++b) {
    absl::StatusOr<int32_t> k =
        kernels::ResolveTopK(params_.top_k, params_.top_k_fraction, lp.len(b));
    if (!k.ok()) return k.status();
  }
  tk_.batch = lp.B;
  tk_.num_q_heads = lp.H;
  tk_.key_heads = lp.hkv;
  tk_.bits = static_cast<int32_t>(lp.descs()[0].placement.signature_bits);
  tk_.max_seq_len = lp.n_max;
  tk_.sink_tokens = params_.sink_tokens;
  tk_.local_tokens = params_.local_tokens;
  tk_.top_k = params_.top_k;
  tk_.top_k_fraction = params_.top_k_fraction;
  max_sel_ = std::max(1, tk_.MaxSelected());
  rows_cap_ = std::min(lp.n_max, lp.G * max_sel_);  // the longest union of a GQA group
  min_cache_ = rows_cap_;
  for (int32_t b = 0; b < lp.B; ++b) {
    DeviceLayer& l = lp.layer(b);
    const int32_t want = lp.state().CacheSlots(lp.len(b), rows_cap_);
    if (l.cache_cap < want) {
      if (absl::Status s =
              lp.state().GrowCache(lp.sequence(b), &l, lp.hkv, want, lp.row, lp.busy());
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
  return lp.LoadPlanes();
}

void HashTopKCall::FillTables(LaunchPlan& lp) {
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
}

absl::Status HashTopKCall::Enqueue(LaunchPlan& lp, Carver& c) {
  const int32_t BH = lp.BH, BK = lp.BK;
  int32_t* stats = lp.stats();
  const size_t method_off = lp.method_offset();
  uint32_t* qsig = c.Take<uint32_t>(static_cast<size_t>(BH) * lp.words);
  tk_.q_sigs = qsig;
  tk_.k_sig_heads = lp.sig_heads();
  tk_.k_token_stride = lp.words;
  tk_.seq_lens = lp.shape().seq_lens;
  tk_.indices = c.Take<int32_t>(static_cast<size_t>(BH) * max_sel_);
  tk_.counts = stats == nullptr ? nullptr : stats + BH;
  tk_.budgets = stats == nullptr ? nullptr : stats + 2 * BH;
  const size_t tw = kc::HashTopKWorkspaceBytes(tk_);
  void* tws = c.Take<char>(tw);

  kc::UnionSelectedParams up;
  up.batch = lp.B;
  up.num_q_heads = lp.H;
  up.num_kv_heads = lp.hkv;
  up.indices = tk_.indices;
  up.counts = tk_.counts;
  up.max_selected = max_sel_;
  up.seq_lens = lp.shape().seq_lens;
  up.max_seq_len = lp.n_max;
  const size_t rows_all = static_cast<size_t>(BK) * rows_cap_;
  cr_.overflow_cap = std::max(0, rows_cap_ - min_cache_);  // misses beyond a cache's slots
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
  up.out.tokens = Table<int32_t>(lp, call_off_[0]);
  up.out.count = Table<int32_t>(lp, call_off_[1]);  // the first BK statistics
  up.out.capacity = rows_cap_;
  up.positions = c.Take<int32_t>(static_cast<size_t>(BH) * max_sel_);
  const size_t uw = kc::UnionSelectedWorkspaceBytes(up);
  void* uws = c.Take<char>(uw);

  kc::PlaceRowsParams pp;
  pp.batch = lp.B;
  pp.num_q_heads = lp.H;
  pp.num_kv_heads = lp.hkv;
  pp.rows = up.out;
  if (cache_cap_ > 0) {
    pp.cache.tokens = Table<int32_t>(lp, cache_off_[0]);
    pp.cache.slots = Table<int32_t>(lp, cache_off_[1]);
    pp.cache.count = Table<int32_t>(lp, cache_off_[2]);
    pp.cache.k = Table<void>(lp, cache_off_[3]);
    pp.cache.v = Table<void>(lp, cache_off_[4]);
    pp.cache.capacity = cache_cap_;
    pp.cache.capacities = lp.Dev<const int32_t>(cache_slots_off_);
  }
  pp.positions = up.positions;
  pp.counts = tk_.counts;
  pp.max_selected = max_sel_;
  pp.fetch.tokens = Table<int32_t>(lp, call_off_[2]);
  pp.fetch.count = Table<int32_t>(lp, call_off_[3]);
  pp.fetch.capacity = rows_cap_;
  pp.fetch_dest = Table<int32_t>(lp, call_off_[4]);
  pp.hits = stats == nullptr ? nullptr : stats + 3 * BH;
  const size_t pw = kc::PlaceRowsWorkspaceBytes(pp);
  void* pws = c.Take<char>(pw);

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
  if (cache_cap_ == 0) {  // no cache: every location is an overflow row
    fp.out.k = fp.second.k;
    fp.out.v = fp.second.v;
  }

  kc::SelectedRowsParams srp;
  srp.shape = lp.shape();
  srp.rows.k = fp.out.k;
  srp.rows.v = fp.out.v;
  srp.second = fp.second;
  srp.positions = up.positions;
  srp.counts = tk_.counts;
  srp.max_selected = max_sel_;
  const size_t sw = kc::SelectedRowsWorkspaceBytes(srp);
  void* sws = c.Take<char>(sw);

  const cudaStream_t stream = lp.stream();
  if (lp.running()) {
    if (absl::Status s = lp.SignQueries(qsig); !s.ok()) return s;
    KVS_CUDA_OK(kc::HashTopK(tk_, tws, tw, stream), "HashTopK");
    KVS_CUDA_OK(kc::UnionSelected(up, uws, uw, stream), "UnionSelected");
    KVS_CUDA_OK(kc::PlaceRows(pp, pws, pw, stream), "PlaceRows");
  }
  if (absl::Status s = lp.Mark(1); !s.ok()) return s;
  if (lp.staged() && lp.running()) {  // the missed rows come from the row source, listed order
    if (absl::Status s = lp.StageListed(lp.Dev<const int32_t>(cr_.fetch_tokens), rows_cap_,
                                        lp.Dev<const int32_t>(cr_.fetch_count), &fp.shape);
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

void HashTopKCall::FillScratchTables(LaunchPlan& lp) {
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

void HashTopKCall::Stats(const LaunchPlan& lp, int32_t b, int32_t j, HeadStats* hs) const {
  const int32_t* st = lp.host_stats();
  const int32_t BH = lp.BH, i = b * lp.hkv + j;
  const uint64_t n = static_cast<uint64_t>(lp.len(b));
  const uint64_t fetched = static_cast<uint64_t>(st[i]);  // the union's rows
  const uint64_t hits = static_cast<uint64_t>(st[3 * BH + i]);
  for (int32_t g = 0; g < lp.G; ++g) {
    hs->rows_selected += static_cast<uint64_t>(st[BH + b * lp.H + j * lp.G + g]);
    hs->budgets.push_back(static_cast<uint64_t>(st[2 * BH + b * lp.H + j * lp.G + g]));
  }
  hs->rows_fetched = fetched;
  hs->rows_cached = hits;
  hs->bytes[kDeviceTier] += n * lp.words * 4 + hits * 2 * lp.row;
  hs->bytes[lp.k_tier()] += (fetched - hits) * lp.row;
  hs->bytes[lp.v_tier()] += (fetched - hits) * lp.row;
}

}  // namespace

const GpuRunner& HashTopKRunner() {
  static const RunnerOf<HashTopKCall> runner;
  return runner;
}

}  // namespace kvsparse::engine::gpu
