#!/usr/bin/env python3
"""Placement and load of sequences over many store hosts (docs/SCALE.md).

A fleet of --hosts store hosts holds the KV caches of --sequences sequences of an 8B-shaped model
(128 KiB of K and V per token: 32 layers x 8 kv heads x 128 x 2 bytes x 2); context lengths are
lognormal (median 16k tokens, clipped to 1k..128k). Each decode step of a sequence reads
--row_fraction of its rows (the selection's budget) from the host holding it; requests pick
sequences by a Zipf law (--zipf: a few hot sequences are decoded by many requests at once).

Placement policies, all computable by any worker from the sequence id and the host list alone
(no directory service):
  rendezvous   highest-random-weight hashing: a sequence lives on the host with the largest
               hash(sequence, host); with replicas R, on the R largest
  two_choices  rendezvous' top 2, the one with fewer bytes at placement time (bounded load; a
               reader must then try both, or the model server remembers which)
  ring         consistent hashing, --vnodes virtual nodes per host
  modulo       hash(sequence) mod hosts (the naive baseline)

Reported per policy: bytes per host (max / mean), the fraction of sequences (and bytes) that move
when one host joins and when one leaves, decode traffic per host with hot sequences (max / mean,
with and without replicas serving reads), and with R replicas the sequences lost when one host and
when two hosts fail.

  python3 tests/scale/placement_sim.py                      # 100 hosts, 200k sequences
  python3 tests/scale/placement_sim.py --hosts 1000 --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2  # layers x kv heads x head dim x bf16 x (K, V)
MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a well-mixed 64-bit hash of 64-bit integers (vectorised)."""
    x = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return x


def pair_hash(seq: np.ndarray, host: np.ndarray) -> np.ndarray:
    """hash(sequence, host) for every pair: [len(seq), len(host)]."""
    with np.errstate(over="ignore"):
        s = mix64(seq.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15))
        h = mix64(host.astype(np.uint64) * np.uint64(0xD6E8FEB86659FD93) + np.uint64(1))
    return mix64(s[:, None] ^ h[None, :])


def rendezvous(seq: np.ndarray, hosts: np.ndarray, replicas: int = 1) -> np.ndarray:
    """[len(seq), replicas] host ids, best first (chunked: [seq, hosts] would not fit at scale)."""
    out = np.empty((len(seq), replicas), dtype=np.int64)
    step = max(1, 4_000_000 // max(1, len(hosts)))
    for a in range(0, len(seq), step):
        scores = pair_hash(seq[a:a + step], hosts)
        if replicas == 1:
            top = np.argmax(scores, axis=1)[:, None]
        else:
            top = np.argsort(scores, axis=1)[:, ::-1][:, :replicas]
        out[a:a + step] = hosts[top]
    return out


def two_choices(seq: np.ndarray, hosts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Rendezvous' top two hosts, the one holding fewer bytes when the sequence arrives."""
    top2 = rendezvous(seq, hosts, 2)
    load = dict.fromkeys(hosts.tolist(), 0)
    out = np.empty(len(seq), dtype=np.int64)
    for i in range(len(seq)):
        a, b = top2[i]
        pick = a if load[a] <= load[b] else b
        load[pick] += int(sizes[i])
        out[i] = pick
    return out


def ring(seq: np.ndarray, hosts: np.ndarray, vnodes: int) -> np.ndarray:
    points = mix64((hosts[:, None].astype(np.uint64) << np.uint64(20)) +
                   np.arange(vnodes, dtype=np.uint64)[None, :] + np.uint64(7)).ravel()
    owner = np.repeat(hosts, vnodes)
    order = np.argsort(points)
    points, owner = points[order], owner[order]
    keys = mix64(seq.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15))
    idx = np.searchsorted(points, keys) % len(points)
    return owner[idx]


def modulo(seq: np.ndarray, hosts: np.ndarray) -> np.ndarray:
    keys = mix64(seq.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15))
    return hosts[(keys % np.uint64(len(hosts))).astype(np.int64)]


def place(policy: str, seq: np.ndarray, hosts: np.ndarray, sizes: np.ndarray,
          vnodes: int) -> np.ndarray:
    if policy == "rendezvous":
        return rendezvous(seq, hosts)[:, 0]
    if policy == "two_choices":
        return two_choices(seq, hosts, sizes)
    if policy == "ring":
        return ring(seq, hosts, vnodes)
    if policy == "modulo":
        return modulo(seq, hosts)
    raise ValueError(policy)


def per_host(hosts: np.ndarray, where: np.ndarray, weights: np.ndarray) -> np.ndarray:
    index = np.searchsorted(hosts, where)
    return np.bincount(index, weights=weights, minlength=len(hosts))


def simulate(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.seed)
    n = args.sequences
    seq = rng.integers(0, 2**62, size=n, dtype=np.int64)  # sequence ids (hashed strings)
    tokens = np.clip(np.exp(rng.normal(np.log(16384), 1.0, size=n)), 1024, 131072).astype(np.int64)
    sizes = tokens * KV_BYTES_PER_TOKEN
    hosts = np.arange(args.hosts, dtype=np.int64)
    # Popularity: request r decodes sequence zipf_rank[r]; a step reads row_fraction of its bytes.
    ranks = rng.permutation(n)
    popularity = 1.0 / np.power(np.arange(1, n + 1), args.zipf)
    popularity /= popularity.sum()
    requests = popularity[ranks] * args.requests  # expected concurrent decodes per sequence
    step_bytes = sizes * args.row_fraction * requests  # bytes read per fleet decode step
    report: dict = {"hosts": args.hosts, "sequences": n, "workers": args.workers,
                    "total_tb": float(sizes.sum() / 1e12),
                    "per_worker_gb_per_step": float(step_bytes.sum() / args.workers / 1e9),
                    "policies": {}}
    joined = np.arange(args.hosts + 1, dtype=np.int64)
    left = hosts[hosts != args.hosts // 2]
    for policy in args.policies:
        where = place(policy, seq, hosts, sizes, args.vnodes)
        load = per_host(hosts, where, sizes)
        traffic = per_host(hosts, where, step_bytes)
        r: dict = {
            "bytes_max_over_mean": float(load.max() / load.mean()),
            "traffic_max_over_mean": float(traffic.max() / traffic.mean()),
        }
        if policy != "two_choices":  # its placement depends on arrival order: not recomputable
            after_join = place(policy, seq, joined, sizes, args.vnodes)
            after_leave = place(policy, seq, left, sizes, args.vnodes)
            moved_j = where != after_join
            moved_l = where != after_leave
            r["moved_on_join"] = float(moved_j.mean())
            r["moved_bytes_on_join"] = float(sizes[moved_j].sum() / sizes.sum())
            r["moved_on_leave"] = float(moved_l.mean())
            r["moved_bytes_on_leave"] = float(sizes[moved_l].sum() / sizes.sum())
            r["ideal_moved"] = 1.0 / (args.hosts + 1)
        report["policies"][policy] = r
    # Replication with rendezvous: reads spread over the replicas, survival of host failures.
    for replicas in (2, 3):
        top = rendezvous(seq, hosts, replicas)
        spread = sum(per_host(hosts, top[:, k], step_bytes / replicas) for k in range(replicas))
        load = sum(per_host(hosts, top[:, k], sizes) for k in range(replicas))
        fail1 = np.array([args.hosts // 3])
        fail2 = np.array([args.hosts // 3, 2 * args.hosts // 3])
        lost1 = np.all(np.isin(top, fail1), axis=1)
        lost2 = np.all(np.isin(top, fail2), axis=1)
        # After one failure, the bytes whose replica count dropped must be copied again.
        rerep = np.any(np.isin(top, fail1), axis=1)
        report[f"replicas_{replicas}"] = {
            "bytes_max_over_mean": float(load.max() / load.mean()),
            "traffic_max_over_mean_reads_spread": float(spread.max() / spread.mean()),
            "lost_on_one_failure": int(lost1.sum()),
            "lost_on_two_failures": int(lost2.sum()),
            "rereplicate_tb_on_one_failure": float(sizes[rerep].sum() / 1e12),
        }
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, default=100)
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--sequences", type=int, default=200_000)
    ap.add_argument("--requests", type=float, default=8000.0,
                    help="decodes in flight over the fleet (8 per worker at 1000 workers)")
    ap.add_argument("--row_fraction", type=float, default=0.05)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--vnodes", type=int, default=100)
    ap.add_argument("--policies", nargs="+",
                    default=["rendezvous", "two_choices", "ring", "modulo"])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="also write the report here")
    args = ap.parse_args(argv)
    report = simulate(args)
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
