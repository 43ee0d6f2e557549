// What the decode worker keeps on its device for each (sequence, layer), as the sequence's
// placement asks: K rows (k_tier = device), V rows (v_tier = device), key signatures
// (signature_bits > 0) and compressed keys (compressed_key_bits > 0). It is a cache of the store:
// built and extended from the store's rows on demand (Acquire syncs to the store's length, which
// covers tokens appended straight to the store, e.g. a prefill, and the split deployment), appended
// to directly when the engine appends a token, and rebuilt when the store's sequence changes
// incarnation. Entries not in use are evicted, least recently used first, to stay under the
// capacity. In this CPU build the "device" is host memory owned by the worker; a CUDA backend keeps
// the same state on the GPU.
//
// Thread-safe. Lock order: an entry's mutex, then the cache's map mutex (never the reverse; the
// map mutex is never held while waiting for an entry).
#ifndef KVSPARSE_ENGINE_RESIDENT_CACHE_H_
#define KVSPARSE_ENGINE_RESIDENT_CACHE_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "engine/row_source.h"
#include "engine/signatures.h"
#include "kernels/compressed_keys.h"

namespace kvsparse::engine {

// The most headroom, in tokens, a layer's rows are allocated with past what they must hold.
inline constexpr uint64_t kMostHeadroomTokens = 2048;

// Rows (tokens, or groups of tokens for compressed keys) to allocate for a layer that must hold
// `need` and holds room for `capacity`: headroom for the decode steps that follow, 1/16 of the
// need or 1/8 of the capacity (short sequences' appends stay amortised O(1)), but at most
// most_headroom rows (kMostHeadroomTokens in the caller's unit), at least `least` in all. Not
// doubling, and not a fraction of a long sequence: a 128k-token prefix held 1/16 more than it
// needed (6% of the state of a sequence with keys compressed on the device) for steps that regrow
// a layer once in kMostHeadroomTokens anyway.
inline uint64_t GrowRows(uint64_t need, uint64_t capacity, uint64_t least,
                         uint64_t most_headroom = kMostHeadroomTokens) {
  const uint64_t headroom = std::min(std::max(need / 16, capacity / 8), most_headroom);
  return std::max(need + headroom, least);
}

// One layer of one sequence on the device.
class ResidentLayer {
 public:
  uint64_t length() const { return length_; }
  uint64_t capacity() const { return capacity_; }
  bool has_k() const { return has_k_; }
  bool has_v() const { return has_v_; }
  bool has_signatures() const { return words_ > 0; }
  bool has_compressed_keys() const { return !compressed_.empty(); }
  // Compressed keys of kv head h (kernels/compressed_keys.h). REQUIRES: has_compressed_keys().
  kernels::CompressedKeysView compressed_keys(uint32_t kv_head) const {
    return compressed_[kv_head].view();
  }
  // Rows [capacity][d] of kv head h, the sequence's dtype; token t at + t * d elements.
  const uint8_t* k(uint32_t kv_head) const { return k_.data() + kv_head * capacity_ * row_bytes_; }
  const uint8_t* v(uint32_t kv_head) const { return v_.data() + kv_head * capacity_ * row_bytes_; }
  const uint8_t* k_base() const { return k_.data(); }
  // Signatures [key_heads][capacity][words].
  const uint32_t* signatures() const { return sig_.data(); }
  int32_t words() const { return words_; }
  int32_t key_heads() const { return key_heads_; }
  size_t bytes() const {
    size_t b = array_bytes();
    for (const kernels::CompressedKeys& c : compressed_) b += c.bytes();
    return b;
  }

 private:
  friend class ResidentCache;
  // K, V and signature arrays (grown together by capacity); compressed keys grow on their own.
  size_t array_bytes() const { return k_.size() + v_.size() + sig_.size() * 4; }
  bool has_k_ = false, has_v_ = false;
  int32_t words_ = 0, key_heads_ = 0;
  size_t row_bytes_ = 0;
  uint64_t length_ = 0, capacity_ = 0;
  std::vector<uint8_t> k_, v_;
  std::vector<uint32_t> sig_;
  std::vector<kernels::CompressedKeys> compressed_;  // [Hkv], empty without the placement's
  std::vector<float> max_norm_;                      // [Hkv] SimHash M, fixed at the first sync
};

struct SyncStats {
  uint64_t rows_fetched = 0;  // rows read from the store to catch up (K and V rows each count)
  uint64_t bytes_fetched = 0;
};

class ResidentCache {
 public:
  // capacity_bytes: most bytes of resident state; sync_chunk_bytes: largest single read from
  // the row source while catching up. maker must outlive the cache.
  // key_widths (optional): compressed keys at per-channel widths where they apply
  // (KeyWidthsApply).
  ResidentCache(size_t capacity_bytes, size_t sync_chunk_bytes, SignatureMaker* maker,
                std::shared_ptr<const kernels::KeyWidths> key_widths = nullptr)
      : capacity_(capacity_bytes),
        sync_chunk_bytes_(sync_chunk_bytes),
        maker_(maker),
        key_widths_(std::move(key_widths)) {}
  ResidentCache(const ResidentCache&) = delete;
  ResidentCache& operator=(const ResidentCache&) = delete;

  class Entry;
  // A locked layer, synced to the store's length as `desc` reported it.
  class Handle {
   public:
    ResidentLayer& layer() { return *layer_; }
    // Appends tokens the engine just appended to the store (k, v: [n, Hkv, d]); keeps the
    // layer in sync without reading them back. RESOURCE_EXHAUSTED when the device is full.
    absl::Status AppendTokens(uint64_t n, const uint8_t* k, const uint8_t* v);

   private:
    friend class ResidentCache;
    ResidentCache* cache_ = nullptr;
    std::shared_ptr<Entry> entry_;
    std::unique_lock<std::mutex> lock_;
    ResidentLayer* layer_ = nullptr;
    uint32_t layer_index_ = 0;
  };

  // Locks the (sequence, layer) state and brings it up to desc.layer_lengths[layer], reading
  // missing rows from `source` (one Gather per chunk of tokens for all kv heads).
  // RESOURCE_EXHAUSTED when the state does not fit; errors of the source pass through.
  absl::StatusOr<Handle> Acquire(const SequenceDesc& desc, uint32_t layer, RowSource* source,
                                 absl::Time deadline, SyncStats* stats);

  // Frees the state of a sequence the store no longer holds (dropped or evicted there). Waits
  // for a call using it to finish.
  void Forget(const std::string& sequence_id);

  size_t bytes() const { return bytes_.load(); }
  size_t capacity() const { return capacity_; }
  uint64_t evictions() const { return evictions_.load(); }

 private:
  // Grows `l` to hold at least `tokens`; RESOURCE_EXHAUSTED past the capacity.
  absl::Status Reserve(Entry* self, ResidentLayer* l, const kvstore::ModelShape& shape,
                       uint64_t tokens);
  // Appends rows [n, Hkv, d] (K and/or V as `l` keeps them) and their signatures.
  absl::Status Append(Entry* self, ResidentLayer* l, uint32_t layer, uint64_t n, const uint8_t* k,
                      const uint8_t* v);
  // Adds `bytes` to the bytes held if they fit under the capacity, evicting idle entries (least
  // recently used first) until they do; false if they cannot. REQUIRES: holding self's lock only.
  bool ReserveBytes(Entry* self, size_t bytes);
  // Frees the least recently used entry other than self that no call is using; false if none.
  bool EvictOne(Entry* self);

  const size_t capacity_;
  const size_t sync_chunk_bytes_;
  SignatureMaker* const maker_;
  const std::shared_ptr<const kernels::KeyWidths> key_widths_;
  std::atomic<size_t> bytes_{0};
  std::atomic<uint64_t> evictions_{0};
  std::atomic<uint64_t> tick_{0};
  std::mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Entry>> entries_;  // guarded by mu_
};

}  // namespace kvsparse::engine

#endif  // KVSPARSE_ENGINE_RESIDENT_CACHE_H_
