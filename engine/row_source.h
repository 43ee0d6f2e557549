// Where the decode engine reads K/V rows from: the store's host tier, in this process
// (LocalRowSource, zero RPCs) or in another one (RemoteRowSource in the server layer,
// through the KvStore Gather RPC). The engine sees only this interface.
#ifndef KVSPARSE_ENGINE_ROW_SOURCE_H_
#define KVSPARSE_ENGINE_ROW_SOURCE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kernels/key_widths.h"
#include "kvstore/store.h"
#include "kvstore/types.h"

namespace kvsparse::engine {

// What the engine needs to know of a sequence.
struct SequenceDesc {
  std::string sequence_id;
  kvstore::ModelShape shape;
  kvstore::Placement placement;
  std::vector<uint64_t> layer_lengths;
  uint64_t incarnation = 0;
  // Tokens per page of the store's host tier (0: not known, e.g. a remote store).
  uint32_t page_tokens = 0;
};

// Whether two sequences have the same shape, dtype, placement and page size (one captured
// plan can hold either).
inline bool SameLayout(const SequenceDesc& a, const SequenceDesc& b) {
  return a.shape.num_layers == b.shape.num_layers && a.shape.num_q_heads == b.shape.num_q_heads &&
         a.shape.num_kv_heads == b.shape.num_kv_heads && a.shape.head_dim == b.shape.head_dim &&
         a.shape.dtype == b.shape.dtype && a.page_tokens == b.page_tokens &&
         a.placement.k_tier == b.placement.k_tier && a.placement.v_tier == b.placement.v_tier &&
         a.placement.signature_bits == b.placement.signature_bits &&
         a.placement.compressed_key_bits == b.placement.compressed_key_bits;
}

// Whether a deployment's key widths (EngineOptions::key_widths) apply to a sequence: it keeps
// compressed keys of their bits and its model has their layers, kv heads and head dim.
inline bool KeyWidthsApply(const kernels::KeyWidths* w, const SequenceDesc& d) {
  return w != nullptr && d.placement.compressed_key_bits == static_cast<uint32_t>(w->bits) &&
         d.shape.num_layers == static_cast<uint32_t>(w->num_layers) &&
         d.shape.num_kv_heads == static_cast<uint32_t>(w->num_kv_heads) &&
         d.shape.head_dim == static_cast<uint32_t>(w->head_dim);
}

// Tokens of one kv head to read.
struct RowRequest {
  uint32_t kv_head = 0;
  absl::Span<const uint32_t> tokens;
};

// Thread-safe.
class RowSource {
 public:
  virtual ~RowSource() = default;
  // The tier rows come from (kHost in process, kRemote across processes).
  virtual kvstore::Tier tier() const = 0;
  // NOT_FOUND for an unknown sequence.
  virtual absl::StatusOr<SequenceDesc> Describe(absl::string_view sequence_id,
                                                absl::Time deadline) = 0;
  // Appends num_tokens tokens to one layer; k, v: [num_tokens, Hkv, d] in the sequence's dtype.
  // FAILED_PRECONDITION if the layer does not hold exactly expected_length tokens.
  virtual absl::Status Append(absl::string_view sequence_id, const kvstore::ModelShape& shape,
                              uint32_t layer, uint64_t expected_length, uint64_t num_tokens,
                              absl::Span<const uint8_t> k, absl::Span<const uint8_t> v,
                              absl::Time deadline) = 0;
  // Reads the rows of `heads` of one layer, one call for all heads, rows in request order:
  // k_out / v_out get [total rows, d] in the sequence's dtype (null when not asked for by
  // kind). Returns the layer's length at read time.
  virtual absl::StatusOr<uint64_t> Gather(absl::string_view sequence_id, uint32_t layer,
                                          kvstore::RowKind kind, absl::Span<const RowRequest> heads,
                                          uint8_t* k_out, uint8_t* v_out, absl::Time deadline) = 0;
  // A zero-copy view of the sequence's pages (kvstore::PageView: rows read in place, e.g. by a
  // GPU kernel when the pages are pinned and mapped). UNIMPLEMENTED where rows are not in this
  // process (the default); NOT_FOUND for an unknown sequence.
  virtual absl::StatusOr<std::unique_ptr<kvstore::PageView>> View(absl::string_view sequence_id);
  // Whether the pages a View shows are device-visible (pinned, CUDA-mapped host memory).
  virtual bool pages_device_visible() const { return false; }
  // Pages reserved ahead of the lengths for rows a device writes in place, and their commit
  // (kvstore::Store::Reserve / CommitWritten). UNIMPLEMENTED where rows are not in this process
  // (the default).
  virtual absl::StatusOr<std::unique_ptr<kvstore::Reservation>> Reserve(
      absl::string_view sequence_id, uint64_t tokens);
  virtual absl::Status CommitWritten(absl::string_view sequence_id, uint32_t num_layers,
                                     uint64_t expected_length, uint64_t num_tokens);
};

// Rows of a store in this process, copied straight into the engine's buffers.
// pages_device_visible: the store's memory is pinned and CUDA-mapped
// (kvstore::NewPinnedHostMemoryResource), so a GPU may read its pages in place.
// REQUIRES: store outlives the source.
std::unique_ptr<RowSource> NewLocalRowSource(kvstore::Store* store,
                                             bool pages_device_visible = false);

// Rows of a sharded fleet of stores: every call goes to the shard kvstore::ShardOf places the
// sequence on (shards[i] is shard i), and its answer is that shard's (a shard that is down gives
// its own UNAVAILABLE; no call moves to another shard, so none can read another store's rows).
// REQUIRES: shards non-empty, all of one tier.
std::unique_ptr<RowSource> NewShardedRowSource(std::vector<std::unique_ptr<RowSource>> shards);

}  // namespace kvsparse::engine

#endif  // KVSPARSE_ENGINE_ROW_SOURCE_H_
