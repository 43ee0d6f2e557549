// An engine::RowSource over another process's KvStore service (the split deployment: a worker with
// --store=HOST:PORT). One Gather RPC per sequence per stage, covering every kv head.
#ifndef KVSPARSE_SERVER_REMOTE_ROW_SOURCE_H_
#define KVSPARSE_SERVER_REMOTE_ROW_SOURCE_H_

#include <grpcpp/channel.h>

#include <memory>
#include <string>

#include "engine/row_source.h"

namespace kvsparse::server {

// The channel's message limits must allow the largest gather (see ServerOptions). token: sent as
// a bearer token with every call (a store with --auth_tokens); empty: none.
std::unique_ptr<engine::RowSource> NewRemoteRowSource(std::shared_ptr<grpc::Channel> channel,
                                                      std::string token = "");

}  // namespace kvsparse::server

#endif  // KVSPARSE_SERVER_REMOTE_ROW_SOURCE_H_
