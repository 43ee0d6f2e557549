"""trace_summary's arithmetic on a hand-made trace: the window from the named ranges, the device's
busy time as the union of overlapping kernels, kernel sums per stream, host time of ranges and
kvsparse's ops, all per step."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trace_summary  # noqa: E402


def kernel(ts: float, dur: float, stream: int, name: str = "k") -> dict:
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_union_of_overlapping_and_nested_intervals() -> None:
    assert trace_summary.union_us([(0, 10), (5, 15), (20, 30), (22, 25)]) == 25
    assert trace_summary.union_us([]) == 0


def test_a_two_step_window(tmp_path: Path) -> None:
    events = [
        {"cat": "user_annotation", "name": "step", "ts": 100, "dur": 100},
        {"cat": "user_annotation", "name": "step", "ts": 200, "dur": 100},
        {"cat": "user_annotation", "name": "attention", "ts": 110, "dur": 30},
        {"cat": "cpu_op", "name": "kvsparse::plan_step", "ts": 115, "dur": 20},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 150, "dur": 20},
        kernel(120, 40, 7, "gemv"), kernel(140, 40, 9, "warm"),  # overlap: busy 60
        kernel(210, 50, 7, "gemv"), {"cat": "gpu_memset", "name": "memset", "ts": 270, "dur": 10, "args": {"stream": 7}},
        kernel(400, 50, 7, "after the window"),
    ]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = trace_summary.summarize(trace_summary.load(path), 2, "step")
    assert s["wall_us_per_step"] == 100
    assert s["device_busy_us_per_step"] == (60 + 50 + 10) / 2
    assert s["kernel_sum_us_per_step"] == {"7": 50, "9": 20}
    assert s["kernels_per_step"] == 2
    assert s["range_cpu_us_per_step"] == {"attention": 15, "kvsparse::plan_step": 10}
    assert s["top_kernels_us_per_step"][0] == {"name": "gemv", "us": 45, "calls": 1}
