"""Admission check for vLLM's OpenAI server: a request whose ``vllm_xargs.kvsparse_method`` is not a
method kvsparse knows is answered 400 (OpenAI's error body, naming the field) before vLLM sees it,
instead of reaching vLLM's worker, where the plugin would fail it with a generic server error.
So is a request naming another method than the deployment's where the deployment decodes inside
vLLM's full CUDA graphs (vLLM's CUDA build, KVSPARSE_VLLM_FULL_GRAPHS not 0: one method is
captured), with the setting that serves per-request methods named; wherever the full graphs are
asked for, even where the worker decodes outside them (a plan too large for the GPU), so that what
a deployment accepts does not depend on its memory. vLLM's ``--middleware`` option loads it (both
builds):

    vllm serve <model> --middleware kvsparse.vllm.middleware.MethodCheck ...

A pure ASGI middleware: it reads the body of JSON POST requests (no larger than vLLM reads
anyway), checks the one field, and hands the same bytes on; every other request passes untouched.
"""

from __future__ import annotations

import json
import os
from typing import Any, Awaitable, Callable

from kvsparse.methods import parse_method
from kvsparse.vllm import plugin
from kvsparse.vllm.plugin import EXTRA_ARG

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

FIELD = f"vllm_xargs.{EXTRA_ARG}"


def captured_method() -> str | None:
    """The deployment's method where this vLLM asks for its decode steps inside its full CUDA
    graphs (kvsparse's plugin on, vLLM's CUDA build, KVSPARSE_VLLM_FULL_GRAPHS not 0), else None."""
    if not plugin.enabled() or not plugin.full_graphs_asked():
        return None
    from vllm.platforms import current_platform

    return os.environ[plugin.ENV_METHOD] if current_platform.is_cuda() else None


def method_error(body: bytes, only: str | None = None) -> str | None:
    """Why the request's method is refused, or None (no method named, or one that parses and,
    where ``only`` names the deployment's captured method, is that method; a body that is not a
    JSON object is left to vLLM)."""
    try:
        request = json.loads(body)
    except ValueError:
        return None
    xargs = request.get("vllm_xargs") if isinstance(request, dict) else None
    if not isinstance(xargs, dict) or xargs.get(EXTRA_ARG) is None:
        return None
    text = xargs[EXTRA_ARG]
    if not isinstance(text, str):
        return f"{FIELD} must be a string such as 'top_k:top_k_fraction=0.03125', not {type(text).__name__}"
    try:
        parse_method(text)
    except (ValueError, TypeError) as e:
        return f"{FIELD}: {e}"
    why = None if only is None else plugin.other_method_refusal(text, only)
    return None if why is None else f"{FIELD}: {why}"


class MethodCheck:
    def __init__(self, app: Callable[[dict[str, Any], Receive, Send], Awaitable[None]]) -> None:
        self.app = app
        self.only = captured_method()  # the one method a full-graph deployment serves

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        messages, chunks = [], []
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        reason = method_error(b"".join(chunks), self.only)
        if reason is not None:
            body = json.dumps({"error": {"message": reason, "type": "BadRequestError", "param": FIELD,
                                         "code": 400}}).encode()
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        replay = iter(messages)

        async def replayed() -> dict[str, Any]:
            return next(replay, None) or await receive()

        await self.app(scope, replayed, send)
