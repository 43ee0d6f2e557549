// Conversions between kvsparse.v1 messages and the engine's types, with validation. Every
// function returns INVALID_ARGUMENT naming the offending field for a malformed message.
#ifndef KVSPARSE_RPC_CONVERT_H_
#define KVSPARSE_RPC_CONVERT_H_

#include <vector>

#include "absl/status/statusor.h"
#include "engine/decode_engine.h"
#include "kernels/dtype.h"
#include "kvsparse/v1/attention.pb.h"
#include "kvsparse/v1/kvstore.pb.h"
#include "kvsparse/v1/tensor.pb.h"
#include "kvstore/store.h"
#include "rpc/dtype.h"  // FromProto / ToProto of the dtype

namespace kvsparse::rpc {

absl::StatusOr<kvstore::Tier> FromProto(v1::Tier tier, const char* field);
v1::Tier ToProto(kvstore::Tier tier);

absl::StatusOr<kvstore::ModelShape> FromProto(const v1::ModelShape& shape);
absl::StatusOr<kvstore::Placement> FromProto(const v1::Placement& placement);
absl::StatusOr<kvstore::RowKind> FromProto(v1::RowKind kind);

// Checks dtype, non-negative shape and len(data) == product(shape) * sizeof(dtype).
absl::Status ValidateTensor(const v1::Tensor& t, const char* field);

// Validates and maps an AppendRequest; the spans point into `msg`, which must outlive the
// result.
absl::StatusOr<kvstore::AppendRequest> FromProto(const v1::AppendRequest& msg);

// The store's view of a GatherRequest; `heads` owns the selections whose spans point into
// `msg`, which must outlive it.
struct GatherArgs {
  kvstore::GatherRequest request;
  std::vector<kvstore::HeadSelection> heads;
};
absl::StatusOr<GatherArgs> FromProto(const v1::GatherRequest& msg);

// The wire's method -> the engine's, its defaults filled (no kind: dense); unknown enum values
// are INVALID_ARGUMENT naming the field. The one codec of a method: the server's Decode and the
// PyTorch op (which receives the same message serialized) both use it.
absl::StatusOr<engine::Method> FromProto(const v1::Method& m);

// Validates and maps a DecodeRequest (method parameters are checked by the engine); the spans
// point into `msg`, which must outlive the result. No method given means dense.
absl::StatusOr<engine::DecodeCall> FromProto(const v1::DecodeRequest& msg);
// Output tensor [B, H, d] (moved out of `result`), per-head statistics and timing.
void ToProto(engine::DecodeResult&& result, const engine::DecodeCall& call,
             v1::DecodeResponse* out);

void ToProto(const kvstore::SequenceInfo& info, v1::SequenceInfo* out);
void ToProto(const kvstore::StoreStats& stats, v1::StoreStats* out);

}  // namespace kvsparse::rpc

#endif  // KVSPARSE_RPC_CONVERT_H_
