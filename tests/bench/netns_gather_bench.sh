#!/usr/bin/env bash
# rpc_gather_bench across two network stacks of this machine: the store (filled, with its arena
# exported over UCX) and the echo service in one network namespace, the clients in another,
# joined by a veth pair (TCP between them, as between two hosts; no shared memory). For each
# access pattern (random rows, as a sparse method selects them; contiguous rows: the transport's
# best case for the same bytes): the Gather RPC, the raw gRPC echo of the same bytes, and the
# UCX data plane (batched gather) side by side.
#
#   sudo tests/bench/netns_gather_bench.sh [BUILD_DIR] [-- extra rpc_gather_bench flags]
#
# Needs root (ip netns). Prints the bench's tables; the namespaces are removed on exit.
set -euo pipefail
build=${1:-build}
shift || true
[ "${1:-}" = "--" ] && shift
bench=$build/bin/rpc_gather_bench
[ -x "$bench" ] || { echo "build $bench first"; exit 1; }
ns_s=kvbs$$ ns_c=kvbc$$
arena=/dev/shm/kvsparse-netns-bench-$$
cleanup() {
  [ -n "${server:-}" ] && kill -9 "$server" 2>/dev/null && wait "$server" 2>/dev/null
  ip netns del "$ns_s" 2>/dev/null || true
  ip netns del "$ns_c" 2>/dev/null || true
  rm -f "$arena" "$arena.log" "$arena.client.log"
}
trap cleanup EXIT
ip netns add "$ns_s"
ip netns add "$ns_c"
ip link add vc netns "$ns_c" type veth peer name vs netns "$ns_s"
ip -n "$ns_c" addr add 10.216.0.1/24 dev vc
ip -n "$ns_s" addr add 10.216.0.2/24 dev vs
for ns in "$ns_s" "$ns_c"; do ip -n "$ns" link set lo up; done
ip -n "$ns_c" link set vc up
ip -n "$ns_s" link set vs up
# UCX lists an interface only once the kernel reports it up (about a second after).
for _ in $(seq 50); do
  [ "$(ip netns exec "$ns_s" cat /sys/class/net/vs/operstate)" = up ] &&
    [ "$(ip netns exec "$ns_c" cat /sys/class/net/vc/operstate)" = up ] && break
  sleep 0.1
done
echo "# $(nproc) cores; veth $ns_c (10.216.0.1) <-> $ns_s (10.216.0.2); UCX_TLS=tcp"
ip netns exec "$ns_s" "$bench" --serve=10.216.0.2:50071 --echo_listen=10.216.0.2:50072 \
  --arena_file="$arena" --reader=ucx --ucx_transports=tcp "$@" >"$arena.log" 2>&1 &
server=$!
for _ in $(seq 600); do grep -q "^serving" "$arena.log" 2>/dev/null && break; kill -0 "$server" 2>/dev/null || break; sleep 0.1; done
grep '^serving' "$arena.log" || { cat "$arena.log"; exit 1; }
for pattern in random contiguous; do
  echo "## pattern $pattern"
  timeout 600 ip netns exec "$ns_c" ${BENCH_WRAP:-} "$bench" --connect=10.216.0.2:50071 --echo=10.216.0.2:50072 --reader=ucx \
    --ucx_transports=tcp --pattern="$pattern" "$@" 2>"$arena.client.log" || { tail -30 "$arena.client.log"; exit 1; }
done
rm -f "$arena.log" "$arena.client.log"
