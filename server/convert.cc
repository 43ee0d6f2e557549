#include "server/convert.h"

#include "absl/strings/str_cat.h"

namespace kvsparse::server {

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
}

}  // namespace kvsparse::server
