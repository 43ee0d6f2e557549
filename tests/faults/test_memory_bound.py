"""Fault: memory a client can make the server hold. The contract (docs/RELIABILITY.md, "Memory"):
the store's pages and the sequences' bookkeeping stay within --capacity; what a drop or an
eviction frees goes back to the system (whole slabs of pages at once, the heap every
--memory_trim_interval), so the server's resident memory stays within its idle size plus the
capacity plus the messages in flight, and returns close to its idle size once everything is
dropped. Failed before: after churn and a drop of everything the RSS stayed at 1,362 of
2,084 MiB (issue 48, defect 3)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.synchronize
import threading
import time

import numpy as np

import kvsparse

MIB = 1 << 20
CAPACITY = 128 * MIB
LAYERS, HKV, D = 4, 2, 64
SHAPE = kvsparse.ModelShape(LAYERS, 4, HKV, D, "fp32")
TOKEN_BYTES = LAYERS * HKV * D * 4 * 2  # K and V: 4 KiB


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


class PeakRss:
    """The peak resident memory of process pid, sampled every `period` seconds on a thread while
    the `with` block runs (peak: at least the RSS when it began)."""

    def __init__(self, pid: int, period: float = 0.01) -> None:
        self.pid, self.period = pid, period
        self.idle = self.peak = rss(pid)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample)

    def _sample(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, rss(self.pid))
            time.sleep(self.period)

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


def rows(tokens: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((LAYERS, tokens, HKV, D)).astype(np.float32)


def test_rss_stays_within_capacity_and_returns_after_drops() -> None:
    with kvsparse.LocalServer(
        gpu="off", capacity="128M", capacity_policy="evict-lru", memory_trim_interval="1s"
    ) as server:
        assert server.process is not None
        pid = server.process.pid
        chunk = rows(256, 1)  # 1 MiB a chunk
        with PeakRss(pid) as sampled:
            with kvsparse.Client(server.target, timeout=60.0) as c:
                # Churn: 600 sequences of 1 MiB through a 128 MiB store (evict-lru makes room).
                for i in range(600):
                    c.store.create_sequence(f"churn{i}", SHAPE)
                    c.store.append(f"churn{i}", chunk, chunk)
                # Large appends, one after another: 16 MiB each into fresh sequences.
                big = rows(4096, 2)
                for i in range(8):
                    c.store.create_sequence(f"big{i}", SHAPE)
                    c.store.append(f"big{i}", big, big)
                stats = c.store.stats()
                assert stats.evictions > 0 and stats.bytes_used <= CAPACITY, stats
                for info in c.store.list_sequences():
                    c.store.drop_sequence(info.sequence_id)
                assert c.store.stats().bytes_used == 0
            time.sleep(2.5)  # two trims
            after = rss(pid)
    # Messages in flight: one 16 MiB append at a time, held as received and as parsed; slack:
    # gRPC's buffers, thread stacks, the heap's fragmentation between trims.
    in_flight, slack = 2 * 4096 * TOKEN_BYTES, 48 * MIB
    idle, peak = sampled.idle, sampled.peak
    print(f"[memory] idle {idle / MIB:.0f} MiB, peak {peak / MIB:.0f} MiB, after drops {after / MIB:.0f} MiB")
    assert peak <= idle + CAPACITY + in_flight + slack, (idle, peak)
    assert after <= idle + 16 * MIB, (idle, after)


APPENDERS, APPEND_TOKENS = 6, 16384  # 64 MiB a message


def _append_once(target: str, i: int, ready: "multiprocessing.synchronize.Barrier") -> None:
    """One appender process: its message built, then sent when every appender is ready."""
    big = rows(APPEND_TOKENS, 3 + i)
    with kvsparse.Client(target, timeout=120.0) as c:
        c.store.create_sequence(f"c{i}", SHAPE)
        ready.wait()
        c.store.append(f"c{i}", big, big)


def concurrent_appends_peak(budget: str) -> tuple[int, int]:
    """APPENDERS processes each sending one 64 MiB append at the same moment into a 512 MiB
    store, with --max_append_bytes_in_flight=budget: the server's idle and peak resident
    memory."""
    ctx = multiprocessing.get_context("spawn")
    with kvsparse.LocalServer(
        gpu="off", capacity="512M", max_message_size="80M", max_append_bytes_in_flight=budget,
        memory_trim_interval="1s",
    ) as server:
        assert server.process is not None
        with PeakRss(server.process.pid, period=0.005) as sampled:
            ready = ctx.Barrier(APPENDERS)
            procs = [ctx.Process(target=_append_once, args=(server.target, i, ready)) for i in range(APPENDERS)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(180)
            assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
            with kvsparse.Client(server.target) as c:
                assert c.store.stats().bytes_used >= APPENDERS * APPEND_TOKENS * TOKEN_BYTES  # and bookkeeping
        return sampled.idle, sampled.peak


def test_concurrent_appends_are_read_within_the_request_budget() -> None:
    """Appends at once hold at most --max_append_bytes_in_flight of messages (each twice: as
    received and as parsed) beside the store's pages; the others wait for room. Failed before the
    budget (the same run with no bound, --max_append_bytes_in_flight=0, reads every message at
    once)."""
    idle, peak = concurrent_appends_peak("80M")
    stored, budget, slack = APPENDERS * APPEND_TOKENS * TOKEN_BYTES, 80 * MIB, 48 * MIB
    print(f"[memory] concurrent appends: idle {idle / MIB:.0f} MiB, peak {peak / MIB:.0f} MiB")
    assert peak <= idle + stored + 2 * budget + slack, (idle, peak)
