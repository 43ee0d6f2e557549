#!/usr/bin/env bash
# Configures and builds into BUILD_DIR (default build/): binaries land in build/bin/.
# Extra arguments go to cmake's configure step, e.g. -DKVSPARSE_ENABLE_CUDA=OFF.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build}
jobs=${JOBS:-$(nproc)}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=${BUILD_TYPE:-RelWithDebInfo} "$@" >/dev/null
cmake --build "$build" -j "$jobs"
