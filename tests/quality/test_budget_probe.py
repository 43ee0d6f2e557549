"""tests/quality/budget_probe.py on the trained model's real-attention dumps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
ops = pytest.importorskip("kvsparse.torch.ops")

HERE = Path(__file__).resolve().parent
DUMP = HERE.parent / "data" / "realattn" / "realattn-n8192-L1-kv0.bin"


def test_probe_ranks_budgets_on_real_attention(tmp_path: Path) -> None:
    if not ops.available():
        pytest.skip("the in-process op (libkvsparse_torch.so) is not built")
    out = tmp_path / "probe.json"
    small, large = "santa:samples=128,scores=compressed", "santa:samples=1024,scores=compressed,proposal=group"
    run = subprocess.run([sys.executable, str(HERE / "budget_probe.py"), "--dumps", str(DUMP), "--out", str(out),
                          "--methods", "dense", small, large], capture_output=True, text=True, timeout=600,
                         env=os.environ)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["context"] == 8192 and r["queries"] == 32 and r["layers"] == [1]
    dense, s128, g1024 = (r["methods"][m] for m in ("dense", small, large))
    assert dense["rel_l2_mean"] < 1e-2  # bf16 output rounding only
    assert dense["rows_fraction"] == pytest.approx(1.0, abs=1e-3)
    # 32 queries x 4 heads: the larger sample's error is well below the smaller's (0.05 against
    # 0.13 when written), and both read a small part of the context.
    assert 0.0 < g1024["rel_l2_mean"] < 0.7 * s128["rel_l2_mean"]
    assert s128["rows_fraction"] < 0.05 and g1024["rows_fraction"] < 0.1
    assert set(s128["layers"]) == {"1"}
    # S2ANTA states a standard error for each output, dense none; on this layer the true error is
    # within two of it for 94-95% of the outputs (when written): the statement is not vacuous.
    assert "stated_se_mean" not in dense
    for m in (s128, g1024):
        assert m["stated_se_mean"] > 0.0 and m["within_2se"] > 0.85
        assert len(m["calls"]["1"]["stated_se"]) == len(m["calls"]["1"]["error"]) == 32 * 4


def test_se_budget_screen_takes_the_size_the_pilot_asks_for(tmp_path: Path) -> None:
    """se_budget_screen.py: a (call, kv head) whose pilot's worst stated SE is twice the target
    asks for 4x the pilot's draws and takes the next run's errors and rows; one at the target
    keeps the pilot's."""
    sys.path.insert(0, str(HERE))
    import se_budget_screen  # noqa: E402

    def run(errors: list[float], ses: list[float], rows: list[float]) -> dict:
        return {"calls": {"0": {"error": errors, "stated_se": ses, "rows": rows}}}

    # Two (call, kv head)s of G = 2 query heads each.
    probe = {"methods": {"santa:samples=100,proposal=group": run([0.3, 0.1, 0.05, 0.04], [0.2, 0.1, 0.1, 0.05], [10, 10]),
                         "santa:samples=400,proposal=group": run([0.1, 0.05, 0.02, 0.02], [0.1, 0.05, 0.05, 0.03], [30, 30])}}
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(probe))
    sizes, runs = se_budget_screen.load(path)
    assert sizes == [100, 400]
    errors, rows, picks = se_budget_screen.screen(sizes, runs, 0.1)
    assert picks.tolist() == [400, 100]  # (0.2 / 0.1)^2 x 100 = 400; 0.1 at the target: 100
    assert rows.tolist() == [30, 10] and errors.tolist() == [0.1, 0.05, 0.05, 0.04]
