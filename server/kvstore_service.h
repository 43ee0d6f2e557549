// gRPC KvStore service: a thin layer over kvstore::Store. Each handler converts and validates
// the request, calls the store, and fills the response; RpcRunner does the rest. Append is
// served as a streamed unary method: its body is read only after the call has taken its share
// of the server's request budget (request_budget.h), the size its client declares in the
// kvsparse-request-bytes header (rpc/request_size.h), or the largest message when it declares
// none.
#ifndef KVSPARSE_SERVER_KVSTORE_SERVICE_H_
#define KVSPARSE_SERVER_KVSTORE_SERVICE_H_

#include <functional>
#include <string>

#include "kvsparse/v1/kvstore.grpc.pb.h"
#include "kvstore/store.h"
#include "kvstore/ucx_plane.h"
#include "server/metrics.h"
#include "server/request_budget.h"
#include "server/rpc.h"

namespace kvsparse::server {

class KvStoreService final
    : public v1::KvStore::WithStreamedUnaryMethod_Append<v1::KvStore::Service> {
 public:
  // REQUIRES: store, rpc, metrics and appends outlive the service. max_message_bytes: the
  // server's receive limit (what an append that declares no size is charged).
  KvStoreService(kvstore::Store* store, const RpcRunner* rpc, Metrics* metrics,
                 RequestBudget* appends, size_t max_message_bytes);

  // Called with the id of each dropped sequence (a decode engine in the same process frees its
  // state of it at once). Set before the service serves.
  void set_drop_listener(std::function<void(const std::string&)> listener) {
    on_drop_ = std::move(listener);
  }
  // The arena's one-sided data plane, answered by GetDataPlane (null: none). Set before the
  // service serves; it must outlive the service.
  void set_data_plane(const kvstore::UcxExport* plane) { data_plane_ = plane; }

  grpc::Status CreateSequence(grpc::ServerContext* ctx, const v1::CreateSequenceRequest* req,
                              v1::SequenceInfo* resp) override;
  grpc::Status ForkSequence(grpc::ServerContext* ctx, const v1::ForkSequenceRequest* req,
                            v1::SequenceInfo* resp) override;
  grpc::Status DropSequence(grpc::ServerContext* ctx, const v1::DropSequenceRequest* req,
                            v1::DropSequenceResponse* resp) override;
  grpc::Status StreamedAppend(
      grpc::ServerContext* ctx,
      grpc::ServerUnaryStreamer<v1::AppendRequest, v1::AppendResponse>* stream) override;
  grpc::Status Gather(grpc::ServerContext* ctx, const v1::GatherRequest* req,
                      v1::GatherResponse* resp) override;
  grpc::Status GetSequenceInfo(grpc::ServerContext* ctx, const v1::GetSequenceInfoRequest* req,
                               v1::SequenceInfo* resp) override;
  grpc::Status GetPageTable(grpc::ServerContext* ctx, const v1::GetPageTableRequest* req,
                            v1::PageTable* resp) override;
  grpc::Status GetDataPlane(grpc::ServerContext* ctx, const v1::GetDataPlaneRequest* req,
                            v1::DataPlane* resp) override;
  grpc::Status ListSequences(grpc::ServerContext* ctx, const v1::ListSequencesRequest* req,
                             v1::ListSequencesResponse* resp) override;
  grpc::Status GetStats(grpc::ServerContext* ctx, const v1::GetStatsRequest* req,
                        v1::StoreStats* resp) override;

 private:
  kvstore::Store* const store_;
  const RpcRunner* const rpc_;
  RequestBudget* const appends_;
  const size_t max_message_bytes_;
  RpcMetric* const create_;
  RpcMetric* const fork_;
  RpcMetric* const drop_;
  RpcMetric* const append_;
  RpcMetric* const gather_;
  RpcMetric* const info_;
  RpcMetric* const page_table_;
  RpcMetric* const data_plane_rpc_;
  const kvstore::UcxExport* data_plane_ = nullptr;
  RpcMetric* const list_;
  RpcMetric* const stats_;
  std::function<void(const std::string&)> on_drop_;
};

}  // namespace kvsparse::server

#endif  // KVSPARSE_SERVER_KVSTORE_SERVICE_H_
