"""Fault: a caller that goes away (issue 28, defect 2). The contract (docs/RELIABILITY.md): the
engine checks the call's deadline and cancellation before each sequence and between the stages of
a step, so work stops soon after the caller has gone; the call's slot (--max_concurrent_calls)
frees when the work stops; on SIGTERM a call in flight is cancelled at the end of
--shutdown_grace and the process exits soon after, not when the call would have finished.

The work: one Decode of 128 sequences x 8192 tokens (64 query heads over one kv head, so 512 MiB
hold it) with vAttention's exact predictor (every key scored): about 0.6 s a sequence and over a
minute a call on the CPU engine of a 2-core machine, so every deadline here (0.2 s, 2 s, the 1 s
grace) passes long before the work could end on any machine, while one stage stays short. Before
the checks the handler ran every sequence after the deadline had passed and logged "Decode OK",
and a SIGTERM waited for it. (With 16 sequences of 8 kv heads, a machine 3x faster than the
2-core one finished the busy call inside its 2 s deadline and the test failed.)"""

from __future__ import annotations

import re
import signal
import threading
import time
import urllib.request

import numpy as np
import pytest

import kvsparse

SHAPE = kvsparse.ModelShape(1, 64, 1, 128, "fp16")
TOKENS, SEQUENCES = 8192, 128
GRACE_S = 1.0
METHOD = kvsparse.VAttention(epsilon=0.05, delta=0.05, predictor="exact")


def load(c: kvsparse.Client) -> list[str]:
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, TOKENS, 1, 128)).astype(np.float16)
    ids = [f"s{b}" for b in range(SEQUENCES)]
    for sid in ids:
        c.store.create_sequence(sid, SHAPE)
        c.store.append(sid, k, k)
    return ids


# How the handler says its work stopped for a caller that has gone: past the deadline, or
# cancelled (the client cancels the RPC when its deadline fires; the server's copy of the
# deadline is later by the request's transit, so a check in between sees the cancellation).
STOPPED = r"deadline passed|the caller cancelled the call"


def wait_for(server: kvsparse.LocalServer, pattern: str, timeout: float = 60.0, count: int = 1) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if len(re.findall(pattern, server.log())) >= count:
            return True
        time.sleep(0.05)
    return False


def test_work_stops_when_the_caller_has_gone() -> None:
    server = kvsparse.LocalServer(
        gpu="off", capacity="2G", max_concurrent_calls=1, shutdown_grace=f"{GRACE_S:g}s", log_level="debug",
        metrics_listen="127.0.0.1:0",
    ).start()
    assert server.process is not None
    q = np.ones((SEQUENCES, 64, 128), np.float16)
    try:
        with kvsparse.Client(server.target, timeout=120.0) as c:
            ids = load(c)
            # The work outlasts its deadline: the handler stops at the next check and says so
            # (before: it ran on and logged "Decode OK"), and the slot is free for the next call.
            with pytest.raises(kvsparse.DeadlineExceeded):
                c.attention.decode(0, ids, q, METHOD, timeout=0.2)
            assert wait_for(server, STOPPED), server.log()[-3000:]
            assert "Decode OK" not in server.log(), "the engine finished the abandoned work"
            time.sleep(0.2)  # the slot is released as the handler returns, just after its log line
            out = c.attention.decode(0, ids[:1], q[:1], kvsparse.Dense())
            assert out.output.shape == (1, 64, 128)

            # While the work holds the one slot, another call is refused and counted, and the
            # slot shows in kvsparse_rpc_in_flight.
            metrics_url = server.metrics_url
            assert metrics_url, server.log()[:2000]
            busy_outcome: list[object] = []

            def busy_call() -> None:
                try:
                    busy_outcome.append(c.attention.decode(0, ids, q, METHOD, timeout=2.0))
                except kvsparse.KvSparseError as e:
                    busy_outcome.append(e)

            busy = threading.Thread(target=busy_call)
            busy.start()
            time.sleep(0.3)
            with pytest.raises(kvsparse.ResourceExhausted, match="server busy"):
                c.attention.decode(0, ids[:1], q[:1], kvsparse.Dense())
            scraped = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
            busy.join(timeout=60)
            assert len(busy_outcome) == 1 and isinstance(busy_outcome[0], kvsparse.DeadlineExceeded), busy_outcome
            assert 'kvsparse_rpc_in_flight{kind="calls"} 1' in scraped, scraped[:3000]
            assert re.search(r'kvsparse_rpc_admission_refusals_total\{limit="max_concurrent_calls",method="Decode"\} 1\b',
                             scraped), scraped[:3000]
            # The busy call's work stopped too.
            assert wait_for(server, STOPPED, timeout=120.0, count=2), server.log()[-3000:]
            time.sleep(0.2)

            # SIGTERM with the same work in flight: cancelled at the end of the grace, the
            # process exits within a stage of it.
            errors: list[BaseException] = []

            def run() -> None:
                try:
                    c.attention.decode(0, ids, q, METHOD)
                except kvsparse.KvSparseError as e:
                    errors.append(e)

            t = threading.Thread(target=run)
            t.start()
            time.sleep(0.3)  # the call is in the engine
            sent = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            code = server.process.wait(timeout=60)
            exit_s = time.monotonic() - sent
            t.join(timeout=30)
        log = server.log()
    finally:
        server.stop()
    assert code == 0, log[-2000:]
    assert exit_s <= GRACE_S + 3.0, f"exited {exit_s:.2f} s after SIGTERM (grace {GRACE_S} s)"
    assert len(errors) == 1 and not isinstance(errors[0], kvsparse.ResourceExhausted), errors
    print(f"[abandoned] exit {exit_s:.2f} s after SIGTERM (grace {GRACE_S} s): {type(errors[0]).__name__}")
