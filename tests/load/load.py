"""Load and soak test of a running kvsparse-server: many concurrent clients appending, gathering and
decoding, every returned row checked against what was appended and every decode against a
reference, with throughput, latency percentiles and the server's memory over time.

    python3 tests/load/load.py --clients 32 --seconds 1800 --out soak.json       # the soak
    python3 tests/load/load.py --clients 8 --seconds 30                           # CI (pytest)
    python3 tests/load/load.py --target 10.0.0.5:50051 --clients 16 --seconds 60  # a server elsewhere
    python3 tests/load/load.py --clients 32 --seconds 60 --rate 150               # paced: 150 steps/s

Without --target it starts kvsparse-server on a free loopback port (--server_flags adds flags) and
reads its memory from /proc. Each client owns its sequences (fp32, so rows compare bit for bit):
rows are a pure function of (sequence, layer, token, kv head), so any row read back can be checked
against the value it must have; a decode (dense) is compared with numpy attention over the rows the
client appended. A client drops a sequence and starts another once it reaches --max_tokens.
Errors are counted by code; a wrong row or output is a corruption. Exit status 1 if any row or
output was wrong or any call failed with a code other than RESOURCE_EXHAUSTED or
DEADLINE_EXCEEDED (capacity and load are the server's to refuse).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import kvsparse

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM = 2, 8, 2, 64
SHAPE = kvsparse.ModelShape(LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, "fp32")


def rows(seq: int, layer: int, t0: int, n: int) -> np.ndarray:
    """The K rows [n, Hkv, d] of tokens t0..t0+n-1 (V: the same of seq + 1_000_000): a hash of
    (seq, layer, token, head, coordinate) mapped to [-1, 1), exactly representable in fp32."""
    with np.errstate(over="ignore"):  # the hash wraps modulo 2^64 on purpose
        return _rows(seq, layer, t0, n)


def _rows(seq: int, layer: int, t0: int, n: int) -> np.ndarray:
    t = np.arange(t0, t0 + n, dtype=np.uint64)[:, None, None]
    h = np.arange(KV_HEADS, dtype=np.uint64)[None, :, None]
    c = np.arange(HEAD_DIM, dtype=np.uint64)[None, None, :]
    x = (np.uint64(seq) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(layer) * np.uint64(0xBF58476D1CE4E5B9)
         + t * np.uint64(0x94D049BB133111EB) + h * np.uint64(0x2545F4914F6CDD1D) + c)
    x ^= x >> np.uint64(31)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(29)
    return ((x >> np.uint64(40)).astype(np.float32) / np.float32(1 << 23) - np.float32(1.0)).astype(np.float32)


def dense(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """q [H, d], k/v [n, Hkv, d] -> [H, d], float64 reference."""
    g = Q_HEADS // KV_HEADS
    out = np.zeros((Q_HEADS, HEAD_DIM))
    for h in range(Q_HEADS):
        s = k[:, h // g].astype(np.float64) @ q[h].astype(np.float64) / np.sqrt(HEAD_DIM)
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ v[:, h // g].astype(np.float64)
    return out


@dataclass
class Stats:
    latency: dict[str, list[float]] = field(default_factory=lambda: {"append": [], "gather": [], "decode": []})
    rows_checked: int = 0
    rows_wrong: int = 0
    outputs_checked: int = 0
    outputs_wrong: int = 0
    errors: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, op: str, seconds: float) -> None:
        with self.lock:
            self.latency[op].append(seconds)


def client_loop(cid: int, target: str, stop: float, args: argparse.Namespace, stats: Stats) -> None:
    rng = random.Random(cid)
    seq_counter = 0
    # --rate: each client starts a step every clients / rate seconds (open loop, staggered), so the
    # server sees `rate` steps a second whatever its latency; 0: the next step as soon as one ends.
    interval = args.clients / args.rate if args.rate > 0 else 0.0
    next_step = time.monotonic() + interval * cid / max(1, args.clients)
    with kvsparse.Client(target, timeout=args.timeout) as c:
        while time.monotonic() < stop:
            seq = cid * 1_000_000 + seq_counter
            seq_counter += 1
            sid = f"load-{cid}-{seq_counter}"
            try:
                c.store.create_sequence(sid, SHAPE)
            except kvsparse.KvSparseError as e:
                stats.errors[f"create {e.code.name}"] += 1
                time.sleep(0.05)
                continue
            n = 0
            try:
                while n < args.max_tokens and time.monotonic() < stop:
                    if interval > 0:
                        time.sleep(max(0.0, next_step - time.monotonic()))
                        next_step += interval
                    step = rng.randint(1, args.append_tokens)
                    k = np.stack([rows(seq, l, n, step) for l in range(LAYERS)])
                    v = np.stack([rows(seq + 1_000_000, l, n, step) for l in range(LAYERS)])
                    t0 = time.perf_counter()
                    c.store.append(sid, k, v, expected_length=n)
                    stats.add("append", time.perf_counter() - t0)
                    n += step
                    layer = rng.randrange(LAYERS)
                    toks = [rng.randrange(n) for _ in range(rng.randint(1, 64))]
                    t0 = time.perf_counter()
                    g = c.store.gather(sid, layer, toks, kv_heads=range(KV_HEADS))
                    stats.add("gather", time.perf_counter() - t0)
                    want_k = np.stack([rows(seq, layer, t, 1)[0] for t in toks])  # [m, Hkv, d]
                    want_v = np.stack([rows(seq + 1_000_000, layer, t, 1)[0] for t in toks])
                    got_k = np.asarray(g.k).reshape(KV_HEADS, len(toks), HEAD_DIM).transpose(1, 0, 2)
                    got_v = np.asarray(g.v).reshape(KV_HEADS, len(toks), HEAD_DIM).transpose(1, 0, 2)
                    wrong = int((got_k != want_k).any(axis=(1, 2)).sum() + (got_v != want_v).any(axis=(1, 2)).sum())
                    with stats.lock:
                        stats.rows_checked += 2 * len(toks) * KV_HEADS
                        stats.rows_wrong += wrong
                    if rng.random() < args.decode_share:
                        q = np.asarray(rng.random() * 2 - 1, np.float32) * rows(seq + 7, layer, n, 1)[0].repeat(
                            Q_HEADS // KV_HEADS, axis=0)
                        t0 = time.perf_counter()
                        r = c.attention.decode(layer, [sid], q[None])
                        stats.add("decode", time.perf_counter() - t0)
                        ref = dense(q, np.concatenate([rows(seq, layer, 0, n)]),
                                    np.concatenate([rows(seq + 1_000_000, layer, 0, n)]))
                        err = np.abs(np.asarray(r.output)[0] - ref).max()
                        with stats.lock:
                            stats.outputs_checked += 1
                            stats.outputs_wrong += int(err > 1e-4)
            except kvsparse.KvSparseError as e:
                stats.errors[f"{type(e).__name__} {e.code.name}"] += 1
            finally:
                try:
                    c.store.drop_sequence(sid)
                except kvsparse.KvSparseError:
                    pass


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def pct(x: list[float], p: float) -> float:
    return float(np.percentile(np.array(x) * 1e3, p)) if x else 0.0


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) buckets: linear
    within the bucket the rank falls in."""
    buckets = sorted(buckets)
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = upper, count
    return lower


def server_latency_ms(url: str) -> dict[str, dict[str, float | None]]:
    """p50 / p99 of the server's own time per call by RPC method, from its /metrics."""
    per: dict[str, list[tuple[float, float]]] = {}
    try:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    except OSError:
        return {}
    for m in re.finditer(r"^kvsparse_rpc_duration_seconds_bucket\{([^}]*)\} (\S+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        le = float("inf") if labels["le"] == "+Inf" else float(labels["le"])
        per.setdefault(labels["method"], []).append((le, float(m.group(2))))
    out = {}
    for method, buckets in per.items():
        p50, p99 = histogram_quantile(0.5, buckets), histogram_quantile(0.99, buckets)
        if p99 is not None:
            out[method] = {"p50": round(1000 * p50, 3) if p50 is not None else None, "p99": round(1000 * p99, 3)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="", help="a running server (default: start one here)")
    p.add_argument("--server_flags", default="capacity=1G,capacity_policy=reject,gpu=off",
                   help="flags of the server started here, name=value,...")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--max_tokens", type=int, default=2048, help="tokens per sequence before it is dropped")
    p.add_argument("--append_tokens", type=int, default=64, help="most tokens per append")
    p.add_argument("--decode_share", type=float, default=0.25, help="share of steps that also decode")
    p.add_argument("--rate", type=float, default=0.0,
                   help="steps per second over all clients (a step: an append, a gather and, for "
                        "--decode_share of them, a decode); 0: each client as fast as it can")
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--report_every", type=float, default=10.0, help="progress and memory, seconds")
    p.add_argument("--out", default="", help="write the summary as JSON here")
    p.add_argument("--metrics", default="",
                   help="the server's /metrics URL (with --target), for its own time per call; a "
                        "server started here is read on its own")
    args = p.parse_args(argv)

    server = None
    target = args.target
    metrics_url = args.metrics
    if not target:
        flags = dict(kv.split("=", 1) for kv in args.server_flags.split(",") if kv)
        flags.setdefault("metrics_listen", "127.0.0.1:0")  # the server's own time per call
        server = kvsparse.LocalServer(**flags).start()
        target = server.target
        metrics_url = metrics_url or server.metrics_url
    stats = Stats()
    start = time.monotonic()
    stop = start + args.seconds
    threads = [threading.Thread(target=client_loop, args=(i, target, stop, args, stats), daemon=True)
               for i in range(args.clients)]
    for t in threads:
        t.start()
    memory = []
    try:
        while any(t.is_alive() for t in threads):
            time.sleep(min(args.report_every, max(0.1, stop - time.monotonic() + 0.5)))
            el = time.monotonic() - start
            if server is not None and server.process is not None:
                memory.append((round(el, 1), round(rss_mb(server.process.pid), 1)))
            ops = sum(len(v) for v in stats.latency.values())
            print(f"[{el:6.1f} s] {ops} calls, {stats.rows_checked} rows checked, {stats.rows_wrong} wrong, "
                  f"{stats.outputs_checked} decodes checked, errors {dict(stats.errors)}"
                  + (f", server RSS {memory[-1][1]} MB" if memory else ""), flush=True)
        for t in threads:
            t.join()
    finally:
        # The server's own time per call (handler entry to status: kvsparse_rpc_duration_seconds),
        # read before it stops: what the clients saw beyond it is theirs (their threads, the
        # interpreter lock, the cores they share with the server).
        server_ms = server_latency_ms(metrics_url) if metrics_url else {}
        code = server.stop() if server is not None else None
    elapsed = time.monotonic() - start
    summary = {
        "clients": args.clients,
        "seconds": round(elapsed, 1),
        "calls_per_second": {op: round(len(v) / elapsed, 1) for op, v in stats.latency.items()},
        "latency_ms": {op: {"p50": pct(v, 50), "p99": pct(v, 99), "p999": pct(v, 99.9)}
                       for op, v in stats.latency.items()},
        "server_latency_ms": server_ms,
        "rows_checked": stats.rows_checked,
        "rows_wrong": stats.rows_wrong,
        "outputs_checked": stats.outputs_checked,
        "outputs_wrong": stats.outputs_wrong,
        "errors": dict(stats.errors),
        "server_rss_mb": memory,
        "server_exit_code": code,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "server_rss_mb"}, indent=1), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    bad_errors = {k: n for k, n in stats.errors.items()
                  if not k.endswith(("RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"))}
    ok = stats.rows_wrong == 0 and stats.outputs_wrong == 0 and not bad_errors and stats.rows_checked > 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
