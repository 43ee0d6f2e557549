#!/usr/bin/env python3
"""SALE prefill (kernels/cuda/sale.h) against dense causal attention, one prompt, one run.

Llama-3.1-8B's attention shape (32 query heads, 8 kv heads, d = 128), bf16, on the GPU. The
prompt is a synthetic family with the structure SALE exploits, stated here and in the JSON:
  - a direction u_j per kv head; every query of its group is 4 u_j + N(0, 0.3^2) noise;
  - attention sinks: keys 0-3 carry 42 u_j (a logit of about 15 at scale 1/sqrt(d));
  - a local band: dims 0-31 hold rotary pairs cos / sin(theta_m t), theta_m = 2^-(3 + m/2), with
    amplitude 2.5 in queries and keys (a logit of about 8.8 at distance 0, fading over hundreds
    of tokens);
  - scattered heavy blocks: 1% of the 32-token key blocks per kv head carry 20 u_j (logit ~7);
  - every other key N(0, 1): the diffuse mass, about 1% of the total at 64k tokens.
Per length: the dense baselines (torch SDPA with the cuDNN and flash backends, causal, GQA), our
computation pass with every block selected (the same work as dense: its efficiency), and SALE
(selection pass, then the computation pass over its mask) at each --tau, with the block sparsity
and the relative L2 error of the output against cuDNN's. CUDA events around each call on torch's
current stream; the medians of --iters timed calls after --warmup. The selection pass: the
median of 3 calls after one, per tau (docs/PERF.md "SALE prefill on the GPU" and the sections
after it have the runs).

Usage: python3 tests/bench/sale_bench.py --lib build/lib/libkvsparse_cuda_capi.so \
           [--lens 32768 65536] [--dense-only-lens 131072] [--tau 0.001 0.008] [--json out.json]
"""
import argparse
import ctypes
import json
import math
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

H, HKV, D = 32, 8, 128
G = H // HKV
DT = torch.bfloat16
DTYPE_BF16 = 2  # kvsparse::kernels::DType::kBf16
BQ, BK, SINK, LOCAL = 64, 32, 32, 256


def load(path):
    lib = ctypes.CDLL(path)
    lib.kvs_sale_select.restype = ctypes.c_int32
    lib.kvs_sale_select.argtypes = [ctypes.c_int32] * 5 + [ctypes.c_float] + [ctypes.c_void_p] * 3 + \
        [ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
         ctypes.c_void_p]
    lib.kvs_sale_attend.restype = ctypes.c_int32
    lib.kvs_sale_attend.argtypes = [ctypes.c_int32] * 5 + [ctypes.c_float] + [ctypes.c_void_p] * 6
    lib.kvs_error_string.restype = ctypes.c_char_p
    lib.kvs_error_string.argtypes = [ctypes.c_int32]
    return lib


def check(lib, rc, what):
    if rc != 0:
        raise RuntimeError(f"{what}: {lib.kvs_error_string(rc).decode()}")


def make_prompt(n, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    u = F.normalize(torch.randn(HKV, D, generator=g, device=dev), dim=-1)
    t = torch.arange(n, device=dev, dtype=torch.float32)
    theta = 2.0 ** -(3 + torch.arange(16, device=dev, dtype=torch.float32) / 2)
    ang = t[:, None] * theta[None, :]
    pos = torch.zeros(n, D, device=dev)
    pos[:, 0:32:2] = 2.5 * torch.cos(ang)
    pos[:, 1:32:2] = 2.5 * torch.sin(ang)
    q = 4.0 * u.repeat_interleave(G, 0)[:, None, :] + 0.3 * torch.randn(H, n, D, generator=g,
                                                                          device=dev)
    q += pos[None]
    k = torch.randn(HKV, n, D, generator=g, device=dev) + pos[None]
    k[:, :4] += 42.0 * u[:, None, :]
    blocks = (n + BK - 1) // BK
    heavy = torch.rand(HKV, blocks, generator=g, device=dev) < 0.01
    heavy_tok = heavy.repeat_interleave(BK, 1)[:, :n]
    k += 20.0 * heavy_tok[..., None] * u[:, None, :]
    v = torch.randn(HKV, n, D, generator=g, device=dev)
    return q.to(DT).contiguous(), k.to(DT).contiguous(), v.to(DT).contiguous()


def timed(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def sdpa(q, k, v, backend):
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                              enable_gqa=True)[0]


def rel_l2(a, b):
    return (torch.linalg.vector_norm((a.float() - b.float())) /
            torch.linalg.vector_norm(b.float())).item()


def run_length(lib, n, taus, dense_only, args):
    q, k, v = make_prompt(n, 1234 + n)
    scale = 1.0 / math.sqrt(D)
    stream = torch.cuda.current_stream().cuda_stream
    rows = []
    ref = sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION)
    for name, backend in [("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("sdpa-flash", SDPBackend.FLASH_ATTENTION)]:
        ms = timed(lambda: sdpa(q, k, v, backend), args.warmup, args.iters)
        rows.append({"n": n, "variant": name, "ms": ms,
                     "rel_l2_vs_cudnn": rel_l2(sdpa(q, k, v, backend), ref)})
    qb, kb = (n + BQ - 1) // BQ, (n + BK - 1) // BK
    out = torch.empty_like(q)
    causal = torch.zeros(H, qb, kb, dtype=torch.uint8, device="cuda")
    last = (torch.clamp((torch.arange(qb, device="cuda") + 1) * BQ, max=n) - 1) // BK
    causal[:, torch.arange(kb, device="cuda")[None, :] <= last[:, None]] = 1

    def attend(mask):
        check(lib, lib.kvs_sale_attend(n, H, HKV, D, DTYPE_BF16, scale, q.data_ptr(), k.data_ptr(),
                                       v.data_ptr(), out.data_ptr(), mask.data_ptr(), stream),
              "kvs_sale_attend")

    ms = timed(lambda: attend(causal), args.warmup, args.iters)
    rows.append({"n": n, "variant": "kvsparse-attend-all-blocks", "ms": ms,
                 "rel_l2_vs_cudnn": rel_l2(out, ref), "block_sparsity": 0.0})
    if dense_only:
        return rows
    ws_bytes = lib.kvs_sale_select(n, H, HKV, D, DTYPE_BF16, scale, q.data_ptr(), k.data_ptr(),
                                   None, SINK, LOCAL, None, None, 0, None)
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device="cuda")
    mask = torch.empty(H, qb, kb, dtype=torch.uint8, device="cuda")
    causal_blocks = causal.sum().item()
    for tau in taus:
        tau_t = torch.full((H,), tau, dtype=torch.float32, device="cuda")

        def select():
            check(lib, lib.kvs_sale_select(n, H, HKV, D, DTYPE_BF16, scale, q.data_ptr(),
                                           k.data_ptr(), tau_t.data_ptr(), SINK, LOCAL,
                                           mask.data_ptr(), ws.data_ptr(), ws_bytes, stream),
                  "kvs_sale_select")

        select_ms = timed(select, 1, 3)
        if args.profile:  # the selection pass's kernels, each timed by the profiler
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                select()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8), flush=True)
        attend_ms = timed(lambda: attend(mask), args.warmup, args.iters)
        sparsity = 1.0 - mask.sum().item() / causal_blocks
        rows.append({"n": n, "variant": f"sale tau={tau}", "tau": tau, "ms": select_ms + attend_ms,
                     "select_ms": select_ms, "attend_ms": attend_ms,
                     "block_sparsity": sparsity, "rel_l2_vs_cudnn": rel_l2(out, ref)})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lib", required=True)
    ap.add_argument("--lens", type=int, nargs="*", default=[32768, 65536])
    ap.add_argument("--dense-only-lens", type=int, nargs="*", default=[131072])
    ap.add_argument("--tau", type=float, nargs="*", default=[0.001, 0.008])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--profile", action="store_true",
                    help="print the selection pass's kernels as torch.profiler times them")
    ap.add_argument("--json")
    args = ap.parse_args()
    lib = load(args.lib)
    rows = []
    for n, dense_only in [(n, False) for n in args.lens] + [(n, True) for n in args.dense_only_lens]:
        for r in run_length(lib, n, args.tau, dense_only, args):
            rows.append(r)
            extra = "".join(f"  {key} {r[key]:.4g}" for key in
                            ("select_ms", "attend_ms", "block_sparsity") if key in r)
            print(f"n={n:>6}  {r['variant']:<28} {r['ms']:10.3f} ms  rel L2 "
                  f"{r['rel_l2_vs_cudnn']:.2e}{extra}", flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "shape": {"H": H, "Hkv": HKV, "d": D, "dtype": "bf16"},
            "blocks": {"block_q": BQ, "block_k": BK, "sink": SINK, "local": LOCAL},
            "command": " ".join(sys.argv)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
