// SANTA / S2ANTA on the GPU: S2antaProp (systematic, proportional tile budgets), S2antaFlash
// (systematic, uniform tile budgets) and SantaIid (i.i.d. over the whole sequence), each one
// kernel sequence that scores the resident K and reads only the sampled V rows (in place, from
// host pages when V is offloaded; from a store in another process, the sampled rows are listed
// by a first run, gathered into pinned staging and read by token: DecodeShape::v_listed). Tiles
// of kernels::cuda::kSantaTile tokens only. Bernoulli qK^T: a kernel first writes the group's
// effective queries (kernels/cuda/bernoulli_qk.h) and the sampler scores them in place of q;
// the K features they read come back in the statistics. Scores from compressed keys:
// engine/cuda/santa_compressed_call.h.
#include <algorithm>
#include <vector>

#include "engine/cuda/gpu_runner.h"
#include "engine/cuda/santa_compressed_call.h"
#include "kernels/cuda/bernoulli_qk.h"
#include "kernels/cuda/santa.h"

namespace kvsparse::engine::gpu {
namespace {

namespace kc = kernels::cuda;

class SantaCall final : public MethodCall {
 public:
  explicit SantaCall(const Method& m)
      : params_(m.santa),
        iid_(params_.sampler == kernels::SantaSampler::kIid),
        prop_(params_.allocation == kernels::SantaAllocation::kProp),
        bernoulli_(params_.bernoulli_qk_samples > 0) {}
  // Captured steps: prop and flash (iid's row count is counted on the host), exact scores
  // (Bernoulli qK^T's feature counts are downloaded per call).
  static bool Capturable(const Method& m, const SequenceDesc&) {
    return m.santa.sampler != kernels::SantaSampler::kIid && m.santa.bernoulli_qk_samples == 0;
  }
  // K resident (the scores stream it); tiles of kSantaTile; exact or Bernoulli qK^T scores; iid
  // with global allocation, or systematic with prop or flash. V from a store in another process
  // is staged.
  static absl::Status Supports(const Method& m, const SequenceDesc& desc, const GpuCaps& caps) {
    const kernels::SantaParams& p = m.santa;
    kernels::Reasons reasons(absl::StatusCode::kFailedPrecondition);
    reasons.AddIf(desc.placement.k_tier != kvstore::Tier::kDevice,
                  "S2ANTA over exact scores on the GPU needs K on the device");
    reasons.Add(SantaTilesOnGpu(p));
    const bool iid_global = p.sampler == kernels::SantaSampler::kIid &&
                            p.allocation == kernels::SantaAllocation::kGlobal;
    const bool sys_prop_or_flash = p.sampler == kernels::SantaSampler::kSystematic &&
                                   (p.allocation == kernels::SantaAllocation::kProp ||
                                    p.allocation == kernels::SantaAllocation::kFlash);
    reasons.AddIf(!iid_global && !sys_prop_or_flash,
                  "S2ANTA on the GPU: iid with global allocation, or systematic with prop or "
                  "flash");
    return reasons.ToStatus();
  }

  absl::Status Enqueue(LaunchPlan& lp, Carver& c) override {
    kc::SantaLaunchParams sp;
    sp.shape = lp.shape();
    sp.num_samples = params_.samples;
    sp.seeds = lp.seeds();
    // Distinct V rows read: counted by prop / flash; for iid from its sampled indices.
    sp.rows_read = iid_ ? nullptr : lp.stats();
    sp.indices = iid_ ? c.Take<int32_t>(static_cast<size_t>(lp.BH) * params_.samples) : nullptr;
    iid_indices_.device = sp.indices;
    if (bernoulli_) {  // the effective queries, scored in place of q
      kc::BernoulliQueriesParams bp;
      bp.batch = lp.B;
      bp.num_q_heads = lp.H;
      bp.num_kv_heads = lp.hkv;
      bp.head_dim = lp.d;
      bp.dtype = lp.dtype;
      bp.q = sp.shape.q;
      bp.q_eff = c.Take<char>(static_cast<size_t>(lp.BH) * lp.d * lp.es);
      bp.params = {params_.bernoulli_qk_samples, params_.bernoulli_mode, params_.bernoulli_sampler};
      bp.seed = sp.seed;
      bp.seeds = sp.seeds;
      bp.features = c.Take<int32_t>(static_cast<size_t>(lp.BK) * 2);
      features_.device = bp.features;
      if (lp.running())
        KVS_CUDA_OK(kc::SampleBernoulliQueries(bp, lp.stream()), "SampleBernoulliQueries");
      sp.shape.q = bp.q_eff;
    }
    const size_t wb = iid_    ? kc::SantaIidWorkspaceBytes(sp)
                      : prop_ ? kc::S2antaPropWorkspaceBytes(sp)
                              : kc::S2antaFlashWorkspaceBytes(sp);
    void* ws = c.Take<char>(wb);
    // V in another process: the sampler runs twice with the same streams, first to list the
    // rows it samples (V read from K's rows, the output discarded), then over those rows staged.
    const bool staged = lp.staged() && lp.v_tier() != kDeviceTier;
    kc::SampledRowsParams rp;
    int32_t* marks = nullptr;
    size_t rwb = 0;
    void* rws = nullptr;
    if (staged) {
      const size_t n = static_cast<size_t>(lp.n_max);
      marks = iid_ ? nullptr : c.Take<int32_t>(static_cast<size_t>(lp.BH) * n);
      rp.batch = lp.B;
      rp.num_q_heads = lp.H;
      rp.num_kv_heads = lp.hkv;
      rp.seq_lens = sp.shape.seq_lens;
      rp.max_seq_len = lp.n_max;
      rp.sample_counts = marks;                     // prop, flash
      rp.indices = sp.indices;                      // iid
      rp.num_samples = iid_ ? params_.samples : 0;  // the mode, sized before indices is carved
      rp.tokens = c.Take<int32_t>(static_cast<size_t>(lp.BK) * n);
      rp.counts = c.Take<int32_t>(lp.BK);
      rwb = kc::SampledRowsWorkspaceBytes(rp);
      rws = c.Take<char>(rwb);
    }
    auto run = [&](const kc::SantaLaunchParams& x) {
      return iid_    ? kc::SantaIid(x, ws, wb, lp.stream())
             : prop_ ? kc::S2antaProp(x, ws, wb, lp.stream())
                     : kc::S2antaFlash(x, ws, wb, lp.stream());
    };
    if (staged && lp.running()) {
      kc::SantaLaunchParams dry = sp;
      dry.rows_read = nullptr;
      dry.shape.v = nullptr;
      dry.shape.v_heads = sp.shape.k_heads;  // any readable rows of V's shape
      dry.shape.v_pages = {};
      dry.sample_counts = marks;
      if (marks != nullptr) {
        KVS_CUDA_OK(cudaMemsetAsync(marks, 0, sizeof(int32_t) * lp.BH * lp.n_max, lp.stream()),
                    "SANTA sample counts");
      }
      KVS_CUDA_OK(run(dry), "SANTA (listing the sampled rows)");
      KVS_CUDA_OK(kc::SampledRows(rp, rws, rwb, lp.stream()), "SampledRows");
    }
    if (absl::Status s = lp.Mark(1); !s.ok()) return s;
    if (staged && lp.running()) {
      if (absl::Status s = lp.StageListed(rp.tokens, lp.n_max, rp.counts, &sp.shape); !s.ok()) {
        return s;
      }
      sp.shape.v_listed = {rp.tokens, rp.counts, lp.n_max};
    }
    if (absl::Status s = lp.Mark(2); !s.ok()) return s;
    if (lp.running()) KVS_CUDA_OK(run(sp), "SANTA");
    return absl::OkStatus();
  }

  absl::Status Download(LaunchPlan& lp) override {
    if (bernoulli_) {
      if (absl::Status s = features_.Fetch(static_cast<size_t>(lp.BK) * 2, lp.stream()); !s.ok()) {
        return s;
      }
    }
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
    if (bernoulli_) {
      const size_t at = 2 * (static_cast<size_t>(b) * lp.hkv + j);
      hs->key_features_head = static_cast<uint64_t>(features_.host[at]);
      hs->key_features_group = static_cast<uint64_t>(features_.host[at + 1]);
    }
  }

 private:
  const kernels::SantaParams params_;
  const bool iid_, prop_, bernoulli_;
  Downloaded<int32_t> iid_indices_;  // iid: the samples [B, H, S]
  Downloaded<int32_t> features_;     // Bernoulli qK^T: K features read [B, Hkv, 2]
};

// Exact scores (K resident) are SantaCall's; scores from compressed keys are
// engine/cuda/santa_compressed_call.h's.
class SantaRunnerOfBoth final : public GpuRunner {
 public:
  absl::Status Supports(const Method& m, const SequenceDesc& desc,
                        const GpuCaps& caps) const override {
    return Exact(m) ? SantaCall::Supports(m, desc, caps)
                    : SantaOverCompressedKeysSupports(m, desc, caps);
  }
  std::unique_ptr<MethodCall> Begin(const Method& m) const override {
    if (Exact(m)) return std::make_unique<SantaCall>(m);
    return BeginSantaOverCompressedKeys(m);
  }
  bool Capturable(const Method& m, const SequenceDesc& desc) const override {
    return Exact(m) ? SantaCall::Capturable(m, desc) : SantaOverCompressedKeysCapturable(m, desc);
  }

 private:
  static bool Exact(const Method& m) { return m.santa.scores == kernels::ScoreSource::kExact; }
};

}  // namespace

const GpuRunner& SantaRunner() {
  static const SantaRunnerOfBoth runner;
  return runner;
}

}  // namespace kvsparse::engine::gpu
