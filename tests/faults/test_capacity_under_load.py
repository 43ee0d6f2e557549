"""Fault: the store fills up under load, with each capacity policy (8 clients appending to their
own 4-layer sequences and reading back). The contract (docs/RELIABILITY.md):
  - reject: an append that does not fit is refused with RESOURCE_EXHAUSTED and leaves nothing
    (every layer keeps its length: no partial rows); everything acknowledged stays readable;
  - evict-lru: whole idle sequences are evicted to make room; a read of an evicted sequence is
    NOT_FOUND, never stale, partial or another sequence's rows; a sequence that is there holds
    exactly the rows acknowledged, in every layer.
A retried append carries expected_length, so a lost acknowledgement cannot double rows."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import kvsparse

LAYERS, HKV, D, CHUNK = 4, 2, 64, 128
SHAPE = kvsparse.ModelShape(LAYERS, 4, HKV, D, "fp32")
CHUNK_BYTES = LAYERS * CHUNK * HKV * D * 4 * 2  # K and V: 512 KiB


def chunk(client_id: int, step: int) -> np.ndarray:
    rng = np.random.default_rng(7919 * client_id + step)
    return rng.standard_normal((LAYERS, CHUNK, HKV, D)).astype(np.float32)


@pytest.mark.parametrize("policy", ["reject", "evict-lru"])
def test_full_store_under_load(policy: str) -> None:
    clients, steps = 8, 24  # 8 x 24 x 512 KiB = 96 MiB wanted of a 24 MiB store
    problems: list[str] = []
    outcomes = {"acked": 0, "refused": 0, "evicted_reads": 0, "recreated": 0}
    lock = threading.Lock()

    with kvsparse.LocalServer(gpu="off", capacity="24M", capacity_policy=policy, page_size="64K") as server:

        def check(c: kvsparse.Client, seq: str, i: int, first_step: int, acked: int) -> None:
            """The sequence holds exactly chunks first_step .. first_step + acked - 1."""
            info = c.store.sequence_info(seq)
            if info.layer_lengths != [acked * CHUNK] * LAYERS:
                problems.append(f"{seq}: layer lengths {info.layer_lengths}, acknowledged {acked * CHUNK}")
                return
            for layer in (0, LAYERS - 1):
                for s in (0, acked - 1):
                    want = chunk(i, first_step + s)[layer]
                    got = c.store.gather(seq, layer, list(range(s * CHUNK, (s + 1) * CHUNK)), kv_heads=[1])
                    if not np.array_equal(np.asarray(got.k), want[:, 1]):
                        problems.append(f"{seq}: wrong rows, layer {layer} chunk {s}")

        def run(i: int) -> None:
            seq = f"c{i}"
            with kvsparse.Client(server.target, timeout=20.0) as c:
                c.store.create_sequence(seq, SHAPE)
                first, acked = 0, 0
                for step in range(steps):
                    k = chunk(i, step)
                    try:
                        c.store.append(seq, k, k, expected_length=acked * CHUNK)
                        acked += 1
                        with lock:
                            outcomes["acked"] += 1
                    except kvsparse.ResourceExhausted:
                        with lock:
                            outcomes["refused"] += 1
                        if policy == "evict-lru":
                            problems.append(f"{seq}: RESOURCE_EXHAUSTED under evict-lru")
                    except kvsparse.NotFound:  # evicted under us (evict-lru only)
                        if policy != "evict-lru":
                            problems.append(f"{seq}: NOT_FOUND under reject")
                            return
                    try:
                        check(c, seq, i, first, acked)
                    except kvsparse.NotFound:
                        if policy != "evict-lru":
                            problems.append(f"{seq}: NOT_FOUND under reject")
                            return
                        with lock:
                            outcomes["evicted_reads"] += 1
                        c.store.create_sequence(seq, SHAPE)  # the model server prefills again
                        first, acked = step + 1, 0
                        with lock:
                            outcomes["recreated"] += 1

        threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        with kvsparse.Client(server.target) as c:
            stats = c.store.stats()
    assert not problems, problems[:5]
    if policy == "reject":
        assert outcomes["refused"] > 0 and outcomes["acked"] > 0, outcomes
    else:
        assert outcomes["evicted_reads"] > 0 and stats.evictions > 0, (outcomes, stats)
    print(f"[capacity {policy}] {outcomes}, store: {stats.bytes_used} of {stats.capacity_bytes} bytes, "
          f"{stats.evictions} evictions, {stats.rejections} rejections")
