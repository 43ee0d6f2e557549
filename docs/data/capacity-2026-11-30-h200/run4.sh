#!/usr/bin/env bash
# The fixed-GPU-budget row (issue 46): 32k, flash at B = 2 (its 8 GiB cache) against kvsg-ckprop at B = 16
# inside an 8 GiB GPU capacity.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
free -g > $OUT/free.txt
STEPS=e2e E2E_TIMEOUT=560 CARRY=.carry/dev \
  E2E_ARGS="--lens 32768 --batches 2,16 --variants flash,kvsg-ckprop --skip 32768:16:flash,32768:2:kvsg-ckprop --rounds 1 --steps 8 --warmup 3 --gpu_row_cache 0.005 --gpu_capacity 8G --store_capacity 80G --json $OUT/e2e.json" \
  bash scripts/gpu_check.sh > $OUT/check.log 2>&1
grep -E "^\| 32k|rc=" $OUT/check.log
