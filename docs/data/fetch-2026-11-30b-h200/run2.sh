#!/usr/bin/env bash
# Session 9, call 1: store-memory probe, warm-unit tests, e2e A/B by experiment switches.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT /tmp/r2
t0=$(date +%s)
[ -d .carry/dev/bin ] || tar -xJf .carry/tpack/dev.tar.xz -C .carry
export LD_LIBRARY_PATH=$PWD/.carry/dev/lib:${LD_LIBRARY_PATH:-}
for r in 32 16; do KVSPARSE_EXP_FETCH_ROWS=$r timeout 200 .carry/dev/bin/kernels_cuda_test --gtest_brief=1 --gtest_filter='*Fetch*:*Warm*:*Selected*' > /tmp/kt$r.log 2>&1; echo "rows $r tests rc=$? $(grep -E '^\[  (PASSED|FAILED)' /tmp/kt$r.log | tr '\n' ' ')" >> $OUT/summary.txt; done
A="--lens 131072 --batches 1 --rounds 1 --steps 8 --warmup 3 --gpu_row_cache 0.005 --profile kvsg-ckprop"
run() { # name, env..., variants
  local name=$1; shift
  env "$@" STEPS=e2e E2E_TIMEOUT=200 CARRY=.carry/dev \
    E2E_ARGS="$A --variants $V --profile_out /tmp/r2/prof-$name.txt --json /tmp/r2/e2e-$name.json" \
    bash scripts/gpu_check.sh > /tmp/e2e-$name.log 2>&1
  grep -E "^\| 128k|FetchRows|Warm" /tmp/e2e-$name.log | cut -c1-300 >> $OUT/summary.txt
  echo "$name done $(( $(date +%s)-t0 ))s" >> $OUT/summary.txt
}
V=flash,kvsg-ckprop run u18r32 KVSPARSE_EXP_WARM_UNIT=18 KVSPARSE_EXP_FETCH_ROWS=32
V=kvsg-ckprop run u18r16 KVSPARSE_EXP_WARM_UNIT=18 KVSPARSE_EXP_FETCH_ROWS=16
V=kvsg-ckprop run u0r32 KVSPARSE_EXP_FETCH_ROWS=32
cp /tmp/e2e-*.log /tmp/r2/; tar czf $OUT/r2.tgz -C /tmp r2
