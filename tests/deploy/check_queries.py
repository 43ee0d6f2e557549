#!/usr/bin/env python3
"""Runs every Grafana panel query (deploy/monitoring/kvsparse-dashboard.json) and every recording
rule (deploy/prometheus/kvsparse.rules.yml) against a live Prometheus that scrapes a live
kvsparse-server, through Prometheus' HTTP API; each must return a non-empty series with a finite
value. Also fails on a rule whose evaluation errored or a scrape target that is down.

A query may come back empty only when every kvsparse_ metric it reads that is missing from the
server's /metrics is listed below: PENDING (the C++ side is to add it; docs/DEPLOY.md) or
GPU_ONLY (exported by the GPU engine only) or WORKER_ONLY (by a worker of a split deployment). Such a query is printed as PENDING or SKIP, and is
checked like the others as soon as the server exports the metric.

usage: check_queries.py --prometheus http://127.0.0.1:PORT --metrics http://127.0.0.1:PORT/metrics
"""
import argparse
import json
import math
import pathlib
import re
import sys
import urllib.parse
import urllib.request

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
PENDING: set[str] = set()
GPU_ONLY = {"kvsparse_gpu_resident_bytes", "kvsparse_gpu_resident_capacity_bytes"}
WORKER_ONLY = {"kvsparse_worker_store_shard_up", "kvsparse_worker_in_place_rows_total",
               "kvsparse_worker_in_place_fallbacks_total"}
SUBSTITUTE = {"$__rate_interval": "1m", "$job": ".+", "$instance": ".+"}


def get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def api(prom, path, **params):
    body = json.loads(get(f"{prom}/api/v1/{path}?{urllib.parse.urlencode(params)}"))
    if body.get("status") != "success":
        raise RuntimeError(f"{path} {params}: {body}")
    return body["data"]


def panel_queries(dashboard):
    for panel in dashboard["panels"]:
        for target in panel.get("targets") or []:
            expr = target["expr"]
            for var, value in SUBSTITUTE.items():
                expr = expr.replace(var, value)
            yield f"panel '{panel['title']}' {target.get('refId', '')}", expr


def metric_names(expr):
    return {re.sub(r"_(bucket|sum|count)$", "", m) for m in re.findall(r"\bkvsparse_[a-z_]+", expr)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prometheus", required=True)
    ap.add_argument("--metrics", required=True, action="append",
                    help="a server's /metrics URL (repeat for several servers)")
    args = ap.parse_args()
    exported = {re.sub(r"_(bucket|sum|count)$", "", line.split("{")[0].split(" ")[0])
                for url in args.metrics for line in get(url).splitlines() if line.startswith("kvsparse_")}
    dashboard = json.loads((ROOT / "deploy/monitoring/kvsparse-dashboard.json").read_text())
    rules = yaml.safe_load((ROOT / "deploy/prometheus/kvsparse.rules.yml").read_text())
    checks = list(panel_queries(dashboard))
    records = [r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r]
    checks += [(f"rule {name}", name) for name in records]
    failures, counts = [], {"ok": 0, "PENDING": 0, "SKIP": 0}

    targets = api(args.prometheus, "targets")["activeTargets"]
    for t in targets:
        if t["health"] != "up":
            failures.append(f"target {t['scrapeUrl']} is {t['health']}: {t.get('lastError')}")
    if not targets:
        failures.append("Prometheus has no active target")
    loaded = 0
    for group in api(args.prometheus, "rules")["groups"]:
        for rule in group["rules"]:
            loaded += 1
            if rule.get("health") not in ("ok", "unknown") or rule.get("lastError"):
                failures.append(f"rule {rule['name']}: health {rule.get('health')}: {rule.get('lastError')}")
    n_rules = sum(len(g["rules"]) for g in rules["groups"])
    if loaded != n_rules:
        failures.append(f"Prometheus loaded {loaded} rules, the file has {n_rules}")

    for what, expr in checks:
        result = api(args.prometheus, "query", query=expr)["result"]
        finite = [s for s in result if math.isfinite(float(s["value"][1]))]
        if finite:
            counts["ok"] += 1
            sample = ", ".join(f"{json.dumps(s['metric'], sort_keys=True)}={float(s['value'][1]):.4g}"
                               for s in finite[:2])
            print(f"ok      {what}: {len(finite)} series, e.g. {sample}"[:200])
            continue
        missing = metric_names(expr) - exported
        if missing and missing <= PENDING | GPU_ONLY | WORKER_ONLY:
            kind = "PENDING" if missing & PENDING else "SKIP"
            counts[kind] += 1
            print(f"{kind:7} {what}: empty; reads {sorted(missing)}, not exported by this server"
                  + (" (to add: docs/DEPLOY.md)" if kind == "PENDING"
                     else " (GPU engine only)" if missing <= GPU_ONLY else " (a split deployment's workers only)"))
            continue
        failures.append(f"{what}: {len(result)} series, none finite: {expr}")
        print(f"FAIL    {what}: {len(result)} series, none finite\n        {expr}")

    print(f"check_queries: {len(checks)} queries ({len(checks) - len(records)} panel targets, "
          f"{len(records)} recording rules): {counts['ok']} ok, {counts['PENDING']} pending, "
          f"{counts['SKIP']} skipped (GPU engine or split workers only), {len(failures)} failed; {len(targets)} targets, {loaded} rules loaded")
    for f in failures:
        print(f"FAIL: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
