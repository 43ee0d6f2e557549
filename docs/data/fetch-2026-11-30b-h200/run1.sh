#!/usr/bin/env bash
# Session 9, call 1: store-memory probe, warm-unit tests, e2e A/B by experiment switches.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT /tmp/r1
t0=$(date +%s)
timeout 150 .carry/probe/host_link_probe 16 4064 thp,store,wslab > $OUT/probe.txt 2>&1
echo "probe rc=$? $(( $(date +%s)-t0 ))s" | tee -a $OUT/summary.txt
STEPS=tests CARRY=.carry/dev bash scripts/gpu_check.sh > $OUT/check.log 2>&1
tail -3 $OUT/check.log >> $OUT/summary.txt
A="--lens 131072 --batches 1 --rounds 1 --steps 8 --warmup 3 --gpu_row_cache 0.005 --profile kvsg-ckprop"
run() { # name, env..., variants
  local name=$1; shift
  env "$@" STEPS=e2e E2E_TIMEOUT=200 CARRY=.carry/dev \
    E2E_ARGS="$A --variants $V --profile_out /tmp/r1/prof-$name.txt --json /tmp/r1/e2e-$name.json" \
    bash scripts/gpu_check.sh > /tmp/e2e-$name.log 2>&1
  grep -E "^\| 128k|FetchRows|Warm" /tmp/e2e-$name.log | cut -c1-300 >> $OUT/summary.txt
  echo "$name done $(( $(date +%s)-t0 ))s" >> $OUT/summary.txt
}
V=flash,kvsg-ckprop run base X=1
V=kvsg-ckprop run pfu18 KVSPARSE_EXP_PREFAULT=1 KVSPARSE_EXP_WARM_UNIT=18
V=kvsg-ckprop run pf KVSPARSE_EXP_PREFAULT=1
cp /tmp/e2e-*.log /tmp/r1/; tar czf $OUT/r1.tgz -C /tmp r1
