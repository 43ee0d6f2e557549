// The one place an absl::Status becomes a grpc::Status.
#ifndef KVSPARSE_RPC_STATUS_H_
#define KVSPARSE_RPC_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace kvsparse::rpc {

// Same code and message. absl codes and gRPC codes share their numbering.
grpc::Status ToGrpcStatus(const absl::Status& status);
// The reverse, for statuses that come back from calls this server makes (split deployment).
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace kvsparse::rpc

#endif  // KVSPARSE_RPC_STATUS_H_
