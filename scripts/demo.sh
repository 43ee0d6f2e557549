#!/usr/bin/env bash
# The main job on a fresh machine: install, build, start kvsparse-server on its embedded
# defaults (store in this process's host memory, gRPC on 127.0.0.1:50051, metrics on
# 127.0.0.1:9464), run a client workload against it, show the metrics, and stop it with SIGTERM.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh
bin=build/bin
log=$(mktemp)
"$bin/kvsparse-server" 2>"$log" &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
cli() { echo "+ kvsparse $*" >&2; "$bin/kvsparse" --wait_for_ready=10s "$@"; }

echo "== kvsparse-server started (pid $pid); client workload:"
cli health
# A Llama-3.1-8B-shaped sequence: 32 layers, 32 query heads, 8 kv heads, d=128, bf16. The
# placement asks the decode worker to keep K resident on its device and 32-bit HashAttention
# signatures of every key, so every method can run; V stays in the store's host tier.
cli create --seq=demo --layers=32 --q_heads=32 --kv_heads=8 --head_dim=128 --dtype=bf16 \
    --k_tier=device --signature_bits=32
cli append --seq=demo --tokens=4096 --seed=7          # 4096 tokens x 32 layers x 8 kv heads: 512 MiB of K+V
cli info --seq=demo
cli gather --seq=demo --layer=17 --heads=0,5 --random_rows=4 --verify --seed=7
cli gather --seq=demo --layer=3 --heads=2 --indices=10,11,10,4095 --unique --kind=v
cli bench-gather --seq=demo --layer=5 --rows=4096 --kind=v --iters=200 --verify --seed=7
cli bench-gather --seq=demo --layer=6 --rows=131072 --kind=v --iters=20
engine=$(grep -o '[a-z]* decode engine' "$log" | head -1)
echo "== the decode worker (${engine:-decode engine}): one layer of one decode step, each method"
cli decode --seq=demo --layer=17 --method=dense
cli decode --seq=demo --layer=17 --method=santa:allocation=prop,samples=128
cli decode --seq=demo --layer=17 --method=santa:allocation=flash,samples=2048
cli decode --seq=demo --layer=17 --method=hash_top_k:top_k_fraction=0.05
cli decode --seq=demo --layer=17 --method=vattention:epsilon=0.1,delta=0.1,predictor=exact
cli gather --seq=demo --layer=99 || echo "(refused as expected; the server keeps serving)"
cli stats
echo "== /metrics (kvsparse_ series):"
python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9464/metrics').read().decode())" \
  | grep -E '^kvsparse_(rpc_requests_total|store_|decode_fetched_bytes_total|decode_dense|resident_bytes)' \
  | grep -v ' 0$' | sed -n 1,40p  # sed reads to the end: no SIGPIPE under pipefail
echo "== SIGTERM: graceful shutdown"
kill -TERM $pid
wait $pid
trap - EXIT
tail -n 3 "$log"
echo "demo: OK"
