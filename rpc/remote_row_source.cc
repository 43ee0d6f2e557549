#include "rpc/remote_row_source.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kvsparse/v1/kvstore.grpc.pb.h"
#include "kvstore/shared_arena.h"
#include "rpc/convert.h"
#include "rpc/data_plane.h"
#include "rpc/logging.h"
#include "rpc/request_size.h"
#include "rpc/security.h"
#include "rpc/status.h"

namespace kvsparse::rpc {
namespace {

// Page-table entries held for all sequences together; past this the tables are dropped and
// fetched again as needed (16 bytes each: 64 MiB).
constexpr size_t kMaxCachedPages = size_t{4} << 20;

// One layer's pages as last fetched, from page 0 on. Immutable once published.
struct LayerTable {
  uint64_t arena_id = 0;
  uint64_t incarnation = 0;
  uint64_t layer_length = 0;
  uint32_t page_tokens = 0;
  uint64_t page_bytes = 0;
  uint64_t row_bytes = 0;
  std::vector<std::vector<kvstore::PageRef>> lanes;
  size_t pages() const { return lanes.empty() ? 0 : lanes[0].size(); }
  size_t entries() const { return pages() * lanes.size(); }  // counted against kMaxCachedPages
};

// What this worker knows of one sequence of the store.
struct SequenceState {
  uint64_t incarnation = 0;             // 0: not known yet
  std::vector<uint64_t> known_lengths;  // per layer, from Describe and this worker's Appends
  std::vector<std::shared_ptr<const LayerTable>> layers;

  size_t entries() const {
    size_t n = 0;
    for (const auto& l : layers) n += l != nullptr ? l->entries() : 0;
    return n;
  }
  // Room for `n` layers.
  void Grow(size_t n) {
    if (layers.size() < n) layers.resize(n);
    if (known_lengths.size() < n) known_lengths.resize(n, 0);
  }
};

class RemoteRowSourceImpl final : public RemoteRowSource {
 public:
  RemoteRowSourceImpl(std::shared_ptr<grpc::Channel> channel, RemoteRowSourceOptions options)
      : channel_(channel), stub_(v1::KvStore::NewStub(channel)), token_(std::move(options.token)) {
    // The plane: UCX when asked for and it starts, else the mapped arena file when given.
    absl::StatusOr<StoreDataPlane> kind = ParseStoreDataPlane(options.data_plane);
    if (!kind.ok()) {
      KVSPARSE_LOG(Warning) << kind.status().message() << "; rows travel through Gather";
    } else if (*kind != StoreDataPlane::kGather) {
      absl::StatusOr<std::unique_ptr<DataPlane>> p =
          NewUcxPlane(options.data_plane_transports, *kind == StoreDataPlane::kUcxRma);
      if (p.ok()) {
        plane_ = std::move(*p);
      } else {
        KVSPARSE_LOG(Warning) << "--store_data_plane=ucx: " << p.status().message()
                              << "; rows travel through Gather";
      }
    }
    if (plane_ == nullptr && !options.arena_file.empty()) {
      plane_ = NewMappedFilePlane(std::move(options.arena_file));
    }
  }

  // Whether rows are read without Gather when possible (a data plane).
  bool direct() const { return plane_ != nullptr; }

  kvstore::Tier tier() const override { return kvstore::Tier::kRemote; }

  absl::StatusOr<engine::SequenceDesc> Describe(absl::string_view id,
                                                absl::Time deadline) override {
    grpc::ClientContext ctx;
    Prepare(&ctx, deadline);
    v1::GetSequenceInfoRequest req;
    req.set_sequence_id(std::string(id));
    v1::SequenceInfo info;
    if (absl::Status s = Remote(stub_->GetSequenceInfo(&ctx, req, &info)); !s.ok()) return s;
    engine::SequenceDesc d;
    d.sequence_id = info.sequence_id();
    absl::StatusOr<kvstore::ModelShape> shape = FromProto(info.shape());
    if (!shape.ok()) return shape.status();
    absl::StatusOr<kvstore::Placement> placement = FromProto(info.placement());
    if (!placement.ok()) return placement.status();
    d.shape = *shape;
    d.placement = *placement;
    d.layer_lengths.assign(info.layer_lengths().begin(), info.layer_lengths().end());
    d.incarnation = info.incarnation();
    if (d.layer_lengths.size() != d.shape.num_layers) {
      return absl::DataLossError("store returned lengths for a different number of layers");
    }
    if (direct()) Learn(d.sequence_id, d.incarnation, d.layer_lengths);
    return d;
  }

  absl::Status Append(absl::string_view id, const kvstore::ModelShape& shape, uint32_t layer,
                      uint64_t expected_length, uint64_t num_tokens, absl::Span<const uint8_t> k,
                      absl::Span<const uint8_t> v, absl::Time deadline) override {
    grpc::ClientContext ctx;
    Prepare(&ctx, deadline);
    v1::AppendRequest req;
    req.set_sequence_id(std::string(id));
    req.set_first_layer(layer);
    req.set_num_layers(1);
    req.set_expected_length(expected_length);
    for (auto [t, data] : {std::pair{req.mutable_k(), k}, std::pair{req.mutable_v(), v}}) {
      t->set_dtype(ToProto(shape.dtype));
      for (int64_t dim :
           {int64_t{1}, static_cast<int64_t>(num_tokens), static_cast<int64_t>(shape.num_kv_heads),
            static_cast<int64_t>(shape.head_dim)}) {
        t->add_shape(dim);
      }
      t->set_data(data.data(), data.size());
    }
    ctx.AddMetadata(kRequestBytesHeader, std::to_string(req.ByteSizeLong()));  // the budget's share
    v1::AppendResponse resp;
    absl::Status s = Remote(stub_->Append(&ctx, req, &resp));
    if (s.ok() && direct()) {
      absl::MutexLock lock(&mu_);
      auto it = seqs_.find(id);
      if (it != seqs_.end() && layer < it->second.known_lengths.size()) {
        uint64_t& known = it->second.known_lengths[layer];
        known = std::max(known, expected_length + num_tokens);
      }
    }
    return s;
  }

  absl::StatusOr<uint64_t> Gather(absl::string_view id, uint32_t layer, kvstore::RowKind kind,
                                  absl::Span<const engine::RowRequest> heads, uint8_t* k_out,
                                  uint8_t* v_out, absl::Time deadline) override {
    size_t rows = 0;
    for (const engine::RowRequest& h : heads) rows += h.tokens.size();
    if (direct() && rows > 0) {  // no rows: the RPC answers the layer's length
      absl::StatusOr<std::optional<uint64_t>> r =
          GatherInPlace(id, layer, kind, heads, k_out, v_out, deadline);
      if (!r.ok()) return r.status();
      if (r->has_value()) return **r;
      fallbacks_.fetch_add(1, std::memory_order_relaxed);
    }
    return GatherRpc(id, layer, kind, heads, k_out, v_out, deadline);
  }

  bool reachable() const override {
    const grpc_connectivity_state state = channel_->GetState(/*try_to_connect=*/false);
    return state == GRPC_CHANNEL_READY || state == GRPC_CHANNEL_IDLE;
  }

  InPlaceStats in_place_stats() const override {
    InPlaceStats s;
    s.rows = rows_.load(std::memory_order_relaxed);
    s.bytes = bytes_.load(std::memory_order_relaxed);
    s.fallbacks = fallbacks_.load(std::memory_order_relaxed);
    s.page_table_calls = page_table_calls_.load(std::memory_order_relaxed);
    return s;
  }

 private:
  absl::StatusOr<uint64_t> GatherRpc(absl::string_view id, uint32_t layer, kvstore::RowKind kind,
                                     absl::Span<const engine::RowRequest> heads, uint8_t* k_out,
                                     uint8_t* v_out, absl::Time deadline) {
    grpc::ClientContext ctx;
    Prepare(&ctx, deadline);
    v1::GatherRequest req;
    req.set_sequence_id(std::string(id));
    req.set_layer(layer);
    req.set_kind(kind == kvstore::RowKind::kK   ? v1::ROW_KIND_K
                 : kind == kvstore::RowKind::kV ? v1::ROW_KIND_V
                                                : v1::ROW_KIND_KV);
    size_t rows = 0;
    for (const engine::RowRequest& h : heads) {
      v1::HeadSelection* sel = req.add_heads();
      sel->set_kv_head(h.kv_head);
      sel->mutable_token_indices()->Add(h.tokens.begin(), h.tokens.end());
      rows += h.tokens.size();
    }
    v1::GatherResponse resp;
    if (absl::Status s = Remote(stub_->Gather(&ctx, req, &resp)); !s.ok()) return s;
    const bool want_k = kind != kvstore::RowKind::kV;
    const bool want_v = kind != kvstore::RowKind::kK;
    const size_t per =
        rows > 0 ? (want_k ? resp.k().data().size() : resp.v().data().size()) / rows : 0;
    if ((want_k && resp.k().data().size() != rows * per) ||
        (want_v && resp.v().data().size() != rows * per)) {
      return absl::DataLossError("store returned a gather of the wrong size");
    }
    if (want_k) std::memcpy(k_out, resp.k().data().data(), resp.k().data().size());
    if (want_v) std::memcpy(v_out, resp.v().data().data(), resp.v().data().size());
    return resp.layer_length();
  }

  // Rows copied from the mapped arena: the layer's length, or nullopt when this read must go
  // through Gather (no usable mapping, or a page freed while it was read).
  absl::StatusOr<std::optional<uint64_t>> GatherInPlace(absl::string_view id, uint32_t layer,
                                                        kvstore::RowKind kind,
                                                        absl::Span<const engine::RowRequest> heads,
                                                        uint8_t* k_out, uint8_t* v_out,
                                                        absl::Time deadline) {
    std::shared_ptr<const kvstore::ArenaReader> map = Reader(deadline);
    if (map == nullptr) return std::nullopt;
    uint32_t max_token = 0;
    uint32_t max_head = 0;
    for (const engine::RowRequest& h : heads) {
      max_head = std::max(max_head, h.kv_head);
      for (uint32_t t : h.tokens) max_token = std::max(max_token, t);
    }
    std::shared_ptr<const LayerTable> table;
    uint64_t known = 0;  // the layer's length as Describe / Append saw it, for known_incarnation
    uint64_t known_incarnation = 0;
    {
      absl::MutexLock lock(&mu_);
      auto it = seqs_.find(id);
      if (it != seqs_.end() && layer < it->second.layers.size()) {
        table = it->second.layers[layer];
        known = it->second.known_lengths[layer];
        known_incarnation = it->second.incarnation;
      }
    }
    // Rows below this are written (a length of another incarnation says nothing of this one).
    auto length = [&](const LayerTable& t) {
      return t.incarnation == known_incarnation ? std::max(known, t.layer_length) : t.layer_length;
    };
    auto covers = [&](const LayerTable& t) {
      return max_token < length(t) && max_token / t.page_tokens < t.pages();
    };
    if (table == nullptr || !covers(*table)) {
      absl::StatusOr<std::shared_ptr<const LayerTable>> fresh = Refresh(id, layer, table, deadline);
      if (!fresh.ok()) {
        // A store without an arena file: every read through Gather from now on.
        if (fresh.status().code() == absl::StatusCode::kFailedPrecondition) return std::nullopt;
        return fresh.status();
      }
      table = *fresh;
      if (max_token >= length(*table)) {
        return absl::OutOfRangeError(absl::StrCat("token ", max_token, " at or past layer ", layer,
                                                  "'s length ", length(*table)));
      }
      if (!covers(*table)) return absl::DataLossError("store returned too few pages");
    }
    if (table->arena_id != map->arena_id()) {
      map = Remap(map, table->arena_id, deadline);
      if (map == nullptr) return std::nullopt;
    }
    if (max_head >= table->lanes.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("kv head ", max_head, " out of range (", table->lanes.size(), " heads)"));
    }
    // A page outside the mapped file would be a store bug or a corrupt table: never read it.
    for (const engine::RowRequest& h : heads) {
      const std::vector<kvstore::PageRef>& lane = table->lanes[h.kv_head];
      for (uint32_t t : h.tokens) {
        if (!map->HoldsPage(lane[t / table->page_tokens].offset, table->page_bytes)) {
          return absl::DataLossError("store returned a page outside its arena file");
        }
      }
    }
    const bool want_k = kind != kvstore::RowKind::kV;
    const bool want_v = kind != kvstore::RowKind::kK;
    std::vector<kvstore::LaneRead> lanes;
    lanes.reserve(heads.size());
    size_t row = 0;
    for (const engine::RowRequest& h : heads) {
      lanes.push_back({table->lanes[h.kv_head], h.tokens,
                       want_k ? k_out + row * table->row_bytes : nullptr,
                       want_v ? v_out + row * table->row_bytes : nullptr});
      row += h.tokens.size();
    }
    absl::StatusOr<bool> read =
        map->Read(lanes, table->page_tokens, table->row_bytes, kind, deadline);
    if (!read.ok()) {
      // The data plane failed (the store went away, a timeout): read through Gather, which
      // answers for the store as it is, and connect again later.
      int64_t dropped = 0;
      if (read_log_.ShouldLog(&dropped)) {
        KVSPARSE_LOG(Warning) << map->name() << ": " << read.status().message()
                              << "; reading through Gather";
      }
      Drop(map);
      return std::nullopt;
    }
    if (!*read) {
      Forget(id);  // its pages were freed: the sequence is gone or made again
      return std::nullopt;
    }
    const uint64_t copies = row * ((want_k ? 1 : 0) + (want_v ? 1 : 0));
    rows_.fetch_add(copies, std::memory_order_relaxed);
    bytes_.fetch_add(copies * table->row_bytes, std::memory_order_relaxed);
    return length(*table);
  }

  // Extends (or, for a new incarnation or arena, replaces) the layer's table from the store and
  // publishes it. Its offsets are checked against the mapping where they are used.
  absl::StatusOr<std::shared_ptr<const LayerTable>> Refresh(absl::string_view id, uint32_t layer,
                                                            std::shared_ptr<const LayerTable> old,
                                                            absl::Time deadline) {
    for (int attempt = 0; attempt < 2; ++attempt) {
      const uint64_t first = old != nullptr ? old->pages() : 0;
      grpc::ClientContext ctx;
      Prepare(&ctx, deadline);
      v1::GetPageTableRequest req;
      req.set_sequence_id(std::string(id));
      req.set_layer(layer);
      req.set_first_page(first);
      v1::PageTable resp;
      page_table_calls_.fetch_add(1, std::memory_order_relaxed);
      if (absl::Status s = Remote(stub_->GetPageTable(&ctx, req, &resp)); !s.ok()) return s;
      if (old != nullptr &&
          (resp.incarnation() != old->incarnation || resp.arena_id() != old->arena_id)) {
        old = nullptr;  // dropped and created again, or a new store: the whole table anew
        continue;
      }
      auto t = std::make_shared<LayerTable>();
      if (old != nullptr) *t = *old;
      t->arena_id = resp.arena_id();
      t->incarnation = resp.incarnation();
      t->layer_length = resp.layer_length();
      t->page_tokens = resp.page_tokens();
      t->page_bytes = resp.page_bytes();
      t->row_bytes = resp.row_bytes();
      if (t->page_tokens == 0 || t->row_bytes == 0 ||
          uint64_t{2} * t->row_bytes * t->page_tokens > t->page_bytes ||
          (old != nullptr && static_cast<size_t>(resp.lanes_size()) != old->lanes.size())) {
        return absl::DataLossError("store returned an inconsistent page table");
      }
      t->lanes.resize(resp.lanes_size());
      for (int h = 0; h < resp.lanes_size(); ++h) {
        const v1::PageTable::Lane& lane = resp.lanes(h);
        if (lane.offsets_size() != lane.generations_size() ||
            lane.offsets_size() != resp.lanes(0).offsets_size()) {
          return absl::DataLossError("store returned an inconsistent page table");
        }
        for (int i = 0; i < lane.offsets_size(); ++i) {
          t->lanes[h].push_back({lane.offsets(i), lane.generations(i)});
        }
      }
      // Fault the new pages in now, not row by row during the reads (offsets checked first).
      if (std::shared_ptr<const kvstore::ArenaReader> map = Current();
          map != nullptr && map->arena_id() == t->arena_id) {
        for (const std::vector<kvstore::PageRef>& lane : t->lanes) {
          auto fresh = absl::MakeConstSpan(lane).subspan(std::min<size_t>(first, lane.size()));
          bool inside = true;
          for (const kvstore::PageRef& p : fresh) inside &= map->HoldsPage(p.offset, t->page_bytes);
          if (inside) map->Prefault(fresh, t->page_bytes);
        }
      }
      Publish(id, layer, t);
      return std::shared_ptr<const LayerTable>(std::move(t));
    }
    return absl::AbortedError("sequence re-created twice while its page table was read");
  }

  void Learn(absl::string_view id, uint64_t incarnation, const std::vector<uint64_t>& lengths) {
    absl::MutexLock lock(&mu_);
    SequenceState& s = seqs_[id];
    if (s.incarnation != incarnation) {
      ResetSequenceLocked(s, incarnation);
      s.Grow(lengths.size());
    }
    for (size_t l = 0; l < lengths.size() && l < s.known_lengths.size(); ++l) {
      s.known_lengths[l] = std::max(s.known_lengths[l], lengths[l]);
    }
  }

  void Publish(absl::string_view id, uint32_t layer, std::shared_ptr<const LayerTable> t) {
    absl::MutexLock lock(&mu_);
    SequenceState* s = &seqs_[id];
    // Known only from this table (no Describe yet, or one of another incarnation).
    if (s->incarnation != t->incarnation) ResetSequenceLocked(*s, t->incarnation);
    s->Grow(layer + 1);
    if (s->layers[layer] != nullptr) cached_pages_ -= s->layers[layer]->entries();
    s->layers[layer] = nullptr;
    if (cached_pages_ + t->entries() > kMaxCachedPages) {
      seqs_.clear();  // bounded memory: start over (the tables are fetched again as needed)
      cached_pages_ = 0;
      s = &seqs_[id];
      s->incarnation = t->incarnation;
      s->Grow(layer + 1);
    }
    cached_pages_ += t->entries();
    s->layers[layer] = std::move(t);
  }

  // Forgets what the sequence's state counted and starts it over for `incarnation`.
  void ResetSequenceLocked(SequenceState& s, uint64_t incarnation)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    cached_pages_ -= s.entries();
    s = SequenceState{};
    s.incarnation = incarnation;
  }

  void Forget(absl::string_view id) {
    absl::MutexLock lock(&mu_);
    auto it = seqs_.find(id);
    if (it == seqs_.end()) return;
    cached_pages_ -= it->second.entries();
    seqs_.erase(it);
  }

  // The reader in use, if any (no opening).
  std::shared_ptr<const kvstore::ArenaReader> Current() {
    absl::MutexLock lock(&mu_);
    return reader_;
  }

  // The current reader of the store's arena (a mapping of --store_arena_file, or a UCX
  // connection), opened at first use; null while there is none (an open is tried at most once a
  // second, without holding mu_).
  std::shared_ptr<const kvstore::ArenaReader> Reader(absl::Time deadline) {
    {
      absl::MutexLock lock(&mu_);
      const absl::Time now = absl::Now();
      if (reader_ != nullptr) {
        // Once a second: is it still the store's arena (a restarted store makes a new file; a
        // failed UCX endpoint)? If not, let it go and open anew.
        if (now < next_check_) return reader_;
        next_check_ = now + absl::Seconds(1);
        if (reader_->IsCurrent()) return reader_;
        KVSPARSE_LOG(Info) << reader_->name() << " is stale (the store restarted?): opening anew";
        ResetLocked();
      }
      if (now < next_open_) return nullptr;
      next_open_ = now + absl::Seconds(1);
    }
    absl::StatusOr<std::shared_ptr<const kvstore::ArenaReader>> r = Open(deadline);
    absl::MutexLock lock(&mu_);
    if (!r.ok()) {
      int64_t dropped = 0;
      if (open_log_.ShouldLog(&dropped)) {
        KVSPARSE_LOG(Warning) << plane_->name() << ": " << r.status().message()
                              << "; reading rows through Gather until it can be opened";
      }
      return nullptr;
    }
    KVSPARSE_LOG(Info) << "reading the store's rows without Gather: " << (*r)->name();
    reader_ = std::move(*r);
    next_check_ = absl::Now() + absl::Seconds(1);
    return reader_;
  }

  absl::StatusOr<std::shared_ptr<const kvstore::ArenaReader>> Open(absl::Time deadline) {
    return plane_->Open(
        *stub_, [&](grpc::ClientContext* ctx) { Prepare(ctx, deadline); }, deadline);
  }

  // The store made a new arena (it restarted): open again. Null when what opens is still not the
  // arena the store's page tables name.
  std::shared_ptr<const kvstore::ArenaReader> Remap(
      const std::shared_ptr<const kvstore::ArenaReader>& stale, uint64_t want_id,
      absl::Time deadline) {
    Drop(stale);
    std::shared_ptr<const kvstore::ArenaReader> m = Reader(deadline);
    return m != nullptr && m->arena_id() == want_id ? m : nullptr;
  }

  // Stops using `stale` (if still in use) and forgets every table (offsets of another arena mean
  // nothing); the next read opens anew.
  void Drop(const std::shared_ptr<const kvstore::ArenaReader>& stale) {
    absl::MutexLock lock(&mu_);
    if (reader_ == stale) ResetLocked();
  }

  void ResetLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    reader_ = nullptr;
    next_open_ = absl::InfinitePast();
    seqs_.clear();
    cached_pages_ = 0;
  }

  void Prepare(grpc::ClientContext* ctx, absl::Time deadline) const {
    ctx->set_deadline(absl::ToChronoTime(deadline));
    if (!token_.empty()) ctx->AddMetadata(kAuthMetadataKey, absl::StrCat(kBearerPrefix, token_));
  }
  // A store-side failure keeps its code; an unreachable store says so; a store that refuses
  // this worker's credentials is the deployment's fault, not the caller's (INTERNAL, logged).
  static absl::Status Remote(const grpc::Status& s) {
    absl::Status st = FromGrpcStatus(s);
    if (st.code() == absl::StatusCode::kUnavailable) {
      return absl::UnavailableError(absl::StrCat("store unavailable: ", st.message()));
    }
    if (st.code() == absl::StatusCode::kUnauthenticated ||
        st.code() == absl::StatusCode::kPermissionDenied) {
      return absl::InternalError(absl::StrCat(
          "the store refused this worker (--store_token_file, --store_tls_*): ", st.message()));
    }
    return st;
  }

  const std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KvStore::Stub> stub_;
  const std::string token_;
  std::unique_ptr<DataPlane> plane_;  // null: every read through Gather

  absl::Mutex mu_;
  std::shared_ptr<const kvstore::ArenaReader> reader_ ABSL_GUARDED_BY(mu_);
  absl::Time next_open_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Time next_check_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::flat_hash_map<std::string, SequenceState> seqs_ ABSL_GUARDED_BY(mu_);
  size_t cached_pages_ ABSL_GUARDED_BY(mu_) = 0;
  LogEvery open_log_{absl::Seconds(30)};
  LogEvery read_log_{absl::Seconds(30)};

  std::atomic<uint64_t> rows_{0};
  std::atomic<uint64_t> bytes_{0};
  std::atomic<uint64_t> fallbacks_{0};
  std::atomic<uint64_t> page_table_calls_{0};
};

}  // namespace

std::unique_ptr<RemoteRowSource> NewRemoteRowSource(std::shared_ptr<grpc::Channel> channel,
                                                    RemoteRowSourceOptions options) {
  return std::make_unique<RemoteRowSourceImpl>(std::move(channel), std::move(options));
}

}  // namespace kvsparse::rpc
