// torch.ops.kvsparse's SALE ops (kernels/sale.h): sale_prefill, the block-sparse attention of
// one prompt by SALE's selection, and sale_calibrate, the per-head thresholds of a target error
// over sample prompts. Host tensors run the CPU reference; CUDA tensors SALE's kernels
// (kernels/cuda/sale.h) on the caller's current stream. Registered into the library that
// torch_ops.cc defines (TORCH_LIBRARY_FRAGMENT); Python's kvsparse.torch.sale wraps them.
#include <ATen/ATen.h>
#include <torch/library.h>
#if __has_include(<ATen/cuda/CUDAContext.h>)
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#define KVSPARSE_TORCH_CUDA 1
#endif

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "kernels/dtype.h"
#include "kernels/sale.h"
#include "op/torch_args.h"
#if defined(KVSPARSE_WITH_CUDA)
#include "kernels/cuda/sale.h"
#endif

namespace kvsparse::torch_ops {
namespace {

using kernels::DType;

// SALE's block geometry from the op's arguments.
kernels::SaleParams SaleParamsOf(int64_t block_q, int64_t block_k, int64_t sink_tokens,
                                 int64_t local_tokens) {
  kernels::SaleParams params;
  params.block_q = static_cast<int32_t>(block_q);
  params.block_k = static_cast<int32_t>(block_k);
  params.sink_tokens = static_cast<int32_t>(sink_tokens);
  params.local_tokens = static_cast<int32_t>(local_tokens);
  Check(kernels::ValidateSaleParams(params));
  return params;
}

// SALE's CPU reference over host tensors; blocks as the op returns them.
at::Tensor SalePrefillHost(const kernels::SalePrefill& p, const kernels::SaleParams& params,
                           at::ArrayRef<double> tau) {
  const std::vector<float> thresholds(tau.begin(), tau.end());
  kernels::SaleMask mask;
  Check(kernels::SaleSelect(p, params, thresholds, &mask));
  Check(kernels::SaleAttend(p, params, mask));
  at::Tensor blocks = at::empty({p.num_q_heads, 2}, at::TensorOptions().dtype(at::kLong));
  for (int32_t h = 0; h < p.num_q_heads; ++h) {
    blocks[h][0] = mask.causal_blocks[h];
    blocks[h][1] = mask.selected_blocks[h];
  }
  return blocks;
}

#if KVSPARSE_TORCH_CUDA && defined(KVSPARSE_WITH_CUDA)
void CheckCuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    Raise(absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e))));
  }
}

// SALE's CUDA kernels (kernels/cuda/sale.h) on the caller's current stream: the thresholds, the
// mask and the selection's workspace come from torch's allocators, nothing synchronises, and
// blocks stays on the device. What the kernels do not take is Unimplemented, naming it.
at::Tensor SalePrefillCuda(const at::Tensor& q, const kernels::SalePrefill& p,
                           const kernels::SaleParams& params, at::ArrayRef<double> tau) {
  namespace kc = kernels::cuda;
  if (!kc::SaleSupports(params, p.head_dim) ||
      !kc::SaleAttendSupports(params, p.head_dim, p.dtype)) {
    Raise(absl::UnimplementedError(absl::StrCat(
        "sale_prefill on CUDA takes bf16 or fp16, head_dim 64 or 128, block_q 64, block_k 32 and "
        "sink + local at most 1024 tokens (got ",
        kernels::DTypeName(p.dtype), ", head_dim ", p.head_dim, ", block_q ", params.block_q,
        ", block_k ", params.block_k, ", sink ", params.sink_tokens, ", local ",
        params.local_tokens, "); CPU tensors run any of them")));
  }
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(q.get_device()).stream();
  const at::TensorOptions bytes = q.options().dtype(at::kByte);
  const at::Tensor tau_host =
      at::tensor(std::vector<float>(tau.begin(), tau.end()), at::kFloat).pin_memory();
  const at::Tensor tau_dev = tau_host.to(q.device(), /*non_blocking=*/true);
  const int64_t q_blocks = (p.tokens + params.block_q - 1) / params.block_q;
  const int64_t k_blocks = (p.tokens + params.block_k - 1) / params.block_k;
  at::Tensor mask = at::empty({p.num_q_heads, q_blocks, k_blocks}, bytes);
  kc::SaleSelectParams sp;
  sp.prompt = p;
  sp.tau = tau_dev.data_ptr<float>();
  sp.blocks = params;
  sp.mask = mask.data_ptr<uint8_t>();
  const size_t ws_bytes = kc::SaleSelectWorkspaceBytes(sp);
  at::Tensor ws = at::empty({static_cast<int64_t>(ws_bytes)}, bytes);
  CheckCuda(kc::SaleSelect(sp, ws.data_ptr(), ws_bytes, stream), "sale_prefill selection");
  kc::SaleAttendParams ap;
  ap.prompt = p;
  ap.blocks = params;
  ap.mask = mask.data_ptr<uint8_t>();
  CheckCuda(kc::SaleAttend(ap, stream), "sale_prefill computation");
  const at::Tensor selected = mask.sum({1, 2}, /*keepdim=*/false, at::kLong);
  return at::stack({at::full_like(selected, kernels::SaleCausalBlocks(p.tokens, params)), selected},
                   1);
}
#endif

// One prompt's tensors for SALE (kernels/sale.h): q [H, n, d], k and v [Hkv, n, d] (a leading
// batch dimension of 1 is accepted), contiguous, on one device, with the output allocated.
struct SaleOperands {
  at::Tensor q, k, v, out;
  kernels::SalePrefill p;
};
SaleOperands SaleOperandsOf(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                            double scale) {
  auto squeeze = [&](const at::Tensor& t, const char* name) {
    at::Tensor r = t.dim() == 4 && t.size(0) == 1 ? t.squeeze(0) : t;
    if (r.dim() != 3) Invalid(absl::StrCat(name, ": [heads, tokens, head_dim] (or [1, ...])"));
    if (r.device() != q_in.device()) Invalid("q, k and v must be on one device");
    return Aligned16(r);  // SALE's CUDA kernels read rows 16 bytes at a time
  };
  SaleOperands o;
  o.q = squeeze(q_in, "q");
  o.k = squeeze(k_in, "k");
  o.v = squeeze(v_in, "v");
  const DType dt = DTypeOf(o.q, "q");
  if (DTypeOf(o.k, "k") != dt || DTypeOf(o.v, "v") != dt) Invalid("q, k and v need one dtype");
  if (o.k.sizes() != o.v.sizes() || o.q.size(1) != o.k.size(1) || o.q.size(2) != o.k.size(2)) {
    Invalid("k and v [Hkv, n, d] must match q [H, n, d] in tokens and head_dim");
  }
  o.out = at::empty_like(o.q);
  kernels::SalePrefill& p = o.p;
  p.tokens = static_cast<int32_t>(o.q.size(1));
  p.num_q_heads = static_cast<int32_t>(o.q.size(0));
  p.num_kv_heads = static_cast<int32_t>(o.k.size(0));
  p.head_dim = static_cast<int32_t>(o.q.size(2));
  p.dtype = dt;
  p.scale = static_cast<float>(scale);
  p.q = o.q.data_ptr();
  p.k = o.k.data_ptr();
  p.v = o.v.data_ptr();
  p.out = o.out.data_ptr();
  Check(kernels::ValidateSalePrefill(p));
  return o;
}

// SALE prefill (kernels/sale.h) of one prompt (SaleOperandsOf), one threshold per query head.
// Returns the output [H, n, d] and per head the causal blocks and those computed ([H, 2], int64,
// on q's device). CPU tensors run the reference; CUDA tensors SALE's kernels (SalePrefillCuda).
std::tuple<at::Tensor, at::Tensor> SalePrefill(const at::Tensor& q_in, const at::Tensor& k_in,
                                               const at::Tensor& v_in, at::ArrayRef<double> tau,
                                               double scale, int64_t block_q, int64_t block_k,
                                               int64_t sink_tokens, int64_t local_tokens) {
  const SaleOperands o = SaleOperandsOf(q_in, k_in, v_in, scale);
  if (static_cast<int64_t>(tau.size()) != o.q.size(0)) {
    Invalid("tau: one threshold per query head");
  }
  const kernels::SaleParams params = SaleParamsOf(block_q, block_k, sink_tokens, local_tokens);
  for (double t : tau) {
    if (!(t >= 0.0 && t < 1.0)) Invalid(absl::StrCat("tau: each threshold in [0, 1), got ", t));
  }
  if (!o.q.is_cuda()) return {o.out, SalePrefillHost(o.p, params, tau)};
#if KVSPARSE_TORCH_CUDA && defined(KVSPARSE_WITH_CUDA)
  return {o.out, SalePrefillCuda(o.q, o.p, params, tau)};
#else
  Raise(absl::UnimplementedError("sale_prefill: this build has no CUDA kernels"));
#endif
}

#if KVSPARSE_TORCH_CUDA && defined(KVSPARSE_WITH_CUDA)
// SALE's halving search (kernels::SaleHalvingSearch) with each round on SALE's CUDA kernels: the
// errors are against the kernels' own output with every block selected (tau 0), computed on the
// device; one synchronisation a round brings the per-head figures to the search.
absl::StatusOr<kernels::SaleCalibration> SaleCalibrateCuda(const std::vector<SaleOperands>& samples,
                                                           const kernels::SaleParams& params,
                                                           double theta, float tau0,
                                                           int32_t max_halvings) {
  const int32_t H = samples[0].p.num_q_heads;
  std::vector<at::Tensor> dense;  // per sample, computed in the first round
  auto round = [&](absl::Span<const float> tau) -> absl::StatusOr<kernels::SaleRound> {
    if (dense.empty()) {
      const std::vector<double> zero(H, 0.0);
      for (const SaleOperands& o : samples) {
        SalePrefillCuda(o.q, o.p, params, zero);
        dense.push_back(o.out.to(at::kFloat));
      }
    }
    const std::vector<double> t(tau.begin(), tau.end());
    at::Tensor worst, skipped;
    for (size_t x = 0; x < samples.size(); ++x) {
      const SaleOperands& o = samples[x];
      const at::Tensor blocks = SalePrefillCuda(o.q, o.p, params, t).to(at::kDouble);
      const at::Tensor err = (o.out.to(at::kFloat) - dense[x]).abs().sum({1, 2}).to(at::kDouble) /
                             std::max<int32_t>(o.p.tokens, 1);
      const at::Tensor causal = blocks.select(1, 0);
      const at::Tensor skip =
          at::where(causal > 0, 1.0 - blocks.select(1, 1) / causal.clamp_min(1), 0.0);
      worst = x == 0 ? err : at::maximum(worst, err);
      skipped = x == 0 ? skip : skipped + skip;
    }
    skipped = skipped / static_cast<double>(samples.size());
    const at::Tensor e = worst.cpu(), s = skipped.cpu();
    return kernels::SaleRound{std::vector<double>(e.data_ptr<double>(), e.data_ptr<double>() + H),
                              std::vector<double>(s.data_ptr<double>(), s.data_ptr<double>() + H)};
  };
  return kernels::SaleHalvingSearch(H, theta, tau0, max_halvings, round);
}
#endif

// SALE's per-head calibration over the samples of one layer (each sample's q [H, n, d], k and v
// [Hkv, n, d], all on the CPU or all on one CUDA device): kernels::SaleCalibrate, the reference,
// on CPU tensors; on CUDA tensors the same search on SALE's kernels (SaleCalibrateCuda). Returns
// per head tau, the worst sample's L1 error per token at it, the mean share of blocks skipped and
// the halvings.
std::tuple<std::vector<double>, std::vector<double>, std::vector<double>, std::vector<int64_t>>
SaleCalibrate(at::TensorList qs, at::TensorList ks, at::TensorList vs, double theta, double tau0,
              int64_t max_halvings, double scale, int64_t block_q, int64_t block_k,
              int64_t sink_tokens, int64_t local_tokens) {
  if (qs.size() != ks.size() || qs.size() != vs.size()) Invalid("q, k and v: one of each a sample");
  if (qs.empty()) Invalid("calibration needs a sample");
  std::vector<SaleOperands> samples;
  for (size_t i = 0; i < qs.size(); ++i) {
    samples.push_back(SaleOperandsOf(qs[i], ks[i], vs[i], scale));
    const kernels::SalePrefill& p = samples.back().p;
    if (samples.back().q.device() != samples[0].q.device()) {
      Invalid("samples: every sample on one device");
    }
    if (p.num_q_heads != samples[0].p.num_q_heads || p.head_dim != samples[0].p.head_dim) {
      Invalid("samples: every sample needs the same heads and head_dim");
    }
  }
  const kernels::SaleParams params = SaleParamsOf(block_q, block_k, sink_tokens, local_tokens);
  absl::StatusOr<kernels::SaleCalibration> c;
  if (!samples[0].q.is_cuda()) {
    std::vector<kernels::SalePrefill> prompts;
    for (const SaleOperands& o : samples) prompts.push_back(o.p);
    c = kernels::SaleCalibrate(prompts, params, theta, static_cast<float>(tau0),
                               static_cast<int32_t>(max_halvings));
  } else {
#if KVSPARSE_TORCH_CUDA && defined(KVSPARSE_WITH_CUDA)
    c = SaleCalibrateCuda(samples, params, theta, static_cast<float>(tau0),
                          static_cast<int32_t>(max_halvings));
#else
    Raise(absl::UnimplementedError("sale_calibrate: this build has no CUDA kernels"));
#endif
  }
  if (!c.ok()) Raise(c.status());
  return {std::vector<double>(c->tau.begin(), c->tau.end()), c->error, c->sparsity,
          std::vector<int64_t>(c->halvings.begin(), c->halvings.end())};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvsparse, m) {
  m.def(
      "sale_prefill(Tensor q, Tensor k, Tensor v, float[] tau, float scale, int block_q, "
      "int block_k, int sink_tokens, int local_tokens) -> (Tensor, Tensor)",
      &SalePrefill);
  m.def(
      "sale_calibrate(Tensor[] q, Tensor[] k, Tensor[] v, float theta, float tau0, "
      "int max_halvings, float scale, int block_q, int block_k, int sink_tokens, "
      "int local_tokens) -> (float[], float[], float[], int[])",
      &SaleCalibrate);
}

}  // namespace kvsparse::torch_ops
