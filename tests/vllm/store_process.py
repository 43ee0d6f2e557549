"""A kvsparse-server store in a process of its own for the vLLM tests' outage cases (both
builds): host memory only, at a given address, ready when it answers a store call."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import kvsparse


def free_port() -> int:
    """A local port no process listens at (now)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_target() -> str:
    return f"127.0.0.1:{free_port()}"


def start_store(target: str) -> subprocess.Popen:
    """kvsparse-server ($KVSPARSE_SERVER, or on PATH) listening at `target`, once it serves."""
    binary = os.environ.get("KVSPARSE_SERVER") or shutil.which("kvsparse-server")
    if not binary:
        raise RuntimeError("kvsparse-server not found (KVSPARSE_SERVER)")
    proc = subprocess.Popen([binary, f"--listen={target}", "--capacity=1G", "--gpu=off", "--log_level=warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            with kvsparse.Client(target, timeout=1.0) as c:
                c.store.stats()
            return proc
        except kvsparse.KvSparseError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"kvsparse-server did not start at {target}")
