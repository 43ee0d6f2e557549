"""The training script's harness on the CPU in seconds (--smoke: a tiny model, a few steps): it
trains (the loss falls), evaluates, and writes a checkpoint transformers loads back, in shards of
at most 15 MB, with its metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_smoke_run_writes_a_loadable_checkpoint(tmp_path: Path) -> None:
    script = Path(__file__).with_name("train_model.py")
    run = subprocess.run(
        [sys.executable, str(script), "--smoke", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["steps"] == 40  # --smoke trains a fixed number of steps, however fast the machine
    assert metrics["final_train_loss"] < 4.0  # from ln(258) = 5.55 at the start
    assert metrics["held_out_ppl_at_context"] > 1.0
    assert set(metrics["passkey_accuracy"]) == {"256@0.1", "256@0.5", "256@0.9"}
    for f in tmp_path.glob("*.safetensors"):
        assert f.stat().st_size <= 15 << 20
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    cfg = model.config
    assert cfg.num_attention_heads == 4 * cfg.num_key_value_heads
    assert next(model.parameters()).dtype == torch.bfloat16
