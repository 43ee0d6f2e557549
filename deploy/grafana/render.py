#!/usr/bin/env python3
"""Draws the main panels of deploy/monitoring/kvsparse-dashboard.json with matplotlib, from the
same queries run as range queries against a Prometheus (the one scripts/deploy_check.sh starts:
DEPLOY_RENDER_PNG=docs/img/kvsparse-dashboard.png bash scripts/deploy_check.sh).

usage: render.py --prometheus URL --start UNIX --end UNIX --out PNG
"""
import argparse
import json
import math
import pathlib
import urllib.parse
import urllib.request

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
PANELS = [
    "Calls per second by method",
    "Latency p50 / p99 by method",
    "Decode engine time p50 / p99 by stage",
    "Saving ratio by method",
    "Bytes read per tier against dense",
    "Achieved gather bandwidth by method",
    "Budgets per query head",
    "Store fill",
    "Evictions and rejections",
    "Errors by code",
]
SUBSTITUTE = {"$__rate_interval": "10s", "$job": ".+", "$instance": ".+"}
SCALE = {"s": (1e3, "ms"), "Bps": (1e-6, "MB/s"), "percentunit": (100, "%"), "bytes": (2**-20, "MiB")}


def legend(fmt, metric):
    return "".join(metric.get(part[2:-2].strip(), "") if part.startswith("{{") else part
                   for part in __import__("re").split(r"(\{\{[^}]*\}\})", fmt)).strip()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prometheus", required=True)
    ap.add_argument("--start", type=float, required=True)
    ap.add_argument("--end", type=float, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    board = json.loads((ROOT / "deploy/monitoring/kvsparse-dashboard.json").read_text())
    by_title = {p["title"]: p for p in board["panels"] if p.get("targets")}
    fig, axes = plt.subplots(5, 2, figsize=(14, 17), constrained_layout=True)
    for ax, title in zip(axes.flat, PANELS):
        panel = by_title[title]
        unit = panel["fieldConfig"]["defaults"].get("unit", "")
        scale, label = SCALE.get(unit, (1, unit))
        for target in panel["targets"]:
            expr = target["expr"]
            for k, v in SUBSTITUTE.items():
                expr = expr.replace(k, v)
            # From 10 s in: rate() windows before that reach back past the first scrape.
            q = urllib.parse.urlencode({"query": expr, "start": args.start + 10, "end": args.end, "step": 1})
            data = json.loads(urllib.request.urlopen(f"{args.prometheus}/api/v1/query_range?{q}").read())
            for series in data["data"]["result"]:
                xs = [t - args.start for t, _ in series["values"]]
                ys = [float(v) * scale if math.isfinite(float(v)) else math.nan for _, v in series["values"]]
                if not any(math.isfinite(y) and y != 0 for y in ys):
                    continue  # idle methods, tiers and codes: drawn flat at 0 they hide the rest
                ax.plot(xs, ys, label=legend(target.get("legendFormat", ""), series["metric"]), linewidth=1.2)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(label, fontsize=8)
        ax.set_xlabel("seconds into the run", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, ncol=2, loc="best")
    fig.suptitle("kvsparse dashboard, main panels: kvsparse-server (CPU engine) under tests/deploy/workload.sh,"
                 " scraped every 1 s (series that stay 0 left out)", fontsize=11)
    fig.savefig(args.out, dpi=80)
    print(f"render: wrote {args.out}")


if __name__ == "__main__":
    main()
