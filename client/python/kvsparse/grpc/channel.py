"""The channel every client of kvsparse-server's services uses: ``open_channel`` (plaintext, or
TLS and a bearer token from ``Credentials``), and ``_Base``, a client of one service with its
deadline and error mapping (each call raises a ``kvsparse.errors.KvSparseError`` subclass with
the server's code and message)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvsparse.errors import from_code, from_rpc_error

DEFAULT_TIMEOUT = 30.0
# Large appends and gathers: the server's own limit (--max_message_size) is 256 MiB.
_MAX_MESSAGE = 512 * 1024 * 1024
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", _MAX_MESSAGE),
    ("grpc.max_receive_message_length", _MAX_MESSAGE),
    # After an outage, calls fail at once while the channel waits to reconnect: retry within 2 s
    # (gRPC's default backoff grows to 120 s), so a server that is back is reached again soon.
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
]

T = TypeVar("T")


@dataclass(frozen=True)
class Credentials:
    """How a channel reaches a kvsparse-server with ``--tls_cert`` / ``--tls_client_ca`` /
    ``--auth_tokens`` (docs/RELIABILITY.md): PEM file paths and a bearer token.

    ``ca``: the CA of the server's certificate (TLS; the server's name is checked against the
    target's host, or ``server_name``); ``cert`` + ``key``: this client's certificate (mutual TLS);
    ``token``: sent as ``authorization: Bearer <token>`` with every call (its role decides what the
    server allows: read, write or admin)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    token: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate needs both cert and key")
        if self.cert is not None and self.ca is None:
            raise ValueError("a client certificate needs TLS: give ca too")


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the bearer token to every call's metadata (plaintext loopback channels included,
    where gRPC's call credentials are not sent)."""

    def __init__(self, token: str) -> None:
        self._metadata = ("authorization", f"Bearer {token}")

    def _details(self, details: Any) -> Any:
        metadata = list(details.metadata or []) + [self._metadata]
        return details._replace(metadata=metadata)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def open_channel(target: str, credentials: Credentials | None = None) -> grpc.Channel:
    """A channel to kvsparse-server at target ("host:port") with message limits large enough for
    the server's: plaintext, or TLS / mutual TLS and a bearer token as ``credentials`` say."""
    c = credentials or Credentials()
    options: list[tuple[str, Any]] = list(_CHANNEL_OPTIONS)
    if c.ca is not None:
        tls = grpc.ssl_channel_credentials(_read(c.ca), _read(c.key), _read(c.cert))
        if c.server_name is not None:
            options.append(("grpc.ssl_target_name_override", c.server_name))
        channel = grpc.secure_channel(target, tls, options=options)
    else:
        channel = grpc.insecure_channel(target, options=options)
    if c.token is not None:
        channel = grpc.intercept_channel(channel, _BearerToken(c.token))
    return channel


class _Base:
    """A client of one service over a channel of its own (``target``) or a shared one."""

    _stub_class: Any = None  # the service's generated stub

    def __init__(
        self,
        target: str | None = None,
        *,
        channel: grpc.Channel | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        credentials: Credentials | None = None,
    ) -> None:
        if (target is None) == (channel is None):
            raise ValueError("give exactly one of target and channel")
        if channel is not None and credentials is not None:
            raise ValueError("credentials apply to a channel of the client's own (target)")
        self._own_channel = channel is None
        self._channel = channel if channel is not None else open_channel(str(target), credentials)
        self.timeout = timeout
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._stub = self._stub_class(self._channel)

    @property
    def channel(self) -> grpc.Channel:
        return self._channel

    def _call(self, fn: Callable[..., T], request: Any, timeout: float | None,
              metadata: tuple[tuple[str, str], ...] = ()) -> T:
        try:
            return fn(request, timeout=self.timeout if timeout is None else timeout, metadata=metadata or None)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def health(self, service: str = "", timeout: float | None = None) -> str:
        """grpc.health.v1 status of the server ("SERVING", "NOT_SERVING", ...)."""
        resp = self._call(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Blocks until the server accepts calls (Unavailable after timeout seconds)."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise from_code(grpc.StatusCode.UNAVAILABLE, f"server not ready after {timeout} s") from None

    def close(self) -> None:
        if self._own_channel:
            self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


