"""Calibration: learned HashAttention bit signatures for a model, from its own queries and keys.

    python -m kvsparse.tools.calibrate --model DIR --text a.txt b.txt --out hash.bin      # or
    kvsparse-calibrate --model DIR --text corpus/*.txt --out hash.bin --bits 32
    kvsparse-server --hash_weights hash.bin ...      # HashTopK(learned=True) / VAttention(learned=True)

Runs the model (a transformers causal LM with rotary attention, Llama-architecture) over the
calibration text in windows of ``--context`` tokens, records every layer's post-RoPE queries and
keys, and trains per layer one MLP per query head and one per kv head (Linear-SiLU-Linear-SiLU-
Linear, as HashAttention's released models) so that the Hamming similarity of their sign bits
ranks a query's keys by attention score. The loss is HashAttention's: weighted binary cross-
entropy of "the key is among the query's top keys", predicted from the relaxed (tanh) similarity
of the two signatures. Two recipes (``RECIPES``, ``--recipe``): ``kvsparse`` labels the top
fraction of the whole causal prefix (positives x5, lr 1e-2 with cosine decay); ``hashattention``
is the paper's released training (the top 32 keys beyond the sink and the local window, positives
x20, Adam 1e-3). ``--key_mlps query`` trains one key MLP per query head as the paper does (the
CPU engine serves it; the GPU engine signs keys with one MLP per kv head).
Writes the version-1 file of ``kernels/hash_signatures.h``; prints each layer's held-out recall
(``topk_recall``: of the true top-k, and of the oracle top-k row the engine would read) against
SimHash at the same bits.

With ``--saap_out`` it also writes SAAP partitions (``kernels/saap.h``): per layer and kv head a
spherical k-means of the keys before RoPE into ``--clusters`` buckets, and per query head a
classifier (Linear-ReLU-Linear) trained with the paper's KL loss to predict the share of the
query's long-range attention in each bucket; it prints how many rows ``--probes`` buckets read
and how much of the attention they hold, against the symmetric baseline (the query's own nearest
centroids).

Needs torch and transformers (``pip install kvsparse[hf]``).
"""

from __future__ import annotations

import argparse
import math
import struct
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence, cast

from kvsparse._extras import needs

with needs("kvsparse.tools.calibrate", "tools", "torch", "transformers"):
    import torch
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

MAGIC = b"KVSPHASH"
VERSION = 1
_CAPTURE = "kvsparse_capture"


# ---- Queries and keys of a model -------------------------------------------------------------


class _Recorder:
    def __init__(self, with_values: bool) -> None:
        self.with_values = with_values
        self.q: dict[int, list[torch.Tensor]] = {}
        self.k: dict[int, list[torch.Tensor]] = {}
        self.v: dict[int, list[torch.Tensor]] = {}


_recorder: _Recorder | None = None


def _capture_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
    """SDPA that also records the layer's post-RoPE query [B, H, T, d] and key [B, Hkv, T, d]."""
    if _recorder is not None:
        layer_idx = cast(int, module.layer_idx)
        _recorder.q.setdefault(layer_idx, []).append(query.detach().to(torch.bfloat16))
        _recorder.k.setdefault(layer_idx, []).append(key.detach().to(torch.bfloat16))
        if _recorder.with_values:
            _recorder.v.setdefault(layer_idx, []).append(value.detach().to(torch.bfloat16))
    return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)


@torch.no_grad()
def capture_qk(model: Any, windows: Sequence[torch.Tensor], with_values: bool = False) -> list[tuple[torch.Tensor, ...]]:
    """Runs `model` over each window (a 1-D tensor of token ids, all of one length T) and returns
    per layer (q [W, H, T, d], k [W, Hkv, T, d]) in bf16 on the model's device, and v [W, Hkv, T,
    d] with `with_values`."""
    global _recorder
    AttentionInterface.register(_CAPTURE, _capture_forward)
    AttentionMaskInterface.register(_CAPTURE, sdpa_mask)
    before = model.config._attn_implementation
    device = next(model.parameters()).device
    _recorder = _Recorder(with_values)
    try:
        model.set_attn_implementation(_CAPTURE)
        for w in windows:
            model(w.to(device)[None], use_cache=False)
        layers = sorted(_recorder.q)
        rec = _recorder
        if with_values:
            return [(torch.cat(rec.q[i]), torch.cat(rec.k[i]), torch.cat(rec.v[i])) for i in layers]
        return [(torch.cat(rec.q[i]), torch.cat(rec.k[i])) for i in layers]
    finally:
        _recorder = None
        model.set_attn_implementation(before)


# Per layer (q, k) of the training windows and of the evaluation windows (capture_qk of each).
Captured = tuple[list[tuple[torch.Tensor, ...]], list[tuple[torch.Tensor, ...]]]


def capture_both(model: Any, train_windows: Sequence[torch.Tensor], eval_windows: Sequence[torch.Tensor]) -> Captured:
    """Both sets of windows' queries and keys, taken once for the hash and SAAP calibrations."""
    return capture_qk(model, train_windows), capture_qk(model, eval_windows)


# ---- The MLPs ----------------------------------------------------------------------------------


class HashMlps(torch.nn.Module):
    """`n` independent MLPs of the same dims, applied batched: x [n, N, dims[0]] -> [n, N, bits]
    (pre-sign). SiLU after every linear but the last, as kernels/hash_signatures.h."""

    def __init__(self, n: int, dims: Sequence[int], generator: torch.Generator) -> None:
        super().__init__()
        self.dims = list(dims)
        self.weights = torch.nn.ParameterList()
        self.biases = torch.nn.ParameterList()
        for i in range(len(dims) - 1):
            bound = 1.0 / math.sqrt(dims[i])
            w = (torch.rand(n, dims[i + 1], dims[i], generator=generator) * 2 - 1) * bound
            b = (torch.rand(n, dims[i + 1], generator=generator) * 2 - 1) * bound
            self.weights.append(torch.nn.Parameter(w))
            self.biases.append(torch.nn.Parameter(b))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = len(self.weights) - 1
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            x = torch.baddbmm(b.unsqueeze(1), x, w.transpose(1, 2))
            if i < last:
                x = torch.nn.functional.silu(x)
        return x


@dataclass
class LayerHash:
    """One layer's trained MLPs: query MLPs (one per query head), key MLPs (one per kv head)."""

    query: HashMlps
    key: HashMlps


def _topk_labels(scores: torch.Tensor, prefix: torch.Tensor, fraction: float, min_top_k: int) -> torch.Tensor:
    """scores [..., Q, T] (-inf beyond each query's causal prefix), prefix [Q] lengths: bool of
    the top ceil(fraction * prefix) keys per query (at least min_top_k)."""
    m = torch.clamp(torch.ceil(prefix.float() * fraction).long(), min=min_top_k)
    return _top_m(scores, torch.minimum(m, prefix))


def _top_m(scores: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """scores [..., Q, T] (-inf where a key may not be chosen), m [Q] >= 1: bool of the m[q]
    highest finite scores of each query (every key tied with the m-th too)."""
    ordered = scores.sort(dim=-1, descending=True).values
    idx = (m - 1).view(*([1] * (scores.dim() - 2)), -1, 1).expand(*scores.shape[:-1], 1)
    threshold = ordered.gather(-1, idx)
    return (scores >= threshold) & torch.isfinite(scores)


@dataclass(frozen=True)
class Recipe:
    """How train_layer labels the keys of a query and weighs its loss: the one place that names
    the two training recipes (RECIPES) and their defaults."""

    # Labels: the label_top_k keys of highest q.k (fixed k) or, with label_top_k = 0, the top
    # ceil(top_fraction * prefix) (at least min_top_k) of the causal prefix.
    label_top_k: int
    top_fraction: float
    min_top_k: int
    # Keys neither labelled nor in the loss: the first exclude_sink tokens and each query's last
    # exclude_local (the attention sink and local window, which HashTopK reads anyway).
    exclude_sink: int
    exclude_local: int
    alpha: float  # weight of a positive in the binary cross-entropy (negatives 1)
    lr: float  # Adam's learning rate
    cosine: bool  # cosine decay to 5% of lr over the steps, else constant
    # The logit: learned scale * (tanh similarity / bits) + learned bias, or the raw tanh dot
    # product (in [-bits, bits]) with threshold 0, as HashAttention's released training.
    learned_scale: bool
    queries_per_step: int
    min_position: int  # queries at positions >= this (and past sink + local + label_top_k)


RECIPES: dict[str, Recipe] = {
    # kvsparse's first recipe: rank the top 1/32 of the whole prefix (what top_k_fraction = 1/32
    # reads, sink and window included), positives x5, lr 1e-2 with cosine decay (on keys with a
    # shared offset 5 with 1e-2 reached a higher recall in 400 steps than 20 with 1e-3).
    "kvsparse": Recipe(label_top_k=0, top_fraction=1 / 32, min_top_k=16, exclude_sink=0, exclude_local=0,
                       alpha=5.0, lr=1e-2, cosine=True, learned_scale=True, queries_per_step=64,
                       min_position=256),
    # HashAttention's released training (xAlg-ai/HashAttention-1.0, train_hashattention.py):
    # labels the top 32 keys by q.k with the first 128 and the query's last 128 tokens masked out
    # of labels and loss, positives x20, sigmoid of the raw tanh dot product, Adam 1e-3 constant,
    # 128 queries per step (theirs: a 128-token prefill chunk every 1024 tokens; here 128 random
    # positions), fp32 (theirs bf16).
    "hashattention": Recipe(label_top_k=32, top_fraction=0.0, min_top_k=32, exclude_sink=128, exclude_local=128,
                            alpha=20.0, lr=1e-3, cosine=False, learned_scale=False, queries_per_step=128,
                            min_position=0),
}

# Key MLPs per layer: one per kv head, shared by its query heads (what the engine's GPU path
# signs), or one per query head (HashAttention's layout: the keys repeated per query head).
KEY_MLPS = ("kv", "query")


def _expand_keys(k: torch.Tensor, heads: int) -> torch.Tensor:
    """k [Hkv, T, d] -> [heads, T, d]: each kv head's keys repeated for its query heads (heads =
    H), or k itself (heads = Hkv)."""
    return k if heads == k.shape[0] else k.repeat_interleave(heads // k.shape[0], dim=0)


def train_layer(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    recipe: str | Recipe = "kvsparse",
    bits: int = 32,
    hidden: int = 128,
    linears: int = 3,
    steps: int = 400,
    key_mlps: str = "kv",
    seed: int = 0,
    log: Callable[[str], None] | None = None,
    **overrides: Any,
) -> LayerHash:
    """Trains one layer's MLPs on its queries q [W, H, T, d] and keys k [W, Hkv, T, d] with a
    recipe (RECIPES' name or a Recipe; `overrides` replace its fields, e.g. alpha=20)."""
    r = RECIPES[recipe] if isinstance(recipe, str) else recipe
    if overrides:
        r = replace(r, **overrides)
    if key_mlps not in KEY_MLPS:
        raise ValueError(f"key_mlps must be one of {KEY_MLPS}, not {key_mlps!r}")
    w_count, h, t, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    device = q.device
    gen = torch.Generator().manual_seed(seed)
    dims = [d] + [hidden] * (linears - 1) + [bits]
    kh = h if key_mlps == "query" else hkv
    qm, km = HashMlps(h, dims, gen).to(device), HashMlps(kh, dims, gen).to(device)
    params = list(qm.parameters()) + list(km.parameters())
    scale = torch.nn.Parameter(torch.tensor(8.0, device=device))
    bias = torch.nn.Parameter(torch.tensor(-2.0, device=device))
    if r.learned_scale:
        params += [scale, bias]
    opt = torch.optim.Adam(params, lr=r.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps, eta_min=r.lr * 0.05) if r.cosine else None
    pick = torch.Generator(device="cpu").manual_seed(seed + 1)
    lo = min(max(r.min_position, r.exclude_sink + r.exclude_local + r.label_top_k), t - 1)
    keys = torch.arange(t, device=device)
    for step in range(steps):
        w = int(torch.randint(w_count, (1,), generator=pick))
        pos = torch.randint(lo, t, (r.queries_per_step,), generator=pick).to(device)
        qx = q[w][:, pos].float()  # [H, Q, d]
        kx = k[w].float()  # [Hkv, T, d]
        with torch.no_grad():
            s = torch.einsum("kgqd,ktd->kgqt", qx.view(hkv, g, -1, d), kx)
            causal = keys[None, :] <= pos[:, None]  # [Q, T]
            # What is labelled and in the loss: the causal prefix less the sink and the window.
            scored = causal & (keys[None, :] >= r.exclude_sink) & (keys[None, :] <= pos[:, None] - r.exclude_local)
            s = s.masked_fill(~scored, float("-inf"))
            if r.label_top_k > 0:
                m = torch.clamp(scored.sum(-1), max=r.label_top_k)
                labels = _top_m(s, m).float()
            else:
                labels = _topk_labels(s, pos + 1, r.top_fraction, r.min_top_k).float()
        fq = torch.tanh(qm(qx)).view(hkv, g, -1, bits)
        fk = torch.tanh(km(_expand_keys(kx, kh))).view(hkv, kh // hkv, t, bits)
        dot = torch.einsum("kgqb,kgtb->kgqt", fq, fk.expand(hkv, g, t, bits))
        logits = scale * dot / bits + bias if r.learned_scale else dot
        weight = (labels * (r.alpha - 1) + 1) * scored
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels, weight=weight, reduction="sum")
        loss = loss / weight.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        if log is not None and (step + 1) % max(1, steps // 4) == 0:
            log(f"  step {step + 1}/{steps}: loss {loss.item():.4f}")
    return LayerHash(qm.eval(), km.eval())


# ---- Signatures and recall ---------------------------------------------------------------------


def sign_bits(x: torch.Tensor) -> torch.Tensor:
    """Pre-sign projections [..., bits] -> {+1, -1} floats (bit = projection > 0, as the C++)."""
    return torch.where(x > 0, 1.0, -1.0)


@torch.no_grad()
def learned_signatures(layer: LayerHash, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [H, N, d], k [Hkv, T, d] -> +-1 signatures [H, N, bits] and [Hk, T, bits] (Hk: the
    layer's key MLPs, Hkv or H)."""
    kh = layer.key.weights[0].shape[0]
    return sign_bits(layer.query(q.float())), sign_bits(layer.key(_expand_keys(k.float(), kh)))


@torch.no_grad()
def simhash_signatures(q: torch.Tensor, k: torch.Tensor, bits: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """SimHash with the max-norm augmentation (kernels/hash_signatures.h's construction, its own
    Gaussian planes): q [H, N, d], k [Hkv, T, d] -> +-1 signatures. Keys of a kv head and the
    queries of its group share that head's planes."""
    h, _, d = q.shape
    hkv = k.shape[0]
    gen = torch.Generator().manual_seed(seed)
    planes = torch.randn(hkv, d + 1, bits, generator=gen).to(q.device)
    kf = k.float()
    norm2 = (kf * kf).sum(-1, keepdim=True)
    aug = torch.sqrt(torch.clamp(norm2.amax(dim=1, keepdim=True) - norm2, min=0))
    sk = sign_bits(torch.cat([kf, aug], -1) @ planes)
    qf = torch.cat([q.float(), torch.zeros_like(q[..., :1], dtype=torch.float32)], -1)
    sq = sign_bits(qf.view(hkv, h // hkv, -1, d + 1) @ planes.unsqueeze(1)).view(h, -1, bits)
    return sq, sk


@torch.no_grad()
def topk_recall(
    q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor, sq: torch.Tensor, sk: torch.Tensor,
    fraction: float = 1 / 32, min_top_k: int = 16, seed: int = 0, sink: int = 128, local: int = 128,
) -> dict[str, float]:
    """For queries q [H, Q, d] at positions pos [Q] over keys k [Hkv, T, d] with signatures
    sq [H, Q, bits] and sk [Hkv or H, T, bits] (ties of signature similarity broken at random),
    the mean over queries and heads of:
    - recall, mass: the share of the true top-m keys of the causal prefix (m = fraction of the
      prefix) among the m keys of highest similarity, and the softmax mass those m keys hold
      against the true top-m's (sink and window ranked like any key);
    - oracle_recall, oracle_mass: against the oracle top-k row as the engine reads it (TopK with
      exact scores: the first `sink` tokens, the last `local`, and the k = round(fraction * n)
      keys of the rest with the highest score): the share of the oracle's k keys among the k the
      signatures rank first in the rest, and the softmax mass of HashTopK's rows (sink + window +
      those k) against the oracle's; boundary_ties: the keys of the rest whose similarity equals
      the k-th highest (a tie broken at random), per key chosen;
    - top32_in_1_16, top32_in_1_32: HashAttention's own measure, the share of the true top 32 of
      the rest among the n/16 (n/32) keys of the rest the signatures rank first."""
    h, nq, d = q.shape
    hkv, t, _ = k.shape
    g = h // hkv
    keys = torch.arange(t, device=q.device)
    causal = keys[None, :] <= pos[:, None]
    s = torch.einsum("kgqd,ktd->kgqt", q.float().view(hkv, g, nq, d), k.float()) / math.sqrt(d)
    s = s.masked_fill(~causal, float("-inf"))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    noise = torch.rand(s.shape, generator=gen).to(q.device) * 0.5  # ties among equal Hamming scores
    sk4 = sk.view(hkv, sk.shape[0] // hkv, t, -1).expand(hkv, g, t, sk.shape[-1])
    sim0 = torch.einsum("kgqb,kgtb->kgqt", sq.view(hkv, g, nq, -1), sk4)
    sim = (sim0 + noise).masked_fill(~causal, float("-inf"))
    true = _topk_labels(s, pos + 1, fraction, min_top_k)
    picked = _topk_labels(sim, pos + 1, fraction, min_top_k)
    p = torch.softmax(s, -1)
    out = {
        "recall": float(((true & picked).sum(-1).float() / true.sum(-1).float()).mean()),
        "mass": float(((p * picked).sum(-1) / (p * true).sum(-1)).mean()),
    }
    n = pos + 1
    always = causal & ((keys[None, :] < sink) | (keys[None, :] >= n[:, None] - local))
    rest = causal & ~always
    n_rest = rest.sum(-1)
    sr, simr = s.masked_fill(~rest, float("-inf")), sim.masked_fill(~rest, float("-inf"))
    ok = n_rest > 0  # queries with a rest to choose from
    kq = torch.clamp(torch.minimum(torch.floor(n.double() * fraction + 0.5).long(), n_rest), min=1)
    oracle, hashed = _top_m(sr, kq), _top_m(simr, kq)
    rec = (oracle & hashed).sum(-1).float() / oracle.sum(-1).float()
    mass = (p * (hashed | always)).sum(-1) / (p * (oracle | always)).sum(-1)
    out["oracle_recall"] = float(rec[..., ok].mean())
    out["oracle_mass"] = float(mass[..., ok].mean())
    # Resolution: the keys of the rest whose similarity equals the k-th highest (the tie that the
    # random break decides), per key chosen.
    sim0r = sim0.masked_fill(~rest, float("-inf"))
    kth = sim0r.sort(dim=-1, descending=True).values.gather(-1, (kq - 1).view(1, 1, -1, 1).expand(hkv, g, nq, 1))
    ties = (sim0r == kth).sum(-1).float() / kq.float()
    out["boundary_ties"] = float(ties[..., ok].mean())
    top32 = _top_m(sr, torch.clamp(torch.minimum(n_rest, torch.full_like(n_rest, 32)), min=1))
    for name, frac in (("top32_in_1_16", 1 / 16), ("top32_in_1_32", 1 / 32)):
        budget = _top_m(simr, torch.clamp(torch.minimum(torch.floor(n.double() * frac).long(), n_rest), min=1))
        out[name] = float(((top32 & budget).sum(-1).float() / top32.sum(-1).float())[..., ok].mean())
    return out


@torch.no_grad()
def windows_recall(
    layer: LayerHash | None, q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor, *, bits: int, fraction: float,
    seed: int, simhash_seed: int,
) -> dict[str, float]:
    """topk_recall's measures averaged over windows: queries q [W, H, T, d] at positions pos over
    keys k [W, Hkv, T, d], signed by `layer`'s MLPs, or by SimHash at `bits` (its planes from
    simhash_seed) when layer is None; window w breaks ties with seed + w."""
    out: dict[str, float] = {}
    for w in range(q.shape[0]):
        qq, kk = q[w][:, pos], k[w]
        sig = simhash_signatures(qq, kk, bits, seed=simhash_seed) if layer is None else learned_signatures(layer, qq, kk)
        for key, x in topk_recall(qq, kk, pos, *sig, fraction, seed=seed + w).items():
            out[key] = out.get(key, 0.0) + x / q.shape[0]
    return out


# ---- The file ------------------------------------------------------------------------------------


def write_hash_weights(path: str | Path, layers: Sequence[LayerHash]) -> int:
    """Writes the version-1 learned hash weight file (kernels/hash_signatures.h); returns its
    size in bytes."""
    first = layers[0]
    dims = first.query.dims
    h, hk = first.query.weights[0].shape[0], first.key.weights[0].shape[0]
    out = bytearray(MAGIC)
    out += struct.pack("<5I", VERSION, len(layers), h, hk, len(dims) - 1)
    out += struct.pack(f"<{len(dims)}I", *dims)
    for layer in layers:
        if layer.query.dims != dims or layer.key.dims != dims:
            raise ValueError("every MLP of the file must have the same dims")
        for mlps in (layer.query, layer.key):
            n = mlps.weights[0].shape[0]
            for j in range(n):
                for w, b in zip(mlps.weights, mlps.biases):
                    out += w[j].detach().float().cpu().contiguous().numpy().astype("<f4").tobytes()
                    out += b[j].detach().float().cpu().contiguous().numpy().astype("<f4").tobytes()
    Path(path).write_bytes(bytes(out))
    return len(out)


# ---- SAAP partitions (kernels/saap.h) ----------------------------------------------------------

SAAP_MAGIC = b"KVSPSAAP"


def rope_params(model: Any) -> tuple[torch.Tensor, float]:
    """The model's RoPE frequencies (inv_freq [d/2], any scaling folded in) and its attention
    scaling, from its rotary embedding module."""
    for module in model.modules():
        inv = getattr(module, "inv_freq", None)
        if isinstance(inv, torch.Tensor):
            return inv.detach().float().cpu(), float(getattr(module, "attention_scaling", 1.0))
    raise ValueError("the model has no rotary embedding (inv_freq)")


def unrope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> torch.Tensor:
    """Inverse of the Llama ("rotate half") RoPE: x [..., T, d] post-RoPE at positions [T] ->
    pre-RoPE, fp32 (angles in float64), as kernels/saap.h's SaapUnrope."""
    half = x.shape[-1] // 2
    ang = positions.double()[:, None] * inv_freq.to(positions.device).double()[None, :]
    cos, sin = ang.cos().float(), ang.sin().float()
    y1, y2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([y1 * cos + y2 * sin, y2 * cos - y1 * sin], -1) / scale


def spherical_kmeans(x: torch.Tensor, clusters: int, iters: int = 10, seed: int = 0) -> torch.Tensor:
    """Unit centroids [C, d] of the directions of x [N, d] (cosine k-means, random init)."""
    gen = torch.Generator().manual_seed(seed)
    xn = torch.nn.functional.normalize(x.float(), dim=-1)
    cent = xn[torch.randperm(xn.shape[0], generator=gen)[:clusters].to(x.device)].clone()
    for _ in range(iters):
        assign = (xn @ cent.T).argmax(-1)
        sums = torch.zeros_like(cent).index_add_(0, assign, xn)
        counts = torch.bincount(assign, minlength=clusters)
        empty = counts == 0
        if bool(empty.any()):  # an empty cluster restarts at a random point
            pick = torch.randint(xn.shape[0], (int(empty.sum()),), generator=gen).to(x.device)
            sums[empty] = xn[pick]
        cent = torch.nn.functional.normalize(sums, dim=-1)
    return cent


@dataclass
class SaapLayer:
    """One layer's partitions: centroids [Hkv, C, d] and the query classifiers (per query head:
    w1 [hidden, d], b1 [hidden], w2 [C, hidden], b2 [C])."""

    centroids: torch.Tensor
    w1: torch.Tensor
    b1: torch.Tensor
    w2: torch.Tensor
    b2: torch.Tensor


def _bucket_mass(q: torch.Tensor, k: torch.Tensor, buckets: torch.Tensor, pos: torch.Tensor, clusters: int,
                 sink: int, local: int) -> torch.Tensor:
    """Per query (heads of one kv head group, q [G, Q, d] post-RoPE at pos [Q]; keys k [T, d]
    post-RoPE with their buckets [T]): the share of the query's attention over its long-range
    keys (past the sink, before the local window) in each bucket, [G, Q, C]."""
    t = torch.arange(k.shape[0], device=k.device)
    long_range = (t[None, :] >= sink) & (t[None, :] < (pos[:, None] + 1 - local))
    s = torch.einsum("gqd,td->gqt", q.float(), k.float()) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~long_range, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    onehot = torch.nn.functional.one_hot(buckets, clusters).float()  # [T, C]
    return p @ onehot


def train_saap_layer(
    q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor, scale: float, *, clusters: int = 128,
    hidden: int = 256, steps: int = 300, queries_per_step: int = 64, sink: int = 128, local: int = 128,
    lr: float = 3e-3, seed: int = 0, log: Callable[[str], None] | None = None,
) -> SaapLayer:
    """k-means of the layer's pre-RoPE keys per kv head, then one classifier per query head
    trained with the paper's KL loss on its long-range attention mass per bucket.
    q [W, H, T, d], k [W, Hkv, T, d] post-RoPE (positions 0..T-1 in each window)."""
    w_count, h, t, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    dev = q.device
    positions = torch.arange(t, device=dev)
    k_pre = unrope(k, positions, inv_freq, scale)  # [W, Hkv, T, d]
    cents = torch.stack([spherical_kmeans(k_pre[:, j].reshape(-1, d), clusters, seed=seed + j)
                         for j in range(hkv)])  # [Hkv, C, d]
    buckets = torch.einsum("wjtd,jcd->wjtc", torch.nn.functional.normalize(k_pre, dim=-1), cents).argmax(-1)
    gen = torch.Generator().manual_seed(seed)
    mlp = HashMlps(h, [d, hidden, clusters], gen).to(dev)  # the same batched linears, ReLU here
    opt = torch.optim.Adam(mlp.parameters(), lr=lr)
    lo = min(t - 1, sink + local + 1)
    pick = torch.Generator().manual_seed(seed + 1)
    for step in range(steps):
        w = int(torch.randint(w_count, (1,), generator=pick))
        pos = torch.randint(lo, t, (queries_per_step,), generator=pick).to(dev)
        with torch.no_grad():
            target = torch.cat([_bucket_mass(q[w, j * g:(j + 1) * g][:, pos], k[w, j], buckets[w, j], pos, clusters,
                                             sink, local) for j in range(hkv)])  # [H, Q, C]
        x = unrope(q[w][:, pos], pos, inv_freq, scale)  # [H, Q, d]
        z = torch.baddbmm(mlp.biases[0].unsqueeze(1), x, mlp.weights[0].transpose(1, 2)).relu()
        logits = torch.baddbmm(mlp.biases[1].unsqueeze(1), z, mlp.weights[1].transpose(1, 2))
        keep = target.sum(-1) > 0
        loss = torch.nn.functional.kl_div(torch.log_softmax(logits, -1)[keep], target[keep], reduction="batchmean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if log is not None and (step + 1) % max(1, steps // 4) == 0:
            log(f"  step {step + 1}/{steps}: KL {loss.item():.4f}")
    return SaapLayer(cents.detach(), mlp.weights[0].detach(), mlp.biases[0].detach(),
                     mlp.weights[1].detach(), mlp.biases[1].detach())


@torch.no_grad()
def saap_coverage(layer: SaapLayer, q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor, scale: float,
                  probes: int, sink: int = 128, local: int = 128, queries: int = 64, seed: int = 0) -> dict[str, float]:
    """On one window (q [H, T, d], k [Hkv, T, d] post-RoPE): for random query positions, the rows
    SAAP reads (sink + window + the group's top-`probes` buckets) as a fraction of the prefix, and
    the share of each query head's attention mass they hold; the same for the symmetric baseline
    (the query's own nearest centroids, summed over the group, instead of the classifier)."""
    h, t, d = q.shape
    hkv = k.shape[0]
    g = h // hkv
    dev = q.device
    gen = torch.Generator().manual_seed(seed)
    pos = torch.randint(min(t - 1, sink + local + 1), t, (queries,), generator=gen).to(dev)
    k_pre = unrope(k, torch.arange(t, device=dev), inv_freq, scale)
    out = {"saap_rows": 0.0, "saap_mass": 0.0, "kmeans_mass": 0.0}
    tt = torch.arange(t, device=dev)
    for j in range(hkv):
        buckets = (torch.nn.functional.normalize(k_pre[j], dim=-1) @ layer.centroids[j].T).argmax(-1)  # [T]
        qj = q[j * g:(j + 1) * g][:, pos]  # [G, Q, d]
        x = unrope(qj, pos, inv_freq, scale)
        z = torch.relu(torch.einsum("gqd,ghd->gqh", x, layer.w1[j * g:(j + 1) * g]) + layer.b1[j * g:(j + 1) * g, None])
        logits = torch.einsum("gqh,gch->gqc", z, layer.w2[j * g:(j + 1) * g]) + layer.b2[j * g:(j + 1) * g, None]
        sym = torch.nn.functional.normalize(x, dim=-1) @ layer.centroids[j].T  # [G, Q, C]
        causal = tt[None, :] <= pos[:, None]
        fixed = (tt[None, :] < sink) | (tt[None, :] > pos[:, None] - local)
        s = torch.einsum("gqd,td->gqt", qj.float(), k[j].float()) / math.sqrt(d)
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), -1)
        # The symmetric baseline scores buckets by a softmax of 20 x the query's cosine to each
        # centroid (a soft nearest-centroid vote), summed over the group like the classifier's.
        for name, score in (("saap", torch.softmax(logits, -1).sum(0)), ("kmeans", torch.softmax(sym * 20, -1).sum(0))):
            top = score.topk(probes, -1).indices  # [Q, probes]
            visit = torch.zeros(queries, layer.centroids.shape[1], dtype=torch.bool, device=dev)
            visit.scatter_(1, top, True)
            rows = (fixed | visit[:, buckets]) & causal  # [Q, T]
            out[f"{name}_mass"] += float((p * rows).sum(-1).mean()) / hkv
            if name == "saap":
                out["saap_rows"] += float((rows.sum(-1).float() / (pos + 1)).mean()) / hkv
    return out


def write_saap(path: str | Path, layers: Sequence[SaapLayer], inv_freq: torch.Tensor, scale: float) -> int:
    """Writes the version-1 SAAP partition file (kernels/saap.h); returns its size in bytes."""
    first = layers[0]
    hkv, c, d = first.centroids.shape
    h, hidden = first.w1.shape[0], first.w1.shape[1]
    f32 = lambda x: x.detach().float().cpu().contiguous().numpy().astype("<f4").tobytes()  # noqa: E731
    out = bytearray(SAAP_MAGIC)
    out += struct.pack("<7I", 1, len(layers), h, hkv, d, c, hidden)
    out += struct.pack("<f", scale)
    out += f32(inv_freq)
    for layer in layers:
        out += f32(layer.centroids)
    for layer in layers:
        for i in range(h):
            out += f32(layer.w1[i]) + f32(layer.b1[i]) + f32(layer.w2[i]) + f32(layer.b2[i])
    Path(path).write_bytes(bytes(out))
    return len(out)


def calibrate_saap(
    model: Any, train_windows: Sequence[torch.Tensor], eval_windows: Sequence[torch.Tensor], *,
    clusters: int = 128, hidden: int = 256, steps: int = 300, probes: int = 8, sink: int = 128,
    local: int = 128, seed: int = 0, log: Callable[[str], None] = print, captured: Captured | None = None,
) -> tuple[list[SaapLayer], list[dict[str, float]], torch.Tensor, float]:
    """SAAP partitions for every layer, and their coverage on `eval_windows` at `probes`
    (`captured`: as calibrate's)."""
    inv_freq, scale = rope_params(model)
    qk, ev = captured or capture_both(model, train_windows, eval_windows)
    layers, rows = [], []
    for i, (q, k) in enumerate(qk):
        t0 = time.time()
        layer = train_saap_layer(q, k, inv_freq, scale, clusters=clusters, hidden=hidden, steps=steps,
                                 sink=sink, local=local, seed=seed + i, log=log)
        layers.append(layer)
        qe, ke = ev[i]
        cov = {"saap_rows": 0.0, "saap_mass": 0.0, "kmeans_mass": 0.0}
        for w in range(qe.shape[0]):
            r = saap_coverage(layer, qe[w], ke[w], inv_freq, scale, probes, sink=sink, local=local, seed=seed + w)
            for key in cov:
                cov[key] += r[key] / qe.shape[0]
        rows.append({"layer": i, **cov})
        log(f"layer {i}: SAAP {probes}/{clusters} buckets read {cov['saap_rows']:.3f} of the rows, holding "
            f"{cov['saap_mass']:.3f} of the attention (symmetric k-means: {cov['kmeans_mass']:.3f}) "
            f"({time.time() - t0:.1f} s)")
    return layers, rows, inv_freq, scale


# ---- The command -----------------------------------------------------------------------------------


def _windows(tokens: torch.Tensor, context: int, count: int, seed: int) -> list[torch.Tensor]:
    if tokens.numel() < context + 1:
        raise ValueError(f"the calibration text has {tokens.numel()} tokens, fewer than one window of {context}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, tokens.numel() - context, (count,), generator=gen).tolist()
    return [tokens[s : s + context] for s in starts]


def calibrate(
    model: Any,
    train_windows: Sequence[torch.Tensor],
    eval_windows: Sequence[torch.Tensor],
    *,
    bits: int = 32,
    hidden: int = 128,
    linears: int = 3,
    steps: int = 400,
    top_fraction: float = 1 / 32,
    recipe: str | Recipe = "kvsparse",
    key_mlps: str = "kv",
    seed: int = 0,
    log: Callable[[str], None] = print,
    captured: Captured | None = None,
    **overrides: Any,
) -> tuple[list[LayerHash], list[dict[str, float]]]:
    """Trains every layer's MLPs on `train_windows` with `recipe` (RECIPES; `overrides` replace
    its fields) and measures on `eval_windows` the recall of selection at `top_fraction`
    (topk_recall's measures, learned and SimHash at the same bits); returns the layers and one
    row per layer. `captured`: the windows' queries and keys if already taken (capture_both)."""
    t0 = time.time()
    if (RECIPES[recipe] if isinstance(recipe, str) else recipe).label_top_k == 0:
        overrides.setdefault("top_fraction", top_fraction)  # labels: the fraction served
    qk, ev = captured or capture_both(model, train_windows, eval_windows)
    log(f"captured {len(qk)} layers' queries and keys of {len(train_windows)} + {len(eval_windows)} windows "
        f"({time.time() - t0:.1f} s)")
    layers, rows = [], []
    for i, (q, k) in enumerate(qk):
        t1 = time.time()
        log(f"layer {i}: training {q.shape[1]} query and {k.shape[1]} key MLPs")
        layer = train_layer(q, k, recipe=recipe, bits=bits, hidden=hidden, linears=linears, steps=steps,
                            key_mlps=key_mlps, seed=seed + i, log=log, **overrides)
        layers.append(layer)
        qe, ke = ev[i]
        t = qe.shape[2]
        gen = torch.Generator().manual_seed(seed + 1000 + i)
        pos = torch.randint(min(256, t - 1), t, (128,), generator=gen).to(qe.device)
        agg: dict[str, float] = {"layer": i}
        for name, learned in (("learned", layer), ("simhash", None)):
            r = windows_recall(learned, qe, ke, pos, bits=bits, fraction=top_fraction, seed=seed, simhash_seed=seed + i)
            agg.update({f"{name}_{key}": x for key, x in r.items()})
        rows.append(agg)
        log(f"layer {i}: top-{top_fraction:.4g} recall learned {agg['learned_recall']:.3f} "
            f"(mass {agg['learned_mass']:.3f}; of the oracle row's {agg['learned_oracle_recall']:.3f}), SimHash "
            f"{agg['simhash_recall']:.3f} (mass {agg['simhash_mass']:.3f}; {agg['simhash_oracle_recall']:.3f}) "
            f"({time.time() - t1:.1f} s)")
    return layers, rows


def _tokens(args: argparse.Namespace, model_dir: str) -> torch.Tensor:
    data = b"".join(Path(p).read_bytes() for p in args.text)
    if args.tokenizer == "bytes":
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return torch.tensor(tok(data.decode("utf-8", errors="replace"))["input_ids"], dtype=torch.long)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvsparse-calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a transformers model directory (from_pretrained)")
    p.add_argument("--text", nargs="+", required=True, help="calibration text files")
    p.add_argument("--out", required=True, help="the learned hash weight file to write")
    p.add_argument("--tokenizer", choices=("auto", "bytes"), default="auto",
                   help="auto: the model's tokenizer; bytes: one token per byte")
    p.add_argument("--context", type=int, default=8192, help="tokens per calibration window")
    p.add_argument("--windows", type=int, default=8, help="training windows (one more tenth held out)")
    p.add_argument("--bits", type=int, default=32, help="signature bits (multiple of 32, 32..256)")
    p.add_argument("--hidden", type=int, default=128, help="hidden width of the MLPs")
    p.add_argument("--linears", type=int, default=3, help="linear layers per MLP")
    p.add_argument("--steps", type=int, default=400, help="optimiser steps per layer")
    p.add_argument("--top_fraction", type=float, default=1 / 32,
                   help="top-k fraction served (recall is measured there; the kvsparse recipe's labels)")
    p.add_argument("--recipe", choices=sorted(RECIPES), default="kvsparse",
                   help="training recipe: kvsparse (rank the top fraction of the prefix) or hashattention "
                        "(HashAttention's released training: top 32 beyond sink and window, positives x20, "
                        "lr 1e-3)")
    p.add_argument("--key_mlps", choices=KEY_MLPS, default="kv",
                   help="one key MLP per kv head (the GPU engine signs these) or per query head (the paper's)")
    p.add_argument("--alpha", type=float, default=None, help="weight of the positives in the BCE (default: the recipe's)")
    p.add_argument("--saap_out", default="", help="also write SAAP partitions (kernels/saap.h) here")
    p.add_argument("--clusters", type=int, default=128, help="SAAP: key buckets per kv head")
    p.add_argument("--saap_hidden", type=int, default=256, help="SAAP: query classifier width")
    p.add_argument("--probes", type=int, default=8, help="SAAP: buckets visited, for the printed coverage")
    p.add_argument("--sink", type=int, default=128, help="SAAP: sink tokens always read (not partitioned)")
    p.add_argument("--local", type=int, default=128, help="SAAP: local window always read")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if args.bits % 32 or not 32 <= args.bits <= 256:
        p.error("--bits must be a multiple of 32 in [32, 256]")
    from transformers import AutoModelForCausalLM

    t0 = time.time()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    tokens = _tokens(args, args.model)
    print(f"model {args.model}: {model.config.num_hidden_layers} layers; {tokens.numel()} calibration tokens "
          f"({time.time() - t0:.1f} s)", flush=True)
    n_eval = max(1, args.windows // 10)
    windows = _windows(tokens, args.context, args.windows + n_eval, args.seed)
    captured = capture_both(model, windows[: args.windows], windows[args.windows :])
    layers, rows = calibrate(
        model, windows[: args.windows], windows[args.windows :], bits=args.bits, hidden=args.hidden,
        linears=args.linears, steps=args.steps, top_fraction=args.top_fraction, recipe=args.recipe,
        key_mlps=args.key_mlps, seed=args.seed, log=lambda s: print(s, flush=True), captured=captured,
        **({"alpha": args.alpha} if args.alpha is not None else {}),
    )
    size = write_hash_weights(args.out, layers)
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0] if k != "layer"}
    print(f"wrote {args.out} ({size} bytes); mean top-{args.top_fraction:.4g} recall learned "
          f"{mean['learned_recall']:.3f}, SimHash {mean['simhash_recall']:.3f} ({time.time() - t0:.1f} s)", flush=True)
    if args.saap_out:
        saap, cov, inv_freq, scale = calibrate_saap(
            model, windows[: args.windows], windows[args.windows :], clusters=args.clusters,
            hidden=args.saap_hidden, steps=args.steps, probes=args.probes, sink=args.sink, local=args.local,
            seed=args.seed, captured=captured,
            log=lambda s: print(s, flush=True))
        size = write_saap(args.saap_out, saap, inv_freq, scale)
        print(f"wrote {args.saap_out} ({size} bytes)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
