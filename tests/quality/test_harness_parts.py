"""Parts of the quality harness (tests/quality/harness.py) on a tiny random Llama: batched
teacher forcing gives each window's own figures, planned decode steps (the captured kernels, on a
GPU) give the eager steps' figures, and a run without pass keys writes its tables."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
ops = pytest.importorskip("kvsparse.torch.ops")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def tiny_llama(dtype: torch.dtype = torch.float32, head_dim: int = 16, device: str = "cpu") -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=4 * head_dim, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=head_dim, max_position_embeddings=1024)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def test_batched_teacher_forcing_gives_each_windows_figures() -> None:
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


def test_planned_steps_refused_where_the_engine_does_not_capture() -> None:
    """--steps planned asks for the captured kernels: on the CPU engine capture_mode says why
    not, auto keeps the eager calls, and planned refuses the method, naming it."""
    import argparse

    import harness  # noqa: E402

    if not ops.available():
        pytest.skip("the in-process op (libkvsparse_torch.so) is not built")
    harness.register()
    model = tiny_llama()
    model.set_attn_implementation(harness.MEASURED)
    engine = ops.InProcessEngine(gpu="off", store_capacity="64M")
    subject = type("S", (), {"model": model})()
    method = harness.Santa(samples=8, scores="compressed")
    try:
        assert harness.capture_mode(model, engine, method, None, "cpu").startswith("eager")
        auto = argparse.Namespace(steps="auto")
        assert not harness.steps_planned(subject, auto, engine, method, None, "cpu", "m", lambda s: None)
        with pytest.raises(SystemExit, match="does not capture m"):
            harness.steps_planned(subject, argparse.Namespace(steps="planned"), engine, method, None, "cpu", "m",
                                  lambda s: None)
    finally:
        engine.close()


@pytest.mark.gpu
def test_planned_steps_give_the_eager_steps_figures() -> None:
    """On a GPU the harness decodes through planned steps (the kernels a deployment captures).
    Top-k over 2-bit compressed keys (a deterministic selection) gives the eager calls' per-token
    NLLs, and the rows each layer read, taken from the plan's statistics, are the eager calls'
    counts. S2ANTA's group mixture draws from other seeds on the two paths (the planned steps'
    seed + layer * 2**32 + position, the eager calls' step_seed): its rows agree in the mean."""
    import harness  # noqa: E402

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not ops.available():
        pytest.skip("the in-process op (libkvsparse_torch.so) is not built")
    harness.register()
    model = tiny_llama(torch.bfloat16, head_dim=64, device="cuda")
    model.set_attn_implementation(harness.MEASURED)
    windows = torch.randint(0, 97, (3, 600), generator=torch.Generator().manual_seed(2))
    engine = ops.InProcessEngine(gpu="on", store_capacity="256M", gpu_capacity="256M")
    try:
        for method in (harness.TopK(top_k_fraction=1 / 8, sink_tokens=16, local_tokens=16),
                       harness.Santa(samples=64, scores="compressed", proposal="group")):
            assert harness.capture_mode(model, engine, method, None, "cuda") == "captured"
            figures = {}
            for planned in (False, True):
                harness.REC.reset()
                harness.REC.active = True
                nll, top1, _, _ = harness.teacher_forced(model, windows, 4, engine, method, 7, "cuda",
                                                         planned=planned)
                harness.REC.active = False
                figures[planned] = nll, top1, list(harness.REC.rows_fraction)
            (nll_e, top1_e, rows_e), (nll_p, top1_p, rows_p) = figures[False], figures[True]
            assert len(rows_p) == len(rows_e) == 4 * 2  # steps x layers
            assert 0.0 < min(rows_p) and max(rows_p) < 0.6, (method, rows_p)
            if isinstance(method, harness.TopK):
                assert nll_p == pytest.approx(nll_e, abs=2e-2) and top1_p == top1_e
                assert rows_p == pytest.approx(rows_e, rel=0.02)
            else:
                assert sum(rows_p) == pytest.approx(sum(rows_e), rel=0.2), (rows_p, rows_e)
    finally:
        engine.close()
