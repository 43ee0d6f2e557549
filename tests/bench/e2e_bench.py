"""End-to-end decoding of a Llama-3.1-8B-shaped model (random bf16 weights from its config:
speed does not depend on the values) with its KV cache held five ways, measured side by side in
one process on one GPU:

  flash           the floor a vLLM user gets (floor_decode.py): KV resident in preallocated buffers,
                  decode attention over exactly each row's length by FlashAttention-2's split-KV
                  varlen kernel (as PyTorch ships it), the whole step one CUDA graph
                  (torch.compile(mode="reduce-overhead", fullgraph=True)); every ratio the docs give
                  is against this row
  weights         the same step at a context of 16 tokens: the non-attention floor (weights, norms,
                  logits), whatever the row's n
  resident        transformers, DynamicCache on the GPU, eager
  compiled        transformers, StaticCache on the GPU, torch.compile(mode="reduce-overhead")
  offloaded       transformers, DynamicCache(offloading=True): KV in host memory, layer prefetch
  kvs-<method>    kvsparse in process (kvsparse.torch.ops.InProcessEngine): the store in pinned host
                  memory, the GPU backend; q and the output stay on the GPU
  kvsc-<method>   the same with the model compiled (torch.compile, default mode: the kvsparse
                  attention calls are graph breaks; no CUDA graphs, the op synchronises)
  kvsg-<method>   the same with planned decode steps (KvSparseCache(max_tokens=...)): the whole
                  step compiled with torch.compile(mode="reduce-overhead", fullgraph=True) and
                  replayed as one CUDA graph (methods the GPU backend captures: prop, hash,
                  ckeys*, ckprop*, ckgroup*, ckvatt: a compressed-key step quantizes a closing group on the GPU;
                  dense needs K and V resident and is the flash row's work)
  kvsgc-<method>  the same without warming the next layer's host-page translations
                  (KvSparseCache(warm_pages=False): every layer's row fetch translates cold)
  kvsgn-<method>  kvsg- through a second in-process engine without a row cache
                  (gpu_row_cache=0: every selected row crosses every step), to set the row cache
                  of --gpu_row_cache against none in one run
  kvsgw-<method>  kvsg- through an in-process engine with key widths (key_widths=: compressed
                  keys at per-channel widths, kernels/key_widths.h): --key_widths's file, or by
                  default widths in the calibration's proportions (3/16 of each kv head's
                  channels at twice the bits, as many left out) from a seeded random ranking: these
                  weights have no queries to rank by, and the kernels' work does not depend on
                  which channels
  grpc-<method>   kvsparse-server on loopback (unary calls), grpcs-<method> over a DecodeStream
  kvsr-<method>   the engine in process (q and the output on the GPU) over a store in another
                  process: kvsparse.torch.ops.InProcessEngine(store=...) against kvsparse-server
                  --role=store on loopback (rows through its Gather RPC)
  split-<method>  a split deployment on loopback: kvsparse-server --role=store holds the KV,
                  --role=worker decodes on the GPU and gathers the rows it selects from the
                  store (KvStore Gather RPC); the model appends to the store, decodes at the
                  worker
  splitucx-<method>  the same with the UCX data plane: the store keeps its arena in a file on
                  /dev/shm exported over UCX (--data_plane=ucx), the worker reads the rows it
                  selects over UCX (--store_data_plane=ucx, TCP here) instead of the Gather RPC
  split1-<method>, splitucx1-<method>  the same two with --gpu_fetch_parallelism=1: the batch's
                  sequences fetched one after another (the default fetches up to 8 at once)

Methods: dense (every row from host memory), prop (S2ANTA-prop S=128, K on the GPU, V in host
memory), hash (HashAttention top-k 1.25% per head from host memory, 4% row cache), vatt
(vAttention eps = delta = 0.05, hash predictor), ckeys (top-k 1/32 per head by 2-bit compressed
keys on the GPU, K and V in host memory, 4% row cache), ckeys64 (the same at 1/64), ckeys1 and
ckeys1-64 (1-bit keys at 1/32 and 1/64; the row cache is --gpu_row_cache's), ckprop
(S2ANTA-prop S=128 drawing from the 2-bit compressed keys' scores, the sampled K and V rows from
host memory: the ratio correction; ckprop256 the same at S=256), ckgroup, ckgroup256, ckgroup512,
ckgroup640, ckgroup768, ckgroup1024 (the same with the group mixture proposal, one sample of S = 128 ... 1024 rows per kv
head for its query heads), ckvatt (vAttention eps = delta = 0.1 over 2-bit compressed
keys with the importance sampler and the CLT-ratio bound; on these random weights its budget
covers every row: docs/PERF.md).

Each variant's cache is filled with n random tokens per sequence and layer (the context a
prefill would leave; not timed), then decoding runs `--warmup` untimed and `--steps` timed
steps of one token for the whole batch: one forward pass of the model with logits for the last
position, argmax as the next token. Printed per row: ms per step (median) and tokens/s (B /
step), GPU memory held for KV, bytes crossing per token from host memory.

    python3 tests/bench/e2e_bench.py --lens 32768 --batches 1 --variants flash,weights,kvsg-ckprop

On a GPU `flash` is measured in every run (first, where --variants does not list it), so that each
speed row, a profiling call's too, stands beside the floor measured in the same pass.

With --rounds N each (n, B) passes over its variants N times, every other pass in reverse order,
and prints each pass's ratios against flash, resident and compiled of the same pass: the GPU host's
speed drifts between runs by more than the variants differ (docs/PERF.md), ratios within a
pass cancel it, and the spread over the passes shows it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import transformers
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

import kvsparse
import kvsparse.torch.hf
from kvsparse.tools import key_widths
from kvsparse.torch import ops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import floor_decode  # noqa: E402  (the floor baseline beside this file)
import trace_summary  # noqa: E402

# Baselines a pass's ratios are taken against, strongest first.
BASELINES = ("flash", "resident", "compiled")
# The weights row's context: long enough for a step, short enough that attention costs nothing.
WEIGHTS_CONTEXT = 16

# Split deployments (a worker over a store in another process); "1": --gpu_fetch_parallelism=1.
SPLIT = ("split", "splitucx", "split1", "splitucx1")
METHODS: dict[str, kvsparse.Method] = {
    "dense": kvsparse.Dense(),
    "prop": kvsparse.Santa(samples=128, allocation="prop"),
    "hash": kvsparse.HashTopK(top_k_fraction=0.0125, sink_tokens=128, local_tokens=128),
    "vatt": kvsparse.VAttention(epsilon=0.05, delta=0.05),
    "ckeys": kvsparse.TopK(top_k_fraction=1 / 32, sink_tokens=128, local_tokens=128),
    "ckeys64": kvsparse.TopK(top_k_fraction=1 / 64, sink_tokens=128, local_tokens=128),
    "ckeys1": kvsparse.TopK(top_k_fraction=1 / 32, sink_tokens=128, local_tokens=128),
    "ckeys1-64": kvsparse.TopK(top_k_fraction=1 / 64, sink_tokens=128, local_tokens=128),
    "ckprop": kvsparse.Santa(samples=128, allocation="prop", scores="compressed"),
    "ckprop256": kvsparse.Santa(samples=256, allocation="prop", scores="compressed"),
    "ckgroup": kvsparse.Santa(samples=128, allocation="prop", scores="compressed", proposal="group"),
    "ckgroup256": kvsparse.Santa(samples=256, allocation="prop", scores="compressed", proposal="group"),
    "ckgroup512": kvsparse.Santa(samples=512, allocation="prop", scores="compressed", proposal="group"),
    "ckgroup640": kvsparse.Santa(samples=640, allocation="prop", scores="compressed", proposal="group"),
    "ckgroup768": kvsparse.Santa(samples=768, allocation="prop", scores="compressed", proposal="group"),
    "ckgroup1024": kvsparse.Santa(samples=1024, allocation="prop", scores="compressed", proposal="group"),
    "ckvatt": kvsparse.VAttention(epsilon=0.1, delta=0.1, predictor="compressed", sampler="importance",
                                  bound="clt-ratio"),
}
# What a method's sequences keep on the worker's GPU when it is not placement_for(method)'s.
PLACEMENTS: dict[str, kvsparse.Placement] = {
    "ckeys1": kvsparse.Placement(compressed_key_bits=1),
    "ckeys1-64": kvsparse.Placement(compressed_key_bits=1),
}


@dataclass
class Row:
    n: int
    batch: int
    variant: str
    ms_per_step: float = 0.0
    tokens_per_s: float = 0.0
    kv_gpu_gb: float = 0.0  # GPU memory held for the KV cache (or its selection state)
    plan_gpu_gb: float = 0.0  # GPU memory a captured plan holds beside it (buffers, shared scratch)
    host_mb_per_token: float = 0.0  # bytes from host memory per generated token
    fetched_fraction: float = 0.0  # of what dense attention over every row reads
    steps_ms: list[float] = field(default_factory=list)
    note: str = ""
    round: int = 0  # --rounds: which pass over the variants measured it
    key_scale: float = 1.0  # --key_scale: the cached keys' scale (1: the random model's own)


def pass_summary(n: int, batch: int, rnd: int, rows: list[Row]) -> str:
    """One pass's tokens/s of each variant against the baselines' (flash, resident, compiled) in the same
    pass."""
    tps = {r.variant: r.tokens_per_s for r in rows if r.tokens_per_s}
    parts = []
    for r in rows:
        if not r.tokens_per_s:
            continue
        rel = [f"{r.tokens_per_s / tps[b]:.2f}x {b}" for b in BASELINES if b in tps and b != r.variant]
        parts.append(f"{r.variant} {r.ms_per_step:.1f} ms" + (f" ({', '.join(rel)})" if rel else ""))
    return f"<!-- pass {rnd + 1}, n={n} B={batch}: " + "; ".join(parts) + " -->"


def log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def make_model(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, device: str):
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=1 << 18,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    torch.set_default_dtype(prev)
    model.eval().requires_grad_(False)
    model.set_attn_implementation("sdpa")
    return model


KEY_SCALE = 1.0  # --key_scale (main sets it)


def random_kv(batch: int, kv_heads: int, n: int, d: int, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's cached K and V: standard normal entries, K times --key_scale (1: the random model's
    queries attend almost uniformly; larger: sharper attention, as a trained model's)."""
    g = torch.Generator(device=device).manual_seed(seed)
    k = torch.randn(batch, kv_heads, n, d, generator=g, device=device, dtype=torch.bfloat16)
    v = torch.randn(batch, kv_heads, n, d, generator=g, device=device, dtype=torch.bfloat16)
    if KEY_SCALE != 1.0:
        k = k * KEY_SCALE
    return k, v


def step(model, cache, ids: torch.Tensor, position: int, call=None) -> torch.Tensor:
    """One decode step of the batch at `position` (through `call`, a compiled model, when given):
    the model's forward pass with logits for the last position; returns the argmax tokens."""
    device = model.device
    out = (call if call is not None else model)(
        input_ids=ids,
        past_key_values=cache,
        position_ids=torch.full((ids.shape[0], 1), position, device=device, dtype=torch.long),
        cache_position=torch.tensor([position], device=device),
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1:].argmax(-1)


def decode_loop(model, cache, batch: int, n: int, warmup: int, steps: int, call=None) -> list[float]:
    """Times `steps` one-token steps after `warmup`; returns ms per step."""
    gpu = model.device.type == "cuda"
    ids = torch.randint(2, model.config.vocab_size, (batch, 1), device=model.device)
    times = []
    with torch.no_grad():
        for t in range(warmup + steps):
            if gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            ids = step(model, cache, ids, n + t, call)
            if gpu:
                torch.cuda.synchronize()
            if t >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
    return times


def profile_steps(model, cache, batch: int, n: int, first: int, call, path: str) -> None:
    """Three more steps under torch.profiler: where a step's time goes (host and device)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    gpu = model.device.type == "cuda"
    ids = torch.randint(2, model.config.vocab_size, (batch, 1), device=model.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with torch.no_grad(), profile(activities=activities) as prof:
        for t in range(first, first + 3):
            with record_function("e2e.step"):
                ids = step(model, cache, ids, n + t, call)
                if gpu:
                    torch.cuda.synchronize()
    trace = str(Path(path).with_suffix(".json.gz"))
    prof.export_chrome_trace(trace)
    summary = trace_summary.summarize(trace_summary.load(trace), 3, "e2e.step")
    with open(path, "w") as f:
        f.write(json.dumps(summary, indent=1) + "\n\n")
        f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
        if gpu:  # the kernels, by their own time on the device
            f.write("\n\n")
            f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=50, max_name_column_width=90))
    log(f"# profile of 3 steps written to {path} (trace {trace}): {json.dumps(summary)[:600]}")


def profile_if_asked(variant: str, model, cache, batch: int, n: int, position: int, first: int, call,
                     args: argparse.Namespace) -> None:
    """profile_steps for a variant --profile names, at the first of --lens (n), from `position`."""
    profiled = args.profile.split(",")
    if variant not in profiled or n != int(args.lens.split(",")[0]):
        return
    out = Path(args.profile_out)
    if len(profiled) > 1:  # one file per variant: profile-<variant>.txt
        out = out.with_name(f"{out.stem}-{variant}{out.suffix}")
    profile_steps(model, cache, batch, position, first, call, str(out))


def kv_bytes(layers: int, batch: int, kv_heads: int, n: int, d: int) -> int:
    return 2 * layers * batch * kv_heads * n * d * 2


def run_transformers(variant: str, model, n: int, batch: int, args) -> Row:
    cfg = model.config
    L, hkv, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    row = Row(n, batch, variant)
    model.set_attn_implementation("sdpa")
    device = str(model.device)
    if variant == "resident":
        cache = DynamicCache(config=cfg)
        for layer in range(L):
            k, v = random_kv(batch, hkv, n, d, device, layer)
            cache.update(k, v, layer)
        row.kv_gpu_gb = kv_bytes(L, batch, hkv, n, d) / 1e9
        row.steps_ms = decode_loop(model, cache, batch, n, args.warmup, args.steps)
    elif variant == "compiled":
        total = n + args.warmup + args.steps + 1
        cache = StaticCache(config=cfg, max_cache_len=total)
        for layer_idx, layer in enumerate(cache.layers):
            k, v = random_kv(batch, hkv, 1, d, device, 0)
            layer.lazy_initialization(k, v)
            k, v = random_kv(batch, hkv, n, d, device, layer_idx)
            layer.keys[:, :, :n].copy_(k)
            layer.values[:, :, :n].copy_(v)
            layer.cumulative_length.fill_(n)
            del k, v
        row.kv_gpu_gb = kv_bytes(L, batch, hkv, total, d) / 1e9
        compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        t0 = time.perf_counter()
        row.steps_ms = decode_loop(model, cache, batch, n, max(args.warmup, 3), args.steps, call=compiled)
        row.note = f"compile+warmup {time.perf_counter() - t0:.0f} s"
    elif variant == "offloaded":
        cache = DynamicCache(config=cfg, offloading=True)
        for layer in range(L):
            k, v = random_kv(batch, hkv, n, d, device, layer)
            cache.update(k, v, layer)
            del k, v
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        row.host_mb_per_token = kv_bytes(L, batch, hkv, n, d) / batch / 1e6
        row.steps_ms = decode_loop(model, cache, batch, n, args.warmup, args.steps)
    del cache
    return finish(row)


def run_floor(variant: str, model, n: int, batch: int, args) -> Row:
    """The floor baseline (floor_decode.py): `flash` over n tokens, `weights` over WEIGHTS_CONTEXT."""
    cfg = model.config
    L, hkv, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    ctx = n if variant == "flash" else WEIGHTS_CONTEXT
    row = Row(n, batch, variant)
    steps_total = max(args.warmup, 3) + args.steps
    floor_decode.register()
    model.set_attn_implementation(floor_decode.ATTN)
    device = str(model.device)
    try:
        with floor_decode.FloorCache(cfg, batch, ctx + steps_total + 8, device) as cache:
            for layer in range(L):
                k, v = random_kv(batch, hkv, ctx, d, device, layer)
                cache.load(layer, k, v)
                del k, v
            row.kv_gpu_gb = cache.bytes() / 1e9
            gpu = model.device.type == "cuda"
            call = torch.compile(model, mode="reduce-overhead", fullgraph=True) if gpu else None
            t0 = time.perf_counter()
            row.steps_ms = decode_loop(model, cache, batch, ctx, max(args.warmup, 3), args.steps, call=call)
            profile_if_asked(variant, model, cache, batch, n, ctx, max(args.warmup, 3) + args.steps, call, args)
            row.note = (f"context {ctx}; " if ctx != n else "") + (
                f"compile+warmup {time.perf_counter() - t0:.0f} s" if gpu else "eager (CPU)")
    finally:
        model.set_attn_implementation("sdpa")
    return finish(row)


def finish(row: Row) -> Row:
    row.ms_per_step = statistics.median(row.steps_ms)
    row.tokens_per_s = row.batch / row.ms_per_step * 1e3
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def run_kvsparse(variant: str, model, n: int, batch: int, args, engines, server) -> Row:
    transport, method_name = variant.split("-", 1)
    planned = transport in ("kvsg", "kvsgc", "kvsgn", "kvsgw")
    compiled = transport in ("kvsc", "kvsg", "kvsgc", "kvsgn", "kvsgw")
    warm_pages = transport != "kvsgc"
    transport = {"kvsgn": "kvsn", "kvsgw": "kvsw"}.get(transport, "kvs" if compiled else transport)
    method = METHODS[method_name]
    cfg = model.config
    L, hkv, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    row = Row(n, batch, variant)
    kvsparse.torch.hf.enable(model)
    target: Any = engines.get(transport)  # kvs, kvsr: an InProcessEngine
    if transport in SPLIT:
        target = kvsparse.Client(
            server[f"{transport}-worker"].target,
            store_target=server[f"{transport.rstrip('1')}-store"].target,
            timeout=600,
        )
    elif transport.startswith("grpc"):
        target = server["all"].target
    steps_total = max(args.warmup, 3 if compiled else 0) + args.steps
    cache = kvsparse.torch.hf.KvSparseCache(
        cfg, target, method=method, placement=PLACEMENTS.get(method_name), stream=transport == "grpcs", seed=1,
        max_tokens=n + steps_total + 8 if planned else None, warm_pages=warm_pages,
    )
    try:
        return measure_kvsparse(row, variant, method, model, n, batch, args, cache, target, engines, transport,
                                planned, compiled, steps_total)
    finally:  # also when the variant fails: its sequences leave the store and the GPU
        cache.close()
        if isinstance(target, kvsparse.Client):
            target.close()
        model.set_attn_implementation("sdpa")


def measure_kvsparse(row: Row, variant: str, method: kvsparse.Method, model, n: int, batch: int, args,
                     cache: "kvsparse.torch.hf.KvSparseCache", target: Any, engines, transport: str, planned: bool,
                     compiled: bool, steps_total: int) -> Row:
    """Loads the context into kvsparse and times the decode steps (run_kvsparse's body)."""
    cfg = model.config
    L, hkv, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    t0 = time.perf_counter()
    for layer in range(L):
        k, v = random_kv(batch, hkv, n, d, str(model.device), layer)
        cache.load(layer, k, v)
        del k, v
    load_s = time.perf_counter() - t0
    # One compiled graph for every layer (their layer_idx differs): without this each layer
    # recompiles, past dynamo's recompile limit.
    torch._dynamo.config.allow_unspec_int_on_nn_module = True
    call = torch.compile(model) if compiled else None
    if planned:
        if cache.steps is None or not cache.steps.captured:
            raise RuntimeError(f"{variant}: no captured plan ({cache.steps.mode if cache.steps else 'none'})")
        call = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    t0 = time.perf_counter()
    row.steps_ms = decode_loop(model, cache, batch, n, max(args.warmup, 3 if compiled else 0), args.steps, call)
    warm_s = time.perf_counter() - t0
    profile_if_asked(variant, model, cache, batch, n, n, max(args.warmup, 3) + args.steps, call, args)
    steps = steps_total
    s = cache.stats
    # Bytes over the whole run (the warm-up steps read as the timed ones do, after the first).
    row.host_mb_per_token = s.bytes_fetched / (steps * batch) / 1e6
    row.fetched_fraction = s.fetched_fraction
    if planned:  # the last step's rows read from host memory, from the GPU's statistics
        stats = cache.step_stats()
        lengths = cache.commit()
        host_bytes = None
        if isinstance(method, kvsparse.Santa) and method.scores == "exact":  # V rows per (layer, b, kv head)
            host_bytes = int(stats[:, 0, : batch * hkv].sum()) * d * 2
        elif isinstance(method, (kvsparse.HashTopK, kvsparse.TopK, kvsparse.Santa, kvsparse.VAttention)):
            # The selected-rows path (hash top-k, top-k and S2ANTA over compressed keys) and
            # vAttention's row set: K and V of the union's rows less the row cache's hits (none
            # for vAttention).
            misses = stats[:, 0, : batch * hkv].sum() - stats[:, 3, : batch * hkv].sum()
            host_bytes = int(misses) * 2 * d * 2
        if host_bytes is not None:
            row.host_mb_per_token = host_bytes / batch / 1e6
            row.fetched_fraction = host_bytes / (2 * L * hkv * d * 2 * sum(lengths))
        row.plan_gpu_gb = cache.steps.device_bytes / 1e9
        row.note = f"{cache.steps.mode}, plan {row.plan_gpu_gb:.3f} GB; "
    mem = target.memory() if transport in engines else None
    if mem is not None:
        row.kv_gpu_gb = mem["gpu_bytes"] / 1e9
    row.note += f"load {load_s:.0f} s" + (f", compile+run {warm_s:.0f} s" if compiled else "")
    return finish(row)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lens", default="32768,131072")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--variants", default="resident,compiled,offloaded,kvs-dense,kvs-prop,kvs-hash,kvs-vatt",
                   help="the rows of each (n, B); on a GPU `flash` is measured first when not listed")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv_heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--store_capacity", default="100G")
    p.add_argument("--gpu_capacity", default="40G")
    p.add_argument("--key_scale", type=float, default=1.0,
                   help="every cached key times this: 1 (default) leaves the random model's attention almost "
                        "uniform, where a sampled method's draws are nearly all distinct rows (its worst case for "
                        "bytes); larger sharpens it, as trained models' attention is (fewer distinct rows a "
                        "sample; the 'fetched / dense' column says how many)")
    p.add_argument("--gpu_row_cache", type=float, default=0.04,
                   help="the in-process engine's row cache (hash, ckeys*): rows per kv head as a fraction of the tokens")
    p.add_argument("--key_widths", default="",
                   help="the kvsgw- engine's key widths file (kvsparse-key-widths); default: random widths in the "
                        "calibration's proportions for the bench's shape")
    p.add_argument("--skip", default="", help="n:B:variant,... combinations to leave out")
    p.add_argument("--rounds", type=int, default=1,
                   help="pass over each (n, B)'s variants this many times, every other pass in reverse order; "
                        "after each pass its tokens/s against resident's and compiled's of the same pass (the "
                        "spread between passes is the host's drift, which ratios within a pass cancel)")
    p.add_argument("--json", default="")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test of the harness")
    p.add_argument("--profile", default="", help="variants to profile (kvsparse's, flash, weights), comma-separated "
                   "(torch.profiler, 3 steps at the first length: the tables, the Chrome trace beside --profile_out "
                   "and its summary, tests/bench/trace_summary.py; with several, --profile_out gets -<variant> before "
                   "its suffix)")
    p.add_argument("--profile_out", default="profile.txt")
    args = p.parse_args()
    return args


def bench_key_widths(args: argparse.Namespace) -> str:
    """The kvsgw- engine's key widths file: --key_widths, or 2-bit widths for the bench's shape in
    the calibration's proportions from a seeded random channel ranking."""
    if args.key_widths:
        return args.key_widths
    d = args.hidden // args.heads
    g = torch.Generator().manual_seed(0)
    widths = [key_widths.widths_of(torch.rand(args.kv_heads, d, generator=g), 3 / 16) for _ in range(args.layers)]
    path = Path(tempfile.gettempdir()) / f"kvsparse-e2e-widths-{os.getpid()}.bin"
    key_widths.write_key_widths(path, widths, bits=2)
    return str(path)


def start_transports(variants: list[str], args: argparse.Namespace, gpu: bool
                     ) -> tuple[dict[str, ops.InProcessEngine], dict[str, kvsparse.LocalServer]]:
    """The in-process engines (by transport) and the local servers the variants decode through."""
    engines: dict[str, ops.InProcessEngine] = {}  # by transport
    if any(v.startswith(("kvs-", "kvsc-", "kvsg-", "kvsgc-")) for v in variants):
        engines["kvs"] = ops.InProcessEngine(
            gpu="on" if gpu else "off", store_capacity=args.store_capacity, gpu_capacity=args.gpu_capacity,
            gpu_row_cache=args.gpu_row_cache,
        )
    if any(v.startswith("kvsgn-") for v in variants):
        engines["kvsn"] = ops.InProcessEngine(
            gpu="on" if gpu else "off", store_capacity=args.store_capacity, gpu_capacity=args.gpu_capacity,
            gpu_row_cache=0.0,
        )
    if any(v.startswith("kvsgw-") for v in variants):
        engines["kvsw"] = ops.InProcessEngine(
            gpu="on" if gpu else "off", store_capacity=args.store_capacity, gpu_capacity=args.gpu_capacity,
            gpu_row_cache=args.gpu_row_cache, key_widths=bench_key_widths(args),
        )
    server: dict[str, kvsparse.LocalServer] = {}
    if any(v.startswith("grpc") for v in variants):
        server["all"] = kvsparse.LocalServer(
            gpu="on" if gpu else "off",
            capacity=args.store_capacity,
            resident_capacity=args.gpu_capacity,
            startup_timeout=120,
        ).start()
    if any(v.startswith(("split-", "split1-", "kvsr")) for v in variants):
        server["store"] = kvsparse.LocalServer(role="store", capacity=args.store_capacity, startup_timeout=120).start()
        server["split-store"] = server["store"]
    if any(v.startswith(("splitucx-", "splitucx1-")) for v in variants):
        server["splitucx-store"] = kvsparse.LocalServer(
            role="store", capacity=args.store_capacity, arena_file=f"/dev/shm/kvsparse-e2e-{os.getpid()}",
            data_plane="ucx", data_plane_transports="tcp", startup_timeout=120,
        ).start()
    if any(v.startswith("kvsr") for v in variants):
        engines["kvsr"] = ops.InProcessEngine(
            gpu="on" if gpu else "off", store=server["store"].target, gpu_capacity=args.gpu_capacity
        )
    for transport in SPLIT:
        if any(v.startswith(f"{transport}-") for v in variants):
            flags: dict[str, Any] = {"gpu_fetch_parallelism": 1} if transport.endswith("1") else {}
            if transport.startswith("splitucx"):
                flags.update(store_data_plane="ucx", data_plane_transports="tcp")
            server[f"{transport}-worker"] = kvsparse.LocalServer(
                role="worker",
                store=server[f"{transport.rstrip('1')}-store"].target,
                gpu="on" if gpu else "off",
                resident_capacity=args.gpu_capacity,
                startup_timeout=120,
                **flags,
            ).start()
    return engines, server


def run_variant(variant: str, model: Any, n: int, batch: int, args: argparse.Namespace,
                engines: dict[str, ops.InProcessEngine], server: dict[str, kvsparse.LocalServer], gpu: bool) -> Row:
    """One row; a variant that fails (out of memory, refused) gives a row whose note says why."""
    failed = None
    # Every row compiles its own graphs (a new cache object, or a new context): without a reset
    # the rows of one process pass dynamo's recompile limit (8 per code object) and the ninth
    # compiled row fails (2026-12-02: two passes of six variants at 128k).
    torch._dynamo.reset()
    try:
        if variant in ("flash", "weights"):
            return run_floor(variant, model, n, batch, args)
        if variant in ("resident", "compiled", "offloaded"):
            return run_transformers(variant, model, n, batch, args)
        return run_kvsparse(variant, model, n, batch, args, engines, server)
    except (torch.cuda.OutOfMemoryError, RuntimeError, kvsparse.KvSparseError) as e:
        failed = f"failed: {type(e).__name__}: {str(e)[:160]}"
    # Outside the handler: the exception's frames (and the tensors they hold) are gone, so the
    # next variant finds the GPU memory free.
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()
    return Row(n, batch, variant, note=failed)


def with_floor(variants: list[str], gpu: bool) -> list[str]:
    """On a GPU every pass measures `flash` first unless it is listed: a speed row stands beside the
    resident decode at the memory floor of the same run (a profiling call too: its step time is
    a speed figure)."""
    return variants if not gpu or "flash" in variants else ["flash", *variants]


def main() -> None:
    global KEY_SCALE
    args = parse_args()
    KEY_SCALE = args.key_scale
    device = args.device
    gpu = device == "cuda"
    name = torch.cuda.get_device_name() if gpu else "CPU"
    log(f"# {name}, torch {torch.__version__}, transformers {transformers.__version__}")
    model = make_model(args.layers, args.hidden, args.heads, args.kv_heads, args.ffn, args.vocab, device)
    log(f"# model: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters; cached keys x {args.key_scale:g}")
    variants = with_floor(args.variants.split(","), gpu)
    engines, server = start_transports(variants, args, gpu)
    skip = set(args.skip.split(",")) if args.skip else set()
    rows: list[Row] = []
    print(
        "| n | B | variant | ms / step | tokens/s | x flash tok/s | x resident tok/s | x compiled tok/s | KV GPU GB | "
        "host MB / token | fetched / dense | note |"
    )
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for n in (int(x) for x in args.lens.split(",")):
        for batch in (int(x) for x in args.batches.split(",")):
            for rnd in range(args.rounds):
                base = base_compiled = base_flash = None
                order = variants if rnd % 2 == 0 else variants[::-1]
                pass_rows: list[Row] = []
                for variant in order:
                    if f"{n}:{batch}:{variant}" in skip:
                        continue
                    of = f" (pass {rnd + 1} of {args.rounds})" if args.rounds > 1 else ""
                    log(f"== n={n} B={batch} {variant}{of}")
                    row = run_variant(variant, model, n, batch, args, engines, server, gpu)
                    row.round = rnd
                    row.key_scale = args.key_scale
                    rows.append(row)
                    pass_rows.append(row)
                    if variant == "resident" and row.tokens_per_s:
                        base = row.tokens_per_s
                    if variant == "compiled" and row.tokens_per_s:
                        base_compiled = row.tokens_per_s
                    if variant == "flash" and row.tokens_per_s:
                        base_flash = row.tokens_per_s
                    rel = f"{row.tokens_per_s / base:.2f}" if base and row.tokens_per_s else ""
                    rel_c = f"{row.tokens_per_s / base_compiled:.2f}" if base_compiled and row.tokens_per_s else ""
                    rel_f = f"{row.tokens_per_s / base_flash:.2f}" if base_flash and row.tokens_per_s else ""
                    print(
                        f"| {n // 1024}k | {batch} | {variant} | {row.ms_per_step:.1f} | {row.tokens_per_s:.1f} | {rel_f} | "
                        f"{rel} | {rel_c} | "
                        f"{row.kv_gpu_gb:.2f} | {row.host_mb_per_token:.1f} | {row.fetched_fraction:.3f} | {row.note} |",
                        flush=True,
                    )
                    if args.json:  # after every row: a run cut short keeps what it measured
                        with open(args.json, "w") as f:
                            json.dump([asdict(r) for r in rows], f, indent=1)
                if args.rounds > 1:
                    print(pass_summary(n, batch, rnd, pass_rows), flush=True)
    for e in engines.values():
        e.close()
    for srv in {id(s): s for s in server.values()}.values():  # "store" and "split-store" are one
        srv.stop()
    if os.path.exists(f"/dev/shm/kvsparse-e2e-{os.getpid()}"):
        os.remove(f"/dev/shm/kvsparse-e2e-{os.getpid()}")


if __name__ == "__main__":
    main()
