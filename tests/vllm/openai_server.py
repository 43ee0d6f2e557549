"""vLLM's OpenAI server for the plugin's tests on either build: started on a free local port
with the arguments a test gives, serving once /health answers, stopped at the end; and a
completion request to it."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from store_process import free_port


@contextlib.contextmanager
def api_server(model: str, log_path: Path, env_extra: dict[str, str], *args: str,
               start_seconds: int = 300) -> Iterator[tuple[str, Any]]:
    """``python -m vllm.entrypoints.openai.api_server --model <model> --skip-tokenizer-init
    <args>`` (its API process, engine core and worker) with the environment plus env_extra and
    HF_HUB_OFFLINE, its output in log_path; yields (base URL, process) once /health answers
    (within start_seconds)."""
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", **env_extra)
    log = open(log_path, "wb")
    api = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                            "--skip-tokenizer-init", "--port", str(port), *args], env=env, stdout=log,
                           stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(start_seconds):
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                assert api.poll() is None, failure(log_path)
                time.sleep(1)
        yield base, api
    finally:
        api.terminate()
        try:
            api.wait(timeout=60)
        except subprocess.TimeoutExpired:
            api.kill()
        log.close()


def failure(log_path: Path) -> str:
    """Why a server that exited did: its log's first error lines (a root cause a later traceback
    only points to) and its end."""
    text = log_path.read_text(errors="replace")
    errors = [x for x in text.splitlines() if "Error" in x][:12]
    return "\n".join(errors) + "\n...\n" + text[-2000:]


def complete(base: str, body: dict) -> dict:
    """POST /v1/completions; urllib.error.HTTPError on an error status."""
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=120))
