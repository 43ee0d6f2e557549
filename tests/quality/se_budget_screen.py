"""A budget set by S2ANTA's own standard error, screened offline on budget_probe.py's output.

budget_probe.py writes, per method and layer, every (call, query head)'s true error and the
standard error S2ANTA states for it, and every (call, kv head)'s rows. Given runs of one proposal
at several S (e.g. the group mixture at 512, 1024 and 2048), this asks what a two-stage rule
would give: draw the smallest S first (the pilot), take the worst stated standard error over the
kv head's query heads, and draw up to S_pilot (SE / target)^2 in all (the standard error falls as
1 / sqrt(S)), rounded up to the next S run (the largest at most). Each (call, kv head) then takes
that run's errors and rows. Printed: each fixed S's and each target's mean and RMS error and
mean rows per (call, kv head), and the share of (call, kv head)s at each S.

    python3 tests/quality/budget_probe.py --gguf smollm2 --context 8192 --queries 8 \\
        --key_widths widths.bin --out probe.json --methods \\
        "santa:samples=512,scores=compressed,proposal=group" \\
        "santa:samples=1024,scores=compressed,proposal=group" \\
        "santa:samples=2048,scores=compressed,proposal=group"
    python3 tests/quality/se_budget_screen.py probe.json --targets 0.15 0.1 0.07 0.05
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

Runs = dict[tuple[str, int], tuple[np.ndarray, np.ndarray, np.ndarray]]


def load(path: Path) -> tuple[list[int], Runs]:
    """The S of each method and, per (layer, S), errors and stated SEs [calls x kv heads, G] and
    rows [calls x kv heads]."""
    r = json.loads(path.read_text())
    runs: Runs = {}
    sizes = []
    for spec, m in r["methods"].items():
        s = int(spec.split("samples=")[1].split(",")[0])
        sizes.append(s)
        for layer, c in m["calls"].items():
            rows = np.asarray(c["rows"], dtype=float)
            runs[(layer, s)] = (np.asarray(c["error"]).reshape(len(rows), -1),
                                np.asarray(c["stated_se"]).reshape(len(rows), -1), rows)
    return sorted(set(sizes)), runs


def screen(sizes: list[int], runs: Runs, target: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Errors, rows and the chosen S of every (call, kv head) under the two-stage rule."""
    errors, rows, picks = [], [], []
    for layer in sorted({k[0] for k in runs}):
        _, se0, _ = runs[(layer, sizes[0])]
        need = sizes[0] * (se0.max(axis=1) / target) ** 2
        for i, n in enumerate(need):
            s = next((x for x in sizes if x >= n), sizes[-1])
            e, _, r = runs[(layer, s)]
            errors.append(e[i])
            rows.append(r[i])
            picks.append(s)
    return np.concatenate(errors), np.asarray(rows), np.asarray(picks)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("probe", type=Path, help="budget_probe.py --out JSON: one proposal at several S")
    p.add_argument("--targets", type=float, nargs="+", default=[0.15, 0.1, 0.07, 0.05],
                   help="standard errors to aim for (relative to the output's norm)")
    args = p.parse_args(argv)
    sizes, runs = load(args.probe)
    layers = sorted({k[0] for k in runs})
    for s in sizes:
        e = np.concatenate([runs[(layer, s)][0].ravel() for layer in layers])
        r = np.concatenate([runs[(layer, s)][2] for layer in layers])
        print(f"fixed S = {s}: error mean {e.mean():.4f} rms {np.sqrt((e ** 2).mean()):.4f}, rows {r.mean():.1f}")
    for t in args.targets:
        e, r, picks = screen(sizes, runs, t)
        share = ", ".join(f"{s}: {np.mean(picks == s):.2f}" for s in sizes)
        print(f"SE target {t}: error mean {e.mean():.4f} rms {np.sqrt((e ** 2).mean()):.4f}, rows {r.mean():.1f} "
              f"(S chosen {share})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
