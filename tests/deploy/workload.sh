#!/usr/bin/env bash
# A client workload for scripts/deploy_check.sh, with the kvsparse CLI, until killed (or for
# ITERATIONS rounds): each round creates a sequence (4 layers, Llama-3.1-8B heads, K resident,
# 32-bit signatures, 2-bit compressed keys), appends 1024 tokens, gathers and verifies rows, runs
# bench-gather, decodes one layer with every method (top-k over the compressed keys among them:
# it states the attention mass it leaves out), sends a refused request and reads the stats. With
# a small --capacity and evict-lru, older sequences get evicted.
#   workload.sh CLI STORE [WORKER]
# STORE may be a sharded fleet's store list (the CLI places each sequence on its shard); with
# WORKER, decodes go to that worker (a split or sharded deployment: --target=WORKER
# --store_target=STORE).
set -euo pipefail
cli=$1 store=$2 worker=${3:-}
iterations=${ITERATIONS:-1000000}
if [ -n "$worker" ]; then ends=(--target="$worker" --store_target="$store"); else ends=(--target="$store"); fi
c() { "$cli" "${ends[@]}" --wait_for_ready=10s "$@" >/dev/null; }
"$cli" --target="$store" --wait_for_ready=10s health
for ((i = 0; i < iterations; i++)); do
  s=w$i
  c create --seq=$s --layers=4 --q_heads=32 --kv_heads=8 --head_dim=128 --dtype=bf16 \
    --k_tier=device --signature_bits=32 --compressed_key_bits=2
  c append --seq=$s --tokens=1024 --seed=$i 2>/dev/null
  c gather --seq=$s --layer=$((i % 4)) --heads=0,5 --random_rows=8 --verify --seed=$i
  c bench-gather --seq=$s --layer=1 --rows=1024 --kind=v --iters=10 --warmup=2
  c decode --seq=$s --layer=2 --method=dense
  c decode --seq=$s --layer=2 --method=santa:allocation=prop,samples=128
  c decode --seq=$s --layer=2 --method=santa:allocation=flash,samples=512
  c decode --seq=$s --layer=2 --method=hash_top_k:top_k_fraction=0.05
  c decode --seq=$s --layer=2 --method=top_k:top_k_fraction=0.05
  c decode --seq=$s --layer=2 --method=vattention:epsilon=0.1,delta=0.1
  c decode --seq=$s --layer=3 --method=vattention:epsilon=0.1,delta=0.1,predictor=exact
  if c gather --seq=$s --layer=99 2>/dev/null; then echo "workload: a bad gather succeeded" >&2; exit 1; fi
  c stats
  echo "workload: round $i done"
done
