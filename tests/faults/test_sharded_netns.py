"""Fault: a sharded fleet across network stacks. Two store shards (--shard_index/--shard_count),
each in a network namespace of its own, and a worker reading both (--store=A,B), rows over the
UCX data plane (TCP) where the build has it, in a third namespace joined to each shard by a veth
pair; the model server's client and an embedded server (the reference) run beside the worker.
What must hold (docs/RELIABILITY.md, docs/SCALE.md):
- every method's output through the fleet is bit-identical to the embedded server's, each
  sequence on the shard placement gives it, rows read over UCX between the namespaces;
- with loss or a slow link on one shard's veth (tc netem where the kernel has it, else iptables'
  statistic match and a tc tbf rate limit), answers stay bit-identical;
- a shard killed (SIGKILL) mid-traffic: its sequences' decodes fail with UNAVAILABLE (or the
  caller's DEADLINE_EXCEEDED), never INTERNAL or a wrong output; the other shard's sequences
  keep decoding, right, throughout;
- the shard restarted (empty): NOT_FOUND for its sequences until the model server re-creates
  them, then bit-identical again.
Needs root (ip netns, tc): skipped otherwise."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvsparse
import netns

PID = os.getpid()
NS_W, NS_S = f"kvfw{PID}", [f"kvf0{PID}", f"kvf1{PID}"]
STORES = ["10.214.0.2:50052", "10.214.1.2:50052"]
WORKER, EMBEDDED, METRICS = "127.0.0.1:50051", "127.0.0.1:50061", "127.0.0.1:9464"

# Runs in the worker's namespace: the model server's side (a sharded client of the stores, the
# worker's Attention client) and the reference (the embedded server, same rows).
DRIVER = textwrap.dedent(
    """
    import json, sys, time, urllib.request
    import numpy as np
    import kvsparse
    from kvsparse.placement import shard_of
    phase, worker, embedded, stores, metrics = sys.argv[1:6]
    seconds = float(sys.argv[6]) if len(sys.argv) > 6 else 0
    SHAPE = kvsparse.ModelShape(2, 8, 2, 64, "fp32")
    IDS = [f"chat-{i}" for i in range(8)]
    METHODS = [kvsparse.Dense(), kvsparse.Santa(samples=32, allocation="prop", tile_size=32)]

    def rows(i):
        rng = np.random.default_rng(100 + i)
        n = 600 + 97 * i
        return [rng.standard_normal((2, n, 2, 64)).astype(np.float32) for _ in range(2)]

    def fill(client, ids):
        for sid in ids:
            k, v = rows(IDS.index(sid))
            client.store.create_sequence(sid, SHAPE)
            client.store.append(sid, k, v)

    q = np.random.default_rng(5).standard_normal((len(IDS), 8, 64)).astype(np.float32)

    def decode(client, ids, method, timeout=None):
        sel = [IDS.index(s) for s in ids]
        return client.attention.decode(1, ids, q[sel], method, seed=9, timeout=timeout).output

    def in_place():
        text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5).read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith(("kvsparse_worker_in_place_rows_total{", "kvsparse_worker_in_place_fallbacks_total{")):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    out = {}
    with kvsparse.Client(embedded) as ref, kvsparse.Client(worker, store_target=stores) as fleet:
        if phase == "fill":
            fleet.store.check_placement()
            fill(ref, IDS)
            fill(fleet, IDS)
            out["held"] = [sorted(i.sequence_id for i in s.list_sequences()) for s in fleet.store.shards]
            out["placed"] = [sorted(s for s in IDS if shard_of(s, 2) == j) for j in range(2)]
        if phase in ("fill", "decode", "recover"):
            if phase == "recover":
                lost = [s for s in IDS if shard_of(s, 2) == 1]
                t0 = time.monotonic()
                while True:
                    try:
                        decode(fleet, lost[:1], METHODS[0])
                        out["error"] = "the restarted shard had the sequence"
                        break
                    except kvsparse.NotFound:
                        break
                    except (kvsparse.Unavailable, kvsparse.DeadlineExceeded):
                        assert time.monotonic() - t0 < 30, "the worker never reached the new shard"
                        time.sleep(0.2)
                fill(fleet, lost)
            t0 = time.monotonic()
            out["equal"] = all(np.array_equal(decode(ref, IDS, m), decode(fleet, IDS, m)) for m in METHODS)
            out["seconds"] = time.monotonic() - t0
            out["in_place"] = in_place()
        if phase == "traffic":  # one sequence per call, round robin, for `seconds` after the first round
            want = {s: decode(ref, [s], METHODS[0]) for s in IDS}
            calls = []
            t_end, t_give_up = None, time.monotonic() + 60
            while time.monotonic() < (t_end or t_give_up):
                if t_end is None and {c[1] for c in calls if c[2] == "OK"} == {0, 1}:
                    t_end = time.monotonic() + seconds  # both shards answered: tell the test to kill
                    open(sys.argv[7], "w").close()
                for s in IDS:
                    t = time.monotonic()
                    try:
                        got = decode(fleet, [s], METHODS[0], timeout=2.0)
                        calls.append([s, shard_of(s, 2), "OK", bool(np.array_equal(got, want[s])), t])
                    except kvsparse.KvSparseError as e:
                        calls.append([s, shard_of(s, 2), e.code.name, None, t])
            out["calls"] = calls
    print(json.dumps(out))
    """
)


HAVE_NETEM = False


def impair(shard: int, kind: str | None) -> None:
    """One shard's link: clear, then "loss" (10% of packets each way) or "slow" (netem 20 ms a
    way; else a 50 Mbit/s tbf)."""
    ends = [(NS_W, f"vw{shard}"), (NS_S[shard], "vs")]
    if kind is None:
        netns.impair(ends)
    elif HAVE_NETEM:
        netns.impair(ends, netem={"slow": "delay 20ms", "loss": "loss 10%"}[kind])
    elif kind == "slow":
        netns.impair(ends, tbf="rate 50mbit burst 32kbit latency 400ms")
    else:
        netns.impair(ends, drop=0.1)


@pytest.fixture(scope="module")
def namespaces() -> Iterator[None]:
    netns.require(NS_W)
    try:
        for i, ns in enumerate(NS_S):
            netns.add(ns)
            netns.link((NS_W, f"vw{i}", f"10.214.{i}.1/24"), (ns, "vs", f"10.214.{i}.2/24"))
            # As a host's default route: UCX's TCP transport may connect from the worker's other
            # interface's address, and the answer must find its way back.
            netns.sh("ip", "-n", ns, "route", "add", "default", "via", f"10.214.{i}.1")
        netns.wait_up([(NS_W, f"vw{i}") for i in range(2)] + [(ns, "vs") for ns in NS_S])
        global HAVE_NETEM
        HAVE_NETEM = netns.have_netem(NS_W, "vw0")
        if not HAVE_NETEM and shutil.which("iptables") is None:
            pytest.skip("neither netem nor iptables here")
        impair(0, None)
        yield
    finally:
        netns.remove(NS_W, *NS_S)


def ucx_flags(store: bool) -> list[str]:
    """The UCX data plane's flags where the server binary has it (linked with libucp)."""
    binary = kvsparse.grpc.local_server.find_server_binary()
    if "libucp" not in netns.sh("ldd", binary, check=False).stdout:
        return []
    return ["--data_plane=ucx" if store else "--store_data_plane=ucx", "--data_plane_transports=tcp"]


def start_store(i: int, tmp: Path) -> subprocess.Popen[bytes]:
    arena = tmp / f"arena{i}"
    arena.unlink(missing_ok=True)
    return netns.start(NS_S[i], tmp / f"store{i}.log", "--role=store", f"--listen={STORES[i]}", "--insecure",
                 "--metrics_listen=", "--capacity=128M", f"--arena_file={arena}", f"--shard_index={i}",
                 "--shard_count=2", *ucx_flags(True))


def wait_port(ns: str, address: str) -> None:
    host, port = address.rsplit(":", 1)
    probe = f"import socket; socket.create_connection(('{host}', {port}), 0.5).close()"
    for _ in range(300):
        if netns.sh("ip", "netns", "exec", ns, sys.executable, "-c", probe, check=False).returncode == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"nothing listens on {address} in {ns}")


def driver(tmp: Path, phase: str, seconds: float = 0) -> subprocess.Popen[str]:
    script = tmp / "driver.py"
    script.write_text(DRIVER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.Popen(["ip", "netns", "exec", NS_W, sys.executable, str(script), phase, WORKER, EMBEDDED,
                             ",".join(STORES), METRICS, str(seconds), str(tmp / "ready")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def result(p: subprocess.Popen[str]) -> dict:
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_sharded_fleet_across_namespaces(namespaces: None, tmp_path: Path) -> None:
    stores = [start_store(i, tmp_path) for i in range(2)]
    worker = netns.start(NS_W, tmp_path / "worker.log", "--role=worker", f"--store={','.join(STORES)}",
                   f"--listen={WORKER}", f"--metrics_listen={METRICS}", "--default_deadline=30s",
                   *ucx_flags(False))
    embedded = netns.start(NS_W, tmp_path / "embedded.log", f"--listen={EMBEDDED}", "--metrics_listen=",
                     "--capacity=256M")
    procs = [*stores, worker, embedded]
    try:
        for ns, address in ((NS_S[0], STORES[0]), (NS_S[1], STORES[1]), (NS_W, WORKER), (NS_W, EMBEDDED)):
            wait_port(ns, address)
        filled = result(driver(tmp_path, "fill"))
        assert filled["held"] == filled["placed"] and all(filled["held"]), filled
        assert filled["equal"], filled
        seconds = {"clean": filled["seconds"]}
        if ucx_flags(False):  # rows over UCX between the namespaces, from both shards
            for shard in ("0", "1"):
                rows = [v for k, v in filled["in_place"].items() if "rows" in k and f'shard="{shard}"' in k]
                assert rows and rows[0] > 0, filled["in_place"]

        for kind in ("loss", "slow"):
            impair(1, kind)
            r = result(driver(tmp_path, "decode"))
            assert r["equal"], (kind, r)
            seconds[kind] = r["seconds"]
        impair(1, None)

        # Shard 1 killed mid-traffic.
        traffic = driver(tmp_path, "traffic", 4.0)
        for _ in range(1200):  # until both shards have answered (a loaded machine starts Python slowly)
            if (tmp_path / "ready").exists() or traffic.poll() is not None:
                break
            time.sleep(0.1)
        assert (tmp_path / "ready").exists(), "the traffic never reached both shards"
        time.sleep(1.0)
        t_kill = time.time()
        os.kill(stores[1].pid, signal.SIGKILL)
        stores[1].wait()
        calls = result(traffic)["calls"]
        by = {(shard, code): 0 for shard in (0, 1) for code in ("OK", "UNAVAILABLE", "DEADLINE_EXCEEDED")}
        for sid, shard, code, equal, t in calls:
            assert code in ("OK", "UNAVAILABLE", "DEADLINE_EXCEEDED"), (sid, code)
            if code == "OK":
                assert equal, f"{sid} decoded wrong"
            by[(shard, code)] = by.get((shard, code), 0) + 1
        assert by[(0, "UNAVAILABLE")] == 0 and by[(0, "DEADLINE_EXCEEDED")] == 0, by  # shard 0 unharmed
        assert by[(0, "OK")] > 0 and by[(1, "OK")] > 0, by  # traffic before the kill
        assert by[(1, "UNAVAILABLE")] + by[(1, "DEADLINE_EXCEEDED")] > 0, by  # and after it
        late_ok = [c for c in calls if c[1] == 1 and c[2] == "OK" and c[4] > t_kill + 0.5]
        assert not late_ok, late_ok[:3]

        # Back (empty): NOT_FOUND, re-created by the model server, bit-identical again.
        stores[1] = start_store(1, tmp_path)
        procs[1] = stores[1]
        wait_port(NS_S[1], STORES[1])
        recovered = result(driver(tmp_path, "recover"))
        assert "error" not in recovered and recovered["equal"], recovered
        seconds["recovered"] = recovered["seconds"]
        print(f"[sharded netns] {'netem' if HAVE_NETEM else 'tbf + iptables'}, "
              f"{'UCX' if ucx_flags(False) else 'Gather'}: {len(calls)} calls in the kill phase {by}; "
              "seconds per check: " + ", ".join(f"{k} {v:.3f}" for k, v in seconds.items()))
        assert worker.poll() is None and embedded.poll() is None and stores[0].poll() is None
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
