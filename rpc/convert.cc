#include "rpc/convert.h"

#include <cmath>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "rpc/method_text.h"

namespace kvsparse::rpc {

using kernels::DType;

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
  out->set_bytes_shared(info.bytes_shared);
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

namespace {

// An enum field of a method: the engine's value for the wire's, from `table` ({wire, engine}
// pairs). UNSPECIFIED was replaced by the field's text_default before (FillUnsetWords, the one
// home of the defaults). INVALID_ARGUMENT naming the field for any other value (a newer
// client's, or a malformed message).
template <typename E, typename W>
absl::StatusOr<E> EnumOf(W value, const char* field, std::initializer_list<std::pair<W, E>> table) {
  for (const auto& [wire, engine] : table) {
    if (value == wire) return engine;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("method.", field, ": unknown value ", static_cast<int>(value)));
}

// A count of a method's message: at most `max`, else INVALID_ARGUMENT naming it (`field`, or
// `message`.`field`: the name is built only for the error).
absl::StatusOr<int32_t> CountOf(uint32_t value, absl::string_view field, uint32_t max,
                                absl::string_view message = "") {
  if (value > max) {
    return absl::InvalidArgumentError(absl::StrCat("method.", message, message.empty() ? "" : ".",
                                                   field, ": ", value, " is out of range (at most ",
                                                   max, ")"));
  }
  return static_cast<int32_t>(value);
}

#define KVS_ASSIGN(lhs, expr)                       \
  do {                                              \
    auto kvs_value = (expr);                        \
    if (!kvs_value.ok()) return kvs_value.status(); \
    lhs = *kvs_value;                               \
  } while (0)
// lhs = EnumOf(value, field, {{wire, engine}, ...}), the engine's type from lhs.
#define KVS_ENUM(lhs, value, field, ...) \
  KVS_ASSIGN(lhs, (EnumOf<std::decay_t<decltype(lhs)>>(value, field, __VA_ARGS__)))

constexpr uint32_t kMaxTokens = 1u << 30;

absl::Status SantaFromProto(const v1::SantaParams& s, kernels::SantaParams* p) {
  using kernels::SantaAllocation;
  using kernels::SantaSampler;
  KVS_ENUM(p->sampler, s.sampler(), "santa.sampler",
           {{v1::SANTA_SAMPLER_IID, SantaSampler::kIid},
            {v1::SANTA_SAMPLER_STRATIFIED, SantaSampler::kStratified},
            {v1::SANTA_SAMPLER_SYSTEMATIC, SantaSampler::kSystematic}});
  KVS_ENUM(p->allocation, s.allocation(), "santa.allocation",
           {{v1::SANTA_ALLOCATION_GLOBAL, SantaAllocation::kGlobal},
            {v1::SANTA_ALLOCATION_PROP, SantaAllocation::kProp},
            {v1::SANTA_ALLOCATION_FLASH, SantaAllocation::kFlash}});
  KVS_ASSIGN(p->samples, CountOf(s.samples(), "santa.samples", 1u << 24));
  KVS_ASSIGN(p->tile_size, CountOf(s.tile_size(), "santa.tile_size", 1u << 24));  // 0: default
  KVS_ASSIGN(p->bernoulli_qk_samples,
             CountOf(s.bernoulli_qk_samples(), "santa.bernoulli_qk_samples", 1024));
  KVS_ENUM(p->bernoulli_mode, s.bernoulli_mode(), "santa.bernoulli_mode",
           {{v1::BERNOULLI_QK_MODE_PER_HEAD, kernels::BernoulliQkMode::kPerHead},
            {v1::BERNOULLI_QK_MODE_MEAN_GROUP_QUERY, kernels::BernoulliQkMode::kMeanGroupQuery}});
  KVS_ENUM(p->bernoulli_sampler, s.bernoulli_sampler(), "santa.bernoulli_sampler",
           {{v1::BERNOULLI_SAMPLER_IID, kernels::BernoulliSampler::kIid},
            {v1::BERNOULLI_SAMPLER_STRATIFIED, kernels::BernoulliSampler::kStratified}});
  KVS_ENUM(p->scores, s.scores(), "santa.scores",
           {{v1::SCORE_SOURCE_EXACT, kernels::ScoreSource::kExact},
            {v1::SCORE_SOURCE_COMPRESSED_KEYS, kernels::ScoreSource::kCompressedKeys}});
  KVS_ENUM(p->correction, s.correction(), "santa.correction",
           {{v1::SANTA_CORRECTION_RATIO, kernels::SantaCorrection::kRatio},
            {v1::SANTA_CORRECTION_NONE, kernels::SantaCorrection::kNone}});
  KVS_ENUM(p->proposal, s.proposal(), "santa.proposal",
           {{v1::SANTA_PROPOSAL_PER_HEAD, kernels::SantaProposal::kPerHead},
            {v1::SANTA_PROPOSAL_GROUP, kernels::SantaProposal::kGroupMixture}});
  p->uniform_floor = s.uniform_floor();  // its range: kernels::ValidateSantaParams
  return absl::OkStatus();
}

// The fixed set of a method message that has one (hash_top_k, top_k, vattention: the same four
// fields, each message with its own defaults); `name` is the message's field in Method.
template <typename Message>
absl::Status FixedSetFromProto(const Message& m, absl::string_view name, kernels::FixedSet* f) {
  KVS_ASSIGN(f->sink_tokens, CountOf(m.sink_tokens(), "sink_tokens", kMaxTokens, name));
  KVS_ASSIGN(f->local_tokens, CountOf(m.local_tokens(), "local_tokens", kMaxTokens, name));
  KVS_ASSIGN(f->top_k, CountOf(m.top_k(), "top_k", kMaxTokens, name));
  f->top_k_fraction = m.top_k_fraction();
  return absl::OkStatus();
}

absl::Status HashTopKFromProto(const v1::HashTopKParams& h, engine::Method* out) {
  if (absl::Status s = FixedSetFromProto(h, "hash_top_k", &out->hash.fixed); !s.ok()) return s;
  KVS_ASSIGN(out->hash.bits, CountOf(h.bits(), "hash_top_k.bits", 256));
  out->learned_signatures = h.source() == v1::SIGNATURE_SOURCE_LEARNED;
  return absl::OkStatus();
}

absl::Status TopKFromProto(const v1::TopKParams& t, kernels::ScoreTopKParams* p) {
  if (absl::Status s = FixedSetFromProto(t, "top_k", &p->fixed); !s.ok()) return s;
  KVS_ENUM(p->source, t.scores(), "top_k.scores",
           {{v1::SCORE_SOURCE_EXACT, kernels::ScoreSource::kExact},
            {v1::SCORE_SOURCE_COMPRESSED_KEYS, kernels::ScoreSource::kCompressedKeys}});
  return absl::OkStatus();
}

absl::Status SaapFromProto(const v1::SaapParams& s, kernels::SaapParams* p) {
  KVS_ASSIGN(p->probes, CountOf(s.probes(), "saap.probes", 1u << 20));
  if (p->probes == 0) p->probes = 8;  // the paper's default
  KVS_ASSIGN(p->sink_tokens, CountOf(s.sink_tokens(), "saap.sink_tokens", kMaxTokens));
  KVS_ASSIGN(p->local_tokens, CountOf(s.local_tokens(), "saap.local_tokens", kMaxTokens));
  return absl::OkStatus();
}

absl::Status VAttentionFromProto(const v1::VAttentionParams& v, engine::Method* out) {
  using kernels::BudgetBound;
  using kernels::ResidualSampler;
  using kernels::TopKPredictor;
  using kernels::VerifyTarget;
  kernels::VAttentionParams& p = out->vattention;
  p.epsilon = v.epsilon();
  p.delta = v.delta();
  p.base_rate = v.base_rate();
  if (absl::Status s = FixedSetFromProto(v, "vattention", &p.fixed); !s.ok()) return s;
  KVS_ASSIGN(p.bits, CountOf(v.bits(), "vattention.bits", 256));
  KVS_ENUM(p.predictor, v.predictor(), "vattention.predictor",
           {{v1::TOP_K_PREDICTOR_EXACT, TopKPredictor::kExact},
            {v1::TOP_K_PREDICTOR_COMPRESSED, TopKPredictor::kCompressed},
            {v1::TOP_K_PREDICTOR_HASH, TopKPredictor::kHash}});
  KVS_ENUM(p.bound, v.bound(), "vattention.bound",
           {{v1::BUDGET_BOUND_HOEFFDING, BudgetBound::kHoeffding},
            {v1::BUDGET_BOUND_CLT_RATIO, BudgetBound::kCltRatio},
            {v1::BUDGET_BOUND_CLT, BudgetBound::kClt}});
  KVS_ENUM(p.sampler, v.sampler(), "vattention.sampler",
           {{v1::RESIDUAL_SAMPLER_IMPORTANCE, ResidualSampler::kImportance},
            {v1::RESIDUAL_SAMPLER_UNIFORM, ResidualSampler::kUniform}});
  KVS_ENUM(p.target, v.target(), "vattention.target",
           {{v1::VERIFY_TARGET_DENOMINATOR, VerifyTarget::kDenominator},
            {v1::VERIFY_TARGET_NUMERATOR, VerifyTarget::kNumerator},
            {v1::VERIFY_TARGET_OUTPUT, VerifyTarget::kOutput}});
  out->learned_signatures = v.source() == v1::SIGNATURE_SOURCE_LEARNED;
  return absl::OkStatus();
}

#undef KVS_ENUM
#undef KVS_ASSIGN

}  // namespace

absl::StatusOr<engine::Method> FromProto(const v1::Method& wire) {
  v1::Method m = wire;
  FillUnsetWords(&m);  // UNSPECIFIED enums read as the proto's text_default
  engine::Method out;
  absl::Status s;
  switch (m.kind_case()) {
    case v1::Method::KIND_NOT_SET:
    case v1::Method::kDense:
      out.kind = engine::MethodKind::kDense;
      return out;
    case v1::Method::kSanta:
      out.kind = engine::MethodKind::kSanta;
      s = SantaFromProto(m.santa(), &out.santa);
      break;
    case v1::Method::kHashTopK:
      out.kind = engine::MethodKind::kHashTopK;
      s = HashTopKFromProto(m.hash_top_k(), &out);
      break;
    case v1::Method::kTopK:
      out.kind = engine::MethodKind::kTopK;
      s = TopKFromProto(m.top_k(), &out.top_k);
      break;
    case v1::Method::kSaap:
      out.kind = engine::MethodKind::kSaap;
      s = SaapFromProto(m.saap(), &out.saap);
      break;
    case v1::Method::kVattention:
      out.kind = engine::MethodKind::kVAttention;
      s = VAttentionFromProto(m.vattention(), &out);
      break;
    default:
      return absl::InvalidArgumentError("method: unknown kind");
  }
  if (!s.ok()) return s;
  return out;
}

absl::StatusOr<engine::DecodeCall> FromProto(const v1::DecodeRequest& msg) {
  engine::DecodeCall c;
  if (msg.sequence_ids_size() == 0) return absl::InvalidArgumentError("sequence_ids: empty");
  if (absl::Status s = ValidateTensor(msg.q(), "q"); !s.ok()) return s;
  if (msg.q().shape_size() != 3) return absl::InvalidArgumentError("q: shape must be [B, H, d]");
  c.layer = msg.layer();
  c.sequence_ids.assign(msg.sequence_ids().begin(), msg.sequence_ids().end());
  c.q_dtype = *FromProto(msg.q().dtype(), "q");
  c.q = absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(msg.q().data().data()),
                                  msg.q().data().size());
  if (msg.q().shape(0) > UINT32_MAX || msg.q().shape(1) > UINT32_MAX ||
      msg.q().shape(2) > UINT32_MAX) {
    return absl::InvalidArgumentError("q: dimension out of range");
  }
  c.q_batch = static_cast<uint32_t>(msg.q().shape(0));  // the engine checks it (CheckCallShapes)
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
  c.scale = msg.scale();  // the engine checks it (CheckScale)
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
    s->set_key_features_head(h.key_features_head);
    s->set_key_features_group(h.key_features_group);
    for (float e : h.standard_error) s->add_standard_error(e);
    for (float e : h.epsilon) s->add_epsilon(e);
    for (float e : h.missed_mass_bound) s->add_missed_mass_bound(e);
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
