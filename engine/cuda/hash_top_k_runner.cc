// HashAttention top-k on the GPU: the selection, then the shared selected-rows path
// (engine/cuda/selected_rows_call.h: row cache, fetch, estimate):
//   SimHashSign / LearnedSign  the queries' signatures;
//   HashTopK                   sink + local window + top-k by Hamming similarity per query head;
//   UnionSelected              the union over each GQA group (each row once per kv head).
#include <algorithm>

#include "engine/cuda/selected_rows_call.h"
#include "kernels/cuda/hash_topk.h"
#include "kernels/hash_topk.h"

namespace kvsparse::engine::gpu {
namespace {

namespace kc = kernels::cuda;

class HashTopKCall final : public SelectedRowsCall {
 public:
  explicit HashTopKCall(const Method& m) : params_(m.hash) {}
  // Signatures on the device (SimHash, or learned MLPs that fit: SignaturesOnGpu). Rows staged
  // from a store in another process: K and V in the same tier (the fetch reads both by list
  // position).
  static absl::Status Supports(const Method& m, const SequenceDesc& desc, const GpuCaps& caps) {
    kernels::Reasons reasons;
    reasons.Add(StagedRowsFit(desc, caps));
    reasons.Add(SignaturesOnGpu(m, desc, caps));
    return reasons.ToStatus();
  }
  // Captured steps: SimHash signatures (the step signs its key as the backend's sync does; the
  // learned MLPs' key signing is not in the step yet). The selection reads the step's lengths on
  // the device; the row cache never holds a stale row (steps never rewrite one).
  static bool Capturable(const Method& m, const SequenceDesc&) { return !m.learned_signatures; }
  // The selection ranks the step's own key by its signature.
  static bool ReadsStepSignatures(const Method&) { return true; }

 private:
  absl::StatusOr<int32_t> PlanSelection(LaunchPlan& lp) override {
    for (int32_t b = 0; b < lp.B; ++b) {
      absl::StatusOr<int32_t> k = kernels::ResolveTopK(params_.fixed, lp.len(b));
      if (!k.ok()) return k.status();
    }
    tk_.batch = lp.B;
    tk_.num_q_heads = lp.H;
    tk_.key_heads = lp.hkv;
    tk_.bits = static_cast<int32_t>(lp.descs()[0].placement.signature_bits);
    tk_.max_seq_len = lp.n_max;
    tk_.fixed = params_.fixed;
    if (absl::Status s = lp.LoadPlanes(); !s.ok()) return s;
    return std::max(1, tk_.MaxSelected());
  }

  absl::Status EnqueueSelection(LaunchPlan& lp, Carver& c, const Selection& s) override {
    const int32_t BH = lp.BH;
    uint32_t* qsig = c.Take<uint32_t>(static_cast<size_t>(BH) * lp.words);
    tk_.q_sigs = qsig;
    tk_.k_sig_heads = lp.sig_heads();
    tk_.k_token_stride = lp.words;
    tk_.seq_lens = lp.shape().seq_lens;
    tk_.indices = c.Take<int32_t>(static_cast<size_t>(BH) * s.max_selected);
    tk_.counts = s.counts;
    tk_.budgets = s.budgets;
    const size_t tw = kc::HashTopKWorkspaceBytes(tk_);
    void* tws = c.Take<char>(tw);
    const Union un = PlanUnion(lp, c, s, tk_.indices, tk_.counts);
    if (!lp.running()) return absl::OkStatus();
    const cudaStream_t stream = lp.stream();
    if (absl::Status st = lp.SignQueries(qsig); !st.ok()) return st;
    KVS_CUDA_OK(kc::HashTopK(tk_, tws, tw, stream), "HashTopK");
    return EnqueueUnion(lp, un);
  }

  const kernels::HashTopKParams params_;
  kc::HashTopKLaunchParams tk_;
};

}  // namespace

const GpuRunner& HashTopKRunner() {
  static const RunnerOf<HashTopKCall> runner;
  return runner;
}

}  // namespace kvsparse::engine::gpu
