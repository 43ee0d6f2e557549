#!/usr/bin/env python3
"""Decode-attention kernel benchmark (S2ANTA paper, Appendix R protocol), all backends in one run.

Llama-3.1-8B shapes (H=32, Hkv=8, d=128), bf16, i.i.d. N(0, 1) inputs drawn on the GPU; before
every timed iteration a 512 MB fp32 buffer is updated in place (cold L2, outside the timed
region); CUDA events on the current stream around one backend call; 10 warm-up and 40 timed
iterations; the median is reported. Backends, measured side by side in this process:
  - torch SDPA, cuDNN and flash backends (enable_gqa, [B, H, n, d] layout);
  - FlashInfer's batch decode kernel (CUDA-core and tensor-core variants), if importable;
  - the S2ANTA authors' reference kernels (OPUSLab/SANTA) if built (--santa-dir), at the same S;
  - kvsparse's kernels through the C ABI (kernels/cuda/capi.h) on torch's current stream.
Per row: median time, speedup over the fastest dense baseline (SDPA / FlashInfer), the bytes the
kernel must read, the floor those bytes imply at the bandwidth measured in this run (a large
device-to-device copy, read + write bytes over time), and the relative L2 error of the output
against an fp32 dense reference.

Usage: python3 tests/bench/kernel_bench.py --lib build-cuda/lib/libkvsparse_cuda_capi.so \
           [--santa-dir DIR] [--json out.json] [--batches 1 8] [--lens 8192 32768 131072]
"""
import argparse
import ctypes
import importlib.util
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

H, HKV, D = 32, 8, 128
G = H // HKV
WARMUP, ITERS = 10, 40
DT = torch.bfloat16


class KvsDecodeArgs(ctypes.Structure):
    _fields_ = [
        ("batch", ctypes.c_int32), ("num_q_heads", ctypes.c_int32),
        ("num_kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32),
        ("dtype", ctypes.c_int32), ("max_seq_len", ctypes.c_int32),
        ("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
        ("batch_stride", ctypes.c_int64), ("head_stride", ctypes.c_int64),
        ("token_stride", ctypes.c_int64), ("seq_lens", ctypes.c_void_p),
        ("scale", ctypes.c_float), ("out", ctypes.c_void_p),
    ]


METHODS = {"dense": 0, "iid": 1, "prop": 2, "flash": 3, "dense-2w": 5}


def load_ours(path):
    lib = ctypes.CDLL(path)
    lib.kvs_decode_workspace_bytes.restype = ctypes.c_size_t
    lib.kvs_decode_workspace_bytes.argtypes = [ctypes.POINTER(KvsDecodeArgs), ctypes.c_int32,
                                               ctypes.c_int32]
    lib.kvs_decode.restype = ctypes.c_int32
    lib.kvs_decode.argtypes = [ctypes.POINTER(KvsDecodeArgs), ctypes.c_int32, ctypes.c_int32,
                               ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t,
                               ctypes.c_void_p, ctypes.c_void_p]
    lib.kvs_hash_topk.restype = ctypes.c_int32
    lib.kvs_hash_topk.argtypes = [ctypes.c_int32] * 4 + [ctypes.c_void_p, ctypes.c_void_p,
                                                         ctypes.c_int64, ctypes.c_int64,
                                                         ctypes.c_void_p] + \
        [ctypes.c_int32] * 4 + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.c_size_t, ctypes.c_void_p]
    lib.kvs_error_string.restype = ctypes.c_char_p
    lib.kvs_error_string.argtypes = [ctypes.c_int32]
    return lib


def check(lib, err, what):
    if err != 0:
        raise RuntimeError(f"{what}: CUDA error {err} {lib.kvs_error_string(err).decode()}")


THRASH = None


ONCE = False  # --once: a single untimed call per backend (for ncu)


def bench(fn):
    """Appendix R: 10 warm-up, 40 timed, cache thrash outside the timed region, median (us)."""
    if ONCE:
        THRASH.add_(1.0)
        fn()
        torch.cuda.synchronize()
        return float("nan"), []
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(ITERS):
        THRASH.add_(1.0)
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return statistics.median(times), times


def copy_bandwidth():
    """Device-to-device copy of 2 GiB: (bytes read + bytes written) / median time, in B/s."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    b = torch.empty_like(a)
    med, _ = bench(lambda: b.copy_(a))
    del a, b
    return 2 * n / (med * 1e-6)


def rel_l2(out, ref):
    out = out.float()
    if not torch.isfinite(out).all():
        return float("nan")
    return ((out - ref).norm() / ref.norm()).item()


def dense_ref(q, k, v, scale):
    """fp32 reference, [B, H, d], from NHD caches [B, n, Hkv, d]."""
    outs = []
    for b in range(q.shape[0]):
        qb = q[b].float().view(HKV, G, D)
        kb = k[b].float()
        s = torch.einsum("kgd,nkd->kgn", qb, kb) * scale
        p = torch.softmax(s, dim=-1)
        del s, kb
        ob = torch.einsum("kgn,nkd->kgd", p, v[b].float())
        outs.append(ob.reshape(H, D))
        del p
    return torch.stack(outs)


def try_import_flashinfer():
    """Imports FlashInfer; optional dependencies its package imports eagerly but the decode path
    never uses (e.g. CuTe DSL, cuda-tile, NCCL bindings) are replaced by empty stub modules when
    they are missing from the image, and the stubs are reported."""
    import types
    stubs = []
    for _ in range(40):
        try:
            import flashinfer  # noqa: F401
            if stubs:
                print(f"# flashinfer imported with stub modules: {', '.join(stubs)}", flush=True)
            return flashinfer, None
        except ModuleNotFoundError as ex:
            missing = ex.name or ""
            if not missing or missing.startswith("flashinfer") or missing in stubs:
                return None, f"ModuleNotFoundError: {ex}"
            parts = missing.split(".")
            for i in range(1, len(parts) + 1):
                name = ".".join(parts[:i])
                if name not in sys.modules:
                    mod = types.ModuleType(name)
                    mod.__path__ = []
                    mod.__getattr__ = lambda attr, _n=name: types.ModuleType(f"{_n}.{attr}")
                    sys.modules[name] = mod
            stubs.append(missing)
            for k in [k for k in sys.modules if k.startswith("flashinfer")]:
                del sys.modules[k]
        except Exception as ex:  # report and go on without it
            return None, f"{type(ex).__name__}: {str(ex)[:300]}"
    return None, "too many missing modules"


def load_santa(santa_dir, which):
    if not santa_dir:
        return None
    name = f"santa_ref_{which}"
    path = os.path.join(santa_dir, which, f"{name}.so")
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def dense_baselines(q, ks, vs, k, v, B, n, kv_bytes, fi):
    """SDPA's cuDNN and flash backends and FlashInfer's decode (when importable): the dense
    baselines, as (name, S, fn, out_fn, bytes, is_dense) entries."""
    cfg = []
    # ---- torch SDPA (on ks, vs: its preferred [B, Hkv, n, d] contiguous layout, same values)
    qs = q.view(B, H, 1, D)
    from torch.nn.attention import sdpa_kernel, SDPBackend
    for bname, be in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                      ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
        def fn(be=be):
            with sdpa_kernel(be):
                return F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)
        cfg.append((bname, 0, fn, lambda o: o.view(B, H, D), kv_bytes, True))

    # ---- FlashInfer batch decode: the NHD caches viewed as pages of 16 tokens
    if fi is not None:
        ps = 16
        kp = k.view(B * n // ps, ps, HKV, D)
        vp = v.view(B * n // ps, ps, HKV, D)
        for tc in (False, True):
            try:
                wsb = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
                w = fi.BatchDecodeWithPagedKVCacheWrapper(wsb, "NHD", use_tensor_cores=tc)
                indptr = torch.arange(B + 1, dtype=torch.int32, device="cuda") * (n // ps)
                indices = torch.arange(B * n // ps, dtype=torch.int32, device="cuda")
                last = torch.full((B,), ps, dtype=torch.int32, device="cuda")
                w.plan(indptr, indices, last, H, HKV, D, ps, q_data_type=DT,
                       kv_data_type=DT)
                def fn(w=w, kp=kp, vp=vp):
                    return w.run(q, (kp, vp))
                fn()
                torch.cuda.synchronize()
                cfg.append(("flashinfer" + ("-tc" if tc else ""), 0, fn, lambda o: o,
                            kv_bytes, True))
            except Exception as ex:
                print(f"# flashinfer{'-tc' if tc else ''} failed: {type(ex).__name__}: "
                      f"{str(ex)[:300]}", flush=True)
    return cfg


def our_kernels(lib, q, k, v, ks, vs, lens, B, n, scale, kv_bytes, stream):
    """kvsparse's kernels through the C API (kvs_decode) on both layouts; the output tensor they
    write is the second value."""
    cfg = []
    k_bytes = kv_bytes // 2
    row_bytes = D * 2
    # ---- ours: on the [B, Hkv, n, d] tensors SDPA gets (the fastest baseline's layout)
    # and on the sequence-major [B, n, Hkv, d] ones (the paper's and FlashInfer's).
    out = torch.empty(B, H, D, device="cuda", dtype=DT)
    args_hnd = KvsDecodeArgs(B, H, HKV, D, 2, n, q.data_ptr(), ks.data_ptr(),
                             vs.data_ptr(), HKV * n * D, n * D, D, lens.data_ptr(), scale,
                             out.data_ptr())
    args_nhd = KvsDecodeArgs(B, H, HKV, D, 2, n, q.data_ptr(), k.data_ptr(),
                             v.data_ptr(), n * HKV * D, D, HKV * D, lens.data_ptr(), scale,
                             out.data_ptr())
    rows_read = torch.zeros(B, HKV, dtype=torch.int32, device="cuda")
    for name, S, a, suffix in (("dense", 0, args_hnd, ""), ("dense", 0, args_nhd, "-nhd"),
                               ("dense-2w", 0, args_hnd, ""),
                               ("prop", 128, args_hnd, ""),
                               ("prop", 128, args_nhd, "-nhd"),
                               ("flash", 2048, args_hnd, ""),
                               ("flash", 2048, args_nhd, "-nhd"),
                               ("iid", 128, args_hnd, "")):
        m = METHODS[name]
        ws = torch.empty(max(1, lib.kvs_decode_workspace_bytes(ctypes.byref(a), m, S)),
                         dtype=torch.uint8, device="cuda")
        def fn(m=m, S=S, ws=ws, a=a, name=name):
            check(lib, lib.kvs_decode(ctypes.byref(a), m, S, 1234, ctypes.c_void_p(
                ws.data_ptr()), ws.numel(), None, stream()), name)
            return out
        if m in (0, 5):
            nbytes = kv_bytes
        else:
            rows_read.zero_()
            check(lib, lib.kvs_decode(ctypes.byref(a), m, S, 1234, ctypes.c_void_p(
                ws.data_ptr()), ws.numel(), ctypes.c_void_p(rows_read.data_ptr()),
                stream()), name)
            torch.cuda.synchronize()
            if m == 1:  # iid reads S rows per query head (with repeats)
                v_rows = B * H * S
            else:
                v_rows = int(rows_read.sum().item())
            tiles = (n + 255) // 256
            if m == 1:  # iid: fp32 u stash written and read back
                side = 8 * B * H * n
            elif m == 2:  # prop: 32-byte sample records + tile max/sum, written
                side = (32 + 8) * B * H * tiles
            else:
                side = 0
            nbytes = k_bytes + v_rows * row_bytes + side
        cfg.append((f"ours-{name}{suffix}", S, fn, lambda o: o.clone(), nbytes, m in (0, 5)))
    return cfg, out


def reference_kernels(santa, q, k, v, B):
    """The S2ANTA authors' kernels (same S, same tensors), where built."""
    cfg = []
    if santa["prop"] is not None:
        mod = santa["prop"]
        def fn(mod=mod):  # batch 1 only: one call per sequence
            return torch.stack([mod.decode_systematic_scalar(q[b], k[b], v[b], 128, 1234,
                                                             0, False)[0]
                                for b in range(B)])
        cfg.append(("ref-prop", 128, fn, lambda o: o, None, False))
    if santa["flash"] is not None:
        mod = santa["flash"]
        def fn(mod=mod):
            return mod.decode_systematic_batched(q, k, v, 2048, 1234, 0, False, -1)[0]
        cfg.append(("ref-flash", 2048, fn, lambda o: o, None, False))
    return cfg


def measure(cfg, ref, B, n, bw):
    """Each entry's output error against dense and its median time; speedups against the fastest
    dense baseline that is not ours, and the memory floor of its bytes."""
    rows = []
    results = []
    for name, S, fn, out_fn, nbytes, is_dense in cfg:
        try:
            o = out_fn(fn())
            torch.cuda.synchronize()
            err = rel_l2(o, ref)
            med, _ = bench(fn)
        except Exception as ex:
            print(f"# {name} B={B} n={n} failed: {type(ex).__name__}: {str(ex)[:300]}",
                  flush=True)
            continue
        results.append(dict(kernel=name, B=B, n=n, S=S, us=med, bytes=nbytes, err=err,
                            dense=is_dense))
    base = [r["us"] for r in results if r["dense"] and not r["kernel"].startswith("ours")]
    best = min(base) if base else float("nan")
    for r in results:
        r["speedup"] = best / r["us"]
        r["floor_us"] = (r["bytes"] / bw * 1e6) if r["bytes"] else float("nan")
        rows.append(r)
        print(f"{r['kernel']:14s} B={B} n={n:6d} S={r['S']:5d} {r['us']:9.1f} us  "
              f"x{r['speedup']:5.2f} vs best dense  "
              f"bytes {((r['bytes'] or 0) / 1e6):9.1f} MB  floor {r['floor_us']:8.1f} us  "
              f"relL2 {r['err']:.4f}", flush=True)
    return rows


def bench_hash_topk(lib, B, n, lens, bw, stream):
    """HashAttention top-k over n tokens x H heads (32-bit signatures), its selection checked
    against torch.topk for one head; one row."""
    qsig = torch.randint(-2**31, 2**31 - 1, (B, H), dtype=torch.int32, device="cuda")
    ksig = torch.randint(-2**31, 2**31 - 1, (B, HKV, n), dtype=torch.int32,
                         device="cuda")
    topk, sink, win = 2048, 128, 128
    maxo = sink + win + topk
    idx = torch.empty(B, H, maxo, dtype=torch.int32, device="cuda")
    cnt = torch.empty(B, H, dtype=torch.int32, device="cuda")
    targs = (B, H, HKV, 32, qsig.data_ptr(), ksig.data_ptr(), HKV * n, n,
             lens.data_ptr(), n, sink, win, topk, idx.data_ptr(), cnt.data_ptr())
    need = lib.kvs_hash_topk(*targs, None, 0, stream())
    hws = torch.empty(max(need, 1), dtype=torch.uint8, device="cuda")
    def fn():
        check(lib, lib.kvs_hash_topk(*targs, ctypes.c_void_p(hws.data_ptr()),
                                     hws.numel(), stream()), "hash_topk")
    fn()
    torch.cuda.synchronize()
    # Check the selection against torch: the top-k of the rest by similarity
    # (ties to the lower token) plus sink and window, for head 0 of sequence 0.
    sim = 32 - 2 * torch.bitwise_count(ksig[0, 0] ^ qsig[0, 0]).to(torch.int64) \
        if hasattr(torch, "bitwise_count") else None
    if sim is not None:
        rest = sim[sink:n - win]
        key = rest * (1 << 20) - torch.arange(rest.numel(), device="cuda")
        top = torch.topk(key, topk).indices + sink
        want = torch.cat([torch.arange(sink, device="cuda"), top.sort().values,
                          torch.arange(n - win, n, device="cuda")])
        got = idx[0, 0, :cnt[0, 0]].to(torch.int64)
        ok = got.numel() == want.numel() and bool((got == want).all())
        print(f"# hash top-k selection matches torch.topk: {ok}", flush=True)
    med, _ = bench(fn)
    hb = B * HKV * n * 4
    r = dict(kernel="ours-hash-topk", B=B, n=n, S=topk, us=med, bytes=hb,
             err=float("nan"), dense=False, speedup=float("nan"),
             floor_us=hb / bw * 1e6)
    print(f"{r['kernel']:14s} B={B} n={n:6d} k={topk:5d} {med:9.1f} us  "
          f"signature bytes {hb / 1e6:.1f} MB  floor {r['floor_us']:.1f} us",
          flush=True)
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--santa-dir", default="")
    ap.add_argument("--json", default="")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--lens", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--once", action="store_true", help="one call per backend, no timing (ncu)")
    args = ap.parse_args()

    global THRASH, ONCE
    ONCE = args.once
    torch.manual_seed(0)
    dev = torch.cuda.get_device_properties(0)
    print(f"# device {dev.name}, {dev.multi_processor_count} SMs, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}", flush=True)
    THRASH = torch.empty(128 << 20, dtype=torch.float32, device="cuda")  # 512 MB
    bw = copy_bandwidth()
    print(f"# device-to-device copy bandwidth (read + write): {bw / 1e12:.2f} TB/s", flush=True)

    lib = load_ours(args.lib)
    stream = lambda: ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)  # noqa: E731
    fi, fi_err = (None, "disabled") if args.no_flashinfer else try_import_flashinfer()
    if fi is None:
        print(f"# flashinfer unavailable: {fi_err}", flush=True)
    else:
        print(f"# flashinfer {getattr(fi, '__version__', '?')}", flush=True)
    santa = {w: load_santa(args.santa_dir, w) for w in ("prop", "flash")}
    print(f"# S2ANTA reference kernels: prop {'yes' if santa['prop'] else 'no'}, "
          f"flash {'yes' if santa['flash'] else 'no'}", flush=True)

    rows = []
    scale = 1.0 / math.sqrt(D)
    for B in args.batches:
        for n in args.lens:
            torch.manual_seed(1000 * B + n)
            q = torch.randn(B, H, D, device="cuda", dtype=DT)
            k = torch.randn(B, n, HKV, D, device="cuda", dtype=DT)  # NHD, the paper's layout
            v = torch.randn(B, n, HKV, D, device="cuda", dtype=DT)
            lens = torch.full((B,), n, dtype=torch.int32, device="cuda")
            ref = dense_ref(q, k, v, scale)
            kv_bytes = 2 * k.numel() * k.element_size()
            ks = k.transpose(1, 2).contiguous()  # SDPA's preferred [B, Hkv, n, d], same values
            vs = v.transpose(1, 2).contiguous()
            cfg = dense_baselines(q, ks, vs, k, v, B, n, kv_bytes, fi)  # (name, S, fn, out_fn, bytes, is_dense)
            ours_cfg, out = our_kernels(lib, q, k, v, ks, vs, lens, B, n, scale, kv_bytes, stream)
            cfg += ours_cfg + reference_kernels(santa, q, k, v, B)
            rows += measure(cfg, ref, B, n, bw)
            # HashAttention top-k at the longest context
            if n >= 131072 or n == max(args.lens):
                rows.append(bench_hash_topk(lib, B, n, lens, bw, stream))
            del q, k, v, ks, vs, ref, out
            torch.cuda.empty_cache()

    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=dev.name, bw=bw, torch=torch.__version__, rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
