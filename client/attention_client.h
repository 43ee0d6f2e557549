// C++ client of the kvsparse Attention service (the decode worker): remote attention over an
// offloaded KV cache. Every call carries a deadline; results are absl::Status(Or).
//
//   kvsparse::client::ClientOptions options;
//   options.target = "127.0.0.1:50051";
//   auto attn = kvsparse::client::AttentionClient::Connect(options);
//   auto out = (*attn)->Decode(request);   // v1::DecodeRequest: layer, sequence ids, q, method
//
// Thread-safe, except that one DecodeSession must be used by one thread at a time.
#ifndef KVSPARSE_CLIENT_ATTENTION_CLIENT_H_
#define KVSPARSE_CLIENT_ATTENTION_CLIENT_H_

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>

#include <memory>

#include "absl/status/statusor.h"
#include "client/kvstore_client.h"
#include "kvsparse/v1/attention.grpc.pb.h"

namespace kvsparse::client {

// A model server's step loop over one DecodeStream: Step sends one request (one layer of one
// step) and waits for its response. The stream's deadline is the session's lifetime limit.
class DecodeSession {
 public:
  ~DecodeSession();
  absl::StatusOr<v1::DecodeResponse> Step(const v1::DecodeRequest& request);
  // Half-closes the stream and returns its final status.
  absl::Status Close();

 private:
  friend class AttentionClient;
  DecodeSession() = default;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::DecodeRequest, v1::DecodeResponse>> stream_;
  bool closed_ = false;
};

class AttentionClient {
 public:
  static absl::StatusOr<std::unique_ptr<AttentionClient>> Connect(ClientOptions options);
  // Shares an existing channel (e.g. a KvStoreClient's, when both services are one server).
  static std::unique_ptr<AttentionClient> FromChannel(std::shared_ptr<grpc::Channel> channel,
                                                      ClientOptions options);

  absl::StatusOr<v1::DecodeResponse> Decode(const v1::DecodeRequest& request);
  absl::Status Decode(const v1::DecodeRequest& request, v1::DecodeResponse* response);
  // Opens a stream that may live `lifetime` (every step must finish inside it).
  absl::StatusOr<std::unique_ptr<DecodeSession>> OpenSession(absl::Duration lifetime);

 private:
  AttentionClient(std::shared_ptr<grpc::Channel> channel, ClientOptions options);
  const ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Attention::Stub> stub_;
};

}  // namespace kvsparse::client

#endif  // KVSPARSE_CLIENT_ATTENTION_CLIENT_H_
