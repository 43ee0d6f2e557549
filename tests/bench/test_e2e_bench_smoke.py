"""e2e_bench end to end on the CPU (--device cpu, a two-layer model, the in-process engine): each
pass over the variants with --rounds runs them in alternating order, every row is tagged with its
pass in the JSON, and each pass prints its ratios against resident's of the same pass."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
ops = pytest.importorskip("kvsparse.torch.ops")

HERE = Path(__file__).resolve().parent


def test_rounds_alternate_the_variants_and_tag_their_rows(tmp_path: Path) -> None:
    try:
        ops.load_library()
    except (FileNotFoundError, OSError) as e:
        pytest.skip(f"the op is not built: {e}")
    out = tmp_path / "e2e.json"
    run = subprocess.run(
        [sys.executable, str(HERE / "e2e_bench.py"), "--device", "cpu", "--lens", "256", "--batches", "1",
         "--variants", "resident,kvs-prop", "--steps", "2", "--warmup", "1", "--layers", "2", "--hidden", "128",
         "--heads", "4", "--kv_heads", "2", "--ffn", "256", "--vocab", "512", "--store_capacity", "256M",
         "--gpu_capacity", "256M", "--rounds", "3", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [(r["variant"], r["round"]) for r in rows] == [
        ("resident", 0), ("kvs-prop", 0), ("kvs-prop", 1), ("resident", 1), ("resident", 2), ("kvs-prop", 2)]
    assert all(r["tokens_per_s"] > 0 and not r["note"].startswith("failed") for r in rows), rows
    summaries = [line for line in run.stdout.splitlines() if line.startswith("<!-- pass ")]
    assert len(summaries) == 3 and all("kvs-prop" in s and "x resident" in s for s in summaries), run.stdout
