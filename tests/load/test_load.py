"""The load program against the real server for a few seconds (CI): concurrent clients append,
gather and decode; every row and output is checked and none may be wrong."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_short_load_run_loses_and_corrupts_nothing(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    run = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("load.py")), "--clients", "8", "--seconds", "20",
         "--report_every", "5", "--out", str(out)],
        capture_output=True, text=True, timeout=180,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["rows_wrong"] == 0 and s["outputs_wrong"] == 0
    assert s["rows_checked"] > 10_000 and s["outputs_checked"] > 50
    assert all(s["calls_per_second"][op] > 0 for op in ("append", "gather", "decode"))
    assert s["server_exit_code"] == 0
