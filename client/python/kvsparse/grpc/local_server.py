"""Starts a kvsparse-server binary on a free loopback port, for tests, examples and notebooks.

    with kvsparse.LocalServer("build/bin/kvsparse-server", capacity="2G") as server:
        client = kvsparse.Client(server.target)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from kvsparse.grpc.client import Credentials, KvStoreClient
from kvsparse.errors import KvSparseError


def find_server_binary() -> str:
    """$KVSPARSE_SERVER, else kvsparse-server on PATH, else build/bin/kvsparse-server of the
    repository this package sits in."""
    env = os.environ.get("KVSPARSE_SERVER")
    if env:
        return env
    on_path = shutil.which("kvsparse-server")
    if on_path:
        return on_path
    repo = Path(__file__).resolve().parents[4]
    candidate = repo / "build" / "bin" / "kvsparse-server"
    if candidate.exists():
        return str(candidate)
    raise FileNotFoundError("kvsparse-server not found: set KVSPARSE_SERVER or put it on PATH")


class LocalServer:
    """A kvsparse-server process on 127.0.0.1. ``flags`` are its command-line flags without the
    leading dashes (``capacity="2G"``, ``gpu="off"``); ``target`` is its address once started.
    ``credentials``: what the start-up health check connects with (a server with ``tls_cert``)."""

    def __init__(
        self,
        binary: str | None = None,
        *,
        startup_timeout: float = 30.0,
        credentials: Credentials | None = None,
        **flags: object,
    ) -> None:
        self.binary = binary or find_server_binary()
        self.credentials = credentials
        self.flags = {"metrics_listen": "", "log_level": "warning", **flags}
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.metrics_port = 0  # with metrics_listen set (e.g. "127.0.0.1:0"): the port it bound
        self._log = tempfile.TemporaryFile()  # the server's stderr (never a pipe that fills)
        self._dir = tempfile.TemporaryDirectory(prefix="kvsparse-server-")  # its port file

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        """The server's /metrics, or "" without metrics_listen."""
        return f"http://127.0.0.1:{self.metrics_port}/metrics" if self.metrics_port else ""

    def start(self) -> "LocalServer":
        # Port 0: the server binds a free port and writes it to --port_file (no window in which
        # another process could take a port chosen here, as with tests running side by side).
        port_file = Path(self._dir.name) / "port"
        port_file.unlink(missing_ok=True)
        args = [self.binary, "--listen=127.0.0.1:0", f"--port_file={port_file}"]
        args += [f"--{k}={v}" for k, v in self.flags.items()]
        self._log.seek(0)
        self._log.truncate()
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=self._log)
        try:
            self._wait_serving(port_file)
        except (KvSparseError, RuntimeError) as e:
            self.stop()
            raise RuntimeError(f"kvsparse-server did not start: {e}") from None
        return self

    def _wait_serving(self, port_file: Path) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while not port_file.exists():
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"exited with {self.process.returncode}: {self.log()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no port after {self.startup_timeout} s")
            time.sleep(0.02)
        # The port file: "<gRPC port> <metrics port, 0 without metrics>".
        ports = port_file.read_text().split()
        self.port = int(ports[0])
        self.metrics_port = int(ports[1]) if len(ports) > 1 else 0
        with KvStoreClient(self.target, timeout=2.0, credentials=self.credentials) as client:
            while time.monotonic() < deadline:
                if self.process is not None and self.process.poll() is not None:
                    raise RuntimeError(f"exited with {self.process.returncode}: {self.log()[-2000:]}")
                try:
                    if client.health(timeout=1.0) == "SERVING":
                        return
                except KvSparseError:
                    pass
                time.sleep(0.05)
        raise RuntimeError(f"not serving after {self.startup_timeout} s")

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after timeout; returns the exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        code = self.process.returncode
        self.process = None
        return code

    def log(self) -> str:
        """What the server wrote to stderr."""
        self._log.seek(0)
        return self._log.read().decode(errors="replace").strip()

    def __enter__(self) -> "LocalServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
