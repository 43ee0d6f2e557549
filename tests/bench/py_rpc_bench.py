"""The Python client's Decode call against a raw gRPC echo of the same bytes, over loopback.

What a model server in Python pays per Decode call beyond the engine, next to what gRPC alone
costs to move the same request and response bytes:

  decode        the kvsparse.AttentionClient.decode call (q as a torch tensor on the model's
                device, or numpy without one: conversion to bytes, protobuf, the RPC, the output
                back as a tensor), unary; ``stream``: the same over one DecodeStream
  engine        the engine's own time for the call (reported in every response)
  server        the server's time, handler entry to response ready (server - engine: what the
                service adds)
  echo          a bare gRPC bytes echo (C++ Echo service in the same server process) whose request
                and response have the Decode call's serialized sizes, called from Python with raw
                bytes (no protobuf, no tensors)
  excess        decode - engine - echo (p50 of each): what the Decode call costs beyond the engine
                and beyond moving its bytes (the client's tensor conversions and protobuf, the
                service's validation and conversion); the target is excess <= echo

The server and the echo run in ``rpc_decode_bench --serve_echo`` (the real kvsparse server, store
and worker in one process, CPU engine or --gpu); Llama-3.1-8B head shapes (H = 32, Hkv = 8,
d = 128, bf16), one layer, ``--tokens`` per sequence.

    python3 tests/bench/py_rpc_bench.py --bench build/bin/rpc_decode_bench --tokens 32768 --batch 1,8
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import grpc
import ml_dtypes
import numpy as np

import kvsparse
from kvsparse import client as kc

H, HKV, D = 32, 8, 128


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[int(p * (len(s) - 1))]


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def echo_request(request_bytes: int, response_bytes: int) -> bytes:
    """A serialized kvsparse.bench.EchoRequest {response_bytes, payload} of request_bytes."""
    head = b"\x08" + varint(response_bytes) + b"\x12"
    n = max(0, request_bytes - len(head) - len(varint(request_bytes)))
    return head + varint(n) + b"x" * n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench", default="build/bin/rpc_decode_bench", help="rpc_decode_bench binary")
    p.add_argument("--gpu", action="store_true", help="the server decodes on its GPU backend")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--batch", default="1,8")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--methods", default="dense,hash")
    args = p.parse_args()

    try:
        import torch

        device = "cuda" if torch.cuda.is_available() else None
    except ImportError:
        torch, device = None, None
    cmd = [args.bench, "--serve_echo"] + (["--gpu"] if args.gpu else [])
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = ""
    while proc.stdout and not line.startswith("serving"):
        line = proc.stdout.readline()
        if not line:
            break
    if not line.startswith("serving"):
        sys.exit(f"{args.bench} did not start: {line!r}")
    ports = dict(kv.split("=") for kv in line.split()[1:])
    print(f"# {line.strip()}; q as {'torch on ' + device if device else 'numpy'}; {args.tokens} tokens")
    methods = {
        "dense": (kvsparse.Dense(), kvsparse.Placement()),
        "hash": (
            kvsparse.HashTopK(top_k_fraction=0.0125, sink_tokens=128, local_tokens=128),
            kvsparse.Placement(signature_bits=32),
        ),
    }
    rng = np.random.default_rng(0)
    echo_ch = grpc.insecure_channel(ports["echo"], options=[("grpc.max_receive_message_length", -1)])
    echo = echo_ch.unary_unary("/kvsparse.bench.Echo/Echo")
    print("| method | B | call | decode p50 ms | p99 | engine p50 | server - engine p50 | echo p50 | excess p50 | excess / echo |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    with kvsparse.Client(ports["kvsparse"], timeout=120) as c:
        shape = kvsparse.ModelShape(num_layers=1, num_q_heads=H, num_kv_heads=HKV, head_dim=D, dtype="bf16")
        for name in args.methods.split(","):
            method, placement = methods[name]
            for B in (int(b) for b in args.batch.split(",")):
                ids = [f"{name}-{B}-{b}" for b in range(B)]
                for sid in ids:
                    c.store.create_sequence(sid, shape, placement)
                    for t0 in range(0, args.tokens, 4096):
                        n = min(4096, args.tokens - t0)
                        k = rng.standard_normal((1, n, HKV, D), dtype=np.float32).astype(ml_dtypes.bfloat16)
                        v = rng.standard_normal((1, n, HKV, D), dtype=np.float32).astype(ml_dtypes.bfloat16)
                        c.store.append(sid, k, v)
                qn = rng.standard_normal((B, H, D), dtype=np.float32).astype(ml_dtypes.bfloat16)
                q = torch.from_numpy(qn.view(np.int16)).view(torch.bfloat16).to(device) if device else qn
                req = kc._decode_request(0, ids, q, method, None, None, 1, 0.0, False)
                resp = c.attention._stub.Decode(req, timeout=120)
                ereq = echo_request(req.ByteSize(), resp.ByteSize())
                for mode in ("unary", "stream"):
                    dec, eng, srv, ech = [], [], [], []
                    stream = c.attention.stream() if mode == "stream" else None
                    call = stream.decode if stream else c.attention.decode
                    for i in range(args.calls + 10):
                        t0 = time.perf_counter()
                        r = call(0, ids, q, method, seed=i)
                        if device:
                            r.output.sum().item()  # the output is on the device (a sync)
                        t1 = time.perf_counter()
                        echo(ereq, timeout=120)
                        t2 = time.perf_counter()
                        if i >= 10:
                            dec.append((t1 - t0) * 1e3)
                            ech.append((t2 - t1) * 1e3)
                            eng.append(r.timing.engine_seconds * 1e3)
                            srv.append((r.timing.server_seconds - r.timing.engine_seconds) * 1e3)
                    if stream:
                        stream.close()
                    excess = statistics.median(dec) - statistics.median(eng) - statistics.median(ech)
                    print(
                        f"| {name} | {B} | {mode} | {statistics.median(dec):.3f} | {pct(dec, 0.99):.3f} | "
                        f"{statistics.median(eng):.3f} | {statistics.median(srv):.3f} | {statistics.median(ech):.3f} | "
                        f"{excess:.3f} | {excess / statistics.median(ech):.2f} |",
                        flush=True,
                    )
                for sid in ids:
                    c.store.drop_sequence(sid)
    echo_ch.close()
    if proc.stdin:
        proc.stdin.close()
    proc.wait(timeout=30)


if __name__ == "__main__":
    main()
