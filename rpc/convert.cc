#include "rpc/convert.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace kvsparse::rpc {

using kernels::DType;

absl::StatusOr<DType> FromProto(v1::DType dtype, const char* field) {
  switch (dtype) {
    case v1::DTYPE_FP32:
      return DType::kFp32;
    case v1::DTYPE_FP16:
      return DType::kFp16;
    case v1::DTYPE_BF16:
      return DType::kBf16;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": dtype must be FP32, FP16 or BF16, got ", static_cast<int>(dtype)));
  }
}

v1::DType ToProto(DType dtype) {
  switch (dtype) {
    case DType::kFp32:
      return v1::DTYPE_FP32;
    case DType::kFp16:
      return v1::DTYPE_FP16;
    case DType::kBf16:
      return v1::DTYPE_BF16;
  }
  return v1::DTYPE_UNSPECIFIED;
}

absl::StatusOr<kvstore::Tier> FromProto(v1::Tier tier, const char* field) {
  switch (tier) {
    case v1::TIER_UNSPECIFIED:
    case v1::TIER_HOST:
      return kvstore::Tier::kHost;
    case v1::TIER_DEVICE:
      return kvstore::Tier::kDevice;
    case v1::TIER_REMOTE:
      return kvstore::Tier::kRemote;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": unknown tier ", static_cast<int>(tier)));
  }
}

v1::Tier ToProto(kvstore::Tier tier) {
  switch (tier) {
    case kvstore::Tier::kHost:
      return v1::TIER_HOST;
    case kvstore::Tier::kDevice:
      return v1::TIER_DEVICE;
    case kvstore::Tier::kRemote:
      return v1::TIER_REMOTE;
  }
  return v1::TIER_UNSPECIFIED;
}

absl::StatusOr<kvstore::ModelShape> FromProto(const v1::ModelShape& shape) {
  kvstore::ModelShape s;
  s.num_layers = shape.num_layers();
  s.num_q_heads = shape.num_q_heads();
  s.num_kv_heads = shape.num_kv_heads();
  s.head_dim = shape.head_dim();
  absl::StatusOr<DType> dt = FromProto(shape.dtype(), "shape.dtype");
  if (!dt.ok()) return dt.status();
  s.dtype = *dt;
  return s;
}

absl::StatusOr<kvstore::Placement> FromProto(const v1::Placement& placement) {
  kvstore::Placement p;
  absl::StatusOr<kvstore::Tier> k = FromProto(placement.k_tier(), "placement.k_tier");
  if (!k.ok()) return k.status();
  absl::StatusOr<kvstore::Tier> v = FromProto(placement.v_tier(), "placement.v_tier");
  if (!v.ok()) return v.status();
  p.k_tier = *k;
  p.v_tier = *v;
  p.signature_bits = placement.signature_bits();
  p.compressed_key_bits = placement.compressed_key_bits();
  return p;
}

absl::StatusOr<kvstore::RowKind> FromProto(v1::RowKind kind) {
  switch (kind) {
    case v1::ROW_KIND_UNSPECIFIED:
    case v1::ROW_KIND_KV:
      return kvstore::RowKind::kKV;
    case v1::ROW_KIND_K:
      return kvstore::RowKind::kK;
    case v1::ROW_KIND_V:
      return kvstore::RowKind::kV;
    default:
      return absl::InvalidArgumentError(absl::StrCat("kind: unknown row kind ", kind));
  }
}

absl::Status ValidateTensor(const v1::Tensor& t, const char* field) {
  absl::StatusOr<DType> dt = FromProto(t.dtype(), field);
  if (!dt.ok()) return dt.status();
  uint64_t elems = 1;
  for (int64_t dim : t.shape()) {
    if (dim < 0 || dim > (int64_t{1} << 40)) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": bad dimension ", dim));
    }
    elems *= static_cast<uint64_t>(dim);
    if (elems > (uint64_t{1} << 40)) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": too many elements"));
    }
  }
  const uint64_t want = elems * kernels::DTypeSize(*dt);
  if (t.data().size() != want) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": shape and dtype need ", want,
                                                   " bytes of data, got ", t.data().size()));
  }
  return absl::OkStatus();
}

absl::StatusOr<kvstore::AppendRequest> FromProto(const v1::AppendRequest& msg) {
  if (absl::Status s = ValidateTensor(msg.k(), "k"); !s.ok()) return s;
  if (absl::Status s = ValidateTensor(msg.v(), "v"); !s.ok()) return s;
  const v1::Tensor& k = msg.k();
  const v1::Tensor& v = msg.v();
  if (k.shape_size() != 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("k: shape must be [num_layers, num_tokens, num_kv_heads, head_dim], got rank ",
                     k.shape_size()));
  }
  if (k.dtype() != v.dtype() || k.shape_size() != v.shape_size() ||
      !std::equal(k.shape().begin(), k.shape().end(), v.shape().begin())) {
    return absl::InvalidArgumentError("k and v must have the same dtype and shape");
  }
  const uint32_t num_layers = msg.num_layers() == 0 ? 1 : msg.num_layers();
  if (k.shape(0) != num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("k: shape[0] = ", k.shape(0), " but num_layers = ", num_layers));
  }
  if (k.shape(2) > UINT32_MAX || k.shape(3) > UINT32_MAX) {
    return absl::InvalidArgumentError("k: kv heads or head dim out of range");
  }
  kvstore::AppendRequest r;
  r.sequence_id = msg.sequence_id();
  r.first_layer = msg.first_layer();
  r.num_layers = num_layers;
  r.num_tokens = static_cast<uint64_t>(k.shape(1));
  r.dtype = *FromProto(k.dtype(), "k");
  r.num_kv_heads = static_cast<uint32_t>(k.shape(2));
  r.head_dim = static_cast<uint32_t>(k.shape(3));
  r.k =
      absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(k.data().data()), k.data().size());
  r.v =
      absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(v.data().data()), v.data().size());
  if (msg.has_expected_length()) r.expected_length = msg.expected_length();
  return r;
}

absl::StatusOr<GatherArgs> FromProto(const v1::GatherRequest& msg) {
  GatherArgs args;
  absl::StatusOr<kvstore::RowKind> kind = FromProto(msg.kind());
  if (!kind.ok()) return kind.status();
  args.heads.reserve(msg.heads_size());
  for (const v1::HeadSelection& h : msg.heads()) {
    args.heads.push_back(
        {h.kv_head(), absl::MakeConstSpan(h.token_indices().data(), h.token_indices_size())});
  }
  args.request.sequence_id = msg.sequence_id();
  args.request.layer = msg.layer();
  args.request.kind = *kind;
  args.request.heads = args.heads;
  args.request.unique = msg.unique();
  return args;
}

void ToProto(const kvstore::SequenceInfo& info, v1::SequenceInfo* out) {
  out->set_sequence_id(info.sequence_id);
  v1::ModelShape* s = out->mutable_shape();
  s->set_num_layers(info.shape.num_layers);
  s->set_num_q_heads(info.shape.num_q_heads);
  s->set_num_kv_heads(info.shape.num_kv_heads);
  s->set_head_dim(info.shape.head_dim);
  s->set_dtype(ToProto(info.shape.dtype));
  v1::Placement* p = out->mutable_placement();
  p->set_k_tier(ToProto(info.placement.k_tier));
  p->set_v_tier(ToProto(info.placement.v_tier));
  p->set_signature_bits(info.placement.signature_bits);
  p->set_compressed_key_bits(info.placement.compressed_key_bits);
  out->mutable_layer_lengths()->Assign(info.layer_lengths.begin(), info.layer_lengths.end());
  out->set_bytes_used(info.bytes_used);
  out->set_page_tokens(info.page_tokens);
  out->set_incarnation(info.incarnation);
}

void ToProto(const kvstore::StoreStats& st, v1::StoreStats* out) {
  out->set_capacity_bytes(st.capacity_bytes);
  out->set_bytes_used(st.bytes_used);
  out->set_num_sequences(st.num_sequences);
  out->set_capacity_policy(std::string(kvstore::CapacityPolicyName(st.policy)));
  out->set_evictions(st.evictions);
  out->set_rejections(st.rejections);
  out->set_page_bytes(st.page_bytes);
  out->set_pages_used(st.pages_used);
  out->set_rows_appended(st.rows_appended);
  uint64_t rows = 0, bytes = 0;
  for (int t = 0; t < kvstore::kNumTiers; ++t) {
    rows += st.rows_gathered[t];
    bytes += st.bytes_gathered[t];
  }
  out->set_rows_gathered(rows);
  out->set_bytes_gathered(bytes);
  out->set_shard_index(st.shard.index);
  out->set_shard_count(st.shard.count);
}

absl::StatusOr<engine::Method> FromProto(const v1::Method& m) {
  engine::Method out;
  switch (m.kind_case()) {
    case v1::Method::KIND_NOT_SET:
    case v1::Method::kDense:
      out.kind = engine::MethodKind::kDense;
      return out;
    case v1::Method::kSanta: {
      const v1::SantaParams& s = m.santa();
      out.kind = engine::MethodKind::kSanta;
      kernels::SantaParams& p = out.santa;
      switch (s.sampler()) {
        case v1::SANTA_SAMPLER_IID:
          p.sampler = kernels::SantaSampler::kIid;
          break;
        case v1::SANTA_SAMPLER_STRATIFIED:
          p.sampler = kernels::SantaSampler::kStratified;
          break;
        case v1::SANTA_SAMPLER_UNSPECIFIED:
        case v1::SANTA_SAMPLER_SYSTEMATIC:
          p.sampler = kernels::SantaSampler::kSystematic;
          break;
        default:
          return absl::InvalidArgumentError("santa.sampler: unknown value");
      }
      switch (s.allocation()) {
        case v1::SANTA_ALLOCATION_GLOBAL:
          p.allocation = kernels::SantaAllocation::kGlobal;
          break;
        case v1::SANTA_ALLOCATION_UNSPECIFIED:
        case v1::SANTA_ALLOCATION_PROP:
          p.allocation = kernels::SantaAllocation::kProp;
          break;
        case v1::SANTA_ALLOCATION_FLASH:
          p.allocation = kernels::SantaAllocation::kFlash;
          break;
        default:
          return absl::InvalidArgumentError("santa.allocation: unknown value");
      }
      if (s.samples() > (1u << 24) || s.tile_size() > (1u << 24) ||
          s.bernoulli_qk_samples() > 1024) {
        return absl::InvalidArgumentError(
            "santa: samples and tile_size must be below 2^24, bernoulli_qk_samples at most 1024");
      }
      p.samples = static_cast<int32_t>(s.samples());
      p.tile_size = static_cast<int32_t>(s.tile_size());  // 0: the engine's default
      p.bernoulli_qk_samples = static_cast<int32_t>(s.bernoulli_qk_samples());
      p.bernoulli_mode = s.bernoulli_mode() == v1::BERNOULLI_QK_MODE_PER_HEAD
                             ? kernels::BernoulliQkMode::kPerHead
                             : kernels::BernoulliQkMode::kMeanGroupQuery;
      p.bernoulli_sampler = s.bernoulli_sampler() == v1::BERNOULLI_SAMPLER_IID
                                ? kernels::BernoulliSampler::kIid
                                : kernels::BernoulliSampler::kStratified;
      switch (s.scores()) {
        case v1::SCORE_SOURCE_UNSPECIFIED:
        case v1::SCORE_SOURCE_EXACT:
          p.scores = kernels::ScoreSource::kExact;
          break;
        case v1::SCORE_SOURCE_COMPRESSED_KEYS:
          p.scores = kernels::ScoreSource::kCompressedKeys;
          break;
        default:
          return absl::InvalidArgumentError("santa.scores: unknown value");
      }
      switch (s.correction()) {
        case v1::SANTA_CORRECTION_UNSPECIFIED:
        case v1::SANTA_CORRECTION_RATIO:
          p.correction = kernels::SantaCorrection::kRatio;
          break;
        case v1::SANTA_CORRECTION_NONE:
          p.correction = kernels::SantaCorrection::kNone;
          break;
        default:
          return absl::InvalidArgumentError("santa.correction: unknown value");
      }
      return out;
    }
    case v1::Method::kHashTopK: {
      const v1::HashTopKParams& h = m.hash_top_k();
      out.kind = engine::MethodKind::kHashTopK;
      if (h.sink_tokens() > (1u << 30) || h.local_tokens() > (1u << 30) || h.top_k() > (1u << 30) ||
          h.bits() > 256) {
        return absl::InvalidArgumentError("hash_top_k: a count is out of range");
      }
      out.hash.sink_tokens = static_cast<int32_t>(h.sink_tokens());
      out.hash.local_tokens = static_cast<int32_t>(h.local_tokens());
      out.hash.top_k = static_cast<int32_t>(h.top_k());
      out.hash.top_k_fraction = h.top_k_fraction();
      out.hash.bits = static_cast<int32_t>(h.bits());
      out.learned_signatures = h.source() == v1::SIGNATURE_SOURCE_LEARNED;
      return out;
    }
    case v1::Method::kTopK: {
      const v1::TopKParams& t = m.top_k();
      out.kind = engine::MethodKind::kTopK;
      if (t.sink_tokens() > (1u << 30) || t.local_tokens() > (1u << 30) || t.top_k() > (1u << 30)) {
        return absl::InvalidArgumentError("top_k: a count is out of range");
      }
      out.top_k.sink_tokens = static_cast<int32_t>(t.sink_tokens());
      out.top_k.local_tokens = static_cast<int32_t>(t.local_tokens());
      out.top_k.top_k = static_cast<int32_t>(t.top_k());
      out.top_k.top_k_fraction = t.top_k_fraction();
      switch (t.scores()) {
        case v1::SCORE_SOURCE_EXACT:
          out.top_k.source = kernels::ScoreSource::kExact;
          break;
        case v1::SCORE_SOURCE_UNSPECIFIED:
        case v1::SCORE_SOURCE_COMPRESSED_KEYS:
          out.top_k.source = kernels::ScoreSource::kCompressedKeys;
          break;
        default:
          return absl::InvalidArgumentError("top_k.scores: unknown value");
      }
      return out;
    }
    case v1::Method::kSaap: {
      const v1::SaapParams& s = m.saap();
      out.kind = engine::MethodKind::kSaap;
      if (s.probes() > (1u << 20) || s.sink_tokens() > (1u << 30) ||
          s.local_tokens() > (1u << 30)) {
        return absl::InvalidArgumentError("saap: a count is out of range");
      }
      out.saap.probes = s.probes() == 0 ? 8 : static_cast<int32_t>(s.probes());
      out.saap.sink_tokens = static_cast<int32_t>(s.sink_tokens());
      out.saap.local_tokens = static_cast<int32_t>(s.local_tokens());
      return out;
    }
    case v1::Method::kVattention: {
      const v1::VAttentionParams& v = m.vattention();
      out.kind = engine::MethodKind::kVAttention;
      kernels::VAttentionParams& p = out.vattention;
      if (v.sink_tokens() > (1u << 30) || v.local_tokens() > (1u << 30) || v.top_k() > (1u << 30) ||
          v.bits() > 256) {
        return absl::InvalidArgumentError("vattention: a count is out of range");
      }
      p.epsilon = v.epsilon();
      p.delta = v.delta();
      p.sink_tokens = static_cast<int32_t>(v.sink_tokens());
      p.local_tokens = static_cast<int32_t>(v.local_tokens());
      p.top_k = static_cast<int32_t>(v.top_k());
      p.top_k_fraction = v.top_k_fraction();
      switch (v.predictor()) {
        case v1::TOP_K_PREDICTOR_EXACT:
          p.predictor = kernels::TopKPredictor::kExact;
          break;
        case v1::TOP_K_PREDICTOR_COMPRESSED:
          p.predictor = kernels::TopKPredictor::kCompressed;
          break;
        case v1::TOP_K_PREDICTOR_UNSPECIFIED:
        case v1::TOP_K_PREDICTOR_HASH:
          p.predictor = kernels::TopKPredictor::kHash;
          break;
        default:
          return absl::InvalidArgumentError("vattention: unknown predictor");
      }
      p.base_rate = v.base_rate();
      switch (v.bound()) {
        case v1::BUDGET_BOUND_HOEFFDING:
          p.bound = kernels::BudgetBound::kHoeffding;
          break;
        case v1::BUDGET_BOUND_CLT_RATIO:
          p.bound = kernels::BudgetBound::kCltRatio;
          break;
        case v1::BUDGET_BOUND_UNSPECIFIED:
        case v1::BUDGET_BOUND_CLT:
          p.bound = kernels::BudgetBound::kClt;
          break;
        default:
          return absl::InvalidArgumentError(
              absl::StrCat("method.vattention.bound: unknown value ", v.bound()));
      }
      switch (v.sampler()) {
        case v1::RESIDUAL_SAMPLER_IMPORTANCE:
          p.sampler = kernels::ResidualSampler::kImportance;
          break;
        case v1::RESIDUAL_SAMPLER_UNSPECIFIED:
        case v1::RESIDUAL_SAMPLER_UNIFORM:
          p.sampler = kernels::ResidualSampler::kUniform;
          break;
        default:
          return absl::InvalidArgumentError(
              absl::StrCat("method.vattention.sampler: unknown value ", v.sampler()));
      }
      switch (v.target()) {
        case v1::VERIFY_TARGET_DENOMINATOR:
          p.target = kernels::VerifyTarget::kDenominator;
          break;
        case v1::VERIFY_TARGET_NUMERATOR:
          p.target = kernels::VerifyTarget::kNumerator;
          break;
        default:
          p.target = kernels::VerifyTarget::kOutput;
      }
      p.bits = static_cast<int32_t>(v.bits());
      out.learned_signatures = v.source() == v1::SIGNATURE_SOURCE_LEARNED;
      return out;
    }
  }
  return absl::InvalidArgumentError("method: unknown kind");
}

absl::StatusOr<engine::DecodeCall> FromProto(const v1::DecodeRequest& msg) {
  engine::DecodeCall c;
  if (msg.sequence_ids_size() == 0) return absl::InvalidArgumentError("sequence_ids: empty");
  if (absl::Status s = ValidateTensor(msg.q(), "q"); !s.ok()) return s;
  if (msg.q().shape_size() != 3 || msg.q().shape(0) != msg.sequence_ids_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "q: shape must be [B, H, d] with B = ", msg.sequence_ids_size(), " sequences"));
  }
  c.layer = msg.layer();
  c.sequence_ids.assign(msg.sequence_ids().begin(), msg.sequence_ids().end());
  c.q_dtype = *FromProto(msg.q().dtype(), "q");
  c.q = absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(msg.q().data().data()),
                                  msg.q().data().size());
  if (msg.q().shape(1) > UINT32_MAX || msg.q().shape(2) > UINT32_MAX) {
    return absl::InvalidArgumentError("q: dimension out of range");
  }
  c.q_heads = static_cast<uint32_t>(msg.q().shape(1));
  c.q_dim = static_cast<uint32_t>(msg.q().shape(2));
  if (msg.has_new_k() != msg.has_new_v()) {
    return absl::InvalidArgumentError("new_k and new_v come together");
  }
  if (msg.has_new_k()) {
    if (absl::Status s = ValidateTensor(msg.new_k(), "new_k"); !s.ok()) return s;
    if (absl::Status s = ValidateTensor(msg.new_v(), "new_v"); !s.ok()) return s;
    if (msg.new_k().dtype() != msg.new_v().dtype() || msg.new_k().shape_size() != 3 ||
        msg.new_k().shape(0) != msg.sequence_ids_size() ||
        !std::equal(msg.new_k().shape().begin(), msg.new_k().shape().end(),
                    msg.new_v().shape().begin(), msg.new_v().shape().end())) {
      return absl::InvalidArgumentError(
          "new_k and new_v must be [B, Hkv, d] of one dtype, B = the number of sequences");
    }
    c.new_kv_dtype = *FromProto(msg.new_k().dtype(), "new_k");
    c.new_k = absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(msg.new_k().data().data()),
                                        msg.new_k().data().size());
    c.new_v = absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(msg.new_v().data().data()),
                                        msg.new_v().data().size());
  }
  absl::StatusOr<engine::Method> m = FromProto(msg.method());
  if (!m.ok()) return m.status();
  c.method = *m;
  c.seed = msg.seed();
  if (!(msg.scale() >= 0.f) || !std::isfinite(msg.scale())) {
    return absl::InvalidArgumentError("scale must be >= 0 and finite (0 = 1/sqrt(d))");
  }
  c.scale = msg.scale();
  c.return_indices = msg.return_indices();
  return c;
}

void ToProto(engine::DecodeResult&& r, const engine::DecodeCall& call, v1::DecodeResponse* out) {
  v1::Tensor* o = out->mutable_output();
  o->set_dtype(ToProto(call.q_dtype));
  o->add_shape(static_cast<int64_t>(call.sequence_ids.size()));
  o->add_shape(r.num_q_heads);
  o->add_shape(r.head_dim);
  *o->mutable_data() = std::move(r.output);
  for (engine::HeadStats& h : r.heads) {
    v1::HeadStats* s = out->add_heads();
    s->set_sequence_index(h.sequence_index);
    s->set_kv_head(h.kv_head);
    s->set_rows_selected(h.rows_selected);
    s->set_rows_fetched(h.rows_fetched);
    s->set_rows_cached(h.rows_cached);
    s->mutable_budgets()->Add(h.budgets.begin(), h.budgets.end());
    s->set_bytes_host(h.bytes[static_cast<int>(kvstore::Tier::kHost)]);
    s->set_bytes_device(h.bytes[static_cast<int>(kvstore::Tier::kDevice)]);
    s->set_bytes_remote(h.bytes[static_cast<int>(kvstore::Tier::kRemote)]);
    s->set_dense_equivalent_bytes(h.dense_equivalent_bytes);
    s->mutable_fetched_tokens()->Add(h.fetched_tokens.begin(), h.fetched_tokens.end());
  }
  v1::Timing* t = out->mutable_timing();
  t->set_selection_seconds(r.timing.selection_seconds);
  t->set_gather_seconds(r.timing.gather_seconds);
  t->set_compute_seconds(r.timing.compute_seconds);
  t->set_engine_seconds(r.timing.engine_seconds);
  t->set_sync_seconds(r.timing.sync_seconds);
  out->set_sync_bytes(r.sync_bytes);
}

}  // namespace kvsparse::rpc
