// The decode engine: one layer of one decode step for B sequences, no gRPC inside.
//
//   1. validate the call and, per sequence, what the method needs of its placement
//   2. append the new token's K/V (if given) to the store
//   3. sync the resident state (K, V, signatures the placement keeps on the device)
//   4. select rows (the method's unit: engine/methods/<method>.cc)
//   5. gather exactly the rows the selection lists: one RowSource::Gather per sequence for all
//      kv heads (each row once: the union over the GQA group); resident halves are read in place
//   6. estimate (fp32 accumulation), output in q's dtype, with per-kv-head statistics
//
// Steps 1-2 are this class's for every backend. Steps 3-6 run on a DecodeBackend when it takes
// the call (the GPU backend, engine/cuda/gpu_backend.h, batched over the sequences), otherwise
// on the CPU (engine/cpu_step.h), where each sequence of a call is its own batch-1 problem.
// Sequence i draws its random numbers with kernels::SequenceSeed(seed, i) on both. docs/DESIGN.md
// follows one call through.
#ifndef KVSPARSE_ENGINE_DECODE_ENGINE_H_
#define KVSPARSE_ENGINE_DECODE_ENGINE_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/decode_call.h"
#include "engine/engine_options.h"
#include "engine/method.h"
#include "engine/resident_cache.h"
#include "engine/row_source.h"
#include "engine/signatures.h"
#include "engine/static_step.h"

namespace kvsparse::engine {

// The start of the FAILED_PRECONDITION message of a call with q on the device that the GPU backend
// does not take (nothing was appended; the caller may retry with q in host memory).
inline constexpr char kNotOnBackend[] = "this call cannot run on the GPU backend";

// Where a validated call is computed when not on the CPU: the GPU backend
// (engine/cuda/gpu_backend.h) of a worker that has a GPU. The engine validates the call and
// appends the new tokens to the store first; the backend then does sync, selection, gather and
// estimate for every sequence of the call.
class DecodeBackend {
 public:
  virtual ~DecodeBackend() = default;
  virtual const char* name() const = 0;
  // Whether this backend computes `call` for its sequences, described by descs (method,
  // placements, shapes, dtype; not lengths): OK, or FAILED_PRECONDITION saying why not; the CPU
  // computes the rest. Asked before the call's new tokens are appended.
  virtual absl::Status Supports(const DecodeCall& call,
                                absl::Span<const SequenceDesc> descs) const = 0;
  // REQUIRES: Supports(call, descs).
  // descs[b]: sequence b of the call as the store holds it now (the new token included).
  // Fills result->output ([B, H, d] in q's dtype), heads ([B * Hkv] in order), the timing's
  // selection / gather / compute / sync seconds and sync_bytes. Thread-safe.
  virtual absl::Status Decode(const DecodeCall& call, absl::Span<const SequenceDesc> descs,
                              DecodeResult* result) = 0;
  // A captured step's plan (engine/static_step.h) over descs (as the store holds them; call:
  // the plan's template, validated, with placeholder device pointers); UNIMPLEMENTED where the
  // backend has none. REQUIRES: Supports(call, descs).
  virtual absl::StatusOr<std::unique_ptr<StaticStep>> PlanStatic(
      const DecodeCall& call, absl::Span<const SequenceDesc> descs, const StaticStepRequest& req) {
    return absl::UnimplementedError("this backend has no captured steps");
  }
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
  // row source pass through. Thread-safe; calls on one sequence serialise per layer. What the
  // method leaves to the engine (MethodUnit::Resolve: S2ANTA's tile size 0) is filled first.
  absl::StatusOr<DecodeResult> Decode(const DecodeCall& call);

  // Plans a captured step (engine/static_step.h) on the GPU backend. FAILED_PRECONDITION: no
  // GPU backend, a method or placement it cannot capture, a sequence already held by a plan or
  // with layers of unequal or zero length; INVALID_ARGUMENT, NOT_FOUND as Decode; OUT_OF_RANGE:
  // a sequence already past max_tokens. The sequences stay held until the plan is destroyed.
  // REQUIRES: the plan is destroyed before the engine. Its device memory (per-layer tables and
  // scratch sized for max_tokens) is the caller's, outside the GPU tier's capacity; the rows it
  // reserves are charged (the store's pages to the store, resident rows to the GPU tier).
  absl::StatusOr<std::unique_ptr<StaticStep>> PlanStatic(const StaticStepRequest& request);
  // The plan's Rebind (StaticStep::Rebind) checks the new sequences as this does.
  // Whether a captured step's plan holds the sequence (its Decode calls and drops are refused).
  bool Held(const std::string& sequence_id) const;

  // Frees what the engine keeps of a sequence (its resident state on the CPU engine and the
  // backend's device state): for an owner that drops the sequence from the store in the same
  // process. (A sequence dropped elsewhere is forgotten when a call finds it gone, or evicted.)
  void Forget(const std::string& sequence_id);

  const ResidentCache& resident() const { return cache_; }
  const DecodeBackend* device_backend() const { return backend_.get(); }
  const char* backend() const { return backend_ != nullptr ? backend_->name() : "cpu"; }

 private:
  // Decode of a call whose method the unit has resolved; start: when Decode began.
  absl::StatusOr<DecodeResult> DecodeResolved(const DecodeCall& call, absl::Time start);
  // The sequences of the call as the store holds them, checked against the call and the
  // method (steps 1 and 2 above, before anything is appended).
  absl::StatusOr<std::vector<SequenceDesc>> Describe(const DecodeCall& call);
  // Appends each sequence's new token to the store (all before any compute).
  absl::Status AppendNewTokens(const DecodeCall& call, absl::Span<const SequenceDesc> descs);
  // A plan's sequences (call.sequence_ids) described and checked: every layer at one length of
  // at least 1 token and at most its bound (bounds: StaticStepRequest::bounds), the backend's
  // support (PlanStatic's errors).
  absl::StatusOr<std::vector<SequenceDesc>> DescribePlanned(const DecodeCall& call,
                                                            uint64_t max_tokens,
                                                            absl::Span<const uint64_t> bounds);
  // Marks ids held by a plan (FAILED_PRECONDITION naming one already held; then none is marked),
  // and releases them.
  absl::Status HoldIds(absl::Span<const std::string> ids);
  void ReleaseIds(absl::Span<const std::string> ids);
  friend class HeldStep;  // a plan's Rebind moves its ids (decode_engine.cc)

  const EngineOptions options_;
  RowSource* const source_;
  SignatureMaker signatures_;
  ResidentCache cache_;
  std::unique_ptr<DecodeBackend> backend_;
  mutable std::mutex held_mu_;
  absl::flat_hash_set<std::string> held_;  // guarded by held_mu_: sequences of live plans
};

}  // namespace kvsparse::engine

#endif  // KVSPARSE_ENGINE_DECODE_ENGINE_H_
