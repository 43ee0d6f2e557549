"""The OpenAI server's admission check (kvsparse.vllm.middleware.MethodCheck), as an ASGI app in
front of another: which requests' methods it answers 400, with OpenAI's error body naming the
field, and that a request it admits reaches the app with the same bytes. Needs no vLLM: the check
reads the request's JSON only (vLLM's own servers load it with ``--middleware``; the CPU build's
test_vllm_plugin.py and the CUDA build's test_vllm_cuda.py run it there)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from kvsparse.methods import FLAGSHIP_TEXT
from kvsparse.vllm.middleware import FIELD, MethodCheck, method_error


def completion(method: str | None) -> bytes:
    request: dict[str, Any] = {"model": "m", "prompt": "a prompt", "max_tokens": 4}
    if method is not None:
        request["vllm_xargs"] = {"kvsparse_method": method}
    return json.dumps(request).encode()


def test_a_full_graph_deployment_admits_its_own_method_only_naming_the_setting() -> None:
    # Elsewhere (vLLM's CPU build, or full graphs off) each request may name its own method.
    assert method_error(completion("dense")) is None
    why = method_error(completion("dense"), FLAGSHIP_TEXT)
    assert why is not None and why.startswith(FIELD), why
    assert "'dense'" in why and repr(FLAGSHIP_TEXT) in why and "KVSPARSE_VLLM_FULL_GRAPHS=0" in why, why
    # The deployment's method however it is written, or none (the deployment's), is admitted.
    assert method_error(completion(FLAGSHIP_TEXT), FLAGSHIP_TEXT) is None
    assert method_error(completion("santa:scores=compressed,allocation=prop,samples=128"), FLAGSHIP_TEXT) is None
    assert method_error(completion(None), FLAGSHIP_TEXT) is None
    # The same method with other parameters is another method.
    assert method_error(completion("santa:samples=64,allocation=prop,scores=compressed"), FLAGSHIP_TEXT) is not None
    # A method that does not parse is refused for that, not for the graphs.
    bad = method_error(completion("bogus"), FLAGSHIP_TEXT)
    assert bad is not None and "bogus" in bad and "FULL_GRAPHS" not in bad, bad


def run(check: MethodCheck, body: bytes) -> tuple[list[dict[str, Any]], list[bytes]]:
    """One POST of `body` in two chunks through the check: what it sent back, and the bodies the
    app behind it received."""
    chunks = [{"type": "http.request", "body": body[:10], "more_body": True},
              {"type": "http.request", "body": body[10:], "more_body": False}]
    sent: list[dict[str, Any]] = []
    seen: list[bytes] = []

    async def receive() -> dict[str, Any]:
        return chunks.pop(0) if chunks else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def app(scope: dict[str, Any], app_receive: Any, app_send: Any) -> None:
        parts = []
        while True:
            message = await app_receive()
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        seen.append(b"".join(parts))
        await app_send({"type": "http.response.start", "status": 200, "headers": []})
        await app_send({"type": "http.response.body", "body": b"{}"})

    check.app = app
    asyncio.run(check({"type": "http", "method": "POST", "path": "/v1/completions"}, receive, send))
    return sent, seen


def test_the_check_answers_400_or_hands_the_same_bytes_on() -> None:
    check = MethodCheck(lambda *args: None)  # type: ignore[arg-type,return-value]
    assert check.only is None  # kvsparse's plugin is off here (no KVSPARSE_VLLM_METHOD)
    check.only = FLAGSHIP_TEXT  # as on vLLM's CUDA build with the full graphs asked for
    sent, seen = run(check, completion("top_k:top_k_fraction=0.25"))
    assert seen == [] and sent[0]["status"] == 400, sent
    error = json.loads(sent[1]["body"])["error"]
    assert error["param"] == FIELD and error["code"] == 400 and "KVSPARSE_VLLM_FULL_GRAPHS=0" in error["message"]
    admitted = completion(FLAGSHIP_TEXT)
    sent, seen = run(check, admitted)
    assert seen == [admitted] and sent[0]["status"] == 200, sent
