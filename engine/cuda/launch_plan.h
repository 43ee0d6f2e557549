// The GPU backend's plan of one Decode call, the part every method shares:
//   - the call's dimensions and its synced sequences;
//   - host tables in one pinned buffer, uploaded in one copy: q in the sequences' dtype, the
//     lengths, the per-sequence seeds, per (sequence, kv head) the device addresses of the
//     resident K / V rows, page lists, key signatures and compressed keys, then the method's own
//     tables
//     (AddHostTable), then the statistics block (zeroed by the upload);
//   - the device scratch laid out as [tables | output | method buffers]; the method carves its
//     buffers twice, first to size them (base null), then to place them (PlaceScratch);
//   - the kernels' DecodeShape over it, the stage events, and the one download of statistics and
//     output (adjacent in the scratch).
// A method's runner (engine/cuda/gpu_runner.h) fills in its part between these steps; the order
// is GpuBackend::Decode's.
#ifndef KVSPARSE_ENGINE_CUDA_LAUNCH_PLAN_H_
#define KVSPARSE_ENGINE_CUDA_LAUNCH_PLAN_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "engine/cuda/cuda_util.h"
#include "engine/cuda/device_state.h"
#include "engine/decode_call.h"
#include "kernels/cuda/decode_params.h"
#include "kernels/cuda/hash_topk.h"

namespace kvsparse::engine::gpu {

// Indices of HeadStats::bytes.
inline constexpr size_t kDeviceTier = static_cast<size_t>(kvstore::Tier::kDevice);
inline constexpr size_t kHostTier = static_cast<size_t>(kvstore::Tier::kHost);

// Bytes of one closed group's block of a sequence's compressed keys (0: it keeps none).
size_t CompressedKeyBlockBytes(const SequenceDesc& desc);

class LaunchPlan {
 public:
  // Statistics: int32 values per (sequence, query head), this many blocks of B * H.
  static constexpr int kStatBlocks = 4;

  // REQUIRES: everything outlives the plan; batch synced for this call.
  LaunchPlan(const DecodeCall& call, absl::Span<const SequenceDesc> descs, SyncedBatch* batch,
             DeviceState* state);
  LaunchPlan(const LaunchPlan&) = delete;
  LaunchPlan& operator=(const LaunchPlan&) = delete;

  // ---- The call. ----
  const DecodeCall& call() const { return call_; }
  const Method& method() const { return call_.method; }
  absl::Span<const SequenceDesc> descs() const { return descs_; }
  DeviceState& state() { return *state_; }
  // The stream every copy and kernel of the call goes on: the backend's, or the caller's for a
  // captured step (engine/cuda/static_step.cc), set before a pass; null reads as "none set", so
  // the caller's legacy default stream is set as cudaStreamLegacy.
  cudaStream_t stream() const { return stream_ != nullptr ? stream_ : state_->stream(); }
  void set_stream(cudaStream_t s) { stream_ = s; }
  // A captured step's plan (engine/cuda/static_step.cc): no statistics are read after its
  // calls, so methods leave out what only the statistics need (a standard error's kernels).
  bool captured() const { return captured_; }
  void set_captured() { captured_ = true; }
  const int32_t B, H, hkv, G, d;
  const kernels::DType dtype;
  const size_t es, row;  // element and row bytes
  const int32_t BH, BK;  // B * H, B * Hkv
  const int32_t words;   // signature words per token (32 bits each)
  const int32_t n_max;   // longest sequence, at least 1
  int32_t len(int32_t b) const { return batch_->lens[b]; }
  DeviceSequence* sequence(int32_t b) const { return batch_->seqs[b]; }
  DeviceLayer& layer(int32_t b) const { return batch_->seqs[b]->layers[call_.layer]; }
  absl::Span<const DeviceSequence* const> busy() const { return batch_->busy; }
  // The tier K and V rows are read from, as the placements say: the device, or for a half not
  // on the device the row source's tier (host in this process, remote across processes).
  size_t k_tier() const { return k_tier_; }
  size_t v_tier() const { return v_tier_; }
  // Whether the rows of the host halves are gathered from the row source into pinned staging
  // (a store whose pages the GPU cannot read: another process) instead of read in place through
  // the page lists. Runners that support it (GpuCaps::staged_rows) call StageListed or StageAll.
  bool staged() const { return staged_; }

  // ---- Host tables (before BuildTables). ----
  // Room for `count` values of T in the host tables; returns its offset.
  template <typename T>
  size_t AddHostTable(size_t count) {
    const size_t off = host_carver_.used();
    host_carver_.Take<T>(count);
    return off;
  }
  // Carves the statistics block, then fills the shared tables in a pinned buffer of the
  // backend's (zeroed first).
  absl::Status BuildTables(PinnedBuf* host);
  // Overwrites entry b of the lengths table in the host tables (after BuildTables: what the
  // device's table holds before a captured step writes it; the plan's len(b) is unchanged).
  void SetHostLength(int32_t b, int32_t n) { HostTable<int32_t>(lens_off_)[b] = n; }
  // A host table's entries, to fill (after BuildTables).
  template <typename T>
  T* HostTable(size_t off) const {
    return reinterpret_cast<T*>(host_ + off);
  }

  // ---- Passes over the method's launch sequence. ----
  // Starts a pass: base null sizes the method's buffers, the scratch's base places them and
  // enqueues. events: record the stage times (null: not timed).
  void BeginPass(char* base, cudaEvent_t* events);
  bool running() const { return base_ != nullptr; }
  char* base() const { return base_; }
  // The device address of a host table's entries in this pass.
  template <typename T>
  T* Dev(size_t off) const {
    return reinterpret_cast<T*>(base_ + off);
  }
  // Device tables: the per-sequence seeds [B]; key signatures per (b, j) [B * Hkv].
  const uint64_t* seeds() const { return Dev<const uint64_t>(seeds_off_); }
  const uint32_t* const* sig_heads() const { return Dev<const uint32_t* const>(sig_heads_off_); }
  // The shared tables a captured step writes on the device (run pass): lengths [B], seeds [B],
  // resident K / V row bases, signature bases and page lists per (b, j) [B * Hkv] (null entries
  // where a sequence keeps none).
  int32_t* lens_table() const { return Dev<int32_t>(lens_off_); }
  uint64_t* seeds_table() const { return Dev<uint64_t>(seeds_off_); }
  void* const* k_heads_table() const { return Dev<void* const>(k_heads_off_); }
  void* const* v_heads_table() const { return Dev<void* const>(v_heads_off_); }
  uint32_t* const* sig_heads_table() const { return Dev<uint32_t* const>(sig_heads_off_); }
  const void* const* const* page_lists() const { return Dev<const void* const* const>(pages_off_); }
  // Compressed keys per (b, j) [B * Hkv] (null entries where a sequence keeps none): the base of
  // the closed groups' blocks (block g at + g * CompressedKeyBlockBytes) and the open group's
  // exact rows ([kKeyGroupTokens, d]).
  uint8_t* const* ck_heads_table() const { return Dev<uint8_t* const>(ck_heads_off_); }
  void* const* ck_tails_table() const { return Dev<void* const>(ck_tails_off_); }
  // The call's layer's channel maps where the deployment's key widths apply to its sequences
  // (DeviceKeyWidths; null ones otherwise): what the compressed keys were quantized with and are
  // scored through. Set by BuildTables.
  DeviceKeyMap key_map() const { return key_map_; }
  size_t stats_bytes() const { return sizeof(int32_t) * kStatBlocks * static_cast<size_t>(BH); }
  // The statistics block on the device; null in the sizing pass.
  int32_t* stats() const {
    return base_ == nullptr ? nullptr : reinterpret_cast<int32_t*>(base_ + stats_off_);
  }
  size_t stats_offset() const { return stats_off_; }
  // Scratch offset of the method's buffers.
  size_t method_offset() const { return method_off_; }
  const kernels::cuda::DecodeShape& shape() const { return shape_; }
  // Records stage event i of a timed pass: 0 start, 1 selection done, 2 gather done, 3 end.
  absl::Status Mark(int i);
  // Signatures of the queries ([B, H, words] at out), as the CPU engine's SignatureMaker::Query:
  // SimHash, or the deployment's learned MLPs. LoadPlanes (in Plan) uploads the layer's planes or
  // MLPs once; SignQueries (in the run pass) enqueues the signing on the call's stream.
  absl::Status LoadPlanes();
  absl::Status SignQueries(uint32_t* out) const;

  // ---- Staged rows (staged() only, in the run pass). ----
  // Waits for the stream, reads the row lists the kernels wrote (per (b, j): counts[i] tokens at
  // tokens + i * cap; device addresses), gathers those rows of the host halves from the row
  // source into pinned staging in list order, and points *shape's addressing of the host halves
  // at them: row r of (b, j)'s list is row r of k_heads[i] / v_heads[i] (FetchRows reads them
  // with source_by_position). Gathers of at most max_fetch_bytes each (several heads per
  // Gather, a long list over several). ABORTED when the sequence shrank under the call.
  absl::Status StageListed(const int32_t* tokens, int32_t cap, const int32_t* counts,
                           kernels::cuda::DecodeShape* shape);
  // Every row 0 .. len(b) - 1 of the host halves, in token order (token t at row t).
  absl::Status StageAll(kernels::cuda::DecodeShape* shape);

  // ---- Scratch, upload, download. ----
  // Places the scratch for the method's `method_bytes`; base() of the run pass.
  absl::StatusOr<char*> PlaceScratch(size_t method_bytes);
  absl::Status Upload();
  // Enqueues the download of the statistics and the output into a pinned buffer of the
  // backend's.
  absl::Status Download(PinnedBuf* down);
  // After the stream is done: the statistics block and the output, in the host buffer.
  const int32_t* host_stats() const { return reinterpret_cast<const int32_t*>(down_); }
  // The output in q's dtype into result->output (nothing when it is on the device).
  void WriteOutput(DecodeResult* result) const;

 private:
  const DecodeCall& call_;
  const absl::Span<const SequenceDesc> descs_;
  SyncedBatch* const batch_;
  DeviceState* const state_;
  const size_t k_tier_, v_tier_;
  const bool staged_;
  cudaStream_t stream_ = nullptr;
  bool captured_ = false;
  absl::Status Stage(absl::Span<const std::vector<uint32_t>> lists,
                     kernels::cuda::DecodeShape* shape);
  Carver host_carver_{nullptr};
  size_t q_off_ = 0, lens_off_ = 0, seeds_off_ = 0;
  size_t k_heads_off_ = 0, v_heads_off_ = 0, pages_off_ = 0, sig_heads_off_ = 0;
  size_t ck_heads_off_ = 0, ck_tails_off_ = 0;
  DeviceKeyMap key_map_;
  size_t stats_off_ = 0, table_bytes_ = 0, out_off_ = 0, method_off_ = 0;
  char* host_ = nullptr;  // pinned host tables
  char* base_ = nullptr;  // the pass's scratch base (null: sizing)
  const char* down_ = nullptr;
  cudaEvent_t* events_ = nullptr;
  const float* planes_ = nullptr;  // SimHash planes, or the learned MLPs (query MLPs first)
  kernels::cuda::DecodeShape shape_;
};

}  // namespace kvsparse::engine::gpu

#endif  // KVSPARSE_ENGINE_CUDA_LAUNCH_PLAN_H_
