// SAAP on the GPU: SaapSelect (the group's classifiers, the probed buckets, sink + window + the
// keys in them, kernels/cuda/saap.h) over the key buckets DeviceState keeps as one-word
// signatures (SaapAssignKeys when the keys reach the device), then the shared selected-rows path
// (engine/cuda/selected_rows_call.h: row cache, fetch, estimate). A query head's rows are its
// group's, so the union is the list itself.
#include "engine/cuda/selected_rows_call.h"
#include "kernels/cuda/saap.h"

namespace kvsparse::engine::gpu {
namespace {

namespace kc = kernels::cuda;

class SaapCall final : public SelectedRowsCall {
 public:
  explicit SaapCall(const Method& m) : params_(m.saap) {}
  // The deployment's partitions fit the sequence and the kernels (SaapOnGpu); parameters the
  // CPU engine would refuse stay there for their error. Rows staged from a store in another
  // process: K and V in the same tier (the fetch reads both by list position).
  static absl::Status Supports(const Method& m, const SequenceDesc& desc, const GpuCaps& caps) {
    kernels::Reasons reasons(absl::StatusCode::kFailedPrecondition);
    reasons.AddIf(caps.saap == nullptr, "the deployment has no SAAP partitions");
    reasons.AddIf(caps.saap != nullptr && !SaapOnGpu(*caps.saap, desc),
                  "the SAAP partitions do not fit the sequence's shape on the GPU");
    reasons.AddIf(caps.saap != nullptr && !kernels::ValidateSaapParams(m.saap, *caps.saap).ok(),
                  "the call's SAAP parameters do not fit the partitions");
    reasons.Add(StagedRowsFit(desc, caps));
    return reasons.ToStatus();
  }

 private:
  absl::StatusOr<int32_t> PlanSelection(LaunchPlan& lp) override {
    SaapSigning* saap = lp.state().saap();
    if (saap == nullptr) return absl::FailedPreconditionError("no SAAP partitions");
    absl::StatusOr<kc::SaapLayerWeights> w = saap->Layer(lp.call().layer);
    if (!w.ok()) return w.status();
    weights_ = *w;
    return lp.n_max;  // the probed buckets may hold every key
  }

  absl::Status EnqueueSelection(LaunchPlan& lp, Carver& c, const Selection& s) override {
    kc::SaapSelectParams sp;
    sp.w = weights_;
    sp.batch = lp.B;
    sp.dtype = lp.dtype;
    sp.q = lp.shape().q;
    sp.bucket_heads = lp.sig_heads();
    sp.bucket_stride = lp.words;
    sp.seq_lens = lp.shape().seq_lens;
    sp.max_seq_len = lp.n_max;
    sp.probes = params_.probes;
    sp.sink_tokens = params_.sink_tokens;
    sp.local_tokens = params_.local_tokens;
    sp.out = s.rows;
    sp.positions = s.positions;
    sp.counts = s.counts;
    sp.budgets = s.budgets;
    const size_t wb = kc::SaapSelectWorkspaceBytes(sp);
    void* ws = c.Take<char>(wb);
    if (!lp.running()) return absl::OkStatus();
    KVS_CUDA_OK(kc::SaapSelect(sp, ws, wb, lp.stream()), "SaapSelect");
    return absl::OkStatus();
  }

  const kernels::SaapParams params_;
  kc::SaapLayerWeights weights_;
};

}  // namespace

const GpuRunner& SaapRunner() {
  static const RunnerOf<SaapCall> runner;
  return runner;
}

}  // namespace kvsparse::engine::gpu
