"""How a client of kvsparse reaches it for a model's decode steps: a ``kvsparse-server`` over gRPC
(``GrpcTransport``) or the engine in this process (``InProcessTransport``, kvsparse.torch.ops), behind
one ``Transport`` interface that the Hugging Face cache (kvsparse.torch.hf) and the vLLM plugin
(kvsparse.vllm.plugin) share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from kvsparse.grpc.client import Client, DecodeStream
from kvsparse.methods import Method, ModelShape, Placement

if TYPE_CHECKING:
    from kvsparse.torch.ops import InProcessEngine


@dataclass
class StepStats:
    """What one decode call read: bytes fetched across the boundary (host memory, another
    process), bytes read on the worker's device, dense-equivalent bytes, rows fetched; and the
    engine's own time for it and its selection stage's where the transport reports them (gRPC:
    Timing.engine_seconds; Timing.selection_seconds, which the GPU engine fills in one call of
    its --gpu_stage_timing_every and the others leave 0); rows found in the GPU's row cache."""

    bytes_fetched: int = 0
    bytes_device: int = 0
    dense_equivalent_bytes: int = 0
    rows_fetched: int = 0
    engine_seconds: float = 0.0
    rows_cached: int = 0
    selection_seconds: float = 0.0


class Transport(Protocol):
    """How a KvSparseCache reaches kvsparse: gRPC or the in-process engine."""

    def create(self, sequence_id: str, shape: ModelShape, placement: Placement) -> None: ...
    # A new sequence holding source_id's first `tokens` tokens, their whole pages shared.
    def fork(self, source_id: str, sequence_id: str, tokens: int, placement: Placement) -> None: ...
    def append(self, sequence_id: str, layer: int, k: torch.Tensor, v: torch.Tensor, expected: int) -> None: ...
    def decode(
        self, layer: int, ids: list[str], q: torch.Tensor, method: Method,
        new_k: torch.Tensor, new_v: torch.Tensor, seed: int, scale: float,
    ) -> tuple[torch.Tensor, StepStats]: ...
    def lengths(self, sequence_id: str) -> list[int]: ...
    def rows(
        self, sequence_id: str, layer: int, count: int, num_kv_heads: int, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
    def drop(self, sequence_ids: list[str]) -> None: ...
    def close(self, sequence_ids: list[str]) -> None: ...


class GrpcTransport:
    """kvsparse-server over gRPC: q, new K/V and the output cross as protobuf."""

    def __init__(self, target: str | Client, timeout: float, stream: bool) -> None:
        self.own = not isinstance(target, Client)
        self.client = Client(target, timeout=timeout) if isinstance(target, str) else target
        self.stream: DecodeStream | None = self.client.attention.stream() if stream else None

    def create(self, sequence_id: str, shape: ModelShape, placement: Placement) -> None:
        self.client.store.create_sequence(sequence_id, shape, placement)

    def fork(self, source_id: str, sequence_id: str, tokens: int, placement: Placement) -> None:
        self.client.store.fork_sequence(source_id, sequence_id, tokens, placement)

    def append(self, sequence_id: str, layer: int, k: torch.Tensor, v: torch.Tensor, expected: int) -> None:
        self.client.store.append(sequence_id, k[None], v[None], first_layer=layer, expected_length=expected)

    def decode(self, layer, ids, q, method, new_k, new_v, seed, scale):  # type: ignore[no-untyped-def]
        call = self.stream.decode if self.stream is not None else self.client.attention.decode
        r = call(layer, ids, q, method, new_k=new_k, new_v=new_v, seed=seed, scale=scale)
        s = StepStats(r.bytes_fetched, r.bytes_device, r.dense_equivalent_bytes, r.rows_fetched,
                      r.timing.engine_seconds, r.rows_cached, r.timing.selection_seconds)
        return r.output, s

    def lengths(self, sequence_id: str) -> list[int]:
        return self.client.store.sequence_info(sequence_id).layer_lengths

    def rows(
        self, sequence_id: str, layer: int, count: int, num_kv_heads: int, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of tokens [0, count) of one layer, [Hkv, count, d] each, like `like`."""
        hkv = num_kv_heads
        r = self.client.store.gather(sequence_id, layer, list(range(count)), kv_heads=range(hkv), like=like)
        k, v = cast(torch.Tensor, r.k), cast(torch.Tensor, r.v)
        return k.reshape(hkv, count, -1), v.reshape(hkv, count, -1)

    def drop(self, sequence_ids: list[str]) -> None:
        for sid in sequence_ids:
            try:
                self.client.store.drop_sequence(sid)
            except Exception:  # the server may be gone; nothing else to free
                pass

    def close(self, sequence_ids: list[str]) -> None:
        try:
            if self.stream is not None:
                self.stream.close()
            self.drop(sequence_ids)
        finally:
            if self.own:
                self.client.close()


class InProcessTransport:
    """The engine in this process (kvsparse.torch.ops): CUDA q and output stay on the device."""

    def __init__(self, engine: "InProcessEngine") -> None:
        self.engine = engine

    def create(self, sequence_id: str, shape: ModelShape, placement: Placement) -> None:
        self.engine.create_sequence(sequence_id, shape, placement)

    def fork(self, source_id: str, sequence_id: str, tokens: int, placement: Placement) -> None:
        self.engine.fork_sequence(source_id, sequence_id, tokens, placement)

    def append(self, sequence_id: str, layer: int, k: torch.Tensor, v: torch.Tensor, expected: int) -> None:
        self.engine.append(sequence_id, layer, k, v, expected)

    def decode(self, layer, ids, q, method, new_k, new_v, seed, scale):  # type: ignore[no-untyped-def]
        out, stats = self.engine.decode(layer, ids, q, method, new_k=new_k, new_v=new_v, seed=seed, scale=scale)
        col = stats.sum(0).tolist()  # STAT_COLUMNS
        return out, StepStats(col[3] + col[5], col[4], col[6], col[1], rows_cached=col[2])

    def lengths(self, sequence_id: str) -> list[int]:
        return self.engine.layer_lengths(sequence_id)

    def rows(
        self, sequence_id: str, layer: int, count: int, num_kv_heads: int, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of tokens [0, count) of one layer, [Hkv, count, d] each, like `like`."""
        k, v = self.engine.read_rows(sequence_id, layer, count)
        return k.to(device=like.device, dtype=like.dtype), v.to(device=like.device, dtype=like.dtype)

    def drop(self, sequence_ids: list[str]) -> None:
        for sid in sequence_ids:
            try:
                self.engine.drop_sequence(sid)
            except Exception:  # the engine may be closed already
                pass

    def close(self, sequence_ids: list[str]) -> None:
        self.drop(sequence_ids)


def make_transport(target: Any, timeout: float, stream: bool) -> Transport:
    if isinstance(target, (str, Client)):
        return GrpcTransport(target, timeout, stream)
    from kvsparse.torch.ops import InProcessEngine

    if isinstance(target, InProcessEngine):
        return InProcessTransport(target)
    raise TypeError(f"target must be an address, a kvsparse.Client or an InProcessEngine, not {type(target)}")


def step_seed(seed: int, position: int, layer: int) -> int:
    """A 63-bit seed per (step, layer) from the cache's seed (splitmix64 finaliser; 63 bits so
    that both transports take it as it is)."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + layer * 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 31)) & (2**63 - 1)
