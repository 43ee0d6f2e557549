#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz: every request type of both services, and one target
# per type) with clang under ASan+UBSan in build-fuzz/ and runs each from a seed corpus of valid
# requests, FUZZ_SECONDS (default 20) each or FUZZ_RUNS executions each. A crash, a sanitizer
# report, or an UNKNOWN / INTERNAL / UNAVAILABLE answer fails it; the reproducer is left in
# build-fuzz/crashes/. FUZZ_TARGETS picks targets (default: all).
#   bash scripts/fuzz.sh                                  # 10 targets x 20 s (CI: 8 s each)
#   FUZZ_RUNS=10000000 bash scripts/fuzz.sh               # the long run (docs/RELIABILITY.md)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build-fuzz}
targets=${FUZZ_TARGETS:-"service create drop append gather info list stats decode pagetable"}
CC=clang CXX=clang++ cmake -S . -B "$build" -G Ninja -DKVSPARSE_FUZZ=ON -DKVSPARSE_BUILD_TESTS=OFF \
  -DKVSPARSE_UCX=OFF -DKVSPARSE_ENABLE_CUDA=OFF -DKVSPARSE_WERROR=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo > /dev/null
cmake --build "$build" -j "${JOBS:-$(nproc)}" --target kvsparse_fuzz
mkdir -p "$build/crashes"
budget=(-max_total_time="${FUZZ_SECONDS:-20}")
[ -n "${FUZZ_RUNS:-}" ] && budget=(-runs="$FUZZ_RUNS")
for t in $targets; do
  bin="$build/bin/kvsparse_${t}_fuzz"
  corpus="$build/corpus/$t"
  mkdir -p "$corpus"
  KVSPARSE_FUZZ_SEEDS="$corpus" "$bin" 2>/dev/null
  echo "== kvsparse_${t}_fuzz"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    LSAN_OPTIONS="suppressions=$PWD/tests/fuzz/lsan.supp:print_suppressions=0" \
    "$bin" "$corpus" "${budget[@]}" -rss_limit_mb=6144 -max_len=65536 -print_final_stats=1 \
    -artifact_prefix="$build/crashes/${t}-" > "$build/$t.log" 2>&1 \
    || { tail -60 "$build/$t.log"; echo "fuzz: kvsparse_${t}_fuzz failed"; exit 1; }
  grep -E "^Done|stat::(number_of_executed_units|average_exec_per_sec|new_units_added|peak_rss_mb)" \
    "$build/$t.log"
done
