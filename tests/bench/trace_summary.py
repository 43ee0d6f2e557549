"""Where a profiled window's time went, from torch.profiler's Chrome trace (Kineto JSON): the
window's wall time, the device's busy time (the union of every kernel, copy and memset), the
sum of the kernels' own times per stream, the CPU time inside named ranges
(torch.profiler.record_function) and the kernels by their total time. Used by e2e_bench's
--profile and tests/vllm/cuda_driver.py's "profile" job; runnable on a saved trace:

    python3 tests/bench/trace_summary.py trace.json.gz
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    with (gzip.open(p, "rt") if p.suffix == ".gz" else open(p)) as f:
        return json.load(f)["traceEvents"]


def union_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize(events: list[dict[str, Any]], steps: int, window: str | None = None, top: int = 25) -> dict[str, Any]:
    """Figures over the window (the first and last CPU range named `window`, else every device
    event), per step where `steps` > 0: wall_us (the window), device_busy_us, kernel_sum_us per
    stream, range_cpu_us per record_function name and kvsparse op (host time), top kernels."""
    dev = [e for e in events if e.get("cat") in DEVICE_CATS and "dur" in e]
    ranges = [e for e in events if e.get("cat") == "user_annotation" and "dur" in e]
    ops = [e for e in events if e.get("cat") == "cpu_op" and "dur" in e and e["name"].startswith("kvsparse")]
    if window is not None and any(e["name"] == window for e in ranges):
        w = [e for e in ranges if e["name"] == window]
        lo, hi = min(e["ts"] for e in w), max(e["ts"] + e["dur"] for e in w)
    else:
        lo = min((e["ts"] for e in dev), default=0.0)
        hi = max((e["ts"] + e["dur"] for e in dev), default=0.0)
    dev = [e for e in dev if lo <= e["ts"] < hi]
    per = max(steps, 1)
    by_stream: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in dev:
        by_stream[str(e.get("args", {}).get("stream", "?"))] += e["dur"]
        n = by_name[e["name"]]
        n[0] += e["dur"]
        n[1] += 1
    cpu: dict[str, float] = defaultdict(float)
    for e in ranges:
        if lo <= e["ts"] < hi and e["name"] != window:
            cpu[e["name"]] += e["dur"]
    for e in ops:  # kvsparse's ops (kvsparse::...), their host time
        if lo <= e["ts"] < hi:
            cpu[e["name"]] += e["dur"]
    kernels = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "steps": steps,
        "wall_us_per_step": (hi - lo) / per,
        "device_busy_us_per_step": union_us([(e["ts"], e["ts"] + e["dur"]) for e in dev]) / per,
        "kernel_sum_us_per_step": {s: t / per for s, t in sorted(by_stream.items(), key=lambda kv: -kv[1])},
        "kernels_per_step": len(dev) / per,
        "range_cpu_us_per_step": {k: v / per for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])},
        "top_kernels_us_per_step": [
            {"name": k[:120], "us": t / per, "calls": c / per} for k, (t, c) in kernels
        ],
    }


def main() -> None:
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    window = sys.argv[3] if len(sys.argv) > 3 else None
    print(json.dumps(summarize(load(sys.argv[1]), steps, window), indent=1))


if __name__ == "__main__":
    main()
