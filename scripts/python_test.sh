#!/usr/bin/env bash
# The Python package (client/python) against the real kvsparse-server of BUILD_DIR: installs it
# with its test extras into a virtual environment (build/venv by default), builds its gRPC stubs
# from proto/ on the way, and runs pytest (the client over every RPC, Hugging Face generation
# through kvsparse; tests marked gpu skip without a CUDA device).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build}
venv=${VENV:-$build/venv}
[ -x "$build/bin/kvsparse-server" ] || { echo "build $build/bin/kvsparse-server first"; exit 1; }
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
fi
"$venv/bin/pip" install -q -c client/python/tests/constraints.txt "./client/python[test]"
KVSPARSE_SERVER="$PWD/$build/bin/kvsparse-server" "$venv/bin/python" -m pytest -q client/python/tests "$@"
