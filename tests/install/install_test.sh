#!/usr/bin/env bash
# Installs kvsparse from BUILD_DIR into a temporary prefix and builds a separate project against
# it with find_package(kvsparse): the client, and the engine linked on its own.
set -euo pipefail
build=${1:?build dir}; src=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
cmake -S "$src/consumer" -B "$tmp/build" -G Ninja -DCMAKE_PREFIX_PATH="$tmp/prefix" >/dev/null
cmake --build "$tmp/build" >/dev/null
"$tmp/build/consumer"
"$tmp/build/engine_consumer"
