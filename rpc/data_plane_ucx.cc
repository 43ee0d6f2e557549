// The UCX plane: the store exports its arena over UCX (--data_plane=ucx); the worker asks the
// store for the arena's address (GetDataPlane) and reads rows with one batched gather message
// per read, or one-sided gets per row (ucx-rma), from a store on any host.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kvstore/ucx_plane.h"
#include "rpc/data_plane.h"
#include "rpc/status.h"

namespace kvsparse::rpc {
namespace {

class UcxPlane final : public DataPlane {
 public:
  explicit UcxPlane(std::unique_ptr<kvstore::UcxReader> reader) : reader_(std::move(reader)) {}
  const char* name() const override { return "--store_data_plane=ucx"; }
  absl::StatusOr<std::shared_ptr<const kvstore::ArenaReader>> Open(
      v1::KvStore::StubInterface& stub, const std::function<void(grpc::ClientContext*)>& prepare,
      absl::Time deadline) override {
    grpc::ClientContext ctx;
    prepare(&ctx);
    v1::DataPlane dp;
    if (absl::Status s = FromGrpcStatus(stub.GetDataPlane(&ctx, v1::GetDataPlaneRequest(), &dp));
        !s.ok()) {
      return s;
    }
    if (dp.transport() != "ucx") {
      return absl::FailedPreconditionError(
          absl::StrCat("the store's data plane is '", dp.transport(), "', not ucx"));
    }
    kvstore::UcxArenaAddress a;
    a.arena_id = dp.arena_id();
    a.worker_address = dp.worker_address();
    a.rkey = dp.rkey();
    a.base_address = dp.base_address();
    a.arena_bytes = dp.arena_bytes();
    a.data_offset = dp.data_offset();
    a.granule = dp.granule();
    a.secret = dp.secret();
    return reader_->Connect(a, std::min(absl::Seconds(5), deadline - absl::Now()));
  }

 private:
  const std::unique_ptr<kvstore::UcxReader> reader_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DataPlane>> NewUcxPlane(const std::string& transports,
                                                       bool one_sided) {
  absl::StatusOr<std::unique_ptr<kvstore::UcxReader>> r = kvstore::UcxReader::Create(
      transports, one_sided ? kvstore::UcxReadMode::kOneSided : kvstore::UcxReadMode::kGather);
  if (!r.ok()) return r.status();
  return std::unique_ptr<DataPlane>(std::make_unique<UcxPlane>(std::move(*r)));
}

}  // namespace kvsparse::rpc
