"""tests/quality/budget_probe.py on the trained model's real-attention dumps, and the harness's
batched teacher forcing: windows decoded as one batch give each window's own figures."""

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


def tiny_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_batched_teacher_forcing_gives_each_windows_figures() -> None:
    sys.path.insert(0, str(HERE))
    import harness  # noqa: E402

    if not ops.available():
        pytest.skip("the in-process op (libkvsparse_torch.so) is not built")
    harness.register()
    model = tiny_llama()
    model.set_attn_implementation(harness.MEASURED)
    windows = torch.randint(0, 97, (3, 40), generator=torch.Generator().manual_seed(1))
    alone = [harness.teacher_forced(model, w, 5, None, None, 0, "cpu") for w in windows]
    nll, top1, _, _ = harness.teacher_forced(model, windows, 5, None, None, 0, "cpu")
    assert len(nll) == len(top1) == 15  # window-major: window 0's five steps first
    assert nll == pytest.approx([x for a in alone for x in a[0]], abs=1e-5)
    assert top1 == [x for a in alone for x in a[1]]
    engine = ops.InProcessEngine(gpu="off", store_capacity="64M")
    try:
        got, got_top1, stats, fraction = harness.teacher_forced(model, windows, 5, engine, harness.Dense(), 7, "cpu")
    finally:
        engine.close()
    assert got == pytest.approx(nll, abs=1e-4)  # dense through kvsparse is SDPA
    assert got_top1 == top1 and stats.decode_calls == 5 * 2 and fraction == 0.0


def test_harness_without_pass_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """--passkey_trials 0 asks for no pass-key documents: none are measured and the tables are
    written without them (the run crashed on an empty list of documents, and the table on a
    method without pass keys)."""
    sys.path.insert(0, str(HERE))
    import harness  # noqa: E402

    monkeypatch.setattr(sys, "argv", ["harness.py", "--model", "m", "--out", "o", "--contexts", "256",
                                      "--passkey_trials", "0"])
    args = harness.parse_args()
    assert not args.want_passkeys
    ctx = {"ppl": 2.0, "ppl_change": 0.01, "ppl_change_ci95": [0.0, 0.02], "top1_agreement": 0.9,
           "rel_l2_mean": 0.1, "final_layer_rel_l2": 0.1, "rows_fraction": 0.1, "bytes_fraction": 0.1,
           "gpu_kv_fraction": 0.05}
    results = {"sdpa": {"256": {"ppl": 1.98}}, "methods": {"dense": {"contexts": {"256": ctx}}}, "recall": []}
    table = harness.markdown(results, args)
    assert "| dense | 0.050 | 2.0000 (+1.00%, +0.00..+2.00)" in table and "@" not in table
