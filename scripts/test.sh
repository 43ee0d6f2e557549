#!/usr/bin/env bash
# Everything CI runs, on a fresh machine: install, build, all tests (GPU tests skip without a
# GPU), the Python package's tests against the built server, vLLM's CPU build generating through
# kvsparse's plugin, then the kernels, the store and the decode engine under
# AddressSanitizer+UBSan and the store and engine under ThreadSanitizer, the libFuzzer targets of
# every request type for a few seconds each, and the layering check.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
step() { echo; echo "== $* ($(( $(date +%s) - start )) s)"; }

step "dependencies"
bash scripts/install_deps.sh

step "layering and function length"
bash scripts/check_layering.sh
bash scripts/check_function_length.sh

step "build (build/)"
bash scripts/build.sh

step "ctest (build/)"
ctest --test-dir build --output-on-failure -j "$(nproc)"

step "Python package: client and Hugging Face generation against the server (build/venv)"
bash scripts/python_test.sh

step "vLLM plugin: vLLM's CPU build generating through the plugin and the server (build/vllm-venv)"
bash scripts/vllm_test.sh

step "ASan+UBSan: kernels, kvstore and the decode engine (build-asan/)"
# UCX is not built with the sanitizers (its memory hooks and threads are not instrumented):
# the data plane's test skips here and runs in the plain build.
BUILD_DIR=build-asan bash scripts/build.sh -DKVSPARSE_CORE_ONLY=ON -DKVSPARSE_SANITIZE=ON \
  -DKVSPARSE_ENABLE_CUDA=OFF -DKVSPARSE_UCX=OFF
# The statistical suites' real-attention cases (tens of thousands of decodes of 8k-token layers)
# run in the plain build above; here their synthetic twins drive the same code. Sanitized tests
# run several times slower than plain ones: a longer timeout.
# KVSPARSE_TEST_REPEAT_DIVISOR: the statistical tests' seeds and trials / 8 (kernels/synthetic.h
# StatisticalRepeats); the plain build ran them all.
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 GTEST_FILTER='-*real_layer*' \
  KVSPARSE_TEST_REPEAT_DIVISOR=8 \
  ctest --test-dir build-asan --output-on-failure -j "$(nproc)" -LE slow --timeout 900

step "TSan: kvstore and the decode engine (build-tsan/)"
BUILD_DIR=build-tsan bash scripts/build.sh -DKVSPARSE_CORE_ONLY=ON -DKVSPARSE_TSAN=ON \
  -DKVSPARSE_ENABLE_CUDA=OFF -DKVSPARSE_UCX=OFF
TSAN_OPTIONS=halt_on_error=1 ctest --test-dir build-tsan --output-on-failure -L 'kvstore|engine'

step "fuzzing: every request type of both services, clang ASan+UBSan (build-fuzz/)"
FUZZ_SECONDS=${FUZZ_SECONDS:-8} bash scripts/fuzz.sh

step "deployment: Dockerfile lint, kustomize overlays, Prometheus rules and alerts, live Prometheus + dashboard queries (build/deploy-venv)"
KVSPARSE_SERVER=build/bin/kvsparse-server bash scripts/deploy_check.sh

step "done: all tests passed"
