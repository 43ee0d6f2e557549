"""The Attention service's client: ``AttentionClient.decode``, and ``stream()`` for a
``DecodeStream`` session that carries a model server's step loop."""

from __future__ import annotations

import functools
import itertools
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvsparse import tensors
from kvsparse.errors import KvSparseError, from_code, from_rpc_error
from kvsparse.grpc.channel import _Base
from kvsparse.methods import Dense, Method
from kvsparse.tensors import ArrayLike
from kvsparse.v1 import attention_pb2, attention_pb2_grpc


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
    # Bernoulli qK^T: (query head, K feature) pairs the estimates read, and K features read for the
    # group (0 for exact scores, which read every feature).
    key_features_head: int = 0
    key_features_group: int = 0
    # Per query head of the group: the standard error the estimate states of itself, relative to
    # the head's output norm (S2ANTA on the CPU engine; empty where none is stated).
    standard_error: list[float] = field(default_factory=list)
    # Per query head: the relative error vAttention's budget promises at probability 1 - delta
    # (0 where its residual was read whole; the CPU engine; empty for other methods).
    epsilon: list[float] = field(default_factory=list)
    # Per query head: a certified upper bound on the share of its attention the rows its output
    # used leave out (top-k over compressed keys on the CPU engine; empty elsewhere).
    missed_mass_bound: list[float] = field(default_factory=list)

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
                h.key_features_head,
                h.key_features_group,
                list(h.standard_error),
                list(h.epsilon),
                list(h.missed_mass_bound),
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


