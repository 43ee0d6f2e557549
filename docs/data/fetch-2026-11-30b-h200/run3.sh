#!/usr/bin/env bash
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT /tmp/r3
t0=$(date +%s)
cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag > $OUT/summary.txt 2>&1
uname -r >> $OUT/summary.txt
timeout 120 .carry/probe/host_link_probe 16 4064 4k > $OUT/probe4k.txt 2>&1
echo "probe rc=$? $(( $(date +%s)-t0 ))s" >> $OUT/summary.txt
A="--lens 131072 --batches 1 --rounds 1 --steps 8 --warmup 3 --gpu_row_cache 0.005 --profile kvsg-ckprop"
mon() { while true; do sleep 8; for p in $(pgrep -f e2e_bench.py); do echo "$1 $(date +%T) pid $p $(grep -E 'Rss|AnonHuge' /proc/$p/smaps_rollup 2>/dev/null | tr -s ' ' | tr '\n' ' ')"; done; done >> /tmp/r3/mon.txt; }
run() { # name, env...
  local name=$1; shift
  mon $name & local m=$!
  env "$@" STEPS=e2e E2E_TIMEOUT=200 CARRY=.carry/dev \
    E2E_ARGS="$A --variants $V --profile_out /tmp/r3/prof-$name.txt --json /tmp/r3/e2e-$name.json" \
    bash scripts/gpu_check.sh > /tmp/e2e-$name.log 2>&1
  kill $m
  grep -E "^\| 128k" /tmp/e2e-$name.log | cut -c1-200 >> $OUT/summary.txt
  echo "$name done $(( $(date +%s)-t0 ))s" >> $OUT/summary.txt
}
V=flash,kvsg-ckprop run u18align KVSPARSE_EXP_WARM_UNIT=18 KVSPARSE_EXP_ALIGN=1
V=kvsg-ckprop run u18 KVSPARSE_EXP_WARM_UNIT=18
V=kvsg-ckprop run u0align KVSPARSE_EXP_ALIGN=1
cp /tmp/e2e-*.log /tmp/r3/; tar czf $OUT/r3.tgz -C /tmp r3
python3 - >> $OUT/summary.txt <<'PY'
import gzip,json,statistics
for n in ['u18align','u18','u0align']:
    try: d=json.load(gzip.open(f'/tmp/r3/prof-{n}.json.gz'))
    except Exception as e: print(n, e); continue
    ev=[e for e in d['traceEvents'] if e.get('ph')=='X' and e.get('cat')=='kernel']
    F=[e['dur'] for e in ev if 'FetchKernel' in e['name']]; W=[e['dur'] for e in ev if 'WarmKernel' in e['name']]
    print(n,'fetch',statistics.median(F),'warm',statistics.median(W))
PY
grep -h "AnonHuge" /tmp/r3/mon.txt | awk '{print $1}' | uniq -c >> $OUT/summary.txt
tail -n 3 /tmp/r3/mon.txt >> $OUT/summary.txt
