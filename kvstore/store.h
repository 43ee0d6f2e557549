// The KV store engine: sequences of K/V rows per (layer, kv head), appended by token and read
// back sparsely by token index. No gRPC here; server/ wraps it.
//
// Layout. A sequence holds, for every (layer, kv head) "lane", a list of fixed-size pages. Token t
// of a lane sits in page t / page_tokens at slot t % page_tokens; a slot is the token's K row
// followed by its V row (2 * row_bytes), so the K and V of one token are adjacent and the rows of
// one kv head are packed together. Appends fill the last page and add pages; rows never move.
//
// Capacity. Every page counts against StoreOptions::capacity_bytes. An append that needs more
// pages than are free either fails (kReject) or first evicts whole idle sequences, least
// recently used first (kEvictLru); a sequence with a call in flight is never evicted.
//
// Thread safety. All methods are thread-safe. Lock order: Sequence::mu_ -> Store::mu_ ->
// PagePool::mu_. Store::mu_ guards the sequence map and is never held while a sequence lock is
// taken; a call pins the sequence it uses (an atomic count) under Store::mu_, and eviction skips
// pinned sequences, so a reader sees either all of a sequence or NOT_FOUND. The locks are
// std::mutex / std::shared_mutex (pthreads), which ThreadSanitizer understands; Debian's
// prebuilt Abseil is not instrumented, so absl::Mutex would make TSan runs report noise.
#ifndef KVSPARSE_KVSTORE_STORE_H_
#define KVSPARSE_KVSTORE_STORE_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvstore/memory_resource.h"
#include "kvstore/page_pool.h"
#include "kvstore/placement.h"
#include "kvstore/shared_arena.h"
#include "kvstore/types.h"
#include "kvstore/worker_pool.h"

namespace kvsparse::kvstore {

struct StoreOptions {
  size_t capacity_bytes = 1ull << 30;  // bytes of pages the store may hold
  CapacityPolicy policy = CapacityPolicy::kReject;
  size_t page_bytes = 64 << 10;  // per page; a multiple of 4096 holding >= 1 token of any shape
  size_t slab_bytes = 64 << 20;  // granularity of requests to the memory resource
  uint64_t max_tokens_per_layer = 1ull << 24;  // token indices travel as uint32
  uint64_t max_gather_bytes = 256ull << 20;    // larger responses get RESOURCE_EXHAUSTED
  uint64_t max_append_bytes = 256ull << 20;    // K + V bytes of one append
  // Threads besides the caller that copy a large append's rows into its pages (parts of
  // consecutive tokens, at most 16; appends under 1 MiB of K and V are copied by the caller
  // alone), so that a prompt's K and V are not copied by one thread (an 8k-token layer of a
  // Llama-3.1-8B shape: 13.5 ms alone, 10 ms with a helper on the 2-core build machine; pages
  // touched for the first time fault in parallel too: 36 against 10-12 ms). 0: the caller alone.
  int append_helpers = 3;
  // Most sequences held at once (each costs bookkeeping even when empty); creating one more is
  // RESOURCE_EXHAUSTED. 0: no bound.
  size_t max_sequences = 0;
  // This store's shard of a sharded fleet (--shard_index/--shard_count): creating a sequence that
  // kvstore::ShardOf places on another shard is FAILED_PRECONDITION, so a client or worker whose
  // list of shards differs from the fleet's can never leave or find a sequence on the wrong one.
  ShardSpec shard;
  // Where pages come from; null = an owned host resource with huge pages.
  // REQUIRES: outlives the store.
  MemoryResource* memory = nullptr;
};

struct SequenceInfo {
  std::string sequence_id;
  ModelShape shape;
  Placement placement;
  std::vector<uint64_t> layer_lengths;
  uint64_t bytes_used = 0;
  // Of bytes_used, the pages another sequence holds too right now (a fork's common prefix).
  uint64_t bytes_shared = 0;
  uint32_t page_tokens = 0;
  // Unique per creation, also across restarts of the store: a sequence dropped (or lost with a
  // store) and created again under the same id gets a new incarnation, so a worker holding state
  // for the old one can tell.
  uint64_t incarnation = 0;
};

struct StoreStats {
  uint64_t capacity_bytes = 0;
  uint64_t bytes_used = 0;
  uint64_t num_sequences = 0;
  CapacityPolicy policy = CapacityPolicy::kReject;
  uint64_t evictions = 0;
  uint64_t rejections = 0;
  uint64_t page_bytes = 0;
  uint64_t pages_used = 0;
  uint64_t rows_appended = 0;  // rows written (a token's K and V rows count as 2)
  uint64_t bytes_appended = 0;
  std::array<uint64_t, kNumTiers> rows_gathered{};  // rows returned (a K+V pair counts as 2)
  std::array<uint64_t, kNumTiers> bytes_gathered{};
  ShardSpec shard;  // this store's place in a sharded fleet
};

struct AppendRequest {
  absl::string_view sequence_id;
  uint32_t first_layer = 0;
  uint32_t num_layers = 1;
  uint64_t num_tokens = 0;
  // What the caller says k and v hold; must match the sequence (a same-size tensor of another
  // dtype or head split is refused, never reinterpreted).
  DType dtype = DType::kBf16;
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  // shape: [num_layers, num_tokens, num_kv_heads, head_dim] in the sequence's dtype each.
  absl::Span<const uint8_t> k;
  absl::Span<const uint8_t> v;
  std::optional<uint64_t> expected_length;  // if set, every layer must hold exactly this many
  absl::Time deadline = absl::InfiniteFuture();
};

struct AppendResult {
  uint64_t first_token = 0;
  uint64_t num_tokens = 0;
  uint64_t bytes_appended = 0;
};

struct HeadSelection {
  uint32_t kv_head = 0;
  absl::Span<const uint32_t> token_indices;
};

struct GatherRequest {
  absl::string_view sequence_id;
  uint32_t layer = 0;
  RowKind kind = RowKind::kKV;
  absl::Span<const HeadSelection> heads;
  bool unique = false;
  absl::Time deadline = absl::InfiniteFuture();
};

struct HeadRows {
  uint32_t kv_head = 0;
  uint64_t row_offset = 0;
  uint64_t row_count = 0;
  std::vector<uint32_t> token_indices;  // unique only: distinct tokens, ascending
  std::vector<uint32_t> counts;         // unique only
};

struct GatherResult {
  std::vector<HeadRows> heads;
  DType dtype = DType::kBf16;  // of the rows
  uint32_t head_dim = 0;
  uint64_t layer_length = 0;
  uint64_t rows = 0;   // rows per returned tensor
  uint64_t bytes = 0;  // bytes written (K and V together)
};

// Destination of a gather: `rows` rows of row_bytes each for K and for V (null when not asked).
struct GatherBuffers {
  uint8_t* k = nullptr;
  uint8_t* v = nullptr;
};
using GatherAllocator =
    absl::FunctionRef<absl::StatusOr<GatherBuffers>(uint64_t rows, size_t row_bytes)>;

// One layer's pages, for a reader that maps the store's arena file (kvstore/shared_arena.h) and
// copies rows in place instead of calling Gather.
struct LayerPageTable {
  uint64_t arena_id = 0;
  uint64_t incarnation = 0;
  uint64_t layer_length = 0;  // tokens the layer held when the table was made
  uint32_t page_tokens = 0;   // tokens per page; token t is in page t / page_tokens
  uint64_t page_bytes = 0;
  uint64_t row_bytes = 0;  // a slot is the token's K row, then its V row
  uint64_t first_page = 0;
  std::vector<std::vector<PageRef>> lanes;  // [num_kv_heads][pages first_page, first_page + 1, ...]
};

class Sequence;
class Store;

// A read-only view of one sequence's pages for zero-copy readers (e.g. a GPU kernel reading
// pinned host memory): where each token's K and V rows sit. While a view lives the sequence is
// pinned (never evicted, its pages never freed) and read-locked (appends to it wait), so every
// address it gives stays valid and its rows do not change. Destroy it promptly.
class PageView {
 public:
  ~PageView();
  PageView(const PageView&) = delete;
  PageView& operator=(const PageView&) = delete;

  const ModelShape& shape() const;
  uint64_t layer_length(uint32_t layer) const;
  // Address of token t's K row in (layer, kv_head); its V row follows at + row_bytes().
  // REQUIRES: layer, kv_head in range; t < layer_length(layer).
  const uint8_t* KRow(uint32_t layer, uint32_t kv_head, uint64_t t) const;
  size_t row_bytes() const;

 private:
  friend class Store;
  struct Impl;
  explicit PageView(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Pages reserved ahead of a sequence's lengths, for a writer that puts the next tokens' rows in
// place itself (e.g. a GPU kernel inside a captured CUDA graph writing pinned, mapped host
// memory) and then commits them (Store::CommitWritten). While it lives the sequence is pinned:
// never evicted, and if dropped its pages go back only when the reservation is released, so every
// address it gives stays valid. It takes no lock: the reserved slots past a layer's length are
// the writer's alone; the store's rows below the lengths never change.
class Reservation {
 public:
  ~Reservation();
  Reservation(const Reservation&) = delete;
  Reservation& operator=(const Reservation&) = delete;

  // Tokens every layer can hold without another page.
  uint64_t tokens() const;
  uint32_t page_tokens() const;
  size_t row_bytes() const;
  // Start of token t's slot in (layer, kv_head): its K row, then its V row at + row_bytes().
  // REQUIRES: layer, kv_head in range; t < tokens().
  uint8_t* Slot(uint32_t layer, uint32_t kv_head, uint64_t t) const;

 private:
  friend class Store;
  struct Impl;
  explicit Reservation(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class Store {
 public:
  // INVALID_ARGUMENT for options that cannot work (page size, capacity).
  static absl::StatusOr<std::unique_ptr<Store>> Create(StoreOptions options);
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // ALREADY_EXISTS if the id is taken; INVALID_ARGUMENT for a bad id, shape or placement;
  absl::StatusOr<SequenceInfo> CreateSequence(absl::string_view sequence_id,
                                              const ModelShape& shape, const Placement& placement);
  // A new sequence holding tokens [0, num_tokens) of every layer of `source_id`, which keeps
  // them too: the whole pages below num_tokens are shared (counted once against the capacity;
  // neither sequence ever writes them again), the page holding token num_tokens - 1 is copied if
  // num_tokens is not a page boundary, and each then grows on its own. The fork has the source's
  // shape and the given placement (the source's if none) and its own incarnation. Its bookkeeping
  // and page pointers are charged as a new sequence's are. INVALID_ARGUMENT (bad id or
  // placement, zero tokens), FAILED_PRECONDITION (a layer of the source holds fewer tokens;
  // an id of another shard), NOT_FOUND (no source), ALREADY_EXISTS, RESOURCE_EXHAUSTED.
  absl::StatusOr<SequenceInfo> ForkSequence(absl::string_view source_id,
                                            absl::string_view sequence_id, uint64_t num_tokens,
                                            std::optional<Placement> placement = std::nullopt);
  // Returns the bytes that return to the store once in-flight calls on it finish (pages it
  // shares with a fork stay with the fork). NOT_FOUND if unknown.
  absl::StatusOr<uint64_t> DropSequence(absl::string_view sequence_id);

  // All-or-nothing. NOT_FOUND (unknown sequence), INVALID_ARGUMENT (layers out of range,
  // dtype, kv heads or head dim other than the sequence's, K/V byte sizes that do not match the
  // shape, zero tokens), FAILED_PRECONDITION (layers of
  // unequal length, or expected_length mismatch), OUT_OF_RANGE (past max_tokens_per_layer),
  // RESOURCE_EXHAUSTED (capacity, or an append larger than max_append_bytes),
  // DEADLINE_EXCEEDED.
  absl::StatusOr<AppendResult> Append(const AppendRequest& request);

  // Copies the requested rows into buffers obtained from `alloc` (called once, after all
  // validation). Rows come in request order (duplicates repeated), or with `unique` once per
  // distinct token in ascending order with counts. NOT_FOUND (unknown or evicted sequence),
  // INVALID_ARGUMENT (no heads, bad layer or kv head), OUT_OF_RANGE (token at or past the
  // layer's length), RESOURCE_EXHAUSTED (more than max_gather_bytes), DEADLINE_EXCEEDED.
  absl::StatusOr<GatherResult> Gather(const GatherRequest& request, GatherAllocator alloc);

  // Adds pages so that every layer of the sequence holds `tokens` tokens without another
  // allocation, counted against the capacity as appended pages are (they stay with the sequence;
  // appends fill them), and pins it while the reservation lives. NOT_FOUND, OUT_OF_RANGE (past
  // max_tokens_per_layer), RESOURCE_EXHAUSTED (capacity).
  absl::StatusOr<std::unique_ptr<Reservation>> Reserve(absl::string_view sequence_id,
                                                       uint64_t tokens);
  // Tokens [length, length + num_tokens) of layers [first_layer, first_layer + num_layers) were
  // written in place into reserved pages: their lengths advance (and the append counters).
  // NOT_FOUND, INVALID_ARGUMENT (layers out of range, zero tokens), FAILED_PRECONDITION
  // (layers of unequal length, expected_length mismatch), OUT_OF_RANGE (past the pages held).
  absl::StatusOr<AppendResult> CommitWritten(absl::string_view sequence_id, uint32_t first_layer,
                                             uint32_t num_layers, uint64_t expected_length,
                                             uint64_t num_tokens);

  absl::StatusOr<SequenceInfo> GetSequenceInfo(absl::string_view sequence_id);
  // The pages of one layer from page index first_page on, with their generations.
  // FAILED_PRECONDITION when the store's memory is not a shared arena (no --arena_file);
  // NOT_FOUND (unknown sequence), INVALID_ARGUMENT (layer out of range).
  absl::StatusOr<LayerPageTable> PageTable(absl::string_view sequence_id, uint32_t layer,
                                           uint64_t first_page);
  // A zero-copy view of a sequence's pages (see PageView). NOT_FOUND if unknown.
  absl::StatusOr<std::unique_ptr<PageView>> View(absl::string_view sequence_id);
  std::vector<SequenceInfo> ListSequences();
  StoreStats Stats() const;
  // The sequences whose ids `which` accepts (a tenant's) and the bytes they hold together: a
  // page several of them share counted once.
  struct Holding {
    uint64_t sequences = 0;
    uint64_t bytes = 0;
  };
  Holding HeldBy(absl::FunctionRef<bool(absl::string_view)> which) const;
  const StoreOptions& options() const { return options_; }

 private:
  class Pin;
  friend struct PageView::Impl;
  friend struct Reservation::Impl;
  Store(StoreOptions options, std::unique_ptr<MemoryResource> owned_memory);

  // INVALID_ARGUMENT for an id that is not one, FAILED_PRECONDITION for another shard's.
  absl::Status CheckNewId(absl::string_view sequence_id) const;
  // Adds a new sequence to the map: ALREADY_EXISTS, RESOURCE_EXHAUSTED (max_sequences).
  absl::Status Insert(const std::shared_ptr<Sequence>& seq) ABSL_LOCKS_EXCLUDED(mu_);
  // What GetSequenceInfo tells of seq.
  SequenceInfo InfoOf(const Sequence& seq) const ABSL_LOCKS_EXCLUDED(mu_);
  // Pages of seq that another sequence holds too, right now.
  size_t SharedPages(const Sequence& seq) const ABSL_LOCKS_EXCLUDED(mu_);
  // Looks up and pins a sequence, marking it used now. NOT_FOUND if absent.
  absl::StatusOr<Pin> Acquire(absl::string_view sequence_id) ABSL_LOCKS_EXCLUDED(mu_);
  // Makes `pages` pages (and `bytes` more charged bytes: a new sequence's bookkeeping) fit under
  // the capacity, evicting idle sequences if the policy allows.
  absl::Status MakeRoom(size_t pages, const Sequence* requester, size_t bytes = 0)
      ABSL_LOCKS_EXCLUDED(mu_);
  // MakeRoom for `pages` pages and `bytes` charged bytes, then `take` (the pool's Allocate or
  // Charge), tried a few times (another call may take the room in between); a failure counts as
  // a rejection. REQUIRES for an append or reservation: the requester's lock held.
  absl::Status TakeRoom(size_t pages, size_t bytes, const Sequence* requester,
                        absl::FunctionRef<absl::Status()> take) ABSL_LOCKS_EXCLUDED(mu_);

  // Copies (and checks) the rows of tokens [len0, len0 + num_tokens) of `req` into `seq`'s
  // pages, parts of consecutive tokens in parallel on appenders_ when large; false when a value is
  // not accepted (kernels::AcceptedValues; not checked when checked_first), some rows then written
  // past the lengths (invisible). REQUIRES: seq's lock held exclusively by the caller (the helpers
  // write under it while the caller waits for them).
  bool CopyRows(const AppendRequest& req, Sequence& seq, uint64_t len0, bool checked_first);

  const StoreOptions options_;
  std::unique_ptr<MemoryResource> owned_memory_;
  PagePool pool_;
  std::unique_ptr<WorkerPool> appenders_;  // options_.append_helpers threads

  mutable std::mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Sequence>> sequences_ ABSL_GUARDED_BY(mu_);
  uint64_t tick_ ABSL_GUARDED_BY(mu_) = 0;  // LRU clock

  // Starts at the clock (microseconds), so incarnations stay unique across restarts of a store
  // (a worker holding state of a sequence tells a re-created one apart even then).
  std::atomic<uint64_t> next_incarnation_;
  std::atomic<uint64_t> evictions_{0};
  std::atomic<uint64_t> rejections_{0};
  std::atomic<uint64_t> rows_appended_{0};
  std::atomic<uint64_t> bytes_appended_{0};
  std::array<std::atomic<uint64_t>, kNumTiers> rows_gathered_{};
  std::array<std::atomic<uint64_t>, kNumTiers> bytes_gathered_{};
};

}  // namespace kvsparse::kvstore

#endif  // KVSPARSE_KVSTORE_STORE_H_
