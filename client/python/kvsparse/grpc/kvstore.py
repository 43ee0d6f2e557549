"""The KvStore service's client: sequences, append, gather, stats (``KvStoreClient``), and
``ShardedKvStoreClient`` over several store shards. Every call has a deadline (the client's
``timeout`` unless the call gives one) and raises a ``kvsparse.errors.KvSparseError`` subclass."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvsparse import tensors
from kvsparse.errors import from_code
from kvsparse.grpc.channel import DEFAULT_TIMEOUT, Credentials, _Base
from kvsparse.methods import ModelShape, Placement
from kvsparse.placement import expand_shard_list, shard_of
from kvsparse.tensors import ArrayLike
from kvsparse.v1 import kvstore_pb2, kvstore_pb2_grpc, tensor_pb2

# The metadata header in which an append declares its message's size (rpc/request_size.h).
REQUEST_BYTES_HEADER = "kvsparse-request-bytes"


@dataclass(frozen=True)
class SequenceInfo:
    sequence_id: str
    shape: ModelShape
    placement: Placement
    layer_lengths: list[int]
    bytes_used: int
    page_tokens: int
    incarnation: int
    bytes_shared: int = 0  # of bytes_used, pages another sequence holds too (a fork's prefix)

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
            bytes_shared=m.bytes_shared,
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

    def fork_sequence(
        self,
        source_id: str,
        sequence_id: str,
        num_tokens: int,
        placement: Placement | None = None,
        timeout: float | None = None,
    ) -> SequenceInfo:
        """A new sequence holding the first ``num_tokens`` tokens of ``source_id`` (a common
        prefix), which keeps them too: their whole pages are shared in the store, not copied.
        ``placement``: the source's when None."""
        req = kvstore_pb2.ForkSequenceRequest(
            source_id=source_id, sequence_id=sequence_id, num_tokens=num_tokens
        )
        if placement is not None:
            placement.to_proto(req.placement)
        return SequenceInfo.from_proto(self._call(self._stub.ForkSequence, req, timeout))

    def drop_sequence(self, sequence_id: str, timeout: float | None = None) -> int:
        """Drops a sequence; returns the bytes it frees (pages a fork shares stay with it)."""
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
        # Its size, so that the server takes its share of its request budget before reading it
        # (--max_append_bytes_in_flight; undeclared, an append is charged the largest message).
        size = ((REQUEST_BYTES_HEADER, str(req.ByteSize())),)
        return self._call(self._stub.Append, req, timeout, size)

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

    def fork_sequence(
        self, source_id: str, sequence_id: str, *args: Any, **kwargs: Any
    ) -> SequenceInfo:
        """On the source's shard: FAILED_PRECONDITION when ``sequence_id`` belongs to another
        (a fork's pages stay on its source's shard; copy the rows there instead)."""
        return self.shard_for(source_id).fork_sequence(source_id, sequence_id, *args, **kwargs)

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


