"""Key widths: per-channel widths of the compressed keys, ranked by a model's own queries.

    kvsparse-key-widths --model DIR --text corpus/*.txt --out widths.bin
    kvsparse-server --key_widths widths.bin ...          # or InProcessEngine(key_widths=...)

The compressed keys (kernels/compressed_keys.h) give every channel of a kv head the same bits. A
channel's share of the score error is E[q_c^2] times its quantization step squared, so channels
differ by orders of magnitude: this tool runs the model over calibration windows, ranks each
(layer, kv head)'s channels by E[q_c^2] (over the group's query heads and the windows' last
``--queries`` positions, as decode steps see them) times the mean over 128-token groups of the
channel's squared range, and writes per channel one of three widths (kernels/key_widths.h): the
first ``--wide`` share of the channels at twice the bits, as many of the last left out, the rest
at the bits. The bytes stay those of uniform widths. On SmolLM2-135M this cut S2ANTA-prop's error
at S = 128 over 2-bit keys from 0.220 to 0.152 (exact scores: 0.107), ranked on another window than
the one measured (docs/ACCURACY.md, "Key widths per channel ranked by the queries").

Needs torch and transformers (``pip install kvsparse[tools]``).
"""

from __future__ import annotations

import argparse
import struct
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

GROUP = 128  # kernels/compressed_keys.h kKeyGroupTokens
OUT, WHOLE, WIDE = 0, 1, 2  # kernels/key_widths.h ChannelWidth


def channel_importance(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Per kv head and channel, E[q_c^2] x the mean over closed groups of the channel's squared
    range: q [M, H, d] queries, k [Hkv, n, d] keys -> [Hkv, d] (float32)."""
    m, h, d = q.shape
    hkv, n, _ = k.shape
    q2 = q.float().pow(2).reshape(m, hkv, h // hkv, d).mean(dim=(0, 2))
    closed = max(GROUP, n // GROUP * GROUP) if n >= GROUP else n
    blocks = k[:, :closed].float().reshape(hkv, -1, min(GROUP, closed), d)
    rng2 = (blocks.amax(dim=2) - blocks.amin(dim=2)).pow(2).mean(dim=1)
    return q2 * rng2


def widths_of(importance: torch.Tensor, wide: float) -> torch.Tensor:
    """[Hkv, d] importances -> [Hkv, d] uint8 widths: the round(wide x d) most important channels
    WIDE, as many of the least OUT, the rest WHOLE."""
    hkv, d = importance.shape
    n_wide = round(wide * d)
    if not 0 <= 2 * n_wide <= d:
        raise ValueError(f"wide share {wide}: {n_wide} wide and as many left out of {d} channels")
    order = importance.argsort(dim=1, descending=True)
    w = torch.full((hkv, d), WHOLE, dtype=torch.uint8)
    for j in range(hkv):
        w[j, order[j, :n_wide]] = WIDE
        w[j, order[j, d - n_wide :]] = OUT
    return w


def write_key_widths(path: str | Path, widths: Sequence[torch.Tensor], bits: int) -> int:
    """The file of kernels/key_widths.h ("KVSPKWID", version 1): widths per layer [Hkv, d]."""
    layers, (hkv, d) = len(widths), tuple(widths[0].shape)
    out = b"KVSPKWID" + struct.pack("<5I", 1, layers, hkv, d, bits)
    out += b"".join(w.to(torch.uint8).contiguous().numpy().tobytes() for w in widths)
    Path(path).write_bytes(out)
    return len(out)


def calibrate_key_widths(captured: Sequence[tuple[torch.Tensor, ...]], wide: float = 3 / 16,
                         queries: int = 256) -> list[torch.Tensor]:
    """Widths per layer from captured (q [W, H, T, d], k [W, Hkv, T, d], ...) of calibration
    windows (kvsparse.tools.calibrate.capture_qk): each window's last `queries` positions' queries
    and its keys."""
    out = []
    for layer in captured:
        q, k = layer[0], layer[1]
        imp = sum(channel_importance(q[w, :, -queries:].transpose(0, 1), k[w]) for w in range(q.shape[0]))
        out.append(widths_of(imp, wide))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM

    from kvsparse.tools import calibrate

    p = argparse.ArgumentParser(prog="kvsparse-key-widths", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a transformers model directory (from_pretrained)")
    p.add_argument("--text", nargs="+", required=True, help="calibration text files")
    p.add_argument("--out", required=True, help="the key widths file to write")
    p.add_argument("--tokenizer", choices=("auto", "bytes"), default="auto",
                   help="auto: the model's tokenizer; bytes: one token per byte")
    p.add_argument("--context", type=int, default=4096, help="tokens per calibration window")
    p.add_argument("--windows", type=int, default=4, help="calibration windows")
    p.add_argument("--queries", type=int, default=256, help="each window's last positions whose queries rank")
    p.add_argument("--bits", type=int, default=2, choices=(1, 2, 4),
                   help="the compressed keys' bits (the placement's compressed_key_bits)")
    p.add_argument("--wide", type=float, default=3 / 16,
                   help="share of each kv head's channels at twice the bits (as many are left out)")
    args = p.parse_args(argv)
    model: Any = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    model.eval()
    tokens = calibrate._tokens(args, args.model)  # noqa: SLF001 (the sibling tool's reader)
    windows = calibrate._windows(tokens, args.context, args.windows, 0)  # noqa: SLF001
    with torch.no_grad():
        captured = calibrate.capture_qk(model, windows)
    widths = calibrate_key_widths(captured, args.wide, args.queries)
    size = write_key_widths(args.out, widths, args.bits)
    print(f"wrote {args.out}: {len(widths)} layers x {widths[0].shape[0]} kv heads x {widths[0].shape[1]} "
          f"channels ({size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
