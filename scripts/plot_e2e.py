#!/usr/bin/env python3
"""Draws the README's picture from the JSON that tests/bench/e2e_bench.py writes (--json), one
file per run: tokens per second against context length at batch 1, and per batch size at 32k, for
each variant of each run. Runs are kept apart (a line style each, "run N" in the labels), since
ratios hold within a run only. The PNG is committed beside the JSON it came from (docs/img/), and
--check redraws it and fails when the committed one differs (the same matplotlib as
scripts/deploy_check.sh's venv; the PNG carries no date or version metadata).

    python scripts/plot_e2e.py RUN.json [RUN2.json ...] docs/img/e2e-tokens-per-s.png
    python scripts/plot_e2e.py --check RUN.json [RUN2.json ...] docs/img/e2e-tokens-per-s.png
"""

from __future__ import annotations

import argparse
import io
import json
import pathlib
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# The variants drawn, in the legend's order, with their names for a reader.
LABELS = {
    "offloaded": "transformers offloaded cache (KV in host RAM)",
    "resident": "GPU-resident KV, eager",
    "compiled": "GPU-resident KV, compiled (CUDA graphs)",
    "kvs-prop": "kvsparse S2ANTA-prop, V in host RAM, eager op",
    "kvsg-prop": "kvsparse S2ANTA-prop, V in host RAM, captured step",
    "kvs-hash": "kvsparse hash top-k, K and V in host RAM, eager op",
    "kvsg-hash": "kvsparse hash top-k, K and V in host RAM, captured step",
}
COLORS = dict(zip(LABELS, ["tab:gray", "tab:orange", "tab:red", "tab:cyan", "tab:blue", "tab:olive", "tab:green"]))
STYLES = ["-", "--", ":"]


def render(runs: list[list[dict]], title: str) -> bytes:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 5.6), gridspec_kw={"width_ratios": [3, 2]})
    multi = len(runs) > 1
    for i, rows in enumerate(runs):
        tag = f" (run {i + 1})" if multi else ""
        for variant, label in LABELS.items():
            pts = sorted((r["n"], r["tokens_per_s"]) for r in rows if r["variant"] == variant and r["batch"] == 1
                         and r.get("tokens_per_s"))
            if pts:
                left.plot([n / 1024 for n, _ in pts], [t for _, t in pts], marker="o", ls=STYLES[i % len(STYLES)],
                          color=COLORS[variant], label=label + tag)
    left.set_xscale("log", base=2)
    ticks = sorted({r["n"] // 1024 for rows in runs for r in rows})
    left.set_xticks(ticks, [f"{k}k" for k in ticks])
    left.minorticks_off()
    left.set_xlabel("context (tokens), batch 1")
    left.set_ylabel("tokens / s (higher is better)")
    left.set_yscale("log")
    left.grid(True, which="both", alpha=0.3)
    handles, labels = left.get_legend_handles_labels()
    bars = [(LABELS[v] + (f" (run {i + 1})" if multi else ""), r["tokens_per_s"], COLORS[v])
            for i, rows in enumerate(runs) for v in LABELS for r in rows
            if r["variant"] == v and r["batch"] == 8 and r["n"] == 32768 and r.get("tokens_per_s")]
    right.barh([b[0].replace(", ", ",\n", 1) for b in bars], [b[1] for b in bars], color=[b[2] for b in bars])
    right.set_xlabel("tokens / s at 32k, batch 8")
    right.tick_params(axis="y", labelsize=7)
    right.invert_yaxis()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.legend(handles, labels, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2, frameon=False)
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=110, metadata={"Software": None}, bbox_inches="tight")
    plt.close(fig)
    return out.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", type=pathlib.Path, nargs="+", help="one e2e_bench JSON per run")
    ap.add_argument("png", type=pathlib.Path)
    ap.add_argument("--check", action="store_true", help="fail if the committed PNG differs from a redraw")
    ap.add_argument("--title", default="Llama-3.1-8B shapes, one H100 80GB HBM3 (tests/bench/e2e_bench.py; docs/PERF.md, "
                    "\"Captured decode steps\"):\nrun 1 S2ANTA-prop, runs 2-3 hash top-k, each with its baselines")
    args = ap.parse_args()
    png = render([json.loads(j.read_text()) for j in args.json], args.title)
    if args.check:
        if not args.png.exists() or args.png.read_bytes() != png:
            print(f"STALE: {args.png}: run python scripts/plot_e2e.py {' '.join(map(str, args.json))} {args.png}",
                  file=sys.stderr)
            return 1
        print(f"plot_e2e: {args.png} matches {' '.join(map(str, args.json))}")
        return 0
    args.png.write_bytes(png)
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
