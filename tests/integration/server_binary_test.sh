#!/usr/bin/env bash
# The real kvsparse-server binary driven by the real kvsparse CLI: flags, health, a workload
# verified byte-for-byte, /metrics over HTTP, and SIGTERM -> NOT_SERVING -> exit 0.
# Usage: server_binary_test.sh BIN_DIR
set -euo pipefail
bin=${1:?bin dir}
work=$(mktemp -d)
trap 'kill -9 ${pid:-} ${wpid:-} 2>/dev/null || true; rm -rf "$work"' EXIT

# --help prints the flags and exits 0, for both programs: the program's name once, the flags'
# files by their path in the repository (no build machine's path).
"$bin/kvsparse" --help | grep -- "--target" >/dev/null
help=$("$bin/kvsparse-server" --help)
grep -q -- "--listen" <<<"$help"
if grep -q "kvsparse-server: kvsparse-server" <<<"$help" || ! grep -q "Flags from server/main.cc" <<<"$help"; then
  echo "kvsparse-server --help:"; head -5 <<<"$help"; exit 1
fi

# Ports 0: the server binds free ones and logs them (no window in which another test could take
# a port chosen here first, as under ctest -j).
"$bin/kvsparse-server" --listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 \
  --capacity=64M --capacity_policy=evict-lru --shutdown_grace=5s 2>"$work/server.log" &
pid=$!
port=; mport=
for _ in $(seq 300); do
  line=$(grep -m1 "listening on" "$work/server.log" || true)
  if [ -n "$line" ]; then
    port=$(sed -E 's/.*listening on [^ ]+ \(port ([0-9]+)\).*/\1/' <<<"$line")
    mport=$(sed -E 's/.*metrics on [^ ]+ \(port ([0-9]+)\).*/\1/' <<<"$line")
    break
  fi
  kill -0 $pid 2>/dev/null || { echo "server exited"; cat "$work/server.log"; exit 1; }
  sleep 0.1
done
[ -n "$port" ] || { echo "server did not report its port in 30 s"; cat "$work/server.log"; exit 1; }
cli() { "$bin/kvsparse" --target=127.0.0.1:$port --wait_for_ready=10s "$@"; }

# Output is captured and then searched, never piped into `grep -q`: grep exits at its first
# match, and under pipefail a writer still writing then dies of SIGPIPE and fails the test.
expect() {  # expect REGEX COMMAND...: the command succeeds and its stdout matches REGEX
  local re=$1 out; shift
  out=$("$@") || { echo "failed: $*"; exit 1; }
  grep -Eq -- "$re" <<<"$out" || { echo "no /$re/ in the output of: $*"; echo "$out"; exit 1; }
}
expect SERVING cli health
# --version names the version and the commit the binaries were built from.
for b in kvsparse-server kvsparse; do
  "$bin/$b" --version | grep -Eq "^$b [0-9.]+ \(commit ([0-9a-f]{12}(-dirty)?|unknown), CUDA (on|off)\)$" \
    || { echo "$b --version: $("$bin/$b" --version)"; exit 1; }
done
expect "t1:" cli create --seq=t1 --layers=2 --q_heads=8 --kv_heads=2 --head_dim=64 --dtype=fp16
expect "appended 500 tokens" cli append --seq=t1 --tokens=500 --seed=9 2>"$work/progress.log"
grep -q "500/500 tokens" "$work/progress.log"     # progress output on stderr
expect verified cli gather --seq=t1 --layer=1 --random_rows=64 --verify --seed=9
expect "3\(x2\)" cli gather --seq=t1 --layer=0 --indices=3,3,7 --unique --kind=v
expect "calls/s" cli bench-gather --seq=t1 --rows=256 --iters=20 --warmup=2 --verify --seed=9
expect "500 tokens in every layer" cli info --seq=t1
expect "sequences +1$" cli stats
# A fork of t1's first 300 tokens: its whole pages shared, the same rows.
expect "of those bytes shared" cli fork --seq=t1f --from=t1 --tokens=300
expect verified cli gather --seq=t1f --layer=1 --random_rows=64 --verify --seed=9
if cli fork --seq=t1g --from=t1 --tokens=501 2>"$work/err.log"; then echo "fork past t1 succeeded"; exit 1; fi
grep -q "FAILED_PRECONDITION" "$work/err.log"
expect "dropped t1f" cli drop --seq=t1f
# A bad request exits non-zero with the server's status, and the server keeps serving.
if cli gather --seq=t1 --layer=9 2>"$work/err.log"; then echo "bad gather succeeded"; exit 1; fi
grep -q INVALID_ARGUMENT "$work/err.log"
if cli info --seq=nope 2>"$work/err.log"; then echo "unknown seq succeeded"; exit 1; fi
grep -q NOT_FOUND "$work/err.log"
# A layer the sequence does not have: the server's answer (the CLI used to say FAILED_PRECONDITION
# "the layer holds no tokens" itself).
if cli decode --seq=t1 --layer=5 2>"$work/err.log"; then echo "decode of layer 5 succeeded"; exit 1; fi
grep -q "INVALID_ARGUMENT.*layer 5" "$work/err.log" || { cat "$work/err.log"; exit 1; }
# A word the method's text does not know is refused, naming the field and its words (it used to be
# read as hash), before any call.
if cli decode --seq=t1 --layer=1 --method=vattention:predictor=hahs 2>"$work/err.log"; then
  echo "unknown predictor accepted"; exit 1
fi
grep -q "predictor='hahs' is not one of hash, exact, compressed" "$work/err.log" || { cat "$work/err.log"; exit 1; }
# `method` prints every field of a method, its defaults from the proto (no server asked).
expect "top_k_fraction: 0.03125" cli method --method=top_k
# S2ANTA over compressed keys from the CLI: a sequence keeping 2-bit keys, the ratio correction.
expect "t2:" cli create --seq=t2 --layers=2 --q_heads=8 --kv_heads=2 --head_dim=64 --dtype=fp16 \
  --compressed_key_bits=2
expect "appended 600 tokens" cli append --seq=t2 --tokens=600 --seed=4 2>/dev/null
expect "relative L2 error against dense" cli decode --seq=t2 --layer=1 \
  --method=santa:scores=compressed,samples=256
# Every response states its error; the CLI prints it (S2ANTA: its standard error; top-k over
# compressed keys: the certified bound on the attention mass it leaves out).
expect "stated standard error, relative to the output .*over 8 heads" cli decode --seq=t2 \
  --layer=1 --method=santa:scores=compressed,samples=256
expect "stated certified bound on the attention mass left out .*over 8 heads" cli decode \
  --seq=t2 --layer=1 --method=top_k:top_k_fraction=0.1
# The group mixture: one sample of S rows per kv head (the union of 4 heads' would be up to 4 S).
expect "relative L2 error against dense" cli decode --seq=t2 --layer=1 \
  --method=santa:scores=compressed,samples=64,proposal=group
# vAttention drawing its residual in proportion to the compressed keys' scores.
expect "relative L2 error against dense" cli decode --seq=t2 --layer=1 \
  --method=vattention:predictor=compressed,sampler=importance,epsilon=0.1,delta=0.1
if cli decode --seq=t2 --layer=1 --method=vattention:sampler=strat 2>"$work/err.log"; then
  echo "unknown residual sampler accepted"; exit 1
fi
grep -q "sampler='strat' is not one of uniform, importance" "$work/err.log" || { cat "$work/err.log"; exit 1; }
# A split deployment from the CLI, named as the Python client names it: --target is the server
# called (for decode, the worker), --store_target the store; the worker reads the rows from the
# store ("remote" bytes). The old --worker flag is refused, naming the new spelling.
"$bin/kvsparse-server" --role=worker --store=127.0.0.1:$port --listen=127.0.0.1:0 \
  --metrics_listen=127.0.0.1:0 --gpu=off 2>"$work/worker.log" &
wpid=$!
wport=
for _ in $(seq 300); do
  line=$(grep -m1 "listening on" "$work/worker.log" || true)
  [ -n "$line" ] && { wport=$(sed -E 's/.*listening on [^ ]+ \(port ([0-9]+)\).*/\1/' <<<"$line"); break; }
  kill -0 $wpid 2>/dev/null || { echo "worker exited"; cat "$work/worker.log"; exit 1; }
  sleep 0.1
done
[ -n "$wport" ] || { echo "worker did not report its port in 30 s"; cat "$work/worker.log"; exit 1; }
split() { "$bin/kvsparse" --target=127.0.0.1:$wport --store_target=127.0.0.1:$port --wait_for_ready=10s "$@"; }
expect "remote [1-9][0-9]*;" split decode --seq=t2 --layer=1 --method=dense
expect "600 tokens in every layer" split info --seq=t2  # store commands go to --store_target
rc=0; "$bin/kvsparse" --target=127.0.0.1:$port --worker=127.0.0.1:$wport health 2>"$work/err.log" || rc=$?
[ $rc -eq 2 ] && grep -q -- "--store_target" "$work/err.log" || { echo "--worker exited $rc"; cat "$work/err.log"; exit 1; }
kill -TERM $wpid; wait $wpid || true
# Appending no tokens is an error, not "appended 0 tokens".
if cli append --seq=t1 --tokens=0 2>"$work/err.log"; then echo "append of 0 tokens succeeded"; exit 1; fi
grep -q INVALID_ARGUMENT "$work/err.log"
# An unknown command is answered with the usage and exit code 2 before any connection (no
# server on port 1: it used to wait --wait_for_ready first, then fail to connect).
rc=0; "$bin/kvsparse" --target=127.0.0.1:1 --wait_for_ready=30s frobnicate 2>"$work/err.log" || rc=$?
[ $rc -eq 2 ] || { echo "unknown command exited $rc"; cat "$work/err.log"; exit 1; }
grep -q "unknown command 'frobnicate'" "$work/err.log"
# --log_format takes text or json only (rpc/logging.h; LoggingTest.JsonLinesParseBackToTheMessage).
rc=0; "$bin/kvsparse-server" --log_format=xml 2>"$work/err.log" || rc=$?
[ $rc -eq 2 ] && grep -q "log_format must be text or json" "$work/err.log" || { cat "$work/err.log"; exit 1; }
# The GPU options' ranges, checked by the engine's one check (engine::CheckGpuOptions).
rc=0; "$bin/kvsparse-server" --gpu=off --gpu_row_cache=1.5 2>"$work/err.log" || rc=$?
[ $rc -eq 2 ] && grep -q -- "--gpu_row_cache must be a fraction in \[0, 1\], not 1.5" "$work/err.log" \
  || { cat "$work/err.log"; exit 1; }
expect SERVING cli health

metrics=$(python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$mport/metrics').read().decode())")
for re in 'kvsparse_rpc_requests_total\{code="OK",method="Gather"\}' \
  'kvsparse_rpc_requests_total\{code="INVALID_ARGUMENT",method="Gather"\} 1$' \
  '^kvsparse_store_appended_bytes_total [1-9]' \
  '^kvsparse_store_gathered_bytes_total\{tier="host"\} [1-9]' \
  '^kvsparse_serving 1$' \
  '^kvsparse_build_info\{commit="([0-9a-f]{12}(-dirty)?|unknown)",cuda="(on|off)",version="[0-9.]+"\} 1$'; do
  grep -Eq -- "$re" <<<"$metrics" || { echo "no /$re/ in /metrics"; exit 1; }
done

kill -TERM $pid
# --shutdown_grace=5s bounds the drain; 15 s leaves room for a loaded machine (ctest -j).
for _ in $(seq 150); do kill -0 $pid 2>/dev/null || break; sleep 0.1; done
if kill -0 $pid 2>/dev/null; then echo "server did not exit within 15 s of SIGTERM"; exit 1; fi
rc=0; wait $pid || rc=$?
[ $rc -eq 0 ] || { echo "server exited $rc"; cat "$work/server.log"; exit 1; }
grep -q "received Terminated" "$work/server.log"
grep -q "shut down" "$work/server.log"

# The README's CLI walk-through (its first sh block under "## The CLI") as written, against a
# server on its defaults (ports apart): every line must succeed (issue 48: it ran past the
# default capacity and dropped s1 before its bench-gather).
readme="$(dirname "$0")/../../README.md"
walk=$(awk '/^## The CLI/{f=1} f && /^```sh/{b=1; next} b && /^```/{exit} b' "$readme")
[ -n "$walk" ] || { echo "no CLI block in README.md"; exit 1; }
"$bin/kvsparse-server" --listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 2>"$work/defaults.log" &
pid=$!
dport=
for _ in $(seq 300); do
  line=$(grep -m1 "listening on" "$work/defaults.log" || true)
  [ -n "$line" ] && { dport=$(sed -E 's/.*listening on [^ ]+ \(port ([0-9]+)\).*/\1/' <<<"$line"); break; }
  sleep 0.1
done
[ -n "$dport" ] || { echo "the server on its defaults did not start"; cat "$work/defaults.log"; exit 1; }
while IFS= read -r line; do
  cmd=$(sed -E -e "s#127\.0\.0\.1:50051#127.0.0.1:$dport#g" \
    -e "s#(^|; *)kvsparse #\1$bin/kvsparse --target=127.0.0.1:$dport --wait_for_ready=10s #g" <<<"${line%%#*}")
  [ -n "${cmd// /}" ] || continue
  eval "$cmd" >"$work/walk.out" 2>&1 || { echo "README walk-through failed: $line"; cat "$work/walk.out"; exit 1; }
done <<<"$walk"
kill -TERM $pid; wait $pid || true
echo "server_binary_test: OK"
