// The tensor dtype between the wire (kvsparse.v1.DType) and kernels::DType: written once, for the
// server's conversions (convert.h) and the clients (the CLI), in kvsparse_rpc_base.
#ifndef KVSPARSE_RPC_DTYPE_H_
#define KVSPARSE_RPC_DTYPE_H_

#include "absl/status/statusor.h"
#include "kernels/dtype.h"
#include "kvsparse/v1/tensor.pb.h"

namespace kvsparse::rpc {

// INVALID_ARGUMENT naming `field` for DTYPE_UNSPECIFIED or an unknown value.
absl::StatusOr<kernels::DType> FromProto(v1::DType dtype, const char* field);
v1::DType ToProto(kernels::DType dtype);

}  // namespace kvsparse::rpc

#endif  // KVSPARSE_RPC_DTYPE_H_
