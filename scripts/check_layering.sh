#!/usr/bin/env bash
# Fails if a module includes a layer above it (docs/DESIGN.md, "Layers"):
#   kernels < kvstore < engine < rpc < server, rpc < client < op (the PyTorch op, which nothing
#   includes and which never includes the server); kernels knows nothing of gRPC,
#   protobuf, the store or libtorch; kvstore knows nothing of gRPC, the engine or the server; the
#   engine knows nothing of gRPC, protobuf, Prometheus or the server (an in-process user links it
#   alone); rpc (what the server and the clients share) knows neither of them; the clients know
#   rpc, not the server.
# The CMake targets say the same: each module's library links only the ones before it.
set -euo pipefail
cd "$(dirname "$0")/.."
bad=0
check() {  # dir, forbidden include regex
  local hits
  hits=$(grep -rnE "#include [<\"]($2)" "$1" --include='*.h' --include='*.cc' --include='*.cu' \
         --include='*.cuh' || true)
  if [ -n "$hits" ]; then echo "layering: $1 must not include $2:"; echo "$hits"; bad=1; fi
}
check kernels 'grpc|grpcpp|google/protobuf|kvsparse/v1|kvstore/|engine/|rpc/|server/|client/|op/|torch|ATen|prometheus'
check kvstore 'grpc|grpcpp|google/protobuf|kvsparse/v1|engine/|rpc/|server/|client/|op/|prometheus'
check engine  'grpc|grpcpp|google/protobuf|kvsparse/v1|rpc/|server/|client/|op/|prometheus'
check rpc     'server/|client/|op/|prometheus'
check server  'client/|op/'
check client  'server/|op/'
check op      'server/'
[ $bad -eq 0 ] && echo "layering: OK"
exit $bad
