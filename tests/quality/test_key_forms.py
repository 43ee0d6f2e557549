"""tests/quality/key_forms.py on one real-attention dump: RoPE's inverse undoes it, 8-bit
quantization is near exact, and every form's recall and mass are fractions, the oracle's mass the
largest up to rounding."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import key_forms  # noqa: E402


def test_rope_inverse_and_quantization() -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(300, 64))
    pos = np.arange(300)
    assert np.allclose(key_forms.rope(key_forms.rope(x, pos, 1e4), pos, 1e4, inverse=True), x)
    q8 = key_forms.quantize(x, 8)
    assert np.abs(q8 - x).max() < 0.05
    assert np.array_equal(q8[256:], x[256:])  # the open group stays exact


def test_measure_one_dump() -> None:
    path = key_forms.DUMPS / "realattn-n8192-L1-kv0.bin"
    if not path.exists():
        pytest.skip("no real-attention dump")
    r = key_forms.measure(key_forms.load(path), 100000.0, 1 / 32, 128, 128, queries=2)
    assert r["layer"] == 1
    for f in r["forms"].values():
        assert 0.0 <= f["recall"] <= 1.0
        assert 0.0 < f["mass"] <= r["oracle_mass"] + 1e-9
