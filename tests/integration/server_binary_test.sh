#!/usr/bin/env bash
# The real kvsparse-server binary driven by the real kvsparse CLI: flags, health, a workload
# verified byte-for-byte, /metrics over HTTP, and SIGTERM -> NOT_SERVING -> exit 0.
# Usage: server_binary_test.sh BIN_DIR
set -euo pipefail
bin=${1:?bin dir}
work=$(mktemp -d)
trap 'kill -9 ${pid:-} 2>/dev/null || true; rm -rf "$work"' EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
port=$(free_port); mport=$(free_port)
"$bin/kvsparse-server" --listen=127.0.0.1:$port --metrics_listen=127.0.0.1:$mport \
  --capacity=64M --capacity_policy=evict-lru --shutdown_grace=5s 2>"$work/server.log" &
pid=$!
cli() { "$bin/kvsparse" --target=127.0.0.1:$port --wait_for_ready=10s "$@"; }

cli health | grep -q SERVING
cli create --seq=t1 --layers=2 --q_heads=8 --kv_heads=2 --head_dim=64 --dtype=fp16 | grep -q "t1:"
cli append --seq=t1 --tokens=500 --seed=9 2>"$work/progress.log" | grep -q "appended 500 tokens"
grep -q "500/500 tokens" "$work/progress.log"     # progress output on stderr
cli gather --seq=t1 --layer=1 --random_rows=64 --verify --seed=9 | grep -q verified
cli gather --seq=t1 --layer=0 --indices=3,3,7 --unique --kind=v | grep -q "3(x2)"
cli bench-gather --seq=t1 --rows=256 --iters=20 --warmup=2 --verify --seed=9 | grep -q "calls/s"
cli info --seq=t1 | grep -q "500 tokens in every layer"
cli stats | grep -q "sequences       1"
# A bad request exits non-zero with the server's status, and the server keeps serving.
if cli gather --seq=t1 --layer=9 2>"$work/err.log"; then echo "bad gather succeeded"; exit 1; fi
grep -q INVALID_ARGUMENT "$work/err.log"
if cli info --seq=nope 2>"$work/err.log"; then echo "unknown seq succeeded"; exit 1; fi
grep -q NOT_FOUND "$work/err.log"
cli health | grep -q SERVING

metrics=$(python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$mport/metrics').read().decode())")
echo "$metrics" | grep -q 'kvsparse_rpc_requests_total{code="OK",method="Gather"}'
echo "$metrics" | grep -q 'kvsparse_rpc_requests_total{code="INVALID_ARGUMENT",method="Gather"} 1'
echo "$metrics" | grep -Eq '^kvsparse_store_appended_bytes_total [1-9]'
echo "$metrics" | grep -Eq '^kvsparse_store_gathered_bytes_total\{tier="host"\} [1-9]'

kill -TERM $pid
for _ in $(seq 100); do kill -0 $pid 2>/dev/null || break; sleep 0.1; done
if kill -0 $pid 2>/dev/null; then echo "server did not exit within 10 s of SIGTERM"; exit 1; fi
wait $pid; rc=$?
[ $rc -eq 0 ] || { echo "server exited $rc"; cat "$work/server.log"; exit 1; }
grep -q "received Terminated" "$work/server.log"
grep -q "shut down" "$work/server.log"
echo "server_binary_test: OK"
