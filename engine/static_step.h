// A decode step that can be captured in a CUDA graph (a compiled model server's step with no
// graph break): planned once on the host for a fixed batch of sequences, a method and a bound
// on their lengths, then run layer by layer with nothing of the host per call.
//
//   plan (host, once):  the store reserves every sequence's pages up to max_tokens (pinned; rows
//                       written in place), the GPU backend brings its device state up to the
//                       sequences' lengths, holds room for max_tokens rows, and builds each
//                       layer's tables in device memory of the plan's own;
//   Enqueue (per layer, capturable): one kernel writes the step's token where the engine keeps
//                       it (the store's reserved slot, the resident rows) at the caller's
//                       positions (a device tensor: the lengths before the step), derives the
//                       step's lengths and seeds (layer l at position p draws as an eager call
//                       with seed + l * 2^32 + p does), and the method's kernels run over them;
//                       statistics stay on the device;
//   Commit (host, when the caller wants): waits for the caller's stream and advances the
//                       store's lengths over the rows the steps wrote.
// While a plan lives its sequences are held: Decode calls and drops of them are refused
// (FAILED_PRECONDITION) and neither the store nor the GPU tier evicts them. A step writes at
// each sequence's next row (one past the last written); any other position, or one at or past
// max_tokens, writes nothing: that sequence's output is zeros and Commit reports OUT_OF_RANGE;
// a negative position marks the slot inactive for the step (nothing written, zeros, no error).
//
// Rebind moves a plan to another batch of as many sequences in the same device memory: a CUDA
// graph recorded from its Enqueue calls replays over the new sequences (a model server's graphs,
// captured once at start over placeholder sequences, serving whichever requests hold the batch's
// slots; docs/VLLM.md).
//
// Methods: those whose GPU runner says Capturable (dense with K and V resident; S2ANTA prop and
// flash; hash top-k with SimHash signatures; top-k and S2ANTA-prop over compressed keys, whose
// step appends its key to the compressed keys on the device, closing a group where it fills);
// the others are FAILED_PRECONDITION at plan time
// and run as eager calls. The store must be in this process with pages the GPU can read (the
// PyTorch op's embedded store).
#ifndef KVSPARSE_ENGINE_STATIC_STEP_H_
#define KVSPARSE_ENGINE_STATIC_STEP_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/method.h"
#include "kernels/dtype.h"

namespace kvsparse::engine {

struct StaticStepRequest {
  std::vector<std::string> sequence_ids;  // B, distinct, each holding >= 1 token in every layer
  Method method;
  uint64_t max_tokens = 0;  // every sequence's length stays at or below this while planned
  uint64_t seed = 0;        // layer l at position p draws as an eager call with seed + l * 2^32 + p
  float scale = 0.f;        // 0: 1/sqrt(d)
  kernels::DType dtype = kernels::DType::kBf16;  // of q, the new K/V and the output
  // Where the K or V rows are in host memory: after each layer, a side stream reads one word of
  // every page of the next layer, so that the host link's address translations of the rows the
  // next layer fetches are warm (kernels::cuda::WarmPagedRows; the side stream joins the caller's
  // at the end of the last layer, so a graph must capture whole steps). false: every layer's
  // fetch translates cold.
  bool warm_pages = true;
  // Enqueue called outside a stream capture (a model server running attention eagerly between
  // its own graphs): the second call of a layer with the same q, new_k, new_v, positions and
  // out records that layer's kernels as a CUDA graph, and later calls with them replay it, one
  // launch instead of a dozen (the host's share of an eager step: docs/PERF.md, "The flagship
  // inside vLLM: where the host's time went"). Calls inside a capture (the caller records whole
  // steps) are unchanged. false: every call outside a capture launches its kernels.
  bool layer_graphs = true;
  // Optional, one per sequence: its own bound (0: max_tokens), the store pages reserved and the
  // device room held for it; a step at or past it writes nothing (as past max_tokens). A slot
  // kept idle (negative positions) can hold a placeholder sequence bound at its length, which
  // then costs next to nothing; the kernels' grids stay sized for max_tokens.
  std::vector<uint64_t> bounds;
};

class StaticStep {
 public:
  // Statistics per layer: int32 blocks of B * H each (rows read per (b, kv head) in the first
  // B * Hkv entries of block 0, as the eager call's statistics block).
  static constexpr int kStatBlocks = 4;

  virtual ~StaticStep() = default;
  // One layer of the step on `stream` (a cudaStream_t), capturable: q and out [B, H, d], new_k
  // and new_v [B, Hkv, d] (contiguous, the sequences' dtype), positions [B] int64, all device
  // memory that stays valid while a captured graph replays.
  virtual absl::Status Enqueue(uint32_t layer, const void* q, const void* new_k, const void* new_v,
                               const int64_t* positions, void* out, void* stream) = 0;
  // Waits for `stream`, then commits the rows the steps wrote; returns each sequence's length.
  // OUT_OF_RANGE when a step was refused since the last commit (its sequence's output was zeros);
  // FAILED_PRECONDITION when the layers of a sequence stand at different lengths (a step that
  // did not run every layer): that sequence is not committed.
  virtual absl::StatusOr<std::vector<uint64_t>> Commit(void* stream) = 0;
  // Moves the plan to `sequence_ids` (as many as the plan's batch, distinct, none held by another
  // plan, each holding >= 1 token in every layer and at most its bound; bounds as
  // StaticStepRequest::bounds, empty: max_tokens for all): waits for `stream`,
  // releases the sequences it held (rows written since the last Commit are dropped, as when a
  // plan ends: Commit first to keep them) and binds the new ones in the same device memory, so
  // that everything an Enqueue recorded (a CUDA graph) replays over them. On an error the plan
  // holds no sequence: every step writes nothing and gives zeros (Commit: OUT_OF_RANGE) until a
  // Rebind succeeds.
  virtual absl::Status Rebind(const std::vector<std::string>& sequence_ids,
                              const std::vector<uint64_t>& bounds, void* stream) = 0;
  // Copies the statistics of every layer, [layers, kStatBlocks, B * H] int32, to device memory
  // dst on `stream` (capturable).
  virtual absl::Status CopyStats(int32_t* dst, void* stream) = 0;
  virtual uint32_t num_layers() const = 0;
  virtual uint32_t batch() const = 0;
  virtual uint32_t num_q_heads() const = 0;
  virtual uint32_t num_kv_heads() const = 0;
  virtual uint32_t head_dim() const = 0;
  // Device memory the plan itself holds beside the engine's sequences (every layer's tables,
  // statistics and buffers, the region the layers share, the control block).
  virtual uint64_t device_bytes() const = 0;
  // Layer graphs (StaticStepRequest::layer_graphs) recorded and replayed so far.
  struct LayerGraphCounts {
    uint64_t recorded = 0;
    uint64_t replayed = 0;
  };
  virtual LayerGraphCounts layer_graph_counts() const = 0;
};

}  // namespace kvsparse::engine

#endif  // KVSPARSE_ENGINE_STATIC_STEP_H_
