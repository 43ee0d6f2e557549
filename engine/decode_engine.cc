#include "engine/decode_engine.h"

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "engine/cpu_step.h"
#include "engine/methods/method_unit.h"
#include "engine/methods/registry.h"
#include "kernels/dtype.h"

namespace kvsparse::engine {
namespace {

bool SameShape(const kvstore::ModelShape& a, const kvstore::ModelShape& b) {
  return a.num_layers == b.num_layers && a.num_q_heads == b.num_q_heads &&
         a.num_kv_heads == b.num_kv_heads && a.head_dim == b.head_dim && a.dtype == b.dtype;
}

// Tensor sizes of the call against the sequences' model shape.
absl::Status CheckCallShapes(const DecodeCall& call, const kvstore::ModelShape& shape) {
  const size_t B = call.sequence_ids.size();
  if (call.layer >= shape.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", call.layer, " outside the sequences' ", shape.num_layers));
  }
  if (call.q_batch != 0 && call.q_batch != B) {
    return absl::InvalidArgumentError(
        absl::StrCat("q has a batch of ", call.q_batch, " but the call names ", B, " sequences"));
  }
  if ((call.q_heads != 0 && call.q_heads != shape.num_q_heads) ||
      (call.q_dim != 0 && call.q_dim != shape.head_dim)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "q has ", call.q_heads, " heads of dim ", call.q_dim, " but the sequences' model has ",
        shape.num_q_heads, " query heads of dim ", shape.head_dim));
  }
  const size_t hd = static_cast<size_t>(shape.num_q_heads) * shape.head_dim;
  if (call.on_device()) {
    if (call.out_device == nullptr || call.q_batch == 0 || call.q_heads == 0 || call.q_dim == 0 ||
        !call.q.empty()) {
      return absl::InvalidArgumentError(
          "a call with q on the device gives q_device, out_device, q_batch, q_heads and q_dim, "
          "not q");
    }
    if (call.q_dtype != shape.dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "q on the device must be the sequences' dtype ", kernels::DTypeName(shape.dtype)));
    }
  } else if (call.q.size() != B * hd * kernels::DTypeSize(call.q_dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("q must be [", B, ", ", shape.num_q_heads, ", ", shape.head_dim, "] ",
                     kernels::DTypeName(call.q_dtype), " = ",
                     B * hd * kernels::DTypeSize(call.q_dtype), " bytes; got ", call.q.size()));
  }
  if (call.new_k.empty() && call.new_v.empty()) return absl::OkStatus();
  const size_t token_bytes = static_cast<size_t>(shape.num_kv_heads) * shape.row_bytes();
  if (call.new_kv_dtype != shape.dtype) {
    return absl::InvalidArgumentError(absl::StrCat("new_k/new_v must be ",
                                                   kernels::DTypeName(shape.dtype), ", got ",
                                                   kernels::DTypeName(call.new_kv_dtype)));
  }
  if (call.new_k.size() != B * token_bytes || call.new_v.size() != B * token_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "new_k and new_v must each be [", B, ", ", shape.num_kv_heads, ", ", shape.head_dim,
        "] = ", B * token_bytes, " bytes; got ", call.new_k.size(), " and ", call.new_v.size()));
  }
  return absl::OkStatus();
}

// One Decode names each sequence once (a repeat would append its new token twice).
absl::Status CheckDistinct(const std::vector<std::string>& ids) {
  absl::flat_hash_set<absl::string_view> seen;
  seen.reserve(ids.size());
  for (const std::string& id : ids) {
    if (!seen.insert(id).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence '", id, "' appears more than once in one call"));
    }
  }
  return absl::OkStatus();
}

// q in host memory must hold finite values below 2^32 (one rule for every method and for K and
// V, kernels::FirstUnacceptedValue: no score can be infinite or NaN). q on the device is not
// scanned (that would cost the call a device sync).
absl::Status CheckFiniteQ(const DecodeCall& call, const kvstore::ModelShape& shape) {
  if (call.on_device()) return absl::OkStatus();
  const size_t n = call.q.size() / kernels::DTypeSize(call.q_dtype);
  const int64_t bad = kernels::FirstUnacceptedValue(call.q.data(), n, call.q_dtype);
  if (bad >= 0) {
    const size_t head = static_cast<size_t>(bad) / shape.head_dim;
    return absl::InvalidArgumentError(
        absl::StrCat("q has a NaN, an infinity or a value of magnitude 2^32 or more (sequence ",
                     head / shape.num_q_heads, ", head ", head % shape.num_q_heads,
                     "): kvsparse accepts finite values below 2^32"));
  }
  return absl::OkStatus();
}

}  // namespace

DecodeEngine::DecodeEngine(EngineOptions options, RowSource* source,
                           std::unique_ptr<DecodeBackend> backend)
    : options_(std::move(options)),
      source_(source),
      signatures_(options_.signatures),
      cache_(options_.resident_capacity_bytes, options_.max_fetch_bytes, &signatures_,
             options_.key_widths),
      backend_(std::move(backend)) {}

void DecodeEngine::Forget(const std::string& sequence_id) {
  cache_.Forget(sequence_id);
  if (backend_ != nullptr) backend_->Forget(sequence_id);
}

absl::StatusOr<std::vector<SequenceDesc>> DecodeEngine::Describe(const DecodeCall& call) {
  const MethodUnit& unit = *FindMethod(call.method.kind).unit;
  const size_t B = call.sequence_ids.size();
  std::vector<SequenceDesc> descs(B);
  for (size_t b = 0; b < B; ++b) {
    absl::StatusOr<SequenceDesc> d = source_->Describe(call.sequence_ids[b], call.deadline);
    if (absl::IsNotFound(d.status())) Forget(call.sequence_ids[b]);  // gone from the store
    if (!d.ok()) return d.status();
    descs[b] = std::move(*d);
  }
  for (size_t b = 1; b < B; ++b) {
    if (!SameShape(descs[b].shape, descs[0].shape)) {
      return absl::InvalidArgumentError(absl::StrCat("sequences '", descs[0].sequence_id, "' and '",
                                                     descs[b].sequence_id,
                                                     "' have different model shapes"));
    }
  }
  if (absl::Status s = CheckCallShapes(call, descs[0].shape); !s.ok()) return s;
  if (absl::Status s = CheckFiniteQ(call, descs[0].shape); !s.ok()) return s;
  const bool append = !call.new_k.empty() || !call.new_v.empty();
  uint64_t call_bytes = 0;
  for (const SequenceDesc& d : descs) {
    call_bytes += (d.layer_lengths[call.layer] + (append ? 1 : 0)) * d.shape.num_kv_heads *
                  d.shape.row_bytes() * 2;
  }
  if (options_.max_call_bytes != 0 && call_bytes > options_.max_call_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("this call covers ", call_bytes, " bytes of K and V; at most ",
                     options_.max_call_bytes, " (--max_decode_bytes): split it"));
  }
  for (const SequenceDesc& d : descs) {
    // A layer with no tokens (and none arriving with this call) has no attention to compute,
    // for every method alike.
    if (!append && d.layer_lengths[call.layer] == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("sequence '", d.sequence_id, "' holds no tokens in layer ", call.layer,
                       ": append its prompt's K/V (or pass new_k/new_v) before decoding"));
    }
    if (absl::Status s = unit.CheckFits(call.method, d, signatures_); !s.ok()) return s;
  }
  return descs;
}

absl::Status DecodeEngine::AppendNewTokens(const DecodeCall& call,
                                           absl::Span<const SequenceDesc> descs) {
  const kvstore::ModelShape& shape = descs[0].shape;
  const size_t token_bytes = static_cast<size_t>(shape.num_kv_heads) * shape.row_bytes();
  for (size_t b = 0; b < descs.size(); ++b) {
    const uint64_t len = descs[b].layer_lengths[call.layer];
    absl::Status s =
        source_->Append(descs[b].sequence_id, shape, call.layer, len, 1,
                        call.new_k.subspan(b * token_bytes, token_bytes),
                        call.new_v.subspan(b * token_bytes, token_bytes), call.deadline);
    if (!s.ok()) {
      return absl::Status(
          s.code(),
          absl::StrCat("appending the new token of sequence '", descs[b].sequence_id, "'",
                       b > 0 ? " (earlier sequences' were appended)" : "", ": ", s.message()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<DecodeResult> DecodeEngine::Decode(const DecodeCall& request) {
  const absl::Time start = absl::Now();
  // The method with the engine's defaults filled (MethodUnit::Resolve): what both backends see.
  // The call is copied only when a default applies.
  Method method = request.method;
  if (FindMethod(method.kind).unit->Resolve(&method, options_)) {
    DecodeCall call = request;
    call.method = std::move(method);
    return DecodeResolved(call, start);
  }
  return DecodeResolved(request, start);
}

absl::StatusOr<DecodeResult> DecodeEngine::DecodeResolved(const DecodeCall& call,
                                                          absl::Time start) {
  if (call.sequence_ids.empty()) return absl::InvalidArgumentError("no sequences");
  if (call.sequence_ids.size() > options_.max_call_sequences) {
    return absl::InvalidArgumentError(absl::StrCat("a call names ", call.sequence_ids.size(),
                                                   " sequences; at most ",
                                                   options_.max_call_sequences));
  }
  if (absl::Status s = CheckDistinct(call.sequence_ids); !s.ok()) return s;
  if (!call.seed_offsets.empty() && call.seed_offsets.size() != call.sequence_ids.size()) {
    return absl::InvalidArgumentError("seed_offsets: one per sequence, or none");
  }
  if (absl::Status s = CheckScale(call.scale); !s.ok()) return s;
  for (const std::string& id : call.sequence_ids) {
    if (Held(id)) {
      return absl::FailedPreconditionError(
          absl::StrCat("sequence '", id,
                       "' is held by a captured step's plan: commit and "
                       "release the plan before eager calls on it"));
    }
  }
  if (absl::Status s = call.CheckLive(); !s.ok()) return s;
  const MethodUnit& unit = *FindMethod(call.method.kind).unit;
  if (absl::Status s = unit.Validate(call.method, options_); !s.ok()) return s;
  absl::StatusOr<std::vector<SequenceDesc>> descs = Describe(call);
  if (!descs.ok()) return descs.status();
  // Only the backend reads q on the device: decided before anything is appended.
  const absl::Status backend_takes =
      backend_ != nullptr ? backend_->Supports(call, *descs)
                          : absl::FailedPreconditionError("this engine has no GPU backend");
  const bool on_backend = backend_takes.ok();
  if (call.on_device() && !on_backend) {
    return absl::FailedPreconditionError(
        absl::StrCat(kNotOnBackend, ": ", backend_takes.message(), "; pass q in host memory"));
  }
  // Every sequence's new token goes in before any compute, so a failure leaves nothing
  // half-done within a sequence (each append is all-or-nothing in the store).
  const bool append = !call.new_k.empty() || !call.new_v.empty();
  if (append) {
    if (absl::Status s = call.CheckLive(); !s.ok()) return s;
    if (absl::Status s = AppendNewTokens(call, *descs); !s.ok()) return s;
  }
  const kvstore::ModelShape& shape = (*descs)[0].shape;
  const size_t B = call.sequence_ids.size();
  DecodeResult result;
  result.num_q_heads = shape.num_q_heads;
  result.head_dim = shape.head_dim;
  if (!call.on_device()) {
    result.output.resize(B * shape.num_q_heads * shape.head_dim * kernels::DTypeSize(call.q_dtype));
  }
  result.heads.reserve(B * shape.num_kv_heads);
  if (backend_ != nullptr && !on_backend)
    result.not_on_backend = std::string(backend_takes.message());
  if (on_backend) {
    std::vector<SequenceDesc> now = *descs;  // as the store holds them now
    if (append) {
      for (SequenceDesc& d : now) ++d.layer_lengths[call.layer];
    }
    if (absl::Status s = backend_->Decode(call, now, &result); !s.ok()) return s;
    result.timing.engine_seconds = absl::ToDoubleSeconds(absl::Now() - start);
    return result;
  }
  const CpuStep::Env env{source_, &cache_, &signatures_, &options_};
  for (size_t b = 0; b < B; ++b) {
    // A caller gone or out of time stops the work here and between the step's stages.
    if (absl::Status s = call.CheckLive(); !s.ok()) return s;
    CpuStep step(env, call, static_cast<uint32_t>(b), (*descs)[b]);
    if (absl::Status s = step.Run(unit, &result); !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("sequence '", (*descs)[b].sequence_id, "': ", s.message()));
    }
  }
  result.timing.engine_seconds = absl::ToDoubleSeconds(absl::Now() - start);
  return result;
}

// A plan that releases its sequences (DecodeEngine::held_) when destroyed, after the backend's
// plan (which waits for its kernels) is gone; its Rebind checks and holds the new sequences as
// PlanStatic does before the backend's plan moves to them.
class HeldStep final : public StaticStep {
 public:
  HeldStep(DecodeEngine* engine, std::unique_ptr<StaticStep> inner, DecodeCall call,
           uint64_t max_tokens, SequenceDesc layout)
      : engine_(engine),
        inner_(std::move(inner)),
        call_(std::move(call)),
        max_tokens_(max_tokens),
        layout_(std::move(layout)) {}
  ~HeldStep() override {
    inner_.reset();
    engine_->ReleaseIds(call_.sequence_ids);
  }
  absl::Status Enqueue(uint32_t layer, const void* q, const void* new_k, const void* new_v,
                       const int64_t* positions, void* out, void* stream) override {
    return inner_->Enqueue(layer, q, new_k, new_v, positions, out, stream);
  }
  absl::StatusOr<std::vector<uint64_t>> Commit(void* stream) override {
    return inner_->Commit(stream);
  }
  absl::Status Rebind(const std::vector<std::string>& sequence_ids,
                      const std::vector<uint64_t>& bounds, void* stream) override {
    if (sequence_ids.size() != inner_->batch()) {
      return absl::InvalidArgumentError(absl::StrCat("a plan of ", inner_->batch(),
                                                     " sequences rebinds to as many, not ",
                                                     sequence_ids.size()));
    }
    if (absl::Status s = CheckDistinct(sequence_ids); !s.ok()) return s;
    // The plan's own sequences are free to take again (in any slot).
    engine_->ReleaseIds(call_.sequence_ids);
    absl::Status held = engine_->HoldIds(sequence_ids);
    if (!held.ok()) {
      (void)engine_->HoldIds(call_.sequence_ids);  // the plan keeps what it had
      return held;
    }
    DecodeCall call = call_;
    call.sequence_ids = sequence_ids;
    absl::StatusOr<std::vector<SequenceDesc>> descs =
        engine_->DescribePlanned(call, max_tokens_, bounds);
    if (descs.ok()) {
      for (const SequenceDesc& d : *descs) {
        if (!SameLayout(d, layout_)) {
          descs = absl::FailedPreconditionError(
              absl::StrCat("sequence '", d.sequence_id,
                           "' has another shape, dtype or placement than the plan's sequences"));
          break;
        }
      }
    }
    absl::Status s = descs.ok() ? inner_->Rebind(sequence_ids, bounds, stream) : descs.status();
    if (!s.ok()) {
      // The backend's plan holds its old sequences where the new ones were refused before it
      // moved, none where it failed moving (StaticStep::Rebind).
      engine_->ReleaseIds(sequence_ids);
      if (!descs.ok()) {
        (void)engine_->HoldIds(call_.sequence_ids);
        return s;
      }
      call_.sequence_ids.clear();
      return s;
    }
    call_ = std::move(call);
    return absl::OkStatus();
  }
  absl::Status CopyStats(int32_t* dst, void* stream) override {
    return inner_->CopyStats(dst, stream);
  }
  uint32_t num_layers() const override { return inner_->num_layers(); }
  uint32_t batch() const override { return inner_->batch(); }
  uint32_t num_q_heads() const override { return inner_->num_q_heads(); }
  uint32_t num_kv_heads() const override { return inner_->num_kv_heads(); }
  uint32_t head_dim() const override { return inner_->head_dim(); }
  uint64_t device_bytes() const override { return inner_->device_bytes(); }
  LayerGraphCounts layer_graph_counts() const override { return inner_->layer_graph_counts(); }

 private:
  DecodeEngine* const engine_;
  std::unique_ptr<StaticStep> inner_;
  DecodeCall call_;  // the plan's template: its sequences those held now
  const uint64_t max_tokens_;
  const SequenceDesc layout_;  // the first sequence planned: the layout every one must have
};

bool DecodeEngine::Held(const std::string& sequence_id) const {
  std::lock_guard<std::mutex> lock(held_mu_);
  return held_.contains(sequence_id);
}

absl::Status DecodeEngine::HoldIds(absl::Span<const std::string> ids) {
  std::lock_guard<std::mutex> lock(held_mu_);
  for (const std::string& id : ids) {
    if (held_.contains(id)) {
      return absl::FailedPreconditionError(
          absl::StrCat("sequence '", id, "' is already held by a captured step's plan"));
    }
  }
  held_.insert(ids.begin(), ids.end());
  return absl::OkStatus();
}

void DecodeEngine::ReleaseIds(absl::Span<const std::string> ids) {
  std::lock_guard<std::mutex> lock(held_mu_);
  for (const std::string& id : ids) held_.erase(id);
}

absl::StatusOr<std::vector<SequenceDesc>> DecodeEngine::DescribePlanned(
    const DecodeCall& call, uint64_t max_tokens, absl::Span<const uint64_t> bounds) {
  if (!bounds.empty() && bounds.size() != call.sequence_ids.size()) {
    return absl::InvalidArgumentError("bounds: none, or one per sequence");
  }
  absl::StatusOr<std::vector<SequenceDesc>> descs = Describe(call);
  if (!descs.ok()) return descs.status();
  for (size_t b = 0; b < descs->size(); ++b) {
    const SequenceDesc& d = (*descs)[b];
    const uint64_t bound = bounds.empty() || bounds[b] == 0 ? max_tokens : bounds[b];
    if (bound > max_tokens) {
      return absl::InvalidArgumentError(absl::StrCat("sequence '", d.sequence_id, "': bound ",
                                                     bound, " past max_tokens ", max_tokens));
    }
    for (uint64_t n : d.layer_lengths) {
      if (n != d.layer_lengths[0] || n == 0) {
        return absl::FailedPreconditionError(
            absl::StrCat("sequence '", d.sequence_id,
                         "': a captured step needs every layer at one length of at least 1 token"));
      }
    }
    if (d.layer_lengths[0] > bound) {
      return absl::OutOfRangeError(absl::StrCat("sequence '", d.sequence_id, "' holds ",
                                                d.layer_lengths[0], " tokens, past its bound ",
                                                bound));
    }
  }
  if (absl::Status s = backend_->Supports(call, *descs); !s.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(kNotOnBackend, ": ", s.message(), "; no captured step"));
  }
  return descs;
}

absl::StatusOr<std::unique_ptr<StaticStep>> DecodeEngine::PlanStatic(const StaticStepRequest& req) {
  if (backend_ == nullptr) {
    return absl::FailedPreconditionError(
        "captured steps run on the GPU backend; this engine has none");
  }
  if (req.sequence_ids.empty()) return absl::InvalidArgumentError("no sequences");
  if (req.sequence_ids.size() > options_.max_call_sequences) {
    return absl::InvalidArgumentError(absl::StrCat("a plan names ", req.sequence_ids.size(),
                                                   " sequences; at most ",
                                                   options_.max_call_sequences));
  }
  if (absl::Status s = CheckDistinct(req.sequence_ids); !s.ok()) return s;
  if (req.max_tokens == 0 || req.max_tokens > (1u << 30)) {
    return absl::InvalidArgumentError("max_tokens: 1 .. 2^30");
  }
  if (absl::Status s = CheckScale(req.scale); !s.ok()) return s;
  const MethodUnit& unit = *FindMethod(req.method.kind).unit;
  Method method = req.method;
  unit.Resolve(&method, options_);  // the engine's defaults, as for Decode
  if (absl::Status s = unit.Validate(method, options_); !s.ok()) return s;
  absl::StatusOr<SequenceDesc> first =
      source_->Describe(req.sequence_ids[0], absl::InfiniteFuture());
  if (!first.ok()) return first.status();
  // The plan's template call: validated as a call with q on the device (placeholder pointers,
  // never read; each Enqueue gives the real ones).
  static const char kPlaceholder = 0;
  DecodeCall call;
  call.sequence_ids = req.sequence_ids;
  call.method = std::move(method);
  call.seed = req.seed;
  call.scale = req.scale;
  call.q_dtype = req.dtype;
  call.q_batch = static_cast<uint32_t>(req.sequence_ids.size());  // the step's q is [B, H, d]
  call.q_heads = first->shape.num_q_heads;
  call.q_dim = first->shape.head_dim;
  call.q_device = &kPlaceholder;
  call.out_device = const_cast<char*>(&kPlaceholder);
  absl::StatusOr<std::vector<SequenceDesc>> descs =
      DescribePlanned(call, req.max_tokens, req.bounds);
  if (!descs.ok()) return descs.status();
  if (absl::Status s = HoldIds(req.sequence_ids); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<StaticStep>> plan = backend_->PlanStatic(call, *descs, req);
  if (!plan.ok()) {
    ReleaseIds(req.sequence_ids);
    return plan.status();
  }
  return std::unique_ptr<StaticStep>(
      new HeldStep(this, std::move(*plan), std::move(call), req.max_tokens, (*descs)[0]));
}

}  // namespace kvsparse::engine
