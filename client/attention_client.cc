#include "client/attention_client.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include "absl/time/clock.h"
#include "rpc/status.h"

namespace kvsparse::client {

AttentionClient::AttentionClient(std::shared_ptr<grpc::Channel> channel, ClientOptions options)
    : options_(std::move(options)),
      channel_(std::move(channel)),
      stub_(v1::Attention::NewStub(channel_)) {}

absl::StatusOr<std::unique_ptr<AttentionClient>> AttentionClient::Connect(ClientOptions options) {
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = OpenChannel(options);
  if (!channel.ok()) return channel.status();
  return std::unique_ptr<AttentionClient>(new AttentionClient(std::move(*channel), options));
}

std::unique_ptr<AttentionClient> AttentionClient::FromChannel(
    std::shared_ptr<grpc::Channel> channel, ClientOptions options) {
  return std::unique_ptr<AttentionClient>(new AttentionClient(std::move(channel), options));
}

absl::Status AttentionClient::Decode(const v1::DecodeRequest& request,
                                     v1::DecodeResponse* response) {
  grpc::ClientContext ctx;
  PrepareContext(options_, &ctx);
  return rpc::FromGrpcStatus(stub_->Decode(&ctx, request, response));
}

absl::StatusOr<v1::DecodeResponse> AttentionClient::Decode(const v1::DecodeRequest& request) {
  v1::DecodeResponse resp;
  absl::Status s = Decode(request, &resp);
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<std::unique_ptr<DecodeSession>> AttentionClient::OpenSession(
    absl::Duration lifetime) {
  std::unique_ptr<DecodeSession> s(new DecodeSession());
  PrepareContext(options_, &s->ctx_);
  s->ctx_.set_deadline(absl::ToChronoTime(absl::Now() + lifetime));
  s->stream_ = stub_->DecodeStream(&s->ctx_);
  if (s->stream_ == nullptr) return absl::UnavailableError("could not open DecodeStream");
  return s;
}

DecodeSession::~DecodeSession() {
  if (!closed_ && stream_ != nullptr) (void)Close();
}

absl::StatusOr<v1::DecodeResponse> DecodeSession::Step(const v1::DecodeRequest& request) {
  if (closed_) return absl::FailedPreconditionError("session closed");
  v1::DecodeResponse resp;
  if (!stream_->Write(request) || !stream_->Read(&resp)) {
    absl::Status s = Close();
    return s.ok() ? absl::UnavailableError("stream ended") : s;
  }
  return resp;
}

absl::Status DecodeSession::Close() {
  if (closed_) return absl::OkStatus();
  closed_ = true;
  stream_->WritesDone();
  v1::DecodeResponse drain;
  while (stream_->Read(&drain)) {
  }
  return rpc::FromGrpcStatus(stream_->Finish());
}

}  // namespace kvsparse::client
