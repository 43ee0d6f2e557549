// Lists a server's services through gRPC server reflection (grpc.reflection.v1alpha), with raw
// bytes on the wire: Debian ships the reflection server library but no client stubs, and
// generating our own would clash with the symbols inside libgrpc++_reflection.
#ifndef KVSPARSE_TESTS_INTEGRATION_REFLECTION_LIST_H_
#define KVSPARSE_TESTS_INTEGRATION_REFLECTION_LIST_H_

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/impl/codegen/client_callback.h>
#include <grpcpp/impl/codegen/sync_stream.h>
#include <grpcpp/support/byte_buffer.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvsparse::testing {

inline absl::StatusOr<std::vector<std::string>> ListServicesByReflection(
    const std::shared_ptr<grpc::Channel>& channel) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  const grpc::internal::RpcMethod method(
      "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
      grpc::internal::RpcMethod::BIDI_STREAMING);
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
          channel.get(), method, &ctx));
  // ServerReflectionRequest { list_services (field 7, string) = "*" }
  const char req_bytes[] = {0x3a, 0x01, '*'};
  grpc::Slice slice(req_bytes, sizeof(req_bytes));
  grpc::ByteBuffer req(&slice, 1);
  if (!stream->Write(req)) return absl::UnavailableError("reflection: write failed");
  stream->WritesDone();
  grpc::ByteBuffer resp;
  if (!stream->Read(&resp)) return absl::UnavailableError("reflection: no response");
  grpc::Status st = stream->Finish();
  if (!st.ok()) return absl::UnavailableError(st.error_message());
  std::vector<grpc::Slice> slices;
  if (!resp.Dump(&slices).ok()) return absl::InternalError("reflection: dump");
  std::string bytes;
  for (const grpc::Slice& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  // ServerReflectionResponse { list_services_response (6) { service (1) { name (1) } } }
  std::vector<std::string> names;
  google::protobuf::io::CodedInputStream in(reinterpret_cast<const uint8_t*>(bytes.data()),
                                            static_cast<int>(bytes.size()));
  for (uint32_t tag; (tag = in.ReadTag()) != 0;) {
    if (tag != ((6 << 3) | 2)) {
      if (!google::protobuf::internal::WireFormatLite::SkipField(&in, tag)) break;
      continue;
    }
    uint32_t len;
    in.ReadVarint32(&len);
    auto outer = in.PushLimit(static_cast<int>(len));
    for (uint32_t t2; (t2 = in.ReadTag()) != 0;) {  // ServiceResponse entries
      uint32_t l2;
      in.ReadVarint32(&l2);
      auto inner = in.PushLimit(static_cast<int>(l2));
      for (uint32_t t3; (t3 = in.ReadTag()) != 0;) {
        std::string name;
        if (t3 == ((1 << 3) | 2) &&
            google::protobuf::internal::WireFormatLite::ReadString(&in, &name)) {
          names.push_back(name);
        } else if (!google::protobuf::internal::WireFormatLite::SkipField(&in, t3)) {
          break;
        }
      }
      in.PopLimit(inner);
    }
    in.PopLimit(outer);
  }
  return names;
}

}  // namespace kvsparse::testing

#endif  // KVSPARSE_TESTS_INTEGRATION_REFLECTION_LIST_H_
