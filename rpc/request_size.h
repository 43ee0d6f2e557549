// The size of a request message, declared by its client before the message is sent, so that a
// kvsparse-server can take the message's share of its request budget before reading it
// (server/request_budget.h; KvStore.Append): the message's encoded bytes, in decimal, in this
// metadata header. kvsparse's clients (C++ KvStoreClient, the remote row source, the Python
// KvStoreClient) declare every append; a call that declares none is charged the largest message
// the server accepts.
#ifndef KVSPARSE_RPC_REQUEST_SIZE_H_
#define KVSPARSE_RPC_REQUEST_SIZE_H_

namespace kvsparse::rpc {

inline constexpr char kRequestBytesHeader[] = "kvsparse-request-bytes";

}  // namespace kvsparse::rpc

#endif  // KVSPARSE_RPC_REQUEST_SIZE_H_
