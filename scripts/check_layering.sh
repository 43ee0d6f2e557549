#!/usr/bin/env bash
# Fails if a module includes a layer above it (DESIGN.md, "Layers"):
#   kernels < kvstore < server < client; kernels knows nothing of gRPC, protobuf, the store or
#   libtorch; kvstore knows nothing of gRPC or the server.
set -euo pipefail
cd "$(dirname "$0")/.."
bad=0
check() {  # dir, forbidden include regex
  local hits
  hits=$(grep -rnE "#include [<\"]($2)" "$1" --include='*.h' --include='*.cc' --include='*.cu' \
         --include='*.cuh' || true)
  if [ -n "$hits" ]; then echo "layering: $1 must not include $2:"; echo "$hits"; bad=1; fi
}
check kernels 'grpc|grpcpp|google/protobuf|kvsparse/v1|kvstore/|server/|client/|torch|ATen|prometheus'
check kvstore 'grpc|grpcpp|google/protobuf|kvsparse/v1|server/|client/|prometheus'
check server  'client/'
[ $bad -eq 0 ] && echo "layering: OK"
exit $bad
