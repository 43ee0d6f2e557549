// What the GPU backend keeps on its device per (sequence, layer), as the sequence's placement
// asks, brought up to the store's length on demand (a prefill written straight to the store, or
// the engine's appended token) and rebuilt when the sequence's incarnation changes: a cache of
// the store. DeviceState is the sync, and owns the parts, one file each:
//   - residency and accounting (engine/cuda/device_memory.h): the buffers per (sequence, layer),
//     the bytes held against the capacity, idle sequences evicted least recently used first;
//   - K rows (k_tier = device) and V rows (v_tier = device), [Hkv][capacity][d], here;
//   - key signatures (signature_bits > 0), one signing per signature kind with its tables
//     (engine/cuda/key_signing.h);
//   - for a half kept in host memory, the device-visible addresses of the store's pages of each
//     kv head, here: kernels read the selected rows in place over the host link (zero-copy, no
//     staging copy; the store's memory must be pinned and mapped); for a store in another
//     process, the pinned staging the launch plan gathers a call's rows into, and its fetchers;
//   - HashAttention's row cache (engine/cuda/row_cache.h);
//   - compressed keys (compressed_key_bits > 0, engine/cuda/compressed_key_sync.h);
//   - the call's device scratch.
//
// Not thread-safe: the backend serialises calls. Every allocation, copy and free is ordered on
// one CUDA stream.
#ifndef KVSPARSE_ENGINE_CUDA_DEVICE_STATE_H_
#define KVSPARSE_ENGINE_CUDA_DEVICE_STATE_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "engine/cuda/compressed_key_sync.h"
#include "engine/cuda/cuda_util.h"
#include "engine/cuda/device_memory.h"
#include "engine/cuda/key_signing.h"
#include "engine/decode_call.h"
#include "engine/engine_options.h"
#include "engine/row_source.h"
#include "engine/signatures.h"
#include "kvstore/store.h"
#include "kvstore/worker_pool.h"

namespace kvsparse::engine::gpu {

// The sequences of one call, synced (DeviceState::Sync).
struct SyncedBatch {
  std::vector<DeviceSequence*> seqs;        // [B]
  std::vector<const DeviceSequence*> busy;  // never evicted during the call
  // Views of the store's pages of sequences with a host half; held until the kernels are done
  // (pages may move again after).
  std::vector<std::unique_ptr<kvstore::PageView>> views;
  std::vector<int32_t> lens;  // [B] tokens at the call's layer
};

class DeviceState {
 public:
  // Reads options.gpu's capacity, row cache and fetch parallelism, max_fetch_bytes, signatures
  // and key_widths. REQUIRES: source outlives the state; stream stays valid (the backend owns it).
  DeviceState(EngineOptions options, RowSource* source, cudaStream_t stream);
  ~DeviceState();
  DeviceState(const DeviceState&) = delete;
  DeviceState& operator=(const DeviceState&) = delete;

  // Brings every sequence of the call up to its length at the call's layer (descs: as the
  // store holds them now, the call's appended token included, which is synced on its own after
  // the rest, as the CPU engine appends it). OUT_OF_RANGE past 2^30 tokens, RESOURCE_EXHAUSTED
  // when the device tier is full, ABORTED when the store's pages changed under the call.
  absl::Status Sync(const DecodeCall& call, absl::Span<const SequenceDesc> descs,
                    SyncedBatch* batch, DecodeResult* result);

  const EngineOptions& options() const { return options_; }
  DeviceMemory& memory() { return memory_; }
  // The signings of the signature kinds: SimHash always (its planes sign the queries of a
  // SimHash placement); learned and SAAP when their weights were given, else null.
  SimHashSigning& simhash() { return simhash_; }
  LearnedSigning* learned() { return learned_.get(); }
  SaapSigning* saap() { return saap_.get(); }
  // The deployment's key widths on the device (the maps of the sequences they apply to).
  DeviceKeyWidths& key_widths() { return key_widths_; }
  // The call's device scratch, at least `bytes` (contents not kept across calls).
  absl::StatusOr<char*> Scratch(size_t bytes);

  // A captured step's hold (engine/cuda/static_step.cc) on a sequence synced for one of its
  // layers (Sync): that layer's rows, signatures and compressed keys grown to max_tokens and its
  // page list to the store's reservation (every slot a step may write or read). Hold once per
  // plan, not per layer.
  absl::Status HoldForSteps(DeviceSequence* e, uint32_t layer, const SequenceDesc& desc,
                            const kvstore::Reservation& reservation, uint64_t max_tokens,
                            BusySequences busy);
  void Hold(DeviceSequence* e) { memory_.Hold(e); }
  void Release(const std::string& sequence_id) { memory_.Release(sequence_id); }
  // Frees what it holds of a sequence (after the last hold is released, if held).
  void Forget(const std::string& sequence_id) { memory_.Forget(sequence_id); }
  size_t bytes() const { return memory_.bytes(); }
  size_t capacity() const { return memory_.capacity(); }
  cudaStream_t stream() const { return memory_.stream(); }
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
  // Brings one layer's rows, signatures and compressed keys up to `target` tokens (rows from the
  // row source).
  absl::Status SyncRows(DeviceSequence* e, uint32_t layer_index, const SequenceDesc& desc,
                        uint64_t target, BusySequences busy, absl::Time deadline,
                        DecodeResult* result);
  // Grows a layer's rows and signatures to hold `target` tokens.
  absl::Status ReserveRows(DeviceSequence* e, DeviceLayer* l, const SequenceDesc& desc,
                           uint64_t target, BusySequences busy);
  // Signs the keys of tokens [t0, t0 + cnt) of a layer (K rows in k_host, head-major) with the
  // signing in force, from resident K or a temporary copy of the chunk.
  absl::Status SignKeys(DeviceSequence* e, DeviceLayer* l, uint32_t layer_index,
                        const SequenceDesc& desc, uint64_t t0, uint64_t cnt, const uint8_t* k_host,
                        BusySequences busy);
  // Brings a host half's page list up to `target` tokens.
  // slot(kv_head, token): the store's slot of a token (a PageView's or a Reservation's).
  using SlotOf = absl::FunctionRef<const uint8_t*(uint32_t, uint64_t)>;
  absl::Status SyncPages(DeviceSequence* e, uint32_t layer_index, const SequenceDesc& desc,
                         SlotOf slot, uint64_t target, BusySequences busy);

  const EngineOptions options_;
  RowSource* const source_;
  DeviceMemory memory_;  // first: the parts below free into it
  SimHashSigning simhash_;
  std::unique_ptr<LearnedSigning> learned_;
  std::unique_ptr<SaapSigning> saap_;
  KeySigning* signing_;  // SAAP, else learned, else SimHash (the CPU engine's order)
  DeviceKeyWidths key_widths_;
  DevBuf scratch_, sync_tmp_;
  PinnedBuf staging_, row_staging_;
  kvstore::WorkerPool fetchers_;
};

}  // namespace kvsparse::engine::gpu

#endif  // KVSPARSE_ENGINE_CUDA_DEVICE_STATE_H_
