// The decode engine: one layer of one decode step for B sequences, no gRPC inside.
//
//   1. validate; append the new token's K/V (if given) to the store and the resident state
//   2. sync the resident state (K, V, signatures the placement keeps on the device)
//   3. selection (kernels/: dense, SANTA/S2ANTA, HashAttention top-k, vAttention)
//   4. gather exactly the rows the selection lists: one RowSource::Gather per sequence for all
//      kv heads (each row once: the union over the GQA group); resident halves are read in place
//   5. estimate (fp32 accumulation), output in q's dtype, with per-kv-head statistics
//
// Each sequence of a call is its own batch-1 problem; sequence i draws its random numbers with
// kernels::SequenceSeed(seed, i). The CPU computes with the kernels' references; a DecodeBackend
// (the GPU backend, server/gpu_backend.h) takes the calls it supports, batched over the
// sequences, and draws the same random numbers.
#ifndef KVSPARSE_SERVER_DECODE_ENGINE_H_
#define KVSPARSE_SERVER_DECODE_ENGINE_H_

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kernels/dtype.h"
#include "kernels/hash_topk.h"
#include "kernels/santa.h"
#include "kernels/vattention.h"
#include "kvstore/types.h"
#include "server/resident_cache.h"
#include "server/row_source.h"

namespace kvsparse::server {

enum class MethodKind { kDense, kSanta, kHashTopK, kVAttention };
const char* MethodName(MethodKind kind);

struct Method {
  MethodKind kind = MethodKind::kDense;
  kernels::SantaParams santa;            // kSanta (tile_size 0: EngineOptions::default_tile_size)
  kernels::HashTopKParams hash;          // kHashTopK (bits 0: the sequence's signature bits)
  kernels::VAttentionParams vattention;  // kVAttention (bits 0: the sequence's)
  bool learned_signatures = false;       // the request asked for learned (not SimHash) signatures
};

struct DecodeCall {
  uint32_t layer = 0;
  std::vector<std::string> sequence_ids;  // B
  kernels::DType q_dtype = kernels::DType::kBf16;
  absl::Span<const uint8_t> q;  // [B, H, d] of q_dtype
  // The H and d q claims to have (0: take the sequences'); must match the model.
  uint32_t q_heads = 0, q_dim = 0;
  // Optional new token per sequence, appended to `layer` first: [B, Hkv, d] each, in the
  // sequences' dtype (new_kv_dtype must match it).
  absl::Span<const uint8_t> new_k, new_v;
  kernels::DType new_kv_dtype = kernels::DType::kBf16;
  Method method;
  uint64_t seed = 0;
  float scale = 0.f;  // 0: 1/sqrt(d)
  bool return_indices = false;
  absl::Time deadline = absl::InfiniteFuture();
};

struct HeadStats {
  uint32_t sequence_index = 0;
  uint32_t kv_head = 0;
  uint64_t rows_selected = 0;     // over the group's query heads, counting repeats
  uint64_t rows_fetched = 0;      // distinct rows read for the estimate and the selection
  uint64_t rows_cached = 0;       // of rows_fetched: found in the GPU's row cache, not fetched
  std::vector<uint64_t> budgets;  // per query head of the group
  std::array<uint64_t, kvstore::kNumTiers> bytes{};  // read from each tier
  uint64_t dense_equivalent_bytes = 0;               // K and V of every row
  std::vector<uint32_t> fetched_tokens;              // with return_indices: the estimate's rows
};

struct DecodeTiming {
  double selection_seconds = 0, gather_seconds = 0, compute_seconds = 0, engine_seconds = 0;
  double sync_seconds = 0;  // resident state catch-up (one-off after a prefill)
  // GPU backend: host work after the sync until every copy and kernel of the call is enqueued,
  // and the wait from then until the stream is done (kernels, transfers, wake-up).
  double launch_seconds = 0, wait_seconds = 0;
  // How many calls the selection / gather / compute times stand for: 1 when every call is
  // timed (CPU engine); the GPU backend times one call in GpuBackendOptions::stage_timing_every
  // (its CUDA events cost host time), which then stands for that many, and the others carry 0
  // here and in the stage times.
  double stage_weight = 1;
};

struct DecodeResult {
  std::string output;  // [B, H, d] in q's dtype
  uint32_t num_q_heads = 0, head_dim = 0;
  std::vector<HeadStats> heads;  // [B * Hkv]
  DecodeTiming timing;
  uint64_t sync_bytes = 0;  // rows read to bring resident state up to date (not per-step cost)
};

struct EngineOptions {
  int32_t default_tile_size = 256;              // S2ANTA tile when a request gives 0
  size_t resident_capacity_bytes = 4ull << 30;  // device-tier state (K, V, signatures)
  // Largest single read from the row source when many rows are needed at once (the resident
  // state's catch-up, or every K row when K is not resident): far under the message limit.
  size_t max_fetch_bytes = 32 << 20;
  SignatureConfig signatures;
};

// Where a validated call is computed when not on the CPU: the GPU backend
// (server/gpu_backend.h) of a worker that has a GPU. The engine validates the call and appends
// the new tokens to the store first; the backend then does sync, selection, gather and estimate
// for every sequence of the call.
class DecodeBackend {
 public:
  virtual ~DecodeBackend() = default;
  virtual const char* name() const = 0;
  // Whether this backend computes `call` for its sequences, described by descs (method,
  // placements, shapes, dtype); the CPU computes the rest.
  virtual bool Supports(const DecodeCall& call, absl::Span<const SequenceDesc> descs) const = 0;
  // REQUIRES: Supports(call, descs).
  // descs[b]: sequence b of the call as the store holds it now (the new token included).
  // Fills result->output ([B, H, d] in q's dtype), heads ([B * Hkv] in order), the timing's
  // selection / gather / compute / sync seconds and sync_bytes. Thread-safe.
  virtual absl::Status Decode(const DecodeCall& call, absl::Span<const SequenceDesc> descs,
                              DecodeResult* result) = 0;
  // Frees what it holds of a sequence the store no longer has.
  virtual void Forget(const std::string& sequence_id) = 0;
  // Bytes of per-sequence state it holds on its device, and its capacity for them.
  virtual size_t resident_bytes() const = 0;
  virtual size_t resident_capacity() const = 0;
};

class DecodeEngine {
 public:
  // REQUIRES: source outlives the engine. backend: optional (null: everything on the CPU).
  DecodeEngine(EngineOptions options, RowSource* source,
               std::unique_ptr<DecodeBackend> backend = nullptr);
  DecodeEngine(const DecodeEngine&) = delete;
  DecodeEngine& operator=(const DecodeEngine&) = delete;

  // INVALID_ARGUMENT (shapes, dtypes, method parameters), NOT_FOUND (unknown sequence),
  // FAILED_PRECONDITION (method needs what the placement does not keep, e.g. hash top-k without
  // signatures), RESOURCE_EXHAUSTED (store or device tier full), DEADLINE_EXCEEDED; errors of the
  // row source pass through. Thread-safe; calls on one sequence serialise per layer.
  absl::StatusOr<DecodeResult> Decode(const DecodeCall& call);

  const ResidentCache& resident() const { return cache_; }
  const DecodeBackend* device_backend() const { return backend_.get(); }
  const char* backend() const { return backend_ != nullptr ? backend_->name() : "cpu"; }

 private:
  struct Sequence;
  absl::Status DecodeSequence(const DecodeCall& call, uint32_t index, const SequenceDesc& desc,
                              DecodeResult* result);

  const EngineOptions options_;
  RowSource* const source_;
  SignatureMaker signatures_;
  ResidentCache cache_;
  std::unique_ptr<DecodeBackend> backend_;
};

}  // namespace kvsparse::server

#endif  // KVSPARSE_SERVER_DECODE_ENGINE_H_
