// An engine::RowSource over another process's KvStore service (the split deployment: a worker with
// --store=HOST:PORT). One Gather RPC per sequence per stage, covering every kv head; or, when the
// store keeps its pages in an arena file this process can map (--store_arena_file, the
// shared-arena pod), rows copied straight from the mapped pages, with one GetPageTable RPC per
// layer when the table it holds no longer covers the rows asked for (every page_tokens tokens).
#ifndef KVSPARSE_RPC_REMOTE_ROW_SOURCE_H_
#define KVSPARSE_RPC_REMOTE_ROW_SOURCE_H_

#include <grpcpp/channel.h>

#include <memory>
#include <string>

#include "engine/row_source.h"

namespace kvsparse::rpc {

// The channel's message limits must allow the largest gather (see ServerOptions). token: sent as
// a bearer token with every call (a store with --auth_tokens); empty: none.
struct RemoteRowSourceOptions {
  // Sent as a bearer token with every call (a store with --auth_tokens); empty: none.
  std::string token;
  // The store's --arena_file as mounted here; empty: rows always through Gather. Mapped at the
  // first read (and again when the store made a new one); while it cannot be (not there yet, not
  // an arena file, the store has none), and for any read whose pages were freed meanwhile, rows
  // come through Gather instead, so a read never returns another sequence's rows.
  std::string arena_file;
  // "ucx": read rows over UCX from the store's exported arena (the store runs with --arena_file
  // and --data_plane=ucx; GetDataPlane gives the address), the store on any host, one batched
  // gather message per read; "ucx-rma": the same with one-sided gets per row (for RDMA). Reads
  // fall back to Gather while it cannot connect. "" or "gather": Gather (or arena_file). The
  // planes: rpc/data_plane.h.
  std::string data_plane;
  std::string data_plane_transports;  // UCX_TLS-style; "": UCX's choice
};

// What the in-place path did (all counters since start).
struct InPlaceStats {
  uint64_t rows = 0;              // rows copied from the mapped arena (a K+V pair counts as 2)
  uint64_t bytes = 0;             // bytes copied from it
  uint64_t fallbacks = 0;         // reads that went through Gather instead
  uint64_t page_table_calls = 0;  // GetPageTable RPCs
};

class RemoteRowSource : public engine::RowSource {
 public:
  virtual InPlaceStats in_place_stats() const = 0;
  // Whether the channel to the store is up (or idle: connects at the next call).
  virtual bool reachable() const = 0;
};

// The channel's message limits must allow the largest gather (see ServerOptions).
std::unique_ptr<RemoteRowSource> NewRemoteRowSource(std::shared_ptr<grpc::Channel> channel,
                                                    RemoteRowSourceOptions options = {});

}  // namespace kvsparse::rpc

#endif  // KVSPARSE_RPC_REMOTE_ROW_SOURCE_H_
