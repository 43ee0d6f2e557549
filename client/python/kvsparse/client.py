"""Clients of kvsparse-server's two gRPC services.

``KvStoreClient`` covers the KvStore service (sequences, append, gather, stats) and
``AttentionClient`` the Attention service (``decode``, and ``stream()`` for a ``DecodeStream``
session that carries a model server's step loop). Every call has a deadline (the client's
``timeout`` unless the call gives one) and raises a ``kvsparse.errors.KvSparseError`` subclass
with the server's code and message. Both clients can share one channel (``channel=``).
"""

from __future__ import annotations

import functools
import itertools
import queue
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvsparse import tensors
from kvsparse.errors import KvSparseError, from_code, from_rpc_error
from kvsparse.methods import Dense, Method, ModelShape, Placement
from kvsparse.placement import expand_shard_list, shard_of
from kvsparse.tensors import ArrayLike
from kvsparse.v1 import attention_pb2, attention_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc, tensor_pb2

DEFAULT_TIMEOUT = 30.0
# Large appends and gathers: the server's own limit (--max_message_size) is 256 MiB.
_MAX_MESSAGE = 512 * 1024 * 1024
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", _MAX_MESSAGE),
    ("grpc.max_receive_message_length", _MAX_MESSAGE),
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

    def _call(self, fn: Callable[..., T], request: Any, timeout: float | None) -> T:
        try:
            return fn(request, timeout=self.timeout if timeout is None else timeout)
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


# ---- KvStore ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SequenceInfo:
    sequence_id: str
    shape: ModelShape
    placement: Placement
    layer_lengths: list[int]
    bytes_used: int
    page_tokens: int
    incarnation: int

    @staticmethod
    def from_proto(m: kvstore_pb2.SequenceInfo) -> "SequenceInfo":
        tiers = {tensor_pb2.TIER_DEVICE: "device"}
        return SequenceInfo(
            sequence_id=m.sequence_id,
            shape=ModelShape(
                m.shape.num_layers,
                m.shape.num_q_heads,
                m.shape.num_kv_heads,
                m.shape.head_dim,
                tensors.NAME_BY_PROTO.get(m.shape.dtype, "?"),
            ),
            placement=Placement(
                tiers.get(m.placement.k_tier, "host"),  # type: ignore[arg-type]
                tiers.get(m.placement.v_tier, "host"),  # type: ignore[arg-type]
                m.placement.signature_bits,
                m.placement.compressed_key_bits,
            ),
            layer_lengths=list(m.layer_lengths),
            bytes_used=m.bytes_used,
            page_tokens=m.page_tokens,
            incarnation=m.incarnation,
        )


@dataclass(frozen=True)
class GatheredHead:
    kv_head: int
    row_offset: int  # first row of this head in k / v
    row_count: int
    token_indices: list[int]  # with unique=True: the distinct tokens, ascending
    counts: list[int]  # with unique=True: how often each was asked for


@dataclass(frozen=True)
class GatherResult:
    k: ArrayLike | None  # [rows, d] (None when kind="v")
    v: ArrayLike | None  # [rows, d] (None when kind="k")
    heads: list[GatheredHead]
    layer_length: int


_ROW_KINDS = {"k": kvstore_pb2.ROW_KIND_K, "v": kvstore_pb2.ROW_KIND_V, "kv": kvstore_pb2.ROW_KIND_KV}


class KvStoreClient(_Base):
    """The KvStore service: sequences of K/V rows per (layer, kv head), in pages."""

    _stub_class = kvstore_pb2_grpc.KvStoreStub

    def create_sequence(
        self,
        sequence_id: str,
        shape: ModelShape,
        placement: Placement = Placement(),
        timeout: float | None = None,
    ) -> SequenceInfo:
        req = kvstore_pb2.CreateSequenceRequest(sequence_id=sequence_id)
        shape.to_proto(req.shape)
        placement.to_proto(req.placement)
        return SequenceInfo.from_proto(self._call(self._stub.CreateSequence, req, timeout))

    def drop_sequence(self, sequence_id: str, timeout: float | None = None) -> int:
        """Drops a sequence; returns the bytes it frees."""
        req = kvstore_pb2.DropSequenceRequest(sequence_id=sequence_id)
        return self._call(self._stub.DropSequence, req, timeout).bytes_freed

    def append(
        self,
        sequence_id: str,
        k: ArrayLike,
        v: ArrayLike,
        *,
        first_layer: int = 0,
        expected_length: int | None = None,
        timeout: float | None = None,
    ) -> kvstore_pb2.AppendResponse:
        """Appends tokens to consecutive layers: k and v are [num_layers, tokens, Hkv, d] (or
        [tokens, Hkv, d] for one layer) in the sequence's dtype. ``expected_length``: every layer
        must hold exactly this many tokens first (makes a retried append safe)."""
        req = kvstore_pb2.AppendRequest(sequence_id=sequence_id, first_layer=first_layer)
        k_arr, v_arr = tensors.to_numpy(k), tensors.to_numpy(v)
        if k_arr.ndim == 3:
            k_arr, v_arr = k_arr[None], v_arr[None]
        req.num_layers = k_arr.shape[0] if k_arr.ndim == 4 else 0
        tensors.to_proto(k_arr, req.k)
        tensors.to_proto(v_arr, req.v)
        if expected_length is not None:
            req.expected_length = expected_length
        return self._call(self._stub.Append, req, timeout)

    def gather(
        self,
        sequence_id: str,
        layer: int,
        tokens: Mapping[int, Sequence[int]] | Sequence[int],
        *,
        kv_heads: Iterable[int] | None = None,
        kind: str = "kv",
        unique: bool = False,
        like: ArrayLike | None = None,
        timeout: float | None = None,
    ) -> GatherResult:
        """Reads rows of one layer: ``tokens`` per kv head ({head: [token, ...]}), or one token
        list for every head in ``kv_heads``. Rows come back in request order (or distinct and
        ascending with ``unique``), as numpy arrays or torch tensors like ``like``."""
        req = kvstore_pb2.GatherRequest(sequence_id=sequence_id, layer=layer, unique=unique)
        if kind not in _ROW_KINDS:
            raise from_code(grpc.StatusCode.INVALID_ARGUMENT, f"kind must be k, v or kv, got {kind!r}")
        req.kind = _ROW_KINDS[kind]
        if isinstance(tokens, Mapping):
            per_head = dict(tokens)
        else:
            if kv_heads is None:
                raise from_code(grpc.StatusCode.INVALID_ARGUMENT, "a token list needs kv_heads")
            per_head = {h: tokens for h in kv_heads}
        for head, toks in per_head.items():
            sel = req.heads.add(kv_head=int(head))
            sel.token_indices.extend(int(t) for t in toks)
        resp = self._call(self._stub.Gather, req, timeout)
        return GatherResult(
            k=tensors.from_proto(resp.k, like) if resp.HasField("k") else None,
            v=tensors.from_proto(resp.v, like) if resp.HasField("v") else None,
            heads=[
                GatheredHead(h.kv_head, h.row_offset, h.row_count, list(h.token_indices), list(h.counts))
                for h in resp.heads
            ],
            layer_length=resp.layer_length,
        )

    def sequence_info(self, sequence_id: str, timeout: float | None = None) -> SequenceInfo:
        req = kvstore_pb2.GetSequenceInfoRequest(sequence_id=sequence_id)
        return SequenceInfo.from_proto(self._call(self._stub.GetSequenceInfo, req, timeout))

    def list_sequences(self, timeout: float | None = None) -> list[SequenceInfo]:
        resp = self._call(self._stub.ListSequences, kvstore_pb2.ListSequencesRequest(), timeout)
        return [SequenceInfo.from_proto(s) for s in resp.sequences]

    def stats(self, timeout: float | None = None) -> kvstore_pb2.StoreStats:
        return self._call(self._stub.GetStats, kvstore_pb2.GetStatsRequest(), timeout)


class ShardedKvStoreClient:
    """A sharded fleet of stores (``kvsparse-server --role=store --shard_index=I
    --shard_count=N``): one ``KvStoreClient`` per shard, in shard order, and every call on a
    sequence goes to the shard ``kvsparse.placement.shard_of`` gives it, where the workers (given
    the same list as ``--store``) look for it. A shard that is down raises its own
    ``Unavailable``; no call moves to another shard.

    ``targets``: a list of addresses, or one string as the worker's ``--store`` takes it
    (``"a:50051,b:50051"``, ``"kvsparse-store-{0..3}.kvsparse-store:50051"``)."""

    def __init__(
        self,
        targets: str | Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT,
        credentials: Credentials | None = None,
    ) -> None:
        addresses = expand_shard_list(targets) if isinstance(targets, str) else list(targets)
        if not addresses:
            raise ValueError("no store shards")
        self.targets = addresses  # in shard order
        self.shards = [KvStoreClient(a, timeout=timeout, credentials=credentials) for a in addresses]

    def __len__(self) -> int:
        return len(self.shards)

    def shard_for(self, sequence_id: str) -> KvStoreClient:
        """The client of the shard that holds (or is to hold) ``sequence_id``."""
        return self.shards[shard_of(sequence_id, len(self.shards))]

    def create_sequence(self, sequence_id: str, *args: Any, **kwargs: Any) -> SequenceInfo:
        return self.shard_for(sequence_id).create_sequence(sequence_id, *args, **kwargs)

    def drop_sequence(self, sequence_id: str, timeout: float | None = None) -> int:
        return self.shard_for(sequence_id).drop_sequence(sequence_id, timeout)

    def append(self, sequence_id: str, *args: Any, **kwargs: Any) -> kvstore_pb2.AppendResponse:
        return self.shard_for(sequence_id).append(sequence_id, *args, **kwargs)

    def gather(self, sequence_id: str, *args: Any, **kwargs: Any) -> GatherResult:
        return self.shard_for(sequence_id).gather(sequence_id, *args, **kwargs)

    def sequence_info(self, sequence_id: str, timeout: float | None = None) -> SequenceInfo:
        return self.shard_for(sequence_id).sequence_info(sequence_id, timeout)

    def list_sequences(self, timeout: float | None = None) -> list[SequenceInfo]:
        """Every shard's sequences (raises if a shard is down)."""
        return [info for c in self.shards for info in c.list_sequences(timeout)]

    def stats(self, timeout: float | None = None) -> list[kvstore_pb2.StoreStats]:
        """Each shard's statistics, in shard order."""
        return [c.stats(timeout) for c in self.shards]

    def health(self, service: str = "", timeout: float | None = None) -> str:
        """SERVING when every shard is; otherwise the first other status."""
        for c in self.shards:
            status = c.health(service, timeout)
            if status != "SERVING":
                return status
        return "SERVING"

    def wait_ready(self, timeout: float = 10.0) -> None:
        for c in self.shards:
            c.wait_ready(timeout)

    def check_placement(self, timeout: float | None = None) -> None:
        """Raises ``FailedPrecondition`` unless shard i of this list says it is shard i of
        ``len(self)`` (``--shard_index``/``--shard_count``): a list out of order, or stores run
        without those flags, would place sequences where the workers do not look."""
        for i, (target, st) in enumerate(zip(self.targets, self.stats(timeout))):
            count = max(1, st.shard_count)
            if count != len(self.shards) or st.shard_index != i:
                raise from_code(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"store {target} (shard {i} of {len(self.shards)} in this list) says it is "
                    f"shard {st.shard_index} of {count} (--shard_index/--shard_count)",
                )

    def close(self) -> None:
        for c in self.shards:
            c.close()

    def __enter__(self) -> "ShardedKvStoreClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- Attention ----------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadStats:
    """What one kv head of one sequence read in a Decode call."""

    sequence_index: int
    kv_head: int
    rows_selected: int
    rows_fetched: int
    budgets: list[int]
    bytes_host: int
    bytes_device: int
    bytes_remote: int
    dense_equivalent_bytes: int
    fetched_tokens: list[int]
    rows_cached: int = 0  # of rows_fetched: found in the GPU's row cache

    @property
    def bytes_read(self) -> int:
        return self.bytes_host + self.bytes_device + self.bytes_remote


@dataclass(frozen=True)
class DecodeResult:
    """One Decode call's answer. ``heads`` (per kv head of each sequence, [B * Hkv]) is built
    from the response on first use; the totals read it without building it (a step loop that
    only sums bytes pays no per-head Python objects)."""

    output: ArrayLike  # [B, H, d] in q's dtype, as q's kind (numpy, or torch on q's device)
    timing: attention_pb2.Timing
    sync_bytes: int
    request_id: int = 0
    head_stats: Any = field(default=(), repr=False, compare=False)  # the response's HeadStats

    @functools.cached_property
    def heads(self) -> list[HeadStats]:
        return [
            HeadStats(
                h.sequence_index,
                h.kv_head,
                h.rows_selected,
                h.rows_fetched,
                list(h.budgets),
                h.bytes_host,
                h.bytes_device,
                h.bytes_remote,
                h.dense_equivalent_bytes,
                list(h.fetched_tokens),
                h.rows_cached,
            )
            for h in self.head_stats
        ]

    @functools.cached_property
    def _totals(self) -> tuple[int, int, int, int, int]:
        fetched = device = dense = rows = cached = 0
        for h in self.head_stats:
            fetched += h.bytes_host + h.bytes_remote
            device += h.bytes_device
            dense += h.dense_equivalent_bytes
            rows += h.rows_fetched
            cached += h.rows_cached
        return fetched, device, dense, rows, cached

    @property
    def bytes_fetched(self) -> int:
        """Bytes the call read from host memory or another process (not the worker's device)."""
        return self._totals[0]

    @property
    def bytes_device(self) -> int:
        """Bytes the call read from the worker's device (resident rows, row cache, signatures)."""
        return self._totals[1]

    @property
    def dense_equivalent_bytes(self) -> int:
        return self._totals[2]

    @property
    def rows_fetched(self) -> int:
        return self._totals[3]

    @property
    def rows_cached(self) -> int:
        """Of rows_fetched, the rows found in the GPU's row cache (read on the device)."""
        return self._totals[4]


def _decode_request(
    layer: int,
    sequence_ids: Sequence[str],
    q: ArrayLike,
    method: Method,
    new_k: ArrayLike | None,
    new_v: ArrayLike | None,
    seed: int,
    scale: float,
    return_indices: bool,
    request_id: int = 0,
) -> attention_pb2.DecodeRequest:
    req = attention_pb2.DecodeRequest(
        layer=layer, seed=seed, scale=scale, return_indices=return_indices, request_id=request_id
    )
    req.sequence_ids.extend(sequence_ids)
    tensors.to_proto(q, req.q)
    if (new_k is None) != (new_v is None):
        raise from_code(grpc.StatusCode.INVALID_ARGUMENT, "new_k and new_v come together")
    if new_k is not None:
        tensors.to_proto(new_k, req.new_k)
        tensors.to_proto(new_v, req.new_v)  # type: ignore[arg-type]
    method.to_proto(req.method)
    return req


def _decode_result(resp: attention_pb2.DecodeResponse, like: ArrayLike) -> DecodeResult:
    return DecodeResult(
        output=tensors.from_proto(resp.output, like),
        timing=resp.timing,
        sync_bytes=resp.sync_bytes,
        request_id=resp.request_id,
        head_stats=resp.heads,
    )


class AttentionClient(_Base):
    """The Attention service: one layer of one decode step for B sequences per call."""

    _stub_class = attention_pb2_grpc.AttentionStub

    def decode(
        self,
        layer: int,
        sequence_ids: Sequence[str],
        q: ArrayLike,
        method: Method = Dense(),
        *,
        new_k: ArrayLike | None = None,
        new_v: ArrayLike | None = None,
        seed: int = 0,
        scale: float = 0.0,
        return_indices: bool = False,
        timeout: float | None = None,
    ) -> DecodeResult:
        """q: [B, H, d]; new_k / new_v: the new token of each sequence, [B, Hkv, d], appended to
        ``layer`` first. Returns the attention output in q's dtype and kind, with per-kv-head
        statistics (rows and bytes read, budgets)."""
        req = _decode_request(layer, sequence_ids, q, method, new_k, new_v, seed, scale, return_indices)
        return _decode_result(self._call(self._stub.Decode, req, timeout), q)

    def stream(self, timeout: float | None = None) -> "DecodeStream":
        """A DecodeStream session (one request per layer per step, answered in order); use it
        as a context manager. ``timeout`` bounds the whole stream (default: none)."""
        return DecodeStream(self._stub, timeout)


_END = object()


class DecodeStream:
    """A model server's step loop over one gRPC stream: ``decode`` sends one request and waits
    for its answer. An error ends the stream; it is raised by the call that meets it and by every
    call after it."""

    def __init__(self, stub: attention_pb2_grpc.AttentionStub, timeout: float | None) -> None:
        self._requests: queue.Queue[Any] = queue.Queue()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._error: KvSparseError | None = None
        self._responses = stub.DecodeStream(iter(self._requests.get, _END), timeout=timeout)

    def decode(
        self,
        layer: int,
        sequence_ids: Sequence[str],
        q: ArrayLike,
        method: Method = Dense(),
        *,
        new_k: ArrayLike | None = None,
        new_v: ArrayLike | None = None,
        seed: int = 0,
        scale: float = 0.0,
        return_indices: bool = False,
    ) -> DecodeResult:
        with self._lock:
            if self._error is not None:
                raise self._error
            request_id = next(self._ids)
            req = _decode_request(
                layer, sequence_ids, q, method, new_k, new_v, seed, scale, return_indices, request_id
            )
            self._requests.put(req)
            try:
                resp = next(self._responses)
            except grpc.RpcError as e:
                self._error = from_rpc_error(e)
                raise self._error from None
            except StopIteration:
                self._error = from_code(grpc.StatusCode.CANCELLED, "the server closed the stream")
                raise self._error from None
            return _decode_result(resp, q)

    def close(self) -> None:
        """Half-closes the stream and waits for the server to finish it."""
        self._requests.put(_END)
        try:
            for _ in self._responses:
                pass
        except grpc.RpcError:
            pass

    def __enter__(self) -> "DecodeStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Client:
    """Both services: ``store`` and ``attention``, over one channel to ``target`` (a server with
    both roles, the default), or in a split deployment (``kvsparse-server --role=store`` and
    ``--role=worker --store=...``) attention at ``target`` (the worker) and the store at
    ``store_target``. A ``store_target`` naming several shards (``"a:1,b:2"``, or
    ``"kvsparse-store-{0..3}.kvsparse-store:50051"``, the worker's ``--store``) makes ``store`` a
    ``ShardedKvStoreClient``."""

    target: str
    timeout: float = DEFAULT_TIMEOUT
    store_target: str | None = None
    credentials: Credentials | None = None  # TLS and token, for both targets
    store: KvStoreClient | ShardedKvStoreClient = field(init=False)
    attention: AttentionClient = field(init=False)

    def __post_init__(self) -> None:
        self._channel = open_channel(self.target, self.credentials)
        split = self.store_target is not None and self.store_target != self.target
        self._store_channel = self._channel
        if split and len(expand_shard_list(self.store_target)) > 1:  # type: ignore[arg-type]
            self.store = ShardedKvStoreClient(
                self.store_target, timeout=self.timeout, credentials=self.credentials  # type: ignore[arg-type]
            )
        else:
            if split:
                self._store_channel = open_channel(self.store_target, self.credentials)  # type: ignore[arg-type]
            self.store = KvStoreClient(channel=self._store_channel, timeout=self.timeout)
        self.attention = AttentionClient(channel=self._channel, timeout=self.timeout)

    def close(self) -> None:
        self._channel.close()
        if isinstance(self.store, ShardedKvStoreClient):
            self.store.close()
        elif self._store_channel is not self._channel:
            self._store_channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
