#include "op/op_engine.h"

#include <grpcpp/grpcpp.h>

#include "absl/strings/escaping.h"
#include "absl/time/clock.h"
#include "client/kvstore_client.h"
#include "engine/gpu_mode.h"
#include "kvstore/placement.h"
#include "rpc/convert.h"
#include "rpc/remote_row_source.h"
#include "rpc/store_connection.h"

namespace kvsparse::torch_ops {
namespace {

namespace en = kvsparse::engine;
namespace kv = kvsparse::kvstore;
namespace v1 = kvsparse::v1;

// The store in this process.
class LocalEngine final : public OpEngine {
 public:
  explicit LocalEngine(std::unique_ptr<en::Embedded> e) : e_(std::move(e)) {}
  en::DecodeEngine& engine() override { return e_->engine(); }
  en::RowSource& source() override { return e_->source(); }
  int device() const override { return e_->device(); }
  absl::Status Create(const std::string& id, const kv::ModelShape& shape,
                      const kv::Placement& placement) override {
    return e_->store().CreateSequence(id, shape, placement).status();
  }
  absl::Status Fork(const std::string& source, const std::string& id, uint64_t num_tokens,
                    const std::optional<kv::Placement>& placement) override {
    return e_->store().ForkSequence(source, id, num_tokens, placement).status();
  }
  absl::Status Drop(const std::string& id) override {
    return e_->store().DropSequence(id).status();
  }
  absl::StatusOr<std::vector<uint64_t>> Lengths(const std::string& id) override {
    absl::StatusOr<kv::SequenceInfo> info = e_->store().GetSequenceInfo(id);
    if (!info.ok()) return info.status();
    return info->layer_lengths;
  }
  absl::Status Append(const kv::AppendRequest& r) override {
    return e_->store().Append(r).status();
  }
  absl::StatusOr<std::pair<uint64_t, uint64_t>> StoreBytes() override {
    const kv::StoreStats s = e_->store().Stats();
    return std::pair<uint64_t, uint64_t>{s.bytes_used, s.capacity_bytes};
  }

 private:
  std::unique_ptr<en::Embedded> e_;
};

v1::Placement PlacementProto(const kv::Placement& placement) {
  v1::Placement p;
  p.set_k_tier(rpc::ToProto(placement.k_tier));
  p.set_v_tier(rpc::ToProto(placement.v_tier));
  p.set_signature_bits(placement.signature_bits);
  p.set_compressed_key_bits(placement.compressed_key_bits);
  return p;
}

// A kvsparse-server store in another process (--role=store, or a server with both roles).
class RemoteStoreEngine final : public OpEngine {
 public:
  static absl::StatusOr<std::unique_ptr<OpEngine>> Create(const rpc::StoreConnectionOptions& so,
                                                          const en::EngineOptions& eo) {
    absl::StatusOr<std::vector<std::string>> shards = kv::ExpandShardList(so.target);
    if (!shards.ok()) return shards.status();
    if (shards->size() != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "store_target: one kvsparse-server store (its sequences are created there), not a list "
          "of ",
          shards->size(), " shards"));
    }
    std::unique_ptr<RemoteStoreEngine> r(new RemoteStoreEngine());
    client::ClientOptions co;
    co.target = so.target;
    co.timeout = kTimeout;
    co.max_message_bytes = so.max_message_bytes;
    co.tls = so.tls;
    co.token = so.rows.token;
    absl::StatusOr<std::unique_ptr<client::KvStoreClient>> c = client::KvStoreClient::Connect(co);
    if (!c.ok()) return c.status();
    r->store_ = std::move(*c);
    absl::StatusOr<rpc::StoreConnection> connection = rpc::ConnectStore(so);
    if (!connection.ok()) return connection.status();
    r->source_ = std::move(connection->source);
    absl::StatusOr<en::AssembledEngine> a = en::AssembleEngine(eo, r->source_.get());
    if (!a.ok()) return a.status();
    r->engine_ = std::move(a->engine);
    r->device_ = a->device;
    return std::unique_ptr<OpEngine>(std::move(r));
  }

  en::DecodeEngine& engine() override { return *engine_; }
  en::RowSource& source() override { return *source_; }
  int device() const override { return device_; }
  absl::Status Create(const std::string& id, const kv::ModelShape& shape,
                      const kv::Placement& placement) override {
    v1::ModelShape s;
    s.set_num_layers(shape.num_layers);
    s.set_num_q_heads(shape.num_q_heads);
    s.set_num_kv_heads(shape.num_kv_heads);
    s.set_head_dim(shape.head_dim);
    s.set_dtype(rpc::ToProto(shape.dtype));
    return store_->CreateSequence(id, s, PlacementProto(placement)).status();
  }
  absl::Status Fork(const std::string& source, const std::string& id, uint64_t num_tokens,
                    const std::optional<kv::Placement>& placement) override {
    const v1::Placement p = PlacementProto(placement.value_or(kv::Placement{}));
    return store_->ForkSequence(source, id, num_tokens, placement ? &p : nullptr).status();
  }
  absl::Status Drop(const std::string& id) override { return store_->DropSequence(id).status(); }
  absl::StatusOr<std::vector<uint64_t>> Lengths(const std::string& id) override {
    absl::StatusOr<v1::SequenceInfo> info = store_->GetSequenceInfo(id);
    if (!info.ok()) return info.status();
    return std::vector<uint64_t>(info->layer_lengths().begin(), info->layer_lengths().end());
  }
  absl::Status Append(const kv::AppendRequest& r) override {
    const absl::Time deadline = absl::Now() + kTimeout;
    absl::StatusOr<en::SequenceDesc> d = source_->Describe(r.sequence_id, deadline);
    if (!d.ok()) return d.status();
    const kv::ModelShape& s = d->shape;
    if (r.first_layer >= s.num_layers) return absl::InvalidArgumentError("layer out of range");
    if (r.dtype != s.dtype || r.num_kv_heads != s.num_kv_heads || r.head_dim != s.head_dim) {
      return absl::InvalidArgumentError("k and v are not the sequence's dtype and head shape");
    }
    const uint64_t expected = r.expected_length.value_or(d->layer_lengths[r.first_layer]);
    // In messages of at most kAppendChunkBytes of K and V (a 128k-token prefill of one layer is
    // far over the message limit), each expecting the length the ones before it left.
    const size_t token_bytes = s.row_bytes() * s.num_kv_heads;
    if (r.k.size() != r.num_tokens * token_bytes || r.v.size() != r.k.size()) {
      return absl::InvalidArgumentError("k and v do not hold num_tokens tokens");
    }
    const uint64_t step = std::max<uint64_t>(1, kAppendChunkBytes / (2 * token_bytes));
    for (uint64_t t0 = 0; t0 < r.num_tokens; t0 += step) {
      const uint64_t n = std::min(step, r.num_tokens - t0);
      if (absl::Status st =
              source_->Append(r.sequence_id, s, r.first_layer, expected + t0, n,
                              r.k.subspan(t0 * token_bytes, n * token_bytes),
                              r.v.subspan(t0 * token_bytes, n * token_bytes), deadline);
          !st.ok()) {
        return st;
      }
    }
    return absl::OkStatus();
  }
  absl::StatusOr<std::pair<uint64_t, uint64_t>> StoreBytes() override {
    absl::StatusOr<v1::StoreStats> s = store_->GetStats();
    if (!s.ok()) return s.status();
    return std::pair<uint64_t, uint64_t>{s->bytes_used(), s->capacity_bytes()};
  }

 private:
  static constexpr absl::Duration kTimeout = absl::Seconds(60);
  static constexpr size_t kAppendChunkBytes = 16 << 20;
  RemoteStoreEngine() = default;
  std::unique_ptr<client::KvStoreClient> store_;
  std::unique_ptr<en::RowSource> source_;
  std::unique_ptr<en::DecodeEngine> engine_;
  int device_ = -1;
};

}  // namespace

absl::StatusOr<engine::Method> MethodFromWire(const std::string& base64) {
  std::string bytes;
  v1::Method m;
  if (!absl::Base64Unescape(base64, &bytes) || !m.ParseFromString(bytes)) {
    return absl::InvalidArgumentError(
        "method: not a base64 serialized kvsparse.v1.Method (kvsparse.torch.ops.method_wire)");
  }
  return rpc::FromProto(m);
}

absl::StatusOr<std::unique_ptr<OpEngine>> NewLocalOpEngine(engine::EmbeddedOptions options) {
  absl::StatusOr<std::unique_ptr<en::Embedded>> e = en::Embedded::Create(std::move(options));
  if (!e.ok()) return e.status();
  return std::unique_ptr<OpEngine>(new LocalEngine(std::move(*e)));
}

absl::StatusOr<std::unique_ptr<OpEngine>> NewRemoteOpEngine(
    const rpc::StoreConnectionOptions& store, const engine::EmbeddedOptions& options) {
  return RemoteStoreEngine::Create(store, options.engine);
}

}  // namespace kvsparse::torch_ops
