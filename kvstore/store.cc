#include "kvstore/store.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace kvsparse::kvstore {

// One sequence's pages and lengths. Internal to the store.
class Sequence {
 public:
  // What a sequence of this shape costs before its first token: the object, its id, a length
  // per layer and a page list per (layer, kv head) lane. Charged to the store's capacity (the
  // pool) from creation to destruction: a wide shape's bookkeeping is memory a client makes the
  // store hold.
  static size_t BookkeepingBytes(const ModelShape& shape, size_t id_bytes) {
    return sizeof(Sequence) + id_bytes + shape.num_layers * sizeof(uint64_t) +
           static_cast<size_t>(shape.num_layers) * shape.num_kv_heads *
               sizeof(std::vector<uint8_t*>);
  }

  // What a fork holds beside its bookkeeping: a page pointer per page of each lane, and an entry in
  // its set of shared pages per page it shares (an entry in the source's set too, charged to the
  // source: SharedEntryBytes).
  static size_t ForkBytes(uint64_t pages, uint64_t shared_pages) {
    return pages * sizeof(uint8_t*) + shared_pages * SharedEntryBytes();
  }
  static constexpr size_t SharedEntryBytes() { return 2 * sizeof(uint8_t*); }

  // REQUIRES: bookkeeping_bytes charged to the pool (given back by the destructor).
  Sequence(std::string id, const ModelShape& shape, const Placement& placement, size_t page_bytes,
           PagePool* pool, size_t bookkeeping_bytes)
      : id_(std::move(id)),
        shape_(shape),
        placement_(placement),
        row_bytes_(shape.row_bytes()),
        slot_bytes_(2 * row_bytes_),
        page_tokens_(page_bytes / slot_bytes_),
        pool_(pool),
        bookkeeping_bytes_(bookkeeping_bytes),
        lengths_(shape.num_layers, 0),
        lanes_(static_cast<size_t>(shape.num_layers) * shape.num_kv_heads) {}

  ~Sequence() {
    std::vector<uint8_t*> all;
    for (auto& lane : lanes_) all.insert(all.end(), lane.begin(), lane.end());
    pool_->Free(all);
    pool_->Uncharge(bookkeeping_bytes_.load());
  }

  Sequence(const Sequence&) = delete;
  Sequence& operator=(const Sequence&) = delete;

  uint64_t PagesFor(uint64_t tokens) const { return (tokens + page_tokens_ - 1) / page_tokens_; }
  size_t Lane(uint32_t layer, uint32_t kv_head) const {
    return static_cast<size_t>(layer) * shape_.num_kv_heads + kv_head;
  }
  // Start of token t's K row (its V row follows). REQUIRES: mu_ held; t < pages * page_tokens_.
  uint8_t* Slot(const std::vector<uint8_t*>& lane, uint64_t t) const {
    return lane[t / page_tokens_] + (t % page_tokens_) * slot_bytes_;
  }

  SequenceInfo Info(size_t page_bytes) const {
    std::shared_lock<std::shared_mutex> lock(mu_);
    SequenceInfo info;
    info.sequence_id = id_;
    info.shape = shape_;
    info.placement = placement_;
    info.layer_lengths = lengths_;
    info.bytes_used = bytes_held(page_bytes);
    info.page_tokens = static_cast<uint32_t>(page_tokens_);
    info.incarnation = incarnation_;
    return info;
  }

  const std::string id_;
  const ModelShape shape_;
  const Placement placement_;
  const size_t row_bytes_;
  const size_t slot_bytes_;
  const size_t page_tokens_;
  PagePool* const pool_;
  // Charged to the pool for this sequence (grows as forks share its pages: shared_).
  std::atomic<size_t> bookkeeping_bytes_;

  // Pages and bookkeeping: what dropping it gives back.
  uint64_t bytes_held(size_t page_bytes) const {
    return pages_held_.load() * page_bytes + bookkeeping_bytes_;
  }

  mutable std::shared_mutex mu_;
  std::vector<uint64_t> lengths_ ABSL_GUARDED_BY(mu_);  // [num_layers]
  // [num_layers * num_kv_heads] page lists. Written under mu_ (writer); pages never move.
  std::vector<std::vector<uint8_t*>> lanes_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> pages_held_{0};
  uint64_t incarnation_ = 0;  // set once at creation, before the sequence is shared

  // Guarded by Store::mu_ (the store's map lock).
  int32_t pins_ = 0;
  uint64_t last_access_ = 0;
  // The pages it holds that a fork shared with another sequence (some may be its alone again
  // once the others let them go); every one also in lanes_. Only grows; each entry charged.
  absl::flat_hash_set<const uint8_t*> shared_;
};

// Keeps a sequence from eviction (and its pages alive) while a call uses it.
class Store::Pin {
 public:
  Pin(Store* store, std::shared_ptr<Sequence> seq) : store_(store), seq_(std::move(seq)) {}
  Pin(Pin&& other) noexcept : store_(other.store_), seq_(std::move(other.seq_)) {}
  Pin& operator=(Pin&&) = delete;
  ~Pin() {
    if (seq_ == nullptr) return;
    std::lock_guard<std::mutex> lock(store_->mu_);
    --seq_->pins_;
    seq_.reset();  // may free a dropped sequence's pages (lock order Store -> PagePool)
  }
  Sequence& operator*() const { return *seq_; }
  Sequence* operator->() const { return seq_.get(); }

 private:
  Store* store_;
  std::shared_ptr<Sequence> seq_;
};

absl::StatusOr<std::unique_ptr<Store>> Store::Create(StoreOptions options) {
  if (options.page_bytes < 4096 || options.page_bytes % 4096 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_bytes must be a multiple of 4096, got ", options.page_bytes));
  }
  // One token of the widest allowed row (fp32, kMaxHeadDim) must fit in a page.
  if (options.page_bytes < 2 * kMaxHeadDim * 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_bytes must be at least ", 2 * kMaxHeadDim * 4));
  }
  if (options.capacity_bytes < options.page_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("capacity_bytes ", options.capacity_bytes,
                                                   " is below one page of ", options.page_bytes));
  }
  if (options.shard.count == 0 || options.shard.index >= options.shard.count) {
    return absl::InvalidArgumentError(absl::StrCat("shard index ", options.shard.index,
                                                   " is not below the shard count ",
                                                   options.shard.count));
  }
  if (options.slab_bytes < options.page_bytes) options.slab_bytes = options.page_bytes;
  if (options.max_tokens_per_layer == 0 || options.max_tokens_per_layer > (1ull << 32)) {
    return absl::InvalidArgumentError("max_tokens_per_layer must be in 1..2^32");
  }
  if (options.memory != nullptr && options.memory->shared_arena() != nullptr &&
      options.page_bytes % options.memory->shared_arena()->granule() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "page_bytes ", options.page_bytes, " is not a multiple of the arena file's granule ",
        options.memory->shared_arena()->granule()));
  }
  std::unique_ptr<MemoryResource> owned;
  if (options.memory == nullptr) {
    owned = NewHostMemoryResource();
    options.memory = owned.get();
  }
  return std::unique_ptr<Store>(new Store(options, std::move(owned)));
}

Store::Store(StoreOptions options, std::unique_ptr<MemoryResource> owned_memory)
    : options_(options),
      owned_memory_(std::move(owned_memory)),
      pool_(options.memory,
            PagePoolOptions{options.page_bytes, options.slab_bytes, options.capacity_bytes}),
      appenders_(std::make_unique<WorkerPool>(std::max(0, options.append_helpers))),
      next_incarnation_(static_cast<uint64_t>(absl::ToUnixMicros(absl::Now()))) {}

Store::~Store() {
  std::lock_guard<std::mutex> lock(mu_);
  sequences_.clear();  // frees pages before pool_ is destroyed
}

absl::Status Store::CheckNewId(absl::string_view sequence_id) const {
  if (absl::Status s = ValidateSequenceId(sequence_id); !s.ok()) return s;
  if (!options_.shard.Holds(sequence_id)) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence '", sequence_id, "' belongs to store shard ",
                     ShardOf(sequence_id, options_.shard.count), " of ", options_.shard.count,
                     "; this is shard ", options_.shard.index,
                     " (the caller's list of store shards differs from the fleet's)"));
  }
  return absl::OkStatus();
}

absl::Status Store::Insert(const std::shared_ptr<Sequence>& seq) {
  std::lock_guard<std::mutex> lock(mu_);
  if (options_.max_sequences != 0 && sequences_.size() >= options_.max_sequences &&
      !sequences_.contains(seq->id_)) {
    return absl::ResourceExhaustedError(absl::StrCat("the store holds ", sequences_.size(),
                                                     " sequences, its most (--max_sequences)"));
  }
  auto [it, inserted] = sequences_.try_emplace(seq->id_, seq);
  if (!inserted) {
    return absl::AlreadyExistsError(absl::StrCat("sequence '", seq->id_, "' already exists"));
  }
  seq->last_access_ = ++tick_;
  return absl::OkStatus();
}

absl::StatusOr<SequenceInfo> Store::CreateSequence(absl::string_view sequence_id,
                                                   const ModelShape& shape,
                                                   const Placement& placement) {
  if (absl::Status s = CheckNewId(sequence_id); !s.ok()) return s;
  if (absl::Status s = ValidateModelShape(shape); !s.ok()) return s;
  if (absl::Status s = ValidatePlacement(placement, shape); !s.ok()) return s;
  // The sequence's bookkeeping is charged before it exists (evicting idle sequences if the
  // policy allows, as an append's pages are); the sequence gives it back when destroyed.
  const size_t bookkeeping = Sequence::BookkeepingBytes(shape, sequence_id.size());
  if (absl::Status charged =
          TakeRoom(0, bookkeeping, nullptr, [&] { return pool_.Charge(bookkeeping); });
      !charged.ok()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "a sequence of ", shape.num_layers, " layers x ", shape.num_kv_heads, " kv heads holds ",
        bookkeeping, " bytes before its first token: ", charged.message()));
  }
  auto seq = std::make_shared<Sequence>(std::string(sequence_id), shape, placement,
                                        options_.page_bytes, &pool_, bookkeeping);
  seq->incarnation_ = next_incarnation_.fetch_add(1) + 1;
  if (absl::Status s = Insert(seq); !s.ok()) return s;
  return InfoOf(*seq);
}

absl::StatusOr<SequenceInfo> Store::ForkSequence(absl::string_view source_id,
                                                 absl::string_view sequence_id, uint64_t num_tokens,
                                                 std::optional<Placement> placement) {
  if (absl::Status s = CheckNewId(sequence_id); !s.ok()) return s;
  if (num_tokens == 0) {
    return absl::InvalidArgumentError("a fork of zero tokens: create the sequence instead");
  }
  absl::StatusOr<Pin> pin = Acquire(source_id);
  if (!pin.ok()) return pin.status();
  Sequence& src = **pin;
  const ModelShape& shape = src.shape_;
  const Placement fork_placement = placement.value_or(src.placement_);
  if (absl::Status s = ValidatePlacement(fork_placement, shape); !s.ok()) return s;
  // Whole pages below num_tokens are shared (nobody writes them again: every holder's length is
  // past them); the page holding the boundary, if any, is copied, so each side appends into
  // pages of its own.
  const uint64_t full = num_tokens / src.page_tokens_;
  const uint64_t boundary_tokens = num_tokens % src.page_tokens_;
  const size_t lanes = src.lanes_.size();
  std::vector<uint8_t*> shared;          // [lane][page < full]
  std::vector<const uint8_t*> boundary;  // [lane]: the source's page holding the boundary
  {
    // The page lists read under the source's read lock (an append may grow them). What they point
    // to stays after it: the pin keeps the pages, and rows below the lengths never change.
    std::shared_lock<std::shared_mutex> lock(src.mu_);
    for (uint32_t l = 0; l < shape.num_layers; ++l) {
      if (src.lengths_[l] < num_tokens) {
        return absl::FailedPreconditionError(
            absl::StrCat("a fork of ", num_tokens, " tokens from '", source_id, "', whose layer ",
                         l, " holds ", src.lengths_[l]));
      }
    }
    shared.reserve(full * lanes);
    for (const auto& lane : src.lanes_) {
      shared.insert(shared.end(), lane.begin(), lane.begin() + full);
      if (boundary_tokens > 0) boundary.push_back(lane[full]);
    }
  }
  const size_t new_pages = boundary_tokens > 0 ? lanes : 0;
  // Charged now: the fork's bookkeeping and page pointers, and at most one entry per shared page
  // in the source's set (what the source's set does not grow by is given back below).
  const size_t bookkeeping = Sequence::BookkeepingBytes(shape, sequence_id.size()) +
                             Sequence::ForkBytes(shared.size() + new_pages, shared.size());
  const size_t source_growth = shared.size() * Sequence::SharedEntryBytes();
  std::vector<uint8_t*> pages;
  if (absl::Status got = TakeRoom(
          new_pages, bookkeeping + source_growth, &src,
          [&]() -> absl::Status {
            if (absl::Status charged = pool_.Charge(bookkeeping + source_growth); !charged.ok())
              return charged;
            absl::Status allocated = pool_.Allocate(new_pages, &pages);
            if (!allocated.ok()) pool_.Uncharge(bookkeeping + source_growth);
            return allocated;
          });
      !got.ok()) {
    return got;
  }
  pool_.Share(shared);
  auto fork = std::make_shared<Sequence>(std::string(sequence_id), shape, fork_placement,
                                         options_.page_bytes, &pool_, bookkeeping);
  fork->incarnation_ = next_incarnation_.fetch_add(1) + 1;
  {
    std::unique_lock<std::shared_mutex> fork_lock(fork->mu_);  // not shared yet: for the analysis
    for (size_t i = 0; i < lanes; ++i) {
      auto& lane = fork->lanes_[i];
      lane.assign(shared.begin() + i * full, shared.begin() + (i + 1) * full);
      if (boundary_tokens > 0) {
        lane.push_back(pages[i]);
        std::memcpy(pages[i], boundary[i], boundary_tokens * src.slot_bytes_);
      }
    }
    std::fill(fork->lengths_.begin(), fork->lengths_.end(), num_tokens);
    fork->pages_held_.store(shared.size() + new_pages);
  }
  {
    std::lock_guard<std::mutex> store_lock(mu_);
    fork->shared_.insert(shared.begin(), shared.end());
    const size_t before = src.shared_.size();
    src.shared_.insert(shared.begin(), shared.end());
    const size_t grown = (src.shared_.size() - before) * Sequence::SharedEntryBytes();
    src.bookkeeping_bytes_.fetch_add(grown);
    pool_.Uncharge(source_growth - grown);
  }
  // On a refusal the fork is destroyed here: its pages and charge go back, the shared pages
  // keep their other holders.
  if (absl::Status s = Insert(fork); !s.ok()) return s;
  return InfoOf(*fork);
}

absl::StatusOr<uint64_t> Store::DropSequence(absl::string_view sequence_id) {
  std::shared_ptr<Sequence> seq;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sequences_.find(sequence_id);
    if (it == sequences_.end()) {
      return absl::NotFoundError(absl::StrCat("sequence '", sequence_id, "' not found"));
    }
    seq = std::move(it->second);
    sequences_.erase(it);
  }
  // Pages and bookkeeping go back when the last pin is released (here if none is held); pages
  // another sequence still shares stay with it.
  return seq->bytes_held(options_.page_bytes) - SharedPages(*seq) * options_.page_bytes;
}

SequenceInfo Store::InfoOf(const Sequence& seq) const {
  SequenceInfo info = seq.Info(options_.page_bytes);
  info.bytes_shared = SharedPages(seq) * options_.page_bytes;
  return info;
}

Store::Holding Store::HeldBy(absl::FunctionRef<bool(absl::string_view)> which) const {
  Holding h;
  absl::flat_hash_set<const uint8_t*> shared;  // each shared page once
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [id, seq] : sequences_) {
    if (!which(id)) continue;
    ++h.sequences;
    h.bytes += (seq->pages_held_.load() - seq->shared_.size()) * options_.page_bytes +
               seq->bookkeeping_bytes_.load();
    shared.insert(seq->shared_.begin(), seq->shared_.end());
  }
  h.bytes += shared.size() * options_.page_bytes;
  return h;
}

size_t Store::SharedPages(const Sequence& seq) const {
  std::lock_guard<std::mutex> lock(mu_);
  return seq.shared_.empty() ? 0 : pool_.SharedAmong(seq.shared_);
}

absl::StatusOr<Store::Pin> Store::Acquire(absl::string_view sequence_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(
        absl::StrCat("sequence '", sequence_id, "' not found (never created, dropped or evicted)"));
  }
  Sequence& seq = *it->second;
  ++seq.pins_;
  seq.last_access_ = ++tick_;
  return Pin(this, it->second);
}

absl::Status Store::MakeRoom(size_t pages, const Sequence* requester, size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (options_.policy == CapacityPolicy::kEvictLru && !pool_.Fits(pages, bytes)) {
    // Evict only when evicting every idle sequence would make room: a request larger than the
    // store, or than what the calls in flight leave of it, is refused with nobody evicted.
    // A page shared by forks goes back only if every holder of it is idle.
    uint64_t idle_pages = 0, idle_bytes = 0;
    absl::flat_hash_map<const uint8_t*, uint32_t> idle_holders;
    for (const auto& [id, seq] : sequences_) {
      if (seq->pins_ > 0 || seq.get() == requester) continue;
      idle_pages += seq->pages_held_.load() - seq->shared_.size();
      idle_bytes += seq->bookkeeping_bytes_.load();
      for (const uint8_t* p : seq->shared_) ++idle_holders[p];
    }
    idle_pages += pool_.PagesFreedBy(idle_holders);
    const uint64_t in_use = pool_.pages_in_use(), charged = pool_.charged_bytes();
    const uint64_t pages_after = in_use + pages - std::min<uint64_t>(idle_pages, in_use + pages);
    const uint64_t bytes_after = pages_after * options_.page_bytes + charged + bytes -
                                 std::min<uint64_t>(idle_bytes, charged + bytes);
    if (pages_after > pool_.capacity_pages() || bytes_after > options_.capacity_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "store full (policy evict-lru): ", pages * options_.page_bytes + bytes,
          " more bytes needed, more than evicting every idle sequence would free (",
          in_use * options_.page_bytes + charged, " of ", options_.capacity_bytes, " in use, ",
          idle_pages * options_.page_bytes + idle_bytes, " idle); nothing was evicted"));
    }
  }
  while (!pool_.Fits(pages, bytes)) {
    if (options_.policy == CapacityPolicy::kReject) {
      return absl::ResourceExhaustedError(
          absl::StrCat("store full (policy reject): ", pages * options_.page_bytes + bytes,
                       " more bytes needed; ",
                       pool_.pages_in_use() * options_.page_bytes + pool_.charged_bytes(), " of ",
                       options_.capacity_bytes, " in use"));
    }
    // Least recently used idle sequence other than the requester.
    auto victim = sequences_.end();
    for (auto it = sequences_.begin(); it != sequences_.end(); ++it) {
      const Sequence& s = *it->second;
      if (s.pins_ > 0 || &s == requester) continue;
      if (victim == sequences_.end() || s.last_access_ < victim->second->last_access_) victim = it;
    }
    if (victim == sequences_.end()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("store full (policy evict-lru): ", pages * options_.page_bytes + bytes,
                       " more bytes needed and every other sequence has a call in flight"));
    }
    sequences_.erase(victim);  // unpinned: this frees its pages now
    evictions_.fetch_add(1, std::memory_order_relaxed);
  }
  return absl::OkStatus();
}

absl::Status Store::TakeRoom(size_t pages, size_t bytes, const Sequence* requester,
                             absl::FunctionRef<absl::Status()> take) {
  absl::Status got;
  // Another call may take the room between MakeRoom and `take`: try a few times.
  for (int attempt = 0; attempt < 4; ++attempt) {
    got = MakeRoom(pages, requester, bytes);
    if (got.ok()) got = take();
    if (got.ok() || !absl::IsResourceExhausted(got)) break;
  }
  if (!got.ok()) rejections_.fetch_add(1, std::memory_order_relaxed);
  return got;
}

namespace {

// INVALID_ARGUMENT naming the first K or V value of an append that is not finite or not below
// 2^32 (kernels::AcceptedValues): the error path, so the slow scan is fine.
absl::Status UnacceptedValues(const AppendRequest& req, const ModelShape& shape) {
  const size_t n = req.k.size() / kernels::DTypeSize(shape.dtype);
  for (const auto& [what, bytes] : {std::pair{"k", req.k}, std::pair{"v", req.v}}) {
    const int64_t bad = kernels::FirstUnacceptedValue(bytes.data(), n, shape.dtype);
    if (bad < 0) continue;
    const uint64_t row = static_cast<uint64_t>(bad) / shape.head_dim;
    const uint64_t h = row % shape.num_kv_heads, t = row / shape.num_kv_heads % req.num_tokens;
    const uint64_t l = req.first_layer + row / shape.num_kv_heads / req.num_tokens;
    return absl::InvalidArgumentError(
        absl::StrCat(what, " holds a NaN, an infinity or a value of magnitude 2^32 or more (layer ",
                     l, ", token ", t, " of the append, kv head ", h, ", element ",
                     bad % shape.head_dim, "): kvsparse accepts finite values below 2^32"));
  }
  return absl::InvalidArgumentError("k or v holds a value kvsparse does not accept");
}

// The bytes of K (and of V) an append carries, once its layers, shape, length limit, size limit
// and payload sizes check out against the sequence's `shape` (nothing locked: these do not
// depend on the sequence's state).
absl::StatusOr<uint64_t> AppendBytes(const AppendRequest& req, const ModelShape& shape,
                                     size_t row_bytes, const StoreOptions& options) {
  if (static_cast<uint64_t>(req.first_layer) + req.num_layers > shape.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layers [", req.first_layer, ", ",
                                                   req.first_layer + req.num_layers,
                                                   ") outside the sequence's ", shape.num_layers));
  }
  if (req.dtype != shape.dtype || req.num_kv_heads != shape.num_kv_heads ||
      req.head_dim != shape.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "append of ", kernels::DTypeName(req.dtype), " rows for ", req.num_kv_heads,
        " kv heads of dim ", req.head_dim, " to a sequence of ", kernels::DTypeName(shape.dtype),
        " with ", shape.num_kv_heads, " kv heads of dim ", shape.head_dim));
  }
  if (req.num_tokens > options.max_tokens_per_layer) {
    return absl::OutOfRangeError(absl::StrCat("append of ", req.num_tokens,
                                              " tokens exceeds max_tokens_per_layer ",
                                              options.max_tokens_per_layer));
  }
  const uint64_t want = req.num_layers * req.num_tokens * shape.num_kv_heads * row_bytes;
  if (want > options.max_append_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "append of ", 2 * want, " bytes exceeds the limit of ", options.max_append_bytes));
  }
  if (req.k.size() != want || req.v.size() != want) {
    return absl::InvalidArgumentError(absl::StrCat(
        "k and v must hold [", req.num_layers, ", ", req.num_tokens, ", ", shape.num_kv_heads, ", ",
        shape.head_dim, "] ", kernels::DTypeName(shape.dtype), " = ", want, " bytes each; got ",
        req.k.size(), " and ", req.v.size()));
  }
  return want;
}

}  // namespace

absl::StatusOr<AppendResult> Store::Append(const AppendRequest& req) {
  if (req.num_tokens == 0) return absl::InvalidArgumentError("append of zero tokens");
  if (req.num_layers == 0) return absl::InvalidArgumentError("append to zero layers");
  absl::StatusOr<Pin> pin = Acquire(req.sequence_id);
  if (!pin.ok()) return pin.status();
  Sequence& seq = **pin;
  const ModelShape& shape = seq.shape_;
  absl::StatusOr<uint64_t> bytes = AppendBytes(req, shape, seq.row_bytes_, options_);
  if (!bytes.ok()) return bytes.status();
  const uint64_t want = *bytes;
  if (absl::Now() > req.deadline) return absl::DeadlineExceededError("deadline passed");

  std::unique_lock<std::shared_mutex> lock(seq.mu_);
  const uint64_t len0 = seq.lengths_[req.first_layer];
  for (uint32_t l = req.first_layer; l < req.first_layer + req.num_layers; ++l) {
    if (seq.lengths_[l] != len0) {
      return absl::FailedPreconditionError(
          absl::StrCat("layers ", req.first_layer, " and ", l, " hold ", len0, " and ",
                       seq.lengths_[l], " tokens; append to layers of equal length"));
    }
  }
  if (req.expected_length.has_value() && *req.expected_length != len0) {
    return absl::FailedPreconditionError(absl::StrCat("expected_length ", *req.expected_length,
                                                      " but the layers hold ", len0, " tokens"));
  }
  if (len0 + req.num_tokens > options_.max_tokens_per_layer) {
    return absl::OutOfRangeError(absl::StrCat(len0, " + ", req.num_tokens,
                                              " tokens exceeds max_tokens_per_layer ",
                                              options_.max_tokens_per_layer));
  }
  // Pages per lane of each layer still to add (a reservation may have added some already).
  std::vector<uint64_t> lane_pages(req.num_layers);
  size_t new_pages = 0;
  for (uint32_t li = 0; li < req.num_layers; ++li) {
    const uint64_t have = seq.lanes_[seq.Lane(req.first_layer + li, 0)].size();
    const uint64_t need = seq.PagesFor(len0 + req.num_tokens);
    lane_pages[li] = need > have ? need - have : 0;
    new_pages += lane_pages[li] * shape.num_kv_heads;
  }
  std::vector<uint8_t*> pages;
  // Under evict-lru making room can evict another sequence: a refused append must not, so its
  // values are checked in full first; otherwise each row is checked as it is copied, below.
  const bool checked_first = new_pages > 0 && options_.policy == CapacityPolicy::kEvictLru;
  if (new_pages > 0) {
    if (checked_first) {
      const size_t n = want / kernels::DTypeSize(shape.dtype);
      if (!kernels::AcceptedValues(req.k.data(), n, shape.dtype) ||
          !kernels::AcceptedValues(req.v.data(), n, shape.dtype)) {
        return UnacceptedValues(req, shape);
      }
    }
    if (absl::Status got =
            TakeRoom(new_pages, 0, &seq, [&] { return pool_.Allocate(new_pages, &pages); });
        !got.ok())
      return got;
  }
  size_t next_page = 0;
  for (uint32_t li = 0; li < req.num_layers; ++li) {
    for (uint32_t h = 0; h < shape.num_kv_heads; ++h) {
      auto& lane = seq.lanes_[seq.Lane(req.first_layer + li, h)];
      for (uint64_t p = 0; p < lane_pages[li]; ++p) lane.push_back(pages[next_page++]);
    }
  }
  // Copy the rows past the layers' lengths (invisible until the lengths move), checking each row
  // just before its copy (CopyRows).
  const bool accepted = CopyRows(req, seq, len0, checked_first);
  if (!accepted) {  // give the new pages back; the sequence holds what it held
    for (uint32_t li = 0; li < req.num_layers; ++li) {
      for (uint32_t h = 0; h < shape.num_kv_heads; ++h) {
        auto& lane = seq.lanes_[seq.Lane(req.first_layer + li, h)];
        lane.resize(lane.size() - lane_pages[li]);
      }
    }
    if (!pages.empty()) pool_.Free(pages);
    return UnacceptedValues(req, shape);
  }
  seq.pages_held_.fetch_add(new_pages);
  for (uint32_t li = 0; li < req.num_layers; ++li) {
    seq.lengths_[req.first_layer + li] = len0 + req.num_tokens;
  }
  const uint64_t rows = req.num_layers * req.num_tokens * shape.num_kv_heads;
  rows_appended_.fetch_add(2 * rows, std::memory_order_relaxed);  // K rows + V rows
  bytes_appended_.fetch_add(2 * want, std::memory_order_relaxed);
  return AppendResult{len0, req.num_tokens, 2 * want};
}

bool Store::CopyRows(const AppendRequest& req, Sequence& seq, uint64_t len0, bool checked_first) {
  // Each row is checked just before its copy, while it is in cache (unless checked in full
  // before): one rule for every way in (Append, Decode's new token, the in-process op), K and V
  // values finite and below 2^32 (kernels::AcceptedValues), so no score or output of the
  // sequence can become infinite or NaN.
  const ModelShape& shape = seq.shape_;
  const size_t row = seq.row_bytes_;
  const size_t row_elems = shape.head_dim;
  const uint32_t hkv = shape.num_kv_heads;
  std::atomic<bool> accepted{true};
  // Parts of consecutive tokens, each token's rows of every layer and kv head in the request's
  // order (the source read once, in order).
  const uint64_t per_part = std::max<uint64_t>(64, (req.num_tokens + 15) / 16);
  auto tokens = [&](size_t part) {
    const uint64_t t0 = part * per_part, t1 = std::min(req.num_tokens, t0 + per_part);
    for (uint32_t li = 0; li < req.num_layers; ++li) {
      if (!accepted.load(std::memory_order_relaxed)) return;
      for (uint64_t t = t0; t < t1; ++t) {
        for (uint32_t h = 0; h < hkv; ++h) {
          const size_t src = ((li * req.num_tokens + t) * hkv + h) * row;
          if (!checked_first &&
              (!kernels::AcceptedValues(req.k.data() + src, row_elems, shape.dtype) ||
               !kernels::AcceptedValues(req.v.data() + src, row_elems, shape.dtype))) {
            accepted.store(false, std::memory_order_relaxed);
            return;
          }
          uint8_t* slot = seq.Slot(seq.lanes_[seq.Lane(req.first_layer + li, h)], len0 + t);
          std::memcpy(slot, req.k.data() + src, row);
          std::memcpy(slot + row, req.v.data() + src, row);
        }
      }
    }
  };
  const size_t parts = static_cast<size_t>((req.num_tokens + per_part - 1) / per_part);
  if (2 * req.k.size() >= (1u << 20) && parts > 1) {
    appenders_->Run(parts, tokens);
  } else {
    for (size_t part = 0; part < parts && accepted.load(std::memory_order_relaxed); ++part) {
      tokens(part);
    }
  }
  return accepted.load();
}

absl::StatusOr<GatherResult> Store::Gather(const GatherRequest& req, GatherAllocator alloc) {
  if (req.heads.empty()) return absl::InvalidArgumentError("gather of no kv heads");
  absl::StatusOr<Pin> pin = Acquire(req.sequence_id);
  if (!pin.ok()) return pin.status();
  Sequence& seq = **pin;
  const ModelShape& shape = seq.shape_;
  if (req.layer >= shape.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", req.layer, " outside the sequence's ", shape.num_layers));
  }
  std::shared_lock<std::shared_mutex> lock(seq.mu_);
  GatherResult result;
  result.dtype = shape.dtype;
  result.head_dim = shape.head_dim;
  result.layer_length = seq.lengths_[req.layer];
  result.heads.reserve(req.heads.size());
  uint64_t rows = 0;
  for (const HeadSelection& sel : req.heads) {
    if (sel.kv_head >= shape.num_kv_heads) {
      return absl::InvalidArgumentError(
          absl::StrCat("kv_head ", sel.kv_head, " outside the sequence's ", shape.num_kv_heads));
    }
    for (uint32_t t : sel.token_indices) {
      if (t >= result.layer_length) {
        return absl::OutOfRangeError(absl::StrCat("token ", t, " of kv head ", sel.kv_head,
                                                  " is past layer ", req.layer, "'s length ",
                                                  result.layer_length));
      }
    }
    HeadRows& hr = result.heads.emplace_back();
    hr.kv_head = sel.kv_head;
    hr.row_offset = rows;
    if (req.unique) {
      std::vector<uint32_t> sorted(sel.token_indices.begin(), sel.token_indices.end());
      std::sort(sorted.begin(), sorted.end());
      for (size_t i = 0; i < sorted.size();) {
        size_t j = i;
        while (j < sorted.size() && sorted[j] == sorted[i]) ++j;
        hr.token_indices.push_back(sorted[i]);
        hr.counts.push_back(static_cast<uint32_t>(j - i));
        i = j;
      }
      hr.row_count = hr.token_indices.size();
    } else {
      hr.row_count = sel.token_indices.size();
    }
    rows += hr.row_count;
  }
  const bool want_k = req.kind != RowKind::kV;
  const bool want_v = req.kind != RowKind::kK;
  const size_t row = seq.row_bytes_;
  const uint64_t bytes = rows * row * (want_k + want_v);
  if (bytes > options_.max_gather_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "gather of ", bytes, " bytes exceeds the limit of ", options_.max_gather_bytes));
  }
  absl::StatusOr<GatherBuffers> out = alloc(rows, row);
  if (!out.ok()) return out.status();
  if ((want_k && out->k == nullptr) || (want_v && out->v == nullptr)) {
    return absl::InternalError("gather allocator returned no buffer");
  }

  // Each row is a DRAM miss at a random address, so throughput is set by how many misses are
  // in flight. Prefetch kAhead rows ahead into L2 (prefetcht1), which tracks more outstanding
  // misses than L1: 131072 random 256 B rows went from 56% to 78% of memcpy bandwidth against an
  // L1 prefetch 8 rows ahead (docs/PERF.md). The division in Slot() overlaps those stalls; a
  // variant that resolved every slot in a first pass was 1.5 ms slower at 131072 rows.
  constexpr size_t kAhead = 16;
  constexpr size_t kDeadlineCheckEvery = 1 << 14;
  const int v_off = static_cast<int>(row);
  for (size_t hi = 0; hi < req.heads.size(); ++hi) {
    const HeadRows& hr = result.heads[hi];
    const auto& lane = seq.lanes_[seq.Lane(req.layer, hr.kv_head)];
    const uint32_t* toks =
        req.unique ? hr.token_indices.data() : req.heads[hi].token_indices.data();
    const size_t n = hr.row_count;
    uint8_t* dk = want_k ? out->k + hr.row_offset * row : nullptr;
    uint8_t* dv = want_v ? out->v + hr.row_offset * row : nullptr;
    for (size_t i = 0; i < n; ++i) {
      if (i + kAhead < n) {
        const uint8_t* ahead = seq.Slot(lane, toks[i + kAhead]);
        for (size_t off = want_k ? 0 : row; off < (want_v ? 2 * row : row); off += 64) {
          __builtin_prefetch(ahead + off, /*rw=*/0, /*locality=*/2);
        }
      }
      if ((i & (kDeadlineCheckEvery - 1)) == kDeadlineCheckEvery - 1 &&
          absl::Now() > req.deadline) {
        return absl::DeadlineExceededError(absl::StrCat("deadline passed after ", i, " rows"));
      }
      const uint8_t* slot = seq.Slot(lane, toks[i]);
      if (want_k) std::memcpy(dk + i * row, slot, row);
      if (want_v) std::memcpy(dv + i * row, slot + v_off, row);
    }
  }
  result.rows = rows;
  result.bytes = bytes;
  const size_t tier = static_cast<size_t>(Tier::kHost);
  rows_gathered_[tier].fetch_add(rows * (want_k + want_v), std::memory_order_relaxed);
  bytes_gathered_[tier].fetch_add(bytes, std::memory_order_relaxed);
  return result;
}

struct Reservation::Impl {
  Store::Pin pin;
  uint64_t tokens = 0;
};

absl::StatusOr<std::unique_ptr<Reservation>> Store::Reserve(absl::string_view sequence_id,
                                                            uint64_t tokens) {
  absl::StatusOr<Pin> pin = Acquire(sequence_id);
  if (!pin.ok()) return pin.status();
  Sequence& seq = **pin;
  if (tokens > options_.max_tokens_per_layer) {
    return absl::OutOfRangeError(absl::StrCat("reservation of ", tokens,
                                              " tokens exceeds max_tokens_per_layer ",
                                              options_.max_tokens_per_layer));
  }
  std::unique_lock<std::shared_mutex> lock(seq.mu_);
  const uint64_t need = seq.PagesFor(tokens);
  size_t new_pages = 0;
  for (const auto& lane : seq.lanes_) new_pages += need > lane.size() ? need - lane.size() : 0;
  if (new_pages > 0) {
    std::vector<uint8_t*> pages;
    if (absl::Status got =
            TakeRoom(new_pages, 0, &seq, [&] { return pool_.Allocate(new_pages, &pages); });
        !got.ok())
      return got;
    size_t next = 0;
    for (auto& lane : seq.lanes_) {
      while (lane.size() < need) lane.push_back(pages[next++]);
    }
    seq.pages_held_.fetch_add(new_pages);
  }
  uint64_t held = std::numeric_limits<uint64_t>::max();
  for (const auto& lane : seq.lanes_) held = std::min<uint64_t>(held, lane.size());
  lock.unlock();
  auto impl = std::unique_ptr<Reservation::Impl>(
      new Reservation::Impl{std::move(*pin), held * seq.page_tokens_});
  return std::unique_ptr<Reservation>(new Reservation(std::move(impl)));
}

absl::StatusOr<AppendResult> Store::CommitWritten(absl::string_view sequence_id,
                                                  uint32_t first_layer, uint32_t num_layers,
                                                  uint64_t expected_length, uint64_t num_tokens) {
  if (num_tokens == 0) return absl::InvalidArgumentError("commit of zero tokens");
  absl::StatusOr<Pin> pin = Acquire(sequence_id);
  if (!pin.ok()) return pin.status();
  Sequence& seq = **pin;
  const ModelShape& shape = seq.shape_;
  if (num_layers == 0 || static_cast<uint64_t>(first_layer) + num_layers > shape.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layers [", first_layer, ", ",
                                                   first_layer + num_layers,
                                                   ") outside the sequence's ", shape.num_layers));
  }
  std::unique_lock<std::shared_mutex> lock(seq.mu_);
  for (uint32_t l = first_layer; l < first_layer + num_layers; ++l) {
    if (seq.lengths_[l] != expected_length) {
      return absl::FailedPreconditionError(absl::StrCat(
          "commit expects ", expected_length, " tokens but layer ", l, " holds ", seq.lengths_[l]));
    }
    for (uint32_t h = 0; h < shape.num_kv_heads; ++h) {
      if (seq.lanes_[seq.Lane(l, h)].size() * seq.page_tokens_ < expected_length + num_tokens) {
        return absl::OutOfRangeError(absl::StrCat("commit of tokens up to ",
                                                  expected_length + num_tokens,
                                                  " past the pages reserved for layer ", l));
      }
    }
  }
  for (uint32_t l = first_layer; l < first_layer + num_layers; ++l) {
    seq.lengths_[l] = expected_length + num_tokens;
  }
  const uint64_t rows = static_cast<uint64_t>(num_layers) * num_tokens * shape.num_kv_heads;
  rows_appended_.fetch_add(2 * rows, std::memory_order_relaxed);
  bytes_appended_.fetch_add(2 * rows * seq.row_bytes_, std::memory_order_relaxed);
  return AppendResult{expected_length, num_tokens, 2 * rows * seq.row_bytes_};
}

Reservation::Reservation(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Reservation::~Reservation() = default;
uint64_t Reservation::tokens() const { return impl_->tokens; }
uint32_t Reservation::page_tokens() const {
  return static_cast<uint32_t>(impl_->pin->page_tokens_);
}
size_t Reservation::row_bytes() const { return impl_->pin->row_bytes_; }
uint8_t* Reservation::Slot(uint32_t layer, uint32_t kv_head, uint64_t t) const {
  const Sequence& s = *impl_->pin;
  std::shared_lock<std::shared_mutex> lock(s.mu_);  // an append may grow the page lists
  return s.Slot(s.lanes_[s.Lane(layer, kv_head)], t);
}

struct PageView::Impl {
  Store::Pin pin;
  std::shared_lock<std::shared_mutex> lock;
};

PageView::PageView(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
PageView::~PageView() = default;  // unlock, then unpin (members destroyed in reverse order)

const ModelShape& PageView::shape() const { return impl_->pin->shape_; }
size_t PageView::row_bytes() const { return impl_->pin->row_bytes_; }

uint64_t PageView::layer_length(uint32_t layer) const { return impl_->pin->lengths_[layer]; }

const uint8_t* PageView::KRow(uint32_t layer, uint32_t kv_head, uint64_t t) const {
  const Sequence& s = *impl_->pin;
  return s.Slot(s.lanes_[s.Lane(layer, kv_head)], t);
}

absl::StatusOr<std::unique_ptr<PageView>> Store::View(absl::string_view sequence_id) {
  absl::StatusOr<Pin> pin = Acquire(sequence_id);
  if (!pin.ok()) return pin.status();
  std::shared_lock<std::shared_mutex> lock((*pin)->mu_);
  auto impl = std::unique_ptr<PageView::Impl>(new PageView::Impl{std::move(*pin), std::move(lock)});
  return std::unique_ptr<PageView>(new PageView(std::move(impl)));
}

absl::StatusOr<LayerPageTable> Store::PageTable(absl::string_view sequence_id, uint32_t layer,
                                                uint64_t first_page) {
  SharedArena* arena = options_.memory->shared_arena();
  if (arena == nullptr) {
    return absl::FailedPreconditionError(
        "this store's pages are not in a shared arena file (start it with --arena_file)");
  }
  absl::StatusOr<Pin> pin = Acquire(sequence_id);
  if (!pin.ok()) return pin.status();
  const Sequence& seq = **pin;
  if (layer >= seq.shape_.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " out of range (", seq.shape_.num_layers, " layers)"));
  }
  std::shared_lock<std::shared_mutex> lock(seq.mu_);
  LayerPageTable t;
  t.arena_id = arena->arena_id();
  t.incarnation = seq.incarnation_;
  t.layer_length = seq.lengths_[layer];
  t.page_tokens = static_cast<uint32_t>(seq.page_tokens_);
  t.page_bytes = options_.page_bytes;
  t.row_bytes = seq.row_bytes_;
  t.first_page = first_page;
  t.lanes.resize(seq.shape_.num_kv_heads);
  // The pin keeps these pages from being freed, so their generations hold while we read them.
  for (uint32_t h = 0; h < seq.shape_.num_kv_heads; ++h) {
    const std::vector<uint8_t*>& lane = seq.lanes_[seq.Lane(layer, h)];
    for (uint64_t i = first_page; i < lane.size(); ++i) {
      t.lanes[h].push_back({arena->Offset(lane[i]), arena->Generation(lane[i])});
    }
  }
  return t;
}

absl::StatusOr<SequenceInfo> Store::GetSequenceInfo(absl::string_view sequence_id) {
  absl::StatusOr<Pin> pin = Acquire(sequence_id);
  if (!pin.ok()) return pin.status();
  return InfoOf(**pin);
}

std::vector<SequenceInfo> Store::ListSequences() {
  std::vector<std::shared_ptr<Sequence>> seqs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, seq] : sequences_) {
      ++seq->pins_;
      seqs.push_back(seq);
    }
  }
  std::vector<SequenceInfo> out;
  out.reserve(seqs.size());
  for (auto& seq : seqs) {
    Pin pin(this, std::move(seq));  // releases the pin taken above
    out.push_back(InfoOf(*pin));
  }
  std::sort(out.begin(), out.end(), [](const SequenceInfo& a, const SequenceInfo& b) {
    return a.sequence_id < b.sequence_id;
  });
  return out;
}

StoreStats Store::Stats() const {
  StoreStats s;
  s.capacity_bytes = options_.capacity_bytes;
  s.page_bytes = options_.page_bytes;
  s.pages_used = pool_.pages_in_use();
  s.bytes_used = s.pages_used * options_.page_bytes + pool_.charged_bytes();
  s.policy = options_.policy;
  s.shard = options_.shard;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s.num_sequences = sequences_.size();
  }
  s.evictions = evictions_.load(std::memory_order_relaxed);
  s.rejections = rejections_.load(std::memory_order_relaxed);
  s.rows_appended = rows_appended_.load(std::memory_order_relaxed);
  s.bytes_appended = bytes_appended_.load(std::memory_order_relaxed);
  for (int t = 0; t < kNumTiers; ++t) {
    s.rows_gathered[t] = rows_gathered_[t].load(std::memory_order_relaxed);
    s.bytes_gathered[t] = bytes_gathered_[t].load(std::memory_order_relaxed);
  }
  return s;
}

}  // namespace kvsparse::kvstore
