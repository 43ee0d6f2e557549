#include "client/kvstore_client.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "kvstore/placement.h"
#include "rpc/request_size.h"
#include "rpc/status.h"

namespace kvsparse::client {

KvStoreClient::KvStoreClient(ClientOptions options) : options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<KvStoreClient>> KvStoreClient::Connect(ClientOptions options) {
  if (options.target.empty()) return absl::InvalidArgumentError("empty target");
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("timeout must be positive");
  }
  std::unique_ptr<KvStoreClient> c(new KvStoreClient(std::move(options)));
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = OpenChannel(c->options_);
  if (!channel.ok()) return channel.status();
  c->channel_ = std::move(*channel);
  c->stub_ = v1::KvStore::NewStub(c->channel_);
  c->health_ = grpc::health::v1::Health::NewStub(c->channel_);
  return c;
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> OpenChannel(const ClientOptions& options) {
  if (options.target.empty()) return absl::InvalidArgumentError("empty target");
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> creds =
      rpc::ChannelCredentialsFor(options.tls);
  if (!creds.ok()) return creds.status();
  auto channel = grpc::CreateCustomChannel(options.target, *creds, args);
  if (channel == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("cannot create a channel to ", options.target));
  }
  return channel;
}

void PrepareContext(const ClientOptions& options, grpc::ClientContext* ctx) {
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + options.timeout));
  if (!options.token.empty()) {
    ctx->AddMetadata(rpc::kAuthMetadataKey, absl::StrCat(rpc::kBearerPrefix, options.token));
  }
}

void KvStoreClient::PrepareCall(grpc::ClientContext* ctx) const { PrepareContext(options_, ctx); }

absl::Status KvStoreClient::WaitForReady(absl::Duration timeout) {
  if (channel_->WaitForConnected(absl::ToChronoTime(absl::Now() + timeout))) {
    return absl::OkStatus();
  }
  // The channel's state says nothing of why; one call that does not wait for a connection
  // carries gRPC's last connection error (a refused port, a TLS handshake's failure).
  grpc::ClientContext ctx;
  PrepareCall(&ctx);
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  grpc::health::v1::HealthCheckRequest req;
  grpc::health::v1::HealthCheckResponse resp;
  const grpc::Status why = health_->Check(&ctx, req, &resp);
  return absl::UnavailableError(absl::StrCat(
      "could not connect to ", options_.target, " within ", absl::FormatDuration(timeout),
      why.ok() || why.error_message().empty() ? std::string() : ": " + why.error_message()));
}

absl::Status KvStoreClient::CheckHealth(const std::string& service) {
  grpc::ClientContext ctx;
  PrepareCall(&ctx);
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  absl::Status s = rpc::FromGrpcStatus(health_->Check(&ctx, req, &resp));
  if (!s.ok()) return s;
  if (resp.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
    return absl::UnavailableError(absl::StrCat(
        "health: ", grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status())));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::SequenceInfo> KvStoreClient::CreateSequence(const std::string& sequence_id,
                                                               const v1::ModelShape& shape,
                                                               const v1::Placement& placement) {
  grpc::ClientContext ctx;
  PrepareCall(&ctx);
  v1::CreateSequenceRequest req;
  req.set_sequence_id(sequence_id);
  *req.mutable_shape() = shape;
  *req.mutable_placement() = placement;
  v1::SequenceInfo resp;
  absl::Status s = rpc::FromGrpcStatus(stub_->CreateSequence(&ctx, req, &resp));
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<v1::SequenceInfo> KvStoreClient::ForkSequence(const std::string& source_id,
                                                             const std::string& sequence_id,
                                                             uint64_t num_tokens,
                                                             const v1::Placement* placement) {
  grpc::ClientContext ctx;
  PrepareCall(&ctx);
  v1::ForkSequenceRequest req;
  req.set_source_id(source_id);
  req.set_sequence_id(sequence_id);
  req.set_num_tokens(num_tokens);
  if (placement != nullptr) *req.mutable_placement() = *placement;
  v1::SequenceInfo resp;
  absl::Status s = rpc::FromGrpcStatus(stub_->ForkSequence(&ctx, req, &resp));
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<v1::DropSequenceResponse> KvStoreClient::DropSequence(
    const std::string& sequence_id) {
  grpc::ClientContext ctx;
  PrepareCall(&ctx);
  v1::DropSequenceRequest req;
  req.set_sequence_id(sequence_id);
  v1::DropSequenceResponse resp;
  absl::Status s = rpc::FromGrpcStatus(stub_->DropSequence(&ctx, req, &resp));
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<v1::AppendResponse> KvStoreClient::Append(const v1::AppendRequest& request) {
  grpc::ClientContext ctx;
  PrepareCall(&ctx);
  // Its size, so that the server takes its share of the request budget before reading it.
  ctx.AddMetadata(rpc::kRequestBytesHeader, std::to_string(request.ByteSizeLong()));
  v1::AppendResponse resp;
  absl::Status s = rpc::FromGrpcStatus(stub_->Append(&ctx, request, &resp));
  if (!s.ok()) return s;
  return resp;
}

absl::Status KvStoreClient::Gather(const v1::GatherRequest& request, v1::GatherResponse* response) {
  grpc::ClientContext ctx;
  PrepareCall(&ctx);
  return rpc::FromGrpcStatus(stub_->Gather(&ctx, request, response));
}

absl::StatusOr<v1::GatherResponse> KvStoreClient::Gather(const v1::GatherRequest& request) {
  v1::GatherResponse resp;
  absl::Status s = Gather(request, &resp);
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<v1::SequenceInfo> KvStoreClient::GetSequenceInfo(const std::string& sequence_id) {
  grpc::ClientContext ctx;
  PrepareCall(&ctx);
  v1::GetSequenceInfoRequest req;
  req.set_sequence_id(sequence_id);
  v1::SequenceInfo resp;
  absl::Status s = rpc::FromGrpcStatus(stub_->GetSequenceInfo(&ctx, req, &resp));
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<std::vector<v1::SequenceInfo>> KvStoreClient::ListSequences() {
  grpc::ClientContext ctx;
  PrepareCall(&ctx);
  v1::ListSequencesResponse resp;
  absl::Status s = rpc::FromGrpcStatus(stub_->ListSequences(&ctx, {}, &resp));
  if (!s.ok()) return s;
  return std::vector<v1::SequenceInfo>(resp.sequences().begin(), resp.sequences().end());
}

absl::StatusOr<v1::StoreStats> KvStoreClient::GetStats() {
  grpc::ClientContext ctx;
  PrepareCall(&ctx);
  v1::StoreStats resp;
  absl::Status s = rpc::FromGrpcStatus(stub_->GetStats(&ctx, {}, &resp));
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<std::unique_ptr<StoreShards>> StoreShards::Connect(const ClientOptions& options) {
  absl::StatusOr<std::vector<std::string>> targets = kvstore::ExpandShardList(options.target);
  if (!targets.ok()) return targets.status();
  auto shards = std::make_unique<StoreShards>();
  for (const std::string& target : *targets) {
    ClientOptions o = options;
    o.target = target;
    absl::StatusOr<std::unique_ptr<KvStoreClient>> c = KvStoreClient::Connect(std::move(o));
    if (!c.ok()) return c.status();
    shards->shards_.push_back(std::move(*c));
  }
  return shards;
}

KvStoreClient& StoreShards::For(absl::string_view sequence_id) {
  return *shards_[kvstore::ShardOf(sequence_id, static_cast<uint32_t>(shards_.size()))];
}

absl::Status StoreShards::CheckPlacement() {
  for (size_t i = 0; i < shards_.size(); ++i) {
    absl::StatusOr<v1::StoreStats> st = shards_[i]->GetStats();
    if (!st.ok()) {
      return absl::Status(st.status().code(),
                          absl::StrCat("store shard ", i, " (", shards_[i]->options().target,
                                       "): ", st.status().message()));
    }
    const uint32_t count = std::max<uint32_t>(1, st->shard_count());
    if (count != shards_.size() || st->shard_index() != i) {
      return absl::FailedPreconditionError(
          absl::StrCat("store ", shards_[i]->options().target, " is shard ", st->shard_index(),
                       " of ", count, " (--shard_index/--shard_count), but it is shard ", i, " of ",
                       shards_.size(), " in this list"));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvsparse::client
