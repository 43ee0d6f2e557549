"""Clients of kvsparse-server's two gRPC services.

``KvStoreClient`` covers the KvStore service (sequences, append, gather, stats) and
``AttentionClient`` the Attention service (``decode``, and ``stream()`` for a ``DecodeStream``
session that carries a model server's step loop). Every call has a deadline (the client's
``timeout`` unless the call gives one) and raises a ``kvsparse.errors.KvSparseError`` subclass
with the server's code and message. Both clients can share one channel (``channel=``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsparse.grpc.attention import AttentionClient, DecodeResult, DecodeStream, HeadStats
from kvsparse.grpc.channel import DEFAULT_TIMEOUT, Credentials, open_channel
from kvsparse.grpc.kvstore import GatherResult, KvStoreClient, SequenceInfo, ShardedKvStoreClient
from kvsparse.placement import expand_shard_list

__all__ = [
    "AttentionClient",
    "Client",
    "Credentials",
    "DecodeResult",
    "DecodeStream",
    "GatherResult",
    "HeadStats",
    "KvStoreClient",
    "SequenceInfo",
    "ShardedKvStoreClient",
    "open_channel",
]


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
