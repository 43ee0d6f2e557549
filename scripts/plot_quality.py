#!/usr/bin/env python3
"""Draws docs/ACCURACY.md's summary picture from the quality harness's JSON
(tests/quality/harness.py --out): for each method of the committed runs on the model trained in
the repository, pass keys against dense's (90 documents at 4k / 8k / 16k) over the share of the KV
bytes the worker keeps on its GPU, and the perplexity change against dense at 16k with its 95%
interval. Each run names its checkpoint by dense's pass keys (training is not bit-reproducible:
every checkpoint is another model). As scripts/plot_e2e.py: --check redraws it and fails when the
committed PNG differs.

    python scripts/plot_quality.py docs/img/quality-gpu-share.png
    python scripts/plot_quality.py --check docs/img/quality-gpu-share.png
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

REPO = pathlib.Path(__file__).resolve().parents[1]
# The runs drawn (docs/data/), 90 pass-key documents each, with gpu_kv_fraction.
RUNS = [
    "quality-2026-11-26-oracle-ckeys-a.json",
    "quality-2026-11-26-ckeys-8windows-a.json",
    "quality-2026-11-26-ckeys-8windows-b.json",
    "quality-2026-11-27-ckeys-santa-a.json",
    "quality-2026-11-27-ckeys-santa-a2.json",
    "quality-2026-11-27-vatt-imp.json",
    "quality-2026-11-27-vatt-imp-2.json",
    "quality-2026-11-27-ckeys1-32windows-c.json",
    "quality-2026-11-27-ckeys1-64windows-d.json",
    "quality-2026-11-27-vatt-imp-gpu-d.json",
]
# Method families by the harness's method-name prefix, in the legend's order.
FAMILIES = [
    ("oracle-topk", "oracle top-k (exact scores, K resident)", "black"),
    ("ckeys1-topk", "top-k over 1-bit keys", "tab:green"),
    ("ckeys2-topk", "top-k over 2-bit keys", "tab:olive"),
    ("ckeys2-s2anta", "S2ANTA-prop over 2-bit keys", "tab:blue"),
    ("s2anta-prop", "S2ANTA-prop, K resident", "tab:cyan"),
    ("vatt-ckeys2", "vAttention over 2-bit keys", "tab:purple"),
    ("hash-learned", "learned HashAttention 32 bits", "tab:red"),
]
MARKERS = "osD^v<>p"
CONTEXT = "16384"


def family(name: str) -> tuple[str, str] | None:
    for prefix, label, color in FAMILIES:
        if name.startswith(prefix):
            return label, color
    return None


def points(data_dir: pathlib.Path) -> list[dict]:
    out = []
    for run in RUNS:
        d = json.loads((data_dir / run).read_text())
        dense = d["methods"]["dense"]["passkey_correct"]
        for name, m in d["methods"].items():
            f = family(name)
            c = m["contexts"].get(CONTEXT)
            if f is None or c is None or m.get("passkey_documents") != 90:
                continue
            out.append({
                "name": name, "family": f[0], "color": f[1], "checkpoint": dense,
                "share": c["gpu_kv_fraction"], "passkeys": m["passkey_correct"] - dense,
                "ppl": 100 * c["ppl_change"], "ci": [100 * x for x in c["ppl_change_ci95"]],
            })
    return out


def render(pts: list[dict], title: str) -> bytes:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 6.2), gridspec_kw={"width_ratios": [1, 1]})
    checkpoints = sorted({p["checkpoint"] for p in pts})
    marker = {c: MARKERS[i % len(MARKERS)] for i, c in enumerate(checkpoints)}
    low = -12  # points below are drawn on the edge, their value beside them
    clipped = 0
    for p in pts:
        y = max(p["passkeys"], low)
        left.scatter(p["share"] * 100, y, color=p["color"], marker=marker[p["checkpoint"]],
                     s=36, alpha=0.85, edgecolors="none")
        if y != p["passkeys"]:
            left.annotate(f"{p['passkeys']} (dense {p['checkpoint']})", (p["share"] * 100, y),
                          textcoords="offset points", xytext=(8, 4 + 10 * clipped), fontsize=7, color=p["color"])
            clipped += 1
    left.set_ylim(low - 1, 3)
    left.set_xscale("log")
    left.set_xticks([3, 5, 8, 13, 30, 53], ["3%", "5%", "8%", "13%", "30%", "53%"])
    left.minorticks_off()
    left.axvline(8, color="gray", ls="--", lw=1)
    left.axhline(-2, color="gray", ls=":", lw=1)
    left.set_xlabel("KV bytes on the worker's GPU (of all KV bytes; 16k, all state)")
    left.set_ylabel("pass keys minus dense's (of 90; 4k / 8k / 16k)")
    left.grid(True, alpha=0.3)
    handles = [plt.Line2D([], [], color=c, marker="o", ls="", label=label) for _, label, c in FAMILIES
               if any(p["family"] == label for p in pts)]
    handles += [plt.Line2D([], [], color="gray", marker=marker[c], ls="", label=f"checkpoint: dense {c}/90")
                for c in checkpoints]
    left.legend(handles=handles, fontsize=7, loc="lower right")
    rows = sorted(pts, key=lambda p: ([f[1] for f in FAMILIES].index(p["family"]), p["name"], p["checkpoint"]))
    edge = 3.0  # % : intervals beyond are cut at the edge, the estimate written beside it
    for i, p in enumerate(rows):
        x = min(max(p["ppl"], -edge), edge)
        lo, hi = min(max(p["ci"][0], -edge), x), max(min(p["ci"][1], edge), x)
        right.errorbar(x, i, xerr=[[x - lo], [hi - x]], color=p["color"],
                       marker=marker[p["checkpoint"]], ms=5, capsize=2, lw=1)
        if x != p["ppl"]:
            right.annotate(f"{p['ppl']:+.1f}% [{p['ci'][0]:+.1f}, {p['ci'][1]:+.1f}]", (x, i),
                           textcoords="offset points", xytext=(-4, 3), ha="right", fontsize=6, color=p["color"])
    right.set_yticks(range(len(rows)), [f"{p['name']} (dense {p['checkpoint']})" for p in rows], fontsize=6)
    right.invert_yaxis()
    right.axvspan(-1, 1, color="tab:green", alpha=0.08)
    right.axvline(0, color="gray", lw=0.8)
    right.set_xlim(-edge, edge)
    right.set_xlabel("perplexity change against dense at 16k, %\n(95% interval; shaded: within 1%)")
    right.grid(True, axis="x", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=100, metadata={"Software": None})
    plt.close(fig)
    return out.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("png", type=pathlib.Path)
    ap.add_argument("--data", type=pathlib.Path, default=REPO / "docs" / "data")
    ap.add_argument("--check", action="store_true", help="fail if the committed PNG differs from a redraw")
    ap.add_argument("--title", default="The 22M-parameter model trained in the repository, decoded through kvsparse "
                    "(tests/quality/harness.py, H100; docs/ACCURACY.md)")
    args = ap.parse_args()
    png = render(points(args.data), args.title)
    if args.check:
        if not args.png.exists() or args.png.read_bytes() != png:
            print(f"STALE: {args.png}: run python scripts/plot_quality.py {args.png}", file=sys.stderr)
            return 1
        print(f"plot_quality: {args.png} matches {', '.join(RUNS)}")
        return 0
    args.png.write_bytes(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
