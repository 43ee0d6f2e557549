// A selection method's GPU path: one runner per method (engine/cuda/<method>_runner.cc), listed
// in the method table (engine/methods/registry.cc) beside the method's CPU unit. The backend
// (engine/cuda/gpu_backend.cc) syncs the device state, builds the call's LaunchPlan and drives a
// runner's MethodCall through these steps, in this order:
//   Plan              host-side bounds, per-sequence state the method needs (a row cache),
//                     room for its host tables (LaunchPlan::AddHostTable);
//   FillTables        its host tables' entries (after the shared ones);
//   Enqueue           carves its device buffers and, in the run pass, enqueues its kernels;
//                     called twice: once to size the buffers (LaunchPlan::base() null), once to
//                     run; marks the stage ends (LaunchPlan::Mark(1): selection done, Mark(2):
//                     gather done);
//   FillScratchTables host table entries that point into the placed scratch;
//   Download          what its statistics need beyond the statistics block;
//   Stats             per (sequence, kv head): rows selected and fetched, budgets, bytes per tier.
#ifndef KVSPARSE_ENGINE_CUDA_GPU_RUNNER_H_
#define KVSPARSE_ENGINE_CUDA_GPU_RUNNER_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "engine/cuda/cuda_util.h"
#include "engine/cuda/device_state.h"
#include "engine/cuda/launch_plan.h"
#include "engine/decode_call.h"
#include "engine/method.h"
#include "engine/row_source.h"
#include "kernels/reasons.h"

namespace kvsparse::engine::gpu {

// What the backend can do, for the runners' Supports. (A method's defaults are the engine's,
// filled before a runner sees it: MethodUnit::Resolve.)
struct GpuCaps {
  // The deployment's learned hash weights (null: SimHash); the GPU signs with them where they
  // fit a sequence (LearnedSignsOnGpu).
  const kernels::LearnedHashWeights* learned = nullptr;
  // The deployment's SAAP partitions (null: none). With them the key signatures are SAAP
  // buckets (DeviceState assigns them where SaapOnGpu): the saap runner reads them, the hash
  // methods are refused (the CPU engine's error).
  const kernels::SaapWeights* saap = nullptr;
  // The host halves' rows come from a store whose pages the GPU cannot read (another process):
  // a runner gathers them through LaunchPlan::StageListed / StageAll, or does not take the call.
  bool staged_rows = false;
  // The deployment's key widths (null: none): a sequence they apply to (KeyWidthsApply) keeps
  // its compressed keys at per-channel widths on the device.
  const kernels::KeyWidths* key_widths = nullptr;
};

// A runner's refusal of a call: FAILED_PRECONDITION saying why the GPU path does not compute
// it. The engine then computes the call on the CPU, or refuses a call whose q is on the device
// with this reason; the reason names what would have to change (method parameter, placement,
// deployment).
inline absl::Status NotOnGpu(absl::string_view why) { return absl::FailedPreconditionError(why); }

// Whether the GPU signs the keys and queries a hash method of `m` reads: the sequence keeps
// signatures, the request asks for the deployment's kind (a mismatch is the CPU engine's error to
// give), and learned MLPs fit the sequence.
inline absl::Status SignaturesOnGpu(const Method& m, const SequenceDesc& desc,
                                    const GpuCaps& caps) {
  kernels::Reasons reasons(absl::StatusCode::kFailedPrecondition);
  reasons.AddIf(desc.placement.signature_bits == 0, "the placement keeps no signatures");
  reasons.AddIf(caps.saap != nullptr, "the deployment's signatures are SAAP buckets");
  reasons.AddIf(m.learned_signatures != (caps.learned != nullptr),
                caps.learned != nullptr
                    ? "the call asks for SimHash signatures; the deployment's are learned"
                    : "the call asks for learned signatures; the deployment has none");
  reasons.AddIf(caps.learned != nullptr && !LearnedSignsOnGpu(*caps.learned, desc),
                "the learned MLPs do not fit the sequence's shape on the GPU");
  return reasons.ToStatus();
}

// Whether the selected-rows path (engine/cuda/selected_rows_call.h) can read a sequence's rows:
// rows staged from a store in another process need K and V in the same tier (the fetch reads
// both by list position).
inline absl::Status StagedRowsFit(const SequenceDesc& desc, const GpuCaps& caps) {
  const kvstore::Placement& pl = desc.placement;
  if (caps.staged_rows &&
      (pl.k_tier == kvstore::Tier::kDevice) != (pl.v_tier == kvstore::Tier::kDevice)) {
    return NotOnGpu("rows staged from a store in another process need K and V in one tier");
  }
  return absl::OkStatus();
}

// One Decode call of a method on the GPU (its state lives from Plan to Stats).
class MethodCall {
 public:
  // Whether a call of `m` over a sequence like `desc` can run as a captured step
  // (engine/cuda/static_step.cc): its Enqueue needs nothing of the host after Plan (no row counts
  // read back, no staging) and reads the step's lengths from the device, and every per-sequence
  // state it reads is what the step's token append (kernels::cuda::StepAppend) keeps up to date. A
  // runner's call type hides this to say yes.
  static bool Capturable(const Method&, const SequenceDesc&) { return false; }
  // Whether a captured step of `m` reads the signature of the key it appends in that same step
  // (then the step signs it on the device, as DeviceState::SignKeys does; other methods leave the
  // resident signatures to be brought up to date after the plan). A call type hides this to say
  // yes.
  static bool ReadsStepSignatures(const Method&) { return false; }
  virtual ~MethodCall() = default;
  virtual absl::Status Plan(LaunchPlan& lp) { return absl::OkStatus(); }
  virtual void FillTables(LaunchPlan& lp) {}
  virtual absl::Status Enqueue(LaunchPlan& lp, Carver& ws) = 0;
  virtual void FillScratchTables(LaunchPlan& lp) {}
  virtual absl::Status Download(LaunchPlan& lp) { return absl::OkStatus(); }
  // hs arrives with sequence_index, kv_head and dense_equivalent_bytes set.
  virtual void Stats(const LaunchPlan& lp, int32_t b, int32_t j, HeadStats* hs) const = 0;
};

class GpuRunner {
 public:
  virtual ~GpuRunner() = default;
  // Whether the GPU path computes `m` for a sequence (OK), or every reason it does not (one
  // FAILED_PRECONDITION, kernels::Reasons): its parameters and what the placement keeps. The checks
  // every method shares (dtype, head dim, group size, pages the GPU can read) are the backend's.
  virtual absl::Status Supports(const Method& m, const SequenceDesc& desc,
                                const GpuCaps& caps) const = 0;
  virtual std::unique_ptr<MethodCall> Begin(const Method& m) const = 0;
  virtual bool Capturable(const Method& m, const SequenceDesc& desc) const = 0;
  // MethodCall::ReadsStepSignatures of the call Begin returns for `m`.
  virtual bool ReadsStepSignatures(const Method& m) const { return false; }
};

// The runner of one MethodCall type, which provides
//   static absl::Status Supports(const Method&, const SequenceDesc&, const GpuCaps&);
//   explicit Call(const Method&);
template <typename Call>
class RunnerOf final : public GpuRunner {
 public:
  absl::Status Supports(const Method& m, const SequenceDesc& desc,
                        const GpuCaps& caps) const override {
    return Call::Supports(m, desc, caps);
  }
  std::unique_ptr<MethodCall> Begin(const Method& m) const override {
    return std::make_unique<Call>(m);
  }
  bool Capturable(const Method& m, const SequenceDesc& desc) const override {
    return Call::Capturable(m, desc);
  }
  bool ReadsStepSignatures(const Method& m) const override { return Call::ReadsStepSignatures(m); }
};

// The runners, one per file of engine/cuda/.
const GpuRunner& DenseRunner();
const GpuRunner& SantaRunner();
const GpuRunner& HashTopKRunner();
const GpuRunner& VAttentionRunner();
const GpuRunner& SaapRunner();
const GpuRunner& TopKRunner();

}  // namespace kvsparse::engine::gpu

#endif  // KVSPARSE_ENGINE_CUDA_GPU_RUNNER_H_
