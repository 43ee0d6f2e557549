// What the GPU backend keeps on its device per (sequence, layer), as the sequence's placement
// asks, and the memory accounting around it:
//   - K rows (k_tier = device) and V rows (v_tier = device), [Hkv][capacity][d];
//   - key signatures (signature_bits > 0), [Hkv][capacity][words], signed on the GPU by
//     SimHashSign, bit for bit the CPU engine's SignatureMaker;
//   - for a half kept in host memory, the device-visible addresses of the store's pages of each
//     kv head: kernels read the selected rows in place over the host link (zero-copy, no staging
//     copy; the store's memory must be pinned and mapped);
//   - HashAttention's row cache: the rows selected at the last step, a fraction of the tokens
//     per kv head (consecutive steps select mostly the same rows, which then stay on the device);
//   - compressed keys (compressed_key_bits > 0): a few bits per key channel, quantized on the
//     host as each group of tokens closes (kernels::CompressKeyGroup: the CPU engine's bits), the
//     open group's rows exact, so top-k scores every token without K on the device.
// All of it is a cache of the store: brought up to the store's length on demand (a prefill
// written straight to the store, or the engine's appended token), rebuilt when the sequence's
// incarnation changes; idle sequences are evicted, least recently used first, to stay under the
// capacity. Also here: the SimHash planes per layer and the call's device scratch.
//
// Not thread-safe: the backend serialises calls. Every allocation, copy and free is ordered on
// one CUDA stream.
#ifndef KVSPARSE_ENGINE_CUDA_DEVICE_STATE_H_
#define KVSPARSE_ENGINE_CUDA_DEVICE_STATE_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/container/node_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "engine/cuda/cuda_util.h"
#include "engine/decode_call.h"
#include "engine/resident_cache.h"
#include "engine/row_source.h"
#include "engine/signatures.h"
#include "kernels/cuda/saap.h"
#include "kvstore/store.h"
#include "kvstore/worker_pool.h"

namespace kvsparse::engine::gpu {

// One layer of one sequence on the device.
struct DeviceLayer {
  uint64_t length = 0, capacity = 0;  // tokens synced; rows allocated per kv head
  DevBuf k, v, sig;                   // [Hkv][capacity][d] rows; [Hkv][capacity][words]
  DevBuf norms;                       // SimHash M per kv head, fixed at the first sync
  DevBuf pages;                       // [Hkv][page_cap] device-visible page addresses
  uint64_t page_cap = 0, pages_known = 0;
  // HashAttention's row cache: cache_cap slots per kv head, laid out as RowsLayout (with slots)
  // says.
  DevBuf cache;
  int32_t cache_cap = 0;
  // Compressed keys (placement.compressed_key_bits > 0): the closed groups' blocks per kv head,
  // [Hkv][ck_cap][KeyGroupBytes] (kernels/compressed_keys.h's layout; every group of tokens
  // [0, length) that is full is closed), and the open group's exact rows [Hkv][group][d].
  DevBuf ck, ck_tail;
  uint64_t ck_cap = 0;  // blocks allocated per kv head
};

struct DeviceSequence {
  uint64_t incarnation = 0;
  kvstore::ModelShape shape;
  kvstore::Placement placement;
  std::vector<DeviceLayer> layers;
  uint64_t last_use = 0;
  size_t bytes = 0;
  // Captured steps' plans holding it (never evicted; a Forget waits for the last release).
  int32_t held = 0;
  bool forgotten = false;
};

// Rows of Hkv heads, cap per head, in one allocation: ascending tokens, (a row cache's) the slot
// of each, the counts, then the K and V rows. A row cache has slots; a plain row set not.
struct RowsLayout {
  size_t tokens = 0, slots = 0, count = 0, k = 0, v = 0, total = 0;
  static RowsLayout Of(int32_t hkv, int32_t cap, size_t row, bool with_slots);
};

// The sequences of one call, synced (DeviceState::Sync).
struct SyncedBatch {
  std::vector<DeviceSequence*> seqs;        // [B]
  std::vector<const DeviceSequence*> busy;  // never evicted during the call
  // Views of the store's pages of sequences with a host half; held until the kernels are done
  // (pages may move again after).
  std::vector<std::unique_ptr<kvstore::PageView>> views;
  std::vector<int32_t> lens;  // [B] tokens at the call's layer
};

struct DeviceStateOptions {
  size_t capacity_bytes = 4ull << 30;  // per-sequence state (rows, signatures, page lists, caches)
  size_t max_fetch_bytes = 32 << 20;   // largest single read from the row source (sync, staging)
  int fetch_parallelism = 8;           // GpuBackendOptions::fetch_parallelism
  double row_cache_fraction = 0.04;    // HashAttention's row cache, rows per kv head / tokens
  SignatureConfig signatures;          // SimHash seed and norm margin, or learned MLPs
};

// Whether the GPU signs a sequence's keys and queries with the learned MLPs `w`: one key MLP per
// kv head, its shape and bits, and dims within LearnedSign's limits. Otherwise (e.g. one key MLP
// per query head) its learned-signature calls run on the CPU engine.
bool LearnedSignsOnGpu(const kernels::LearnedHashWeights& w, const SequenceDesc& desc);
// Whether the GPU assigns (and the saap runner reads) SAAP buckets for a sequence: the
// partitions fit its model (layers, heads, head dim), it keeps one-word signatures, and the
// kernels take the partitions' sizes. Otherwise its saap calls run on the CPU engine.
bool SaapOnGpu(const kernels::SaapWeights& w, const SequenceDesc& desc);

class DeviceState {
 public:
  // REQUIRES: source outlives the state; stream stays valid (the backend owns it).
  DeviceState(DeviceStateOptions options, RowSource* source, cudaStream_t stream);
  ~DeviceState();
  DeviceState(const DeviceState&) = delete;
  DeviceState& operator=(const DeviceState&) = delete;

  // Brings every sequence of the call up to its length at the call's layer (descs: as the
  // store holds them now, the call's appended token included, which is synced on its own after
  // the rest, as the CPU engine appends it). OUT_OF_RANGE past 2^30 tokens, RESOURCE_EXHAUSTED
  // when the device tier is full, ABORTED when the store's pages changed under the call.
  absl::Status Sync(const DecodeCall& call, absl::Span<const SequenceDesc> descs,
                    SyncedBatch* batch, DecodeResult* result);

  // Row-cache slots per kv head for a sequence of n tokens: row_cache_fraction of n rounded up
  // to 64, at most rows_cap (the longest union); 0 without a cache.
  int32_t CacheSlots(int32_t n, int32_t rows_cap) const;
  // Grows a layer's row cache to `cap` slots per kv head, keeping what it holds.
  absl::Status GrowCache(DeviceSequence* e, DeviceLayer* l, int32_t hkv, int32_t cap, size_t row,
                         absl::Span<const DeviceSequence* const> busy);
  // The SimHash planes of every kv head of a layer on the device: [Hkv][bits][d + 1].
  absl::StatusOr<const float*> Planes(uint32_t layer, int32_t hkv, int32_t bits, int32_t d);
  // The learned MLPs of a layer on the device (kernels::cuda::LearnedSign's packing): the H query
  // MLPs, then the key MLPs. REQUIRES: learned weights (options().signatures.learned).
  absl::StatusOr<const float*> LearnedMlps(uint32_t layer);
  // A layer of the SAAP partitions on the device. REQUIRES: options().signatures.saap.
  absl::StatusOr<kernels::cuda::SaapLayerWeights> SaapLayer(uint32_t layer);
  const DeviceStateOptions& options() const { return options_; }
  // The call's device scratch, at least `bytes` (contents not kept across calls).
  absl::StatusOr<char*> Scratch(size_t bytes);

  // A captured step's hold (engine/cuda/static_step.cc) on a sequence synced for one of its
  // layers (Sync): that layer's rows and signatures grown to max_tokens and its page list to the
  // store's reservation (every slot a step may write or read). Hold once per plan, not per layer.
  absl::Status HoldForSteps(DeviceSequence* e, uint32_t layer, const SequenceDesc& desc,
                            const kvstore::Reservation& reservation, uint64_t max_tokens,
                            absl::Span<const DeviceSequence* const> busy);
  void Hold(DeviceSequence* e) { ++e->held; }
  void Release(const std::string& sequence_id);

  // Frees what it holds of a sequence (after the last hold is released, if held).
  void Forget(const std::string& sequence_id);
  size_t bytes() const { return bytes_; }
  size_t capacity() const { return options_.capacity_bytes; }
  cudaStream_t stream() const { return stream_; }
  // Where the rows of a host half come from. pages_device_visible(): the kernels read the
  // store's pages in place (the page lists Sync keeps); otherwise (a store in another process)
  // a call's rows are gathered into row_staging(), pinned memory the kernels read in place.
  RowSource* source() const { return source_; }
  PinnedBuf* row_staging() { return &row_staging_; }
  size_t max_fetch_bytes() const { return options_.max_fetch_bytes; }
  // Runs the staging fetches of a batch's sequences side by side (fetch_parallelism - 1 helpers
  // beside the calling thread; none when the pages are device-visible: nothing is fetched).
  kvstore::WorkerPool* fetchers() { return &fetchers_; }

 private:
  absl::Status Alloc(DevBuf* b, size_t bytes);
  // Allocates *slot and copies `host` into it, waiting for the copy: a layer's planes, MLPs or
  // partitions, uploaded once.
  absl::Status UploadTable(DevBuf* slot, const std::vector<float>& host, const char* what);
  void Free(DevBuf* b);
  void FreeSequence(DeviceSequence* e);
  // Accounts `delta` more bytes to `self`, evicting idle sequences (least recently used first);
  // RESOURCE_EXHAUSTED when they do not fit. Sequences in `busy` are never evicted.
  absl::Status Charge(DeviceSequence* self, size_t delta,
                      absl::Span<const DeviceSequence* const> busy);
  // Replaces *b by a buffer of `bytes` (contents copied by `copy`, which may copy nothing).
  template <typename Copy>
  absl::Status Regrow(DeviceSequence* e, DevBuf* b, size_t bytes,
                      absl::Span<const DeviceSequence* const> busy, Copy&& copy);
  // Brings one layer's rows and signatures up to `target` tokens (rows from the row source).
  absl::Status SyncRows(DeviceSequence* e, uint32_t layer_index, const SequenceDesc& desc,
                        uint64_t target, absl::Span<const DeviceSequence* const> busy,
                        absl::Time deadline, DecodeResult* result);
  // Grows a layer's rows and signatures to hold `target` tokens.
  absl::Status ReserveRows(DeviceSequence* e, DeviceLayer* l, const SequenceDesc& desc,
                           uint64_t target, absl::Span<const DeviceSequence* const> busy);
  // Signs the keys of tokens [t0, t0 + cnt) of a layer (K rows in k_host, head-major).
  absl::Status SignKeys(DeviceSequence* e, DeviceLayer* l, uint32_t layer_index,
                        const SequenceDesc& desc, uint64_t t0, uint64_t cnt, const uint8_t* k_host,
                        absl::Span<const DeviceSequence* const> busy);
  // Compresses the keys of tokens [t0, t0 + cnt) of a layer (K rows in k_host, head-major):
  // quantizes the groups that close, keeps the open group's rows exact.
  absl::Status CompressKeys(DeviceSequence* e, DeviceLayer* l, const SequenceDesc& desc,
                            uint64_t t0, uint64_t cnt, const uint8_t* k_host,
                            absl::Span<const DeviceSequence* const> busy);
  // Brings a host half's page list up to `target` tokens.
  // slot(kv_head, token): the store's slot of a token (a PageView's or a Reservation's).
  using SlotOf = absl::FunctionRef<const uint8_t*(uint32_t, uint64_t)>;
  absl::Status SyncPages(DeviceSequence* e, uint32_t layer_index, const SequenceDesc& desc,
                         SlotOf slot, uint64_t target,
                         absl::Span<const DeviceSequence* const> busy);

  const DeviceStateOptions options_;
  RowSource* const source_;
  const cudaStream_t stream_;
  absl::node_hash_map<std::string, DeviceSequence> entries_;  // node map: pointers stay valid
  size_t bytes_ = 0;
  uint64_t tick_ = 0, evictions_ = 0;
  std::map<std::tuple<uint32_t, int32_t, int32_t>, DevBuf> planes_;
  std::map<uint32_t, DevBuf> learned_;  // per layer
  std::map<uint32_t, DevBuf> saap_;     // per layer (kernels::cuda::PackSaapLayer)
  DevBuf scratch_, sync_tmp_;
  PinnedBuf staging_, row_staging_;
  kvstore::WorkerPool fetchers_;
};

}  // namespace kvsparse::engine::gpu

#endif  // KVSPARSE_ENGINE_CUDA_DEVICE_STATE_H_
