"""Which compressed form of the keys finds the tokens that matter, at equal bytes (issue 25,
item 2): on the real-attention dumps of the model trained here (tests/data/realattn, written by
harness.py --dump_layers: layers 1, 3, 5, kv head 0, 8192 tokens, the last 32 queries of its 4
query heads), each form scores every key, sink 128 + window 128 + the top 1/32 of the tokens per
query head are chosen, and the choice is compared with the oracle's (exact scores):

- quant<b>:      per-channel asymmetric quantization of the post-RoPE keys to b bits over
                 groups of 128 tokens, fp16 minimum and step (kernels/compressed_keys.h, what the
                 engine keeps; re-stated here in numpy for the measurement, without the open
                 group's exact rows);
- lowrank-pre<r>: the keys before RoPE projected on their top-r principal directions (one SVD
                 per window, ShadowKV's form), fp16 coefficients, scored as q . RoPE_t(U c_t);
- lowrank-post<r>: the same on the post-RoPE keys.

Bytes per token and kv head: quant b: d b / 8 + 4 d / 128 (+ 2 for the error norm the engine
keeps); low rank r: 2 r (the d x r basis amortised over the window). Printed per layer and form:
recall of the oracle's top-k tokens, and the attention mass (exact softmax) of sink + window +
the chosen tokens, against the oracle's.

    python3 tests/quality/key_forms.py --json docs/data/key-forms-2026-11-27.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DUMPS = HERE.parent / "data" / "realattn"


def load(path: Path) -> dict:
    raw = path.read_bytes()
    assert raw[:8] == b"KVSPQKV1", path
    n, d, g, m, layer, kv = np.frombuffer(raw[8:32], "<u4")
    bf = np.frombuffer(raw[32:], "<u2")

    def take(count: int, at: int) -> tuple[np.ndarray, int]:
        x = (bf[at : at + count].astype(np.uint32) << 16).view(np.float32)
        return x, at + count

    q, at = take(m * g * d, 0)
    k, at = take(n * d, at)
    return {"n": int(n), "d": int(d), "g": int(g), "m": int(m), "layer": int(layer),
            "q": q.reshape(m, g, d).astype(np.float64), "k": k.reshape(n, d).astype(np.float64)}


def rope(x: np.ndarray, pos: np.ndarray, theta: float, inverse: bool = False) -> np.ndarray:
    """transformers' Llama RoPE (rotate_half: pairs (i, i + d/2)) at positions pos, or its inverse."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = np.outer(pos, inv_freq)
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    if inverse:
        sin = -sin
    rot = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def quantize(k: np.ndarray, bits: int, group: int = 128) -> np.ndarray:
    out = k.copy()
    top = 2**bits - 1
    for g0 in range(0, len(k) - len(k) % group, group):
        blk = k[g0 : g0 + group]
        lo = blk.min(0).astype(np.float16).astype(np.float64)
        step = ((blk.max(0) - lo) / top).astype(np.float16).astype(np.float64)
        step = np.where(step > 0, step, 1.0)
        code = np.clip(np.round((blk - lo) / step), 0, top)
        out[g0 : g0 + group] = lo + step * code
    return out


def low_rank(k: np.ndarray, r: int) -> np.ndarray:
    mean = k.mean(0)
    u, s, vt = np.linalg.svd(k - mean, full_matrices=False)
    coef = ((k - mean) @ vt[:r].T).astype(np.float16).astype(np.float64)
    return mean + coef @ vt[:r]


def choose(scores: np.ndarray, k: int, sink: int, local: int) -> np.ndarray:
    n = len(scores)
    mid = np.arange(sink, max(sink, n - local))
    top = mid[np.argsort(-scores[mid], kind="stable")[:k]] if k > 0 else mid[:0]
    return np.concatenate([np.arange(min(sink, n)), top, np.arange(max(sink, n - local), n)])


def measure(dump: dict, theta: float, fraction: float, sink: int, local: int, queries: int = 0) -> dict:
    """Recall and mass of each form against the oracle, over the last `queries` queries (0: all)."""
    n, d = dump["n"], dump["d"]
    k_post = dump["k"]
    pos = np.arange(n)
    k_pre = rope(k_post, pos, theta, inverse=True)
    forms = {
        "quant2": (quantize(k_post, 2), 2 * d / 8 + 4 * d / 128 + 2),
        "quant1": (quantize(k_post, 1), d / 8 + 4 * d / 128 + 2),
        "lowrank-pre16": (rope(low_rank(k_pre, 16), pos, theta), 32),
        "lowrank-pre19": (rope(low_rank(k_pre, 19), pos, theta), 38),
        "lowrank-pre32": (rope(low_rank(k_pre, 32), pos, theta), 64),
        "lowrank-post19": (low_rank(k_post, 19), 38),
    }
    scale = 1 / np.sqrt(d)
    out = {name: {"bytes_per_token": b, "recall": [], "mass": []} for name, (_, b) in forms.items()}
    oracle_mass = []
    for i in range(dump["m"] - (queries or dump["m"]), dump["m"]):
        keys = n - dump["m"] + i + 1
        kk = max(0, int(fraction * keys))
        for g in range(dump["g"]):
            q = dump["q"][i, g]
            exact = k_post[:keys] @ q * scale
            p = np.exp(exact - exact.max())
            p /= p.sum()
            oracle = choose(exact, kk, sink, local)
            oracle_set = set(oracle[sink : sink + kk].tolist())
            oracle_mass.append(p[oracle].sum())
            for name, (approx_k, _) in forms.items():
                chosen = choose(approx_k[:keys] @ q * scale, kk, sink, local)
                top = set(chosen[sink : sink + kk].tolist())
                out[name]["recall"].append(len(top & oracle_set) / max(1, len(oracle_set)))
                out[name]["mass"].append(p[chosen].sum())
    res = {"layer": dump["layer"], "oracle_mass": float(np.mean(oracle_mass)), "forms": {}}
    for name, r in out.items():
        res["forms"][name] = {"bytes_per_token": r["bytes_per_token"], "recall": float(np.mean(r["recall"])),
                              "mass": float(np.mean(r["mass"]))}
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--theta", type=float, default=100000.0, help="the model's rope_theta (train_model.py's)")
    p.add_argument("--fraction", type=float, default=1 / 32)
    p.add_argument("--json", default="")
    args = p.parse_args()
    results = []
    for path in sorted(DUMPS.glob("realattn-*.bin")):
        r = measure(load(path), args.theta, args.fraction, 128, 128)
        results.append(r)
        print(f"layer {r['layer']}: oracle mass {r['oracle_mass']:.3f}")
        for name, f in r["forms"].items():
            print(f"  {name:15s} {f['bytes_per_token']:5.1f} B/token  recall {f['recall']:.3f}  mass {f['mass']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"fraction": args.fraction, "theta": args.theta, "layers": results},
                                              indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
