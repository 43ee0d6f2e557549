#!/usr/bin/env bash
# The shared-arena pod (deploy/overlays/shared-arena) as two containers of the runtime image:
# the store keeps its pages in an arena file on a shared tmpfs directory, the worker (in the
# store's network namespace, the directory mounted read-only) maps it and reads rows in place.
# Drives the CLI workload against them and checks that every row the worker read came from the
# file (no fallback to Gather), then stops both with SIGTERM.
#   PODMAN="podman --runtime runc" RUN_FLAGS="--ulimit nofile=4096:4096 --ulimit nproc=4096:4096" \
#     bash docker/run_shared_arena.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PODMAN=${PODMAN:-podman}
IMAGE=${IMAGE:-localhost/kvsparse:dev}
CLI=${CLI:-build/bin/kvsparse}
read -r -a run_flags <<<"${RUN_FLAGS:-}"
shm=$(mktemp -d /dev/shm/kvsparse-pod.XXXXXX)
chown 10001:10001 "$shm"
cleanup() {
  $PODMAN rm -f kvs-worker >/dev/null 2>&1 || true
  $PODMAN rm -f kvs-store >/dev/null 2>&1 || true
  rm -rf "$shm"
}
trap cleanup EXIT
secure=(--read-only --cap-drop=ALL --security-opt no-new-privileges "${run_flags[@]}")
$PODMAN run -d --name kvs-store "${secure[@]}" -v "$shm:/dev/shm/kvsparse" \
  -p 127.0.0.1:50062:50052 -p 127.0.0.1:50063:50051 -p 127.0.0.1:9475:9464 "$IMAGE" \
  --role=store --listen=0.0.0.0:50052 --insecure --metrics_listen=0.0.0.0:9465 --capacity=1G \
  --capacity_policy=evict-lru --arena_file=/dev/shm/kvsparse/arena >/dev/null
$PODMAN run -d --name kvs-worker "${secure[@]}" --network container:kvs-store \
  -v "$shm:/dev/shm/kvsparse:ro" "$IMAGE" \
  --role=worker --store=127.0.0.1:50052 --store_arena_file=/dev/shm/kvsparse/arena \
  --listen=0.0.0.0:50051 --insecure --metrics_listen=0.0.0.0:9464 --gpu=off >/dev/null
for t in 50062 50063; do "$CLI" --target=127.0.0.1:$t --wait_for_ready=20s health; done
"$CLI" --target=127.0.0.1:50062 create --seq=demo --layers=4 --k_tier=device --signature_bits=32
"$CLI" --target=127.0.0.1:50062 append --seq=demo --tokens=8192 --seed=7
for m in dense santa hash_top_k vattention; do
  echo "== decode $m on the worker"
  "$CLI" --target=127.0.0.1:50062 --worker=127.0.0.1:50063 decode --seq=demo --layer=2 --method=$m
done
metrics=$(curl -sf 127.0.0.1:9475/metrics | grep -E '^kvsparse_worker_(in_place|page_table)')
echo "$metrics"
rows=$(awk '/^kvsparse_worker_in_place_rows_total/ {print $2}' <<<"$metrics")
fallbacks=$(awk '/^kvsparse_worker_in_place_fallbacks_total/ {print $2}' <<<"$metrics")
[ "${rows%.*}" -gt 0 ] && [ "${fallbacks%.*}" -eq 0 ] \
  || { echo "shared arena: the worker did not read in place"; exit 1; }
$PODMAN stop -t 30 kvs-worker kvs-store >/dev/null
$PODMAN ps -a --filter name=kvs- --format '{{.Names}} {{.Status}}'
echo "shared arena: ok (${rows%.*} rows read in place, no Gather fallback)"
