"""Fault: the store of a split deployment is killed (SIGKILL) under a worker. The worker must answer
UNAVAILABLE (never an output computed from rows it no longer has a store for), and once a new
store is up at the same address and the model server has re-created and re-filled its sequence
(the contract: a store's loss loses its sequences; the model server prefills again), decodes are
right again, with the new rows, not rows the worker kept from the old store."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import kvsparse

SHAPE = kvsparse.ModelShape(2, 8, 2, 64, "fp32")


def dense(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """q [H, d], k/v [n, Hkv, d] -> [H, d]."""
    out = np.zeros_like(q, dtype=np.float64)
    for h in range(q.shape[0]):
        s = k[:, h // 4].astype(np.float64) @ q[h] / np.sqrt(q.shape[1])
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ v[:, h // 4]
    return out


def fill(store: kvsparse.Client, rng: np.random.Generator, n: int = 300) -> tuple[np.ndarray, np.ndarray]:
    store.store.create_sequence("s", SHAPE, kvsparse.Placement(k_tier="device", v_tier="device"))
    k = rng.standard_normal((2, n, 2, 64)).astype(np.float32)
    v = rng.standard_normal((2, n, 2, 64)).astype(np.float32)
    store.store.append("s", k, v)
    return k, v


def test_worker_answers_unavailable_then_recovers_after_a_re_prefill() -> None:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 8, 64)).astype(np.float32)
    store = kvsparse.LocalServer(role="store", capacity="256M", gpu="off").start()
    port = store.port
    worker = kvsparse.LocalServer(role="worker", store=store.target, gpu="off", default_deadline="5s").start()
    try:
        with kvsparse.Client(worker.target, timeout=5.0) as w, kvsparse.Client(store.target, timeout=5.0) as s:
            k, v = fill(s, rng)
            r = w.attention.decode(1, ["s"], q)  # the worker syncs its device-tier copy of K and V
            np.testing.assert_allclose(r.output[0], dense(q[0], k[1], v[1]), rtol=1e-4, atol=1e-5)
        os.kill(store.process.pid, signal.SIGKILL)
        store.process.wait()
        with kvsparse.Client(worker.target, timeout=5.0) as w:
            for _ in range(3):  # never an output from the rows it kept: the store is gone
                with pytest.raises(kvsparse.Unavailable) as err:
                    w.attention.decode(1, ["s"], q)
                assert "store" in err.value.details.lower(), err.value.details
            assert w.store.health() == "SERVING"  # the worker itself keeps serving
        # A new store at the same address (the model server's deployment restarts it), empty.
        new_store = kvsparse.LocalServer(role="store", capacity="256M", gpu="off", listen=f"127.0.0.1:{port}")
        new_store.start()
        try:
            with kvsparse.Client(worker.target, timeout=5.0) as w, kvsparse.Client(new_store.target, timeout=5.0) as s:
                deadline = time.monotonic() + 20
                while True:  # the worker's channel reconnects with backoff
                    try:
                        w.attention.decode(1, ["s"], q)
                        pytest.fail("the new store does not have the sequence")
                    except kvsparse.NotFound:
                        break
                    except (kvsparse.Unavailable, kvsparse.DeadlineExceeded):
                        assert time.monotonic() < deadline, "the worker never reached the new store"
                        time.sleep(0.2)
                k2, v2 = fill(s, rng)  # the re-prefill: new rows under the same id
                r = w.attention.decode(1, ["s"], q)
                np.testing.assert_allclose(r.output[0], dense(q[0], k2[1], v2[1]), rtol=1e-4, atol=1e-5)
        finally:
            new_store.stop()
    finally:
        worker.stop()
        store.stop()
