// SANTA / S2ANTA on the GPU: S2antaProp (systematic, proportional tile budgets), S2antaFlash
// (systematic, uniform tile budgets) and SantaIid (i.i.d. over the whole sequence), each one
// kernel sequence that scores the resident K and reads only the sampled V rows (in place, from
// host pages when V is offloaded). Tiles of kernels::cuda::kSantaTile tokens only; Bernoulli
// qK^T runs on the CPU engine.
#include <algorithm>
#include <vector>

#include "engine/cuda/gpu_runner.h"
#include "kernels/cuda/santa.h"

namespace kvsparse::engine::gpu {
namespace {

namespace kc = kernels::cuda;

class SantaCall final : public MethodCall {
 public:
  explicit SantaCall(const Method& m)
      : params_(m.santa),
        iid_(params_.sampler == kernels::SantaSampler::kIid),
        prop_(params_.allocation == kernels::SantaAllocation::kProp) {}
  // K resident (the scores stream it); tiles of kSantaTile; no Bernoulli qK^T; iid with global
  // allocation, or systematic with prop or flash.
  static bool Supports(const Method& m, const SequenceDesc& desc, const GpuCaps& caps) {
    const kernels::SantaParams& p = m.santa;
    const int32_t tile = p.tile_size == 0 ? caps.default_tile_size : p.tile_size;
    // (The sampled V rows are read inside the kernel: V from another process's store is not.)
    if (desc.placement.k_tier != kvstore::Tier::kDevice || tile != kc::kSantaTile ||
        p.bernoulli_qk_samples != 0 ||
        (caps.staged_rows && desc.placement.v_tier != kvstore::Tier::kDevice)) {
      return false;
    }
    return (p.sampler == kernels::SantaSampler::kIid &&
            p.allocation == kernels::SantaAllocation::kGlobal) ||
           (p.sampler == kernels::SantaSampler::kSystematic &&
            (p.allocation == kernels::SantaAllocation::kProp ||
             p.allocation == kernels::SantaAllocation::kFlash));
  }

  absl::Status Enqueue(LaunchPlan& lp, Carver& c) override {
    kc::SantaParams sp;
    sp.shape = lp.shape();
    sp.num_samples = params_.samples;
    sp.seeds = lp.seeds();
    // Distinct V rows read: counted by prop / flash; for iid from its sampled indices.
    sp.rows_read = iid_ ? nullptr : lp.stats();
    sp.indices = iid_ ? c.Take<int32_t>(static_cast<size_t>(lp.BH) * params_.samples) : nullptr;
    iid_indices_.device = sp.indices;
    const size_t wb = iid_    ? kc::SantaIidWorkspaceBytes(sp)
                      : prop_ ? kc::S2antaPropWorkspaceBytes(sp)
                              : kc::S2antaFlashWorkspaceBytes(sp);
    void* ws = c.Take<char>(wb);
    if (absl::Status s = lp.Mark(1); !s.ok()) return s;
    if (absl::Status s = lp.Mark(2); !s.ok()) return s;
    if (lp.running()) {
      KVS_CUDA_OK(iid_    ? kc::SantaIid(sp, ws, wb, lp.stream())
                  : prop_ ? kc::S2antaProp(sp, ws, wb, lp.stream())
                          : kc::S2antaFlash(sp, ws, wb, lp.stream()),
                  "SANTA");
    }
    return absl::OkStatus();
  }

  absl::Status Download(LaunchPlan& lp) override {
    if (!iid_) return absl::OkStatus();
    return iid_indices_.Fetch(static_cast<size_t>(lp.BH) * params_.samples, lp.stream());
  }

  void Stats(const LaunchPlan& lp, int32_t b, int32_t j, HeadStats* hs) const override {
    const uint64_t n = static_cast<uint64_t>(lp.len(b));
    const int32_t G = lp.G;
    uint64_t rows = static_cast<uint64_t>(lp.host_stats()[b * lp.hkv + j]);
    if (iid_) {  // distinct tokens over the group's samples
      const size_t S = static_cast<size_t>(params_.samples);
      const size_t first = (static_cast<size_t>(b) * lp.H + j * G) * S;
      const std::vector<int32_t>& all = iid_indices_.host;
      std::vector<int32_t> toks(all.begin() + first, all.begin() + first + G * S);
      std::sort(toks.begin(), toks.end());
      rows = n > 0 ? std::unique(toks.begin(), toks.end()) - toks.begin() : 0;
    }
    hs->rows_selected = n > 0 ? static_cast<uint64_t>(params_.samples) * G : 0;
    hs->rows_fetched = rows;
    hs->budgets.assign(G, n > 0 ? params_.samples : 0);
    hs->bytes[kDeviceTier] += n * lp.row;  // every K row is scored
    hs->bytes[lp.v_tier()] += rows * lp.row;
  }

 private:
  const kernels::SantaParams params_;
  const bool iid_, prop_;
  Downloaded<int32_t> iid_indices_;  // iid: the samples [B, H, S]
};

}  // namespace

const GpuRunner& SantaRunner() {
  static const RunnerOf<SantaCall> runner;
  return runner;
}

}  // namespace kvsparse::engine::gpu
