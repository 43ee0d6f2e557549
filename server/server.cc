#include "server/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include "absl/strings/str_cat.h"
#include "server/kvstore_service.h"
#include "server/logging.h"

namespace kvsparse::server {

absl::StatusOr<std::unique_ptr<Server>> Server::Start(ServerOptions options) {
  if (options.max_message_bytes < (1 << 20) || options.max_message_bytes > (1ull << 31) - 1) {
    return absl::InvalidArgumentError("max_message_bytes must be in 1 MiB .. 2 GiB - 1");
  }
  // Payload limits leave room for the message's other fields.
  const uint64_t payload_limit = options.max_message_bytes - (64 << 10);
  options.store.max_gather_bytes = std::min(options.store.max_gather_bytes, payload_limit);
  options.store.max_append_bytes = std::min(options.store.max_append_bytes, payload_limit / 2);

  std::unique_ptr<Server> s(new Server());
  s->options_ = options;
  absl::StatusOr<std::unique_ptr<kvstore::Store>> store = kvstore::Store::Create(options.store);
  if (!store.ok()) return store.status();
  s->store_ = std::move(*store);
  absl::StatusOr<std::unique_ptr<Metrics>> metrics = Metrics::Create(options.metrics_listen);
  if (!metrics.ok()) return metrics.status();
  s->metrics_ = std::move(*metrics);
  s->metrics_->AddCollectable(NewStoreCollector(s->store_.get()));
  s->rpc_ = std::make_unique<RpcRunner>(options.default_deadline);
  s->kvstore_service_ =
      std::make_unique<KvStoreService>(s->store_.get(), s->rpc_.get(), s->metrics_.get());

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, grpc::InsecureServerCredentials(), &s->port_);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  builder.RegisterService(s->kvstore_service_.get());
  s->grpc_ = builder.BuildAndStart();
  if (s->grpc_ == nullptr || s->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen));
  }
  grpc::HealthCheckServiceInterface* health = s->grpc_->GetHealthCheckService();
  health->SetServingStatus(true);
  health->SetServingStatus(v1::KvStore::service_full_name(), true);
  KVSPARSE_LOG(Info) << "kvsparse-server listening on " << options.listen << " (port " << s->port_
                     << "), metrics on "
                     << (options.metrics_listen.empty()
                             ? std::string("(off)")
                             : absl::StrCat(options.metrics_listen, " (port ", s->metrics_->port(),
                                            ")"))
                     << "; store capacity " << options.store.capacity_bytes << " bytes, policy "
                     << kvstore::CapacityPolicyName(options.store.policy);
  return s;
}

Server::~Server() { Shutdown(); }

void Server::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_ || grpc_ == nullptr) return;
    shut_down_ = true;
  }
  KVSPARSE_LOG(Info) << "shutting down: health NOT_SERVING, in-flight calls get "
                     << absl::FormatDuration(options_.shutdown_grace);
  grpc_->GetHealthCheckService()->SetServingStatus(false);
  grpc_->Shutdown(absl::ToChronoTime(absl::Now() + options_.shutdown_grace));
  KVSPARSE_LOG(Info) << "shut down";
}

void Server::Wait() {
  if (grpc_ != nullptr) grpc_->Wait();
}

}  // namespace kvsparse::server
