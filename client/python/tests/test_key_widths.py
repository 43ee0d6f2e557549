"""Key widths (kvsparse.tools.key_widths): the ranking, the file, and the engine reading it (the
in-process op on the CPU engine, which keeps the compressed keys at those widths)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvsparse
import kvsparse.torch.ops as ops
from kvsparse.tools import key_widths as kw

SHAPE = kvsparse.ModelShape(2, 8, 2, 64, "bf16")


def test_the_most_important_channels_widen_and_as_many_are_left_out() -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(16, 8, 64, generator=gen)
    q[:, :, 5] *= 20  # channel 5 carries the queries' energy
    k = torch.randn(2, 300, 64, generator=gen)
    k[:, :, 9] *= 0.01  # channel 9 barely varies
    w = kw.widths_of(kw.channel_importance(q, k), 3 / 16)
    assert w.shape == (2, 64) and w.dtype == torch.uint8
    for j in range(2):
        assert int((w[j] == kw.WIDE).sum()) == 12 and int((w[j] == kw.OUT).sum()) == 12
        assert w[j, 5] == kw.WIDE and w[j, 9] == kw.OUT
    with pytest.raises(ValueError, match="wide share"):
        kw.widths_of(kw.channel_importance(q, k), 0.6)


def _widths_file(path: Path, wide_channels: range, out_channels: range) -> Path:
    w = torch.full((2, 64), kw.WHOLE, dtype=torch.uint8)
    w[:, list(wide_channels)] = kw.WIDE
    w[:, list(out_channels)] = kw.OUT
    kw.write_key_widths(path, [w, w], bits=2)
    return path


def _decode_error(engine: ops.InProcessEngine, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
    """Top-k 1/32 over 2-bit compressed keys, no sink or window: the output's relative error
    against exact attention (float64)."""
    placement = kvsparse.Placement(compressed_key_bits=2)
    engine.create_sequence("s", SHAPE, placement)
    engine.append("s", 1, k, v)
    out, _ = engine.decode(1, ["s"], q[None], kvsparse.TopK(top_k_fraction=1 / 32, sink_tokens=0, local_tokens=0))
    engine.drop_sequence("s")
    kk = k.double().transpose(0, 1).repeat_interleave(4, 0)  # [H, n, d]
    vv = v.double().transpose(0, 1).repeat_interleave(4, 0)
    p = (torch.einsum("hd,hnd->hn", q.double(), kk) / 8).softmax(-1)
    want = torch.einsum("hn,hnd->hd", p, vv)
    return float((out[0].double() - want).norm() / want.norm())


def test_the_engine_keeps_compressed_keys_at_the_files_widths(tmp_path: Path) -> None:
    """Queries that score through channels 0-11 (the file widens them, and leaves 52-63 out, where
    they put no weight): top-k over the compressed keys selects better than at uniform widths,
    so its output is closer to exact attention."""
    gen = torch.Generator().manual_seed(7)
    n = 2048
    k = torch.randn(n, 2, 64, generator=gen)
    k[:, :, :12] *= 3
    k = k.to(torch.bfloat16)
    v = torch.randn(n, 2, 64, generator=gen).to(torch.bfloat16)
    q = torch.zeros(8, 64)
    q[:, :12] = torch.randn(8, 12, generator=gen) * 2
    q = q.to(torch.bfloat16)
    path = _widths_file(tmp_path / "widths.bin", range(0, 12), range(52, 64))
    with ops.InProcessEngine(store_capacity="256M", gpu="off") as uniform, ops.InProcessEngine(
        store_capacity="256M", gpu="off", key_widths=str(path)
    ) as widened:
        e_uniform, e_widths = _decode_error(uniform, q, k, v), _decode_error(widened, q, k, v)
    assert e_widths < 0.7 * e_uniform, (e_widths, e_uniform)


def test_a_bad_widths_file_is_refused_naming_the_setting(tmp_path: Path) -> None:
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"KVSPKWID" + b"\x01\x00\x00\x00")
    with pytest.raises(kvsparse.InvalidArgument, match="key_widths"):
        ops.InProcessEngine(store_capacity="64M", gpu="off", key_widths=str(bad))
    w = torch.full((2, 64), kw.WHOLE, dtype=torch.uint8)
    w[:, 0] = kw.WIDE  # one widened, none left out: 65 stored channels
    kw.write_key_widths(tmp_path / "over.bin", [w, w], bits=2)
    with pytest.raises(kvsparse.InvalidArgument, match="as many channels must be left out"):
        ops.InProcessEngine(store_capacity="64M", gpu="off", key_widths=str(tmp_path / "over.bin"))
