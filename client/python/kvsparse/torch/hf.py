"""Hugging Face transformers integration: ``model.generate`` with its KV cache in kvsparse.

    import kvsparse.torch.hf
    model = AutoModelForCausalLM.from_pretrained(...)        # a Llama-architecture model
    kvsparse.torch.hf.enable(model)                                 # attn_implementation="kvsparse"
    with kvsparse.torch.hf.KvSparseCache(model.config, target="127.0.0.1:50051",
                                   method=kvsparse.HashTopK(top_k_fraction=0.02)) as cache:
        out = model.generate(input_ids, attention_mask=mask, past_key_values=cache,
                             max_new_tokens=64, do_sample=False)
        print(cache.stats)

How it works:
- ``KvSparseCache`` is a ``transformers.Cache`` whose layers keep nothing on the model's
  device. One kvsparse sequence per batch row is created at the first forward pass.
- Prefill (a forward pass of more than one token per row): attention is the model's own SDPA over
  the prompt's K/V; the ``kvsparse`` attention function then appends each row's K/V (post-RoPE,
  left padding dropped) to the store in bulk, one layer at a time.
- Decode (one token per row): the cache's ``update`` hands the new token's K/V to the
  ``kvsparse`` attention function, which sends q and the new K/V in one Decode call per layer:
  the server appends the token and computes attention with the cache's method over the rows it
  selects. Only the attention output comes back.
- The sequences are dropped from the store when the cache is closed or garbage-collected.

``target`` is the transport: a server address or ``Client`` (gRPC), or a
``kvsparse.torch.ops.InProcessEngine`` (the engine in this process: on a CUDA device q and the output
stay on the GPU, on the caller's stream). Beam search and cache cropping (assisted decoding) are
not supported.

Compiled decoding (``max_tokens``, in-process engine only): once every layer holds the prompt,
the cache plans its decode steps (``kvsparse.torch.ops.DecodeSteps``: the store reserves each row's
pages up to ``max_tokens``) and the decode steps become traceable: the cache's ``update`` only
counts the step in a device tensor, and the attention function calls the planned op with the
row positions the model already has (``position_ids``), so a whole step compiles into one graph
with no break (``torch.compile(model, mode="reduce-overhead", fullgraph=True)``); on the GPU
backend, for the methods it captures (dense with K and V resident, S2ANTA prop or flash, hash
top-k with SimHash signatures, top-k and S2ANTA-prop over compressed keys), that graph is replayed
as a CUDA graph. CUDA graphs need such a
captured plan (``cache.steps.captured``; otherwise ``cache.steps.mode`` says why and the steps
are eager calls: compile without ``mode="reduce-overhead"``). One such cache decodes at a time
in a process, and it must be closed; its rows become the store's at ``commit()`` (also done by
``layer_lengths`` and ``close``).

A planned cache tells transformers it is not compileable, so ``model.generate`` does not
compile its steps by itself (the planned op's kernels then launch eagerly, step by step): it
did, one recompile per cache (every cache is a new plan). The wrong tokens seen once dynamo's
recompile limit was reached (an H200, 2026-11-30) were not the compiler's: called on PyTorch's
default stream (the legacy stream, handle 0) the planned steps' kernels ran on the engine's own
stream, unordered with the model's kernels before and after them, which showed wherever the steps
ran eagerly; they now run on the caller's stream, that one included (engine/cuda/static_step.cc;
docs/ACCURACY.md).
"""

from __future__ import annotations

import threading
import uuid
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from kvsparse._extras import needs

with needs("kvsparse.torch.hf", "hf", "torch", "transformers"):
    import torch
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvsparse.methods import Dense, Method, ModelShape, Placement, placement_for
from kvsparse.tensors import dtype_name
from kvsparse.torch.transport import make_transport, step_seed

if TYPE_CHECKING:
    from kvsparse.grpc.client import Client
    from kvsparse.torch.ops import DecodeSteps, InProcessEngine
    from kvsparse.torch.sale import SalePrefill

ATTN_IMPLEMENTATION = "kvsparse"

# Largest K+V payload of one prefill Append call (the server's message limit is 256 MiB by
# default). Smaller messages move faster through gRPC (serialisation, flow control): on the
# development machine 32 MB messages went at twice the rate of 128 MB ones. Each call expects the
# length the ones before it left, so a failure part-way leaves a prefix appended, nothing twice,
# and the cache refuses further use.
_APPEND_BYTES = 16 * 1024 * 1024

# The cache whose update() ran last on this thread (a weak reference), for the attention function
# that follows it in the same attention layer (transformers passes the layer's cache to
# update(), not to the attention function).
_active = threading.local()

# The planned cache of this process (max_tokens; one at a time) and its decode steps: what a
# compiled decode step's attention calls (a global, so that the traced code reads no
# thread-local or weak reference).
_planned_cache: "KvSparseCache | None" = None
_planned_steps: "DecodeSteps | None" = None


@dataclass
class CacheStats:
    """What the decode steps of a cache read, summed over layers, sequences and steps."""

    decode_calls: int = 0
    bytes_fetched: int = 0  # from host memory or another process (what crossed the boundary)
    bytes_device: int = 0  # read on the worker's device (resident rows, signatures, row cache)
    dense_equivalent_bytes: int = 0  # what dense attention over every row would have read
    rows_fetched: int = 0
    prefill_bytes_appended: int = 0
    sale_prefills: int = 0  # (layer, row) prompts attended through SALE
    sale_skipped: float = 0.0  # their shares of causal blocks skipped, summed (mean: / sale_prefills)

    @property
    def fetched_fraction(self) -> float:
        """Bytes fetched over what dense attention would have read (1.0 for dense from host)."""
        return self.bytes_fetched / self.dense_equivalent_bytes if self.dense_equivalent_bytes else 0.0


class KvSparseLayer(CacheLayerMixin):
    """One layer of a KvSparseCache: tracks its length; the rows live in kvsparse."""

    # False even for a planned cache: transformers' generate compiles by itself for a compileable
    # cache, one recompile per planned cache (the module's text).
    is_compileable = False
    is_sliding = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, cache: "KvSparseCache", layer_idx: int) -> None:
        super().__init__()
        self._cache = weakref.proxy(cache)
        self.layer_idx = layer_idx
        self.length = 0  # tokens per row as the model counts them (left padding included)
        self.planned = False  # decode steps through the cache's plan (traceable)
        self.steps_done: torch.Tensor | None = None  # planned steps since the plan, on the device

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.planned and key_states.shape[-2] == 1:
            # Traceable: the step's token goes in through the attention function's planned op.
            cast(torch.Tensor, self.steps_done).add_(1)
            return key_states, value_states
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self._cache._update(self.layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.planned:  # decode steps ignore the mask: a constant size, no recompiles
            return query_length + 1, 0
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        if self.planned and self.steps_done is not None:
            # A 0-dim device tensor, as transformers' StaticLayer answers (traceable, no sync).
            return cast(int, self.steps_done + self.length)
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise NotImplementedError("a KvSparseCache cannot be reset: make a new one")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("KvSparseCache does not support beam search")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("KvSparseCache does not support cropping (assisted decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("KvSparseCache does not support expanding the batch")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("KvSparseCache does not support selecting batch rows")


@dataclass
class _Staged:
    key: torch.Tensor
    value: torch.Tensor
    prefill: bool


class KvSparseCache(Cache):
    """A transformers Cache that keeps every layer's K/V in kvsparse.

    Args:
        config: the model's config (layers, heads, head dim).
        target: kvsparse-server's address ("host:port"), a ``Client``, or a
            ``kvsparse.torch.ops.InProcessEngine``.
        method: the selection method of the decode steps (``kvsparse.Dense()``,
            ``HashTopK(...)``, ``Santa(...)``, ``VAttention(...)``).
        placement: what the worker keeps on its device per sequence; default: what the method
            reads (``placement_for(method)``).
        seed: base seed of the sampling methods (each layer and step draws its own).
        stream: (gRPC) send decode calls over one DecodeStream instead of unary calls.
        timeout: deadline of each call, seconds.
        sequence_prefix: the store names batch row b's sequence ``sequence_prefix + str(b)``
            (default ``"hf-<12 random hex digits>-"``); with sharded stores the name picks the
            shard. Two live caches must not share a prefix.
        max_tokens: plan the decode steps once the prompt is in (in-process engine only): each
            row's length stays at or below it; the decode steps compile without graph breaks and
            capture in CUDA graphs where the GPU backend can (see the module's text).
        prefill: SALE's calibrated thresholds (``kvsparse.torch.sale.SalePrefill``): the prompt's
            attention through SALE's block-sparse prefill instead of SDPA, each row over its own
            tokens (left- or right-padded batches too). Off by default. On a CUDA device the op
            runs SALE's kernels (bf16 / fp16, head_dim 64 or 128, the paper's block geometry);
            on the CPU its reference (kernels/sale.h).
        warm_pages: with ``max_tokens``, where K or V rows are in host memory, warm the next
            layer's address translations on a side stream after each layer (``DecodeSteps``);
            on by default.
    """

    def __init__(
        self,
        config: Any,
        target: "str | Client | InProcessEngine" = "127.0.0.1:50051",
        *,
        method: Method = Dense(),
        placement: Placement | None = None,
        seed: int = 0,
        stream: bool = False,
        timeout: float = 60.0,
        sequence_prefix: str | None = None,
        max_tokens: int | None = None,
        prefill: "SalePrefill | None" = None,
        warm_pages: bool = True,
    ) -> None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.num_layers = int(text.num_hidden_layers)
        self.num_q_heads = int(text.num_attention_heads)
        self.num_kv_heads = int(getattr(text, "num_key_value_heads", None) or self.num_q_heads)
        self.head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // self.num_q_heads)
        from kvsparse.torch.ops import InProcessEngine

        if max_tokens is not None and not isinstance(target, InProcessEngine):
            raise ValueError("max_tokens (planned, compileable decode steps) needs an InProcessEngine target")
        self.max_tokens = max_tokens
        self.warm_pages = warm_pages
        if prefill is not None and len(prefill.thresholds) != self.num_layers:
            raise ValueError(f"prefill: thresholds for {len(prefill.thresholds)} layers, the model has {self.num_layers}")
        self.prefill = prefill
        self._engine = target if max_tokens is not None else None
        self.steps: DecodeSteps | None = None
        super().__init__(
            layers=[KvSparseLayer(self, i) for i in range(self.num_layers)]
        )
        self.transport = make_transport(target, timeout, stream)
        self.method = method
        self.placement = placement if placement is not None else placement_for(method)
        self.seed = seed
        self.stats = CacheStats()
        self.sequence_ids: list[str] = []
        self._prefix = sequence_prefix if sequence_prefix is not None else f"hf-{uuid.uuid4().hex[:12]}-"
        self._staged: dict[int, _Staged] = {}
        self._failed: BaseException | None = None  # a failed kvsparse call leaves the cache unusable
        self._finalizer = weakref.finalize(self, self.transport.close, self.sequence_ids)

    # ---- Cache API -----------------------------------------------------------------------

    def close(self) -> None:
        """Drops the sequences from the store (also done when the cache is garbage-collected)."""
        self._release_plan()
        self._finalizer()

    # ---- Planned decode steps (max_tokens) ---------------------------------------------------

    def _plan(self) -> None:
        """Plans the decode steps once every layer holds the prompt (max_tokens caches)."""
        global _planned_cache, _planned_steps
        if self.max_tokens is None or self.steps is not None:
            return
        if any(self._layer(i).length == 0 for i in range(self.num_layers)):
            return
        if _planned_cache is not None:
            raise RuntimeError("another KvSparseCache with max_tokens is decoding in this process: close it first")
        dtype = dtype_name(self._layer(0).dtype)
        self.steps = cast("InProcessEngine", self._engine).plan_steps(
            self.sequence_ids, self.method, max_tokens=self.max_tokens, seed=self.seed, dtype=dtype,
            warm_pages=self.warm_pages,
        )
        for i in range(self.num_layers):
            layer = self._layer(i)
            layer.steps_done = torch.zeros((), dtype=torch.long, device=layer.device)
            torch._dynamo.mark_static_address(layer.steps_done)
            layer.planned = True
        _planned_cache, _planned_steps = self, self.steps

    def commit(self) -> list[int]:
        """Makes the planned steps' rows the store's (waits for the device); returns each row's
        length. Nothing to do without a plan."""
        if self.steps is None:
            return [self.transport.lengths(sid)[0] for sid in self.sequence_ids]
        return self.steps.commit()

    def step_stats(self) -> torch.Tensor | None:
        """The last planned step's GPU statistics (``DecodeSteps.stats``); None without a
        captured plan."""
        return self.steps.stats() if self.steps is not None and self.steps.captured else None

    def _release_plan(self) -> None:
        global _planned_cache, _planned_steps
        if self.steps is None:
            return
        try:
            self.steps.commit()
        finally:
            self.steps.close()
            self.steps = None
            if _planned_cache is self:
                _planned_cache, _planned_steps = None, None

    def __enter__(self) -> "KvSparseCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def batch_size(self) -> int:
        return len(self.sequence_ids) if self.sequence_ids else -1

    # ---- What the layers and the attention function call --------------------------------

    # Opaque to torch.compile (graph breaks): the cache's bookkeeping is Python state.
    @torch.compiler.disable
    def _update(
        self, layer_idx: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._finalizer.alive:
            raise RuntimeError("this KvSparseCache is closed")
        if _planned_cache is not None and _planned_cache is not self and key.shape[-2] == 1:
            raise RuntimeError("a KvSparseCache with max_tokens is decoding in this process: close it first")
        if self._failed is not None:
            raise RuntimeError(
                f"this KvSparseCache is out of step with kvsparse after an earlier error "
                f"({self._failed!r}): close it and make a new one"
            )
        layer = self._layer(layer_idx)
        pending = self._staged.get(layer_idx)
        if pending is not None:
            raise RuntimeError(
                "layer %d's previous K/V never reached kvsparse: the model must run with "
                'attn_implementation="kvsparse" (kvsparse.torch.hf.enable(model))' % layer_idx
            )
        prefill = layer.length == 0 or key.shape[-2] > 1
        if prefill and layer.length > 0:
            raise NotImplementedError("KvSparseCache: a second prefill into a filled cache")
        if not self.sequence_ids:
            self._create(key)
        self._staged[layer_idx] = _Staged(key, value, prefill)
        _active.cache = weakref.ref(self)
        layer.length += key.shape[-2]
        return key, value

    def _layer(self, layer_idx: int) -> KvSparseLayer:
        return cast(KvSparseLayer, self.layers[layer_idx])

    def _create(self, key: torch.Tensor) -> None:
        dtype = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(key.dtype)
        if dtype is None:
            raise TypeError(f"kvsparse keeps bf16, fp16 or fp32 K/V, not {key.dtype}")
        shape = ModelShape(self.num_layers, self.num_q_heads, self.num_kv_heads, self.head_dim, dtype)
        for b in range(key.shape[0]):
            sid = f"{self._prefix}{b}"
            self.transport.create(sid, shape, self.placement)
            self.sequence_ids.append(sid)

    def load(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Puts a layer's existing K/V ([B, Hkv, n, d], post-RoPE, no padding) into kvsparse
        without a forward pass: to move a context computed elsewhere (another cache, a stored
        prefix) under kvsparse. Every layer must get the same n before decoding."""
        layer = self._layer(layer_idx)
        if layer.length:
            raise RuntimeError(f"layer {layer_idx} already holds tokens")
        if not self.sequence_ids:
            self._create(key)
        if key.shape[0] != len(self.sequence_ids):
            raise ValueError(f"key has {key.shape[0]} rows, the cache {len(self.sequence_ids)}")
        layer.lazy_initialization(key, value)
        self._append_prefill(layer_idx, _Staged(key, value, True), None)
        layer.length = key.shape[-2]
        self._plan()

    def layer_lengths(self, row: int) -> list[int]:
        """Tokens the store holds per layer for batch row `row` (its own, without padding)."""
        if self.steps is not None:
            self.steps.commit()
        return self.transport.lengths(self.sequence_ids[row])

    def _take(self, layer_idx: int) -> _Staged | None:
        return self._staged.pop(layer_idx, None)

    def _append_prefill(self, layer_idx: int, staged: _Staged, attention_mask: torch.Tensor | None) -> None:
        """Appends each row's prompt K/V to its sequence, without the left padding."""
        valid = None if attention_mask is None else _valid_keys(attention_mask, staged.key)
        for b, sid in enumerate(self.sequence_ids):
            k, v = staged.key[b], staged.value[b]  # [Hkv, T, d]
            if valid is not None and not bool(valid[b].all()):
                k, v = k[:, valid[b]], v[:, valid[b]]
            k, v = k.transpose(0, 1), v.transpose(0, 1)  # [n_b, Hkv, d]
            n = k.shape[0]
            per_token = 2 * k.shape[1] * k.shape[2] * k.element_size() if n else 1
            step = max(1, _APPEND_BYTES // per_token)
            for t0 in range(0, n, step):
                try:
                    self.transport.append(sid, layer_idx, k[t0 : t0 + step], v[t0 : t0 + step], t0)
                except BaseException as e:
                    self._failed = e
                    raise
            self.stats.prefill_bytes_appended += n * per_token

    def _sale_prefill(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      scaling: float | None, spans: list[tuple[int, int]]) -> torch.Tensor:
        """The prompt's attention through SALE, row by row over each row's tokens
        ``spans[b] = (first, end)`` (a padded row's padding positions get zeros, which nothing
        reads): [B, n, H, d] as SDPA's forward returns."""
        from kvsparse.torch import ops

        assert self.prefill is not None
        out = torch.zeros_like(query) if any(s != (0, query.shape[2]) for s in spans) else None
        rows = []
        for b, (t0, t1) in enumerate(spans):
            row, skipped = ops.sale_prefill(query[b, :, t0:t1], key[b, :, t0:t1], value[b, :, t0:t1],
                                            self.prefill.layer(layer_idx), scale=scaling,
                                            params=self.prefill.params)
            if out is None:
                rows.append(row)
            else:
                out[b, :, t0:t1] = row
            self.stats.sale_prefills += 1
            self.stats.sale_skipped += float(skipped.mean())
        return (torch.stack(rows) if out is None else out).transpose(1, 2).contiguous()

    def _decode(self, layer_idx: int, query: torch.Tensor, staged: _Staged, scaling: float | None) -> torch.Tensor:
        """One decode step of one layer: q [B, H, 1, d], the new token's K/V [B, Hkv, 1, d];
        returns the attention output [B, 1, H, d]."""
        q = query[:, :, 0, :]
        new_k, new_v = staged.key[:, :, 0, :], staged.value[:, :, 0, :]
        position = self._layer(layer_idx).length
        seed = step_seed(self.seed, position, layer_idx)
        try:
            out, step = self.transport.decode(
                layer_idx, self.sequence_ids, q, self.method, new_k, new_v, seed, float(scaling) if scaling else 0.0
            )
        except BaseException as e:  # the layers' lengths already count this step's token
            self._failed = e
            raise
        s = self.stats
        s.decode_calls += 1
        s.bytes_fetched += step.bytes_fetched
        s.bytes_device += step.bytes_device
        s.dense_equivalent_bytes += step.dense_equivalent_bytes
        s.rows_fetched += step.rows_fetched
        return out.to(query.dtype).unsqueeze(1)


def _valid_keys(attention_mask: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: the prompt positions each row attends to (its non-padding tokens), read off
    the last query row of the prefill's 4D mask."""
    b, _, t, _ = key.shape
    last = attention_mask[:, 0, -1, -t:]
    if last.dtype == torch.bool:
        return last.expand(b, t)
    return (last == 0).expand(b, t)


def _token_spans(attention_mask: torch.Tensor | None, key: torch.Tensor) -> list[tuple[int, int]] | None:
    """Each row's prompt tokens as one span ``(first, end)`` (left or right padding outside it),
    or None where a row's tokens are not contiguous (SDPA prefills such a batch)."""
    b, _, t, _ = key.shape
    if attention_mask is None:
        return [(0, t)] * b
    spans = []
    for row in _valid_keys(attention_mask, key).cpu():
        idx = row.nonzero().flatten()
        if idx.numel() == 0:
            return None
        first, end = int(idx[0]), int(idx[-1]) + 1
        if end - first != idx.numel():
            return None
        spans.append((first, end))
    return spans


def kvsparse_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function registered as "kvsparse": prefill through SDPA (and its K/V into
    the store), decode through kvsparse. Calls without a KvSparseCache are plain SDPA. A planned
    cache's decode steps (max_tokens) call the planned op, traceable and capturable; the others
    go through the host (a graph break in a compiled model)."""
    steps = _planned_steps
    if steps is not None and query.shape[2] == 1:
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            raise RuntimeError("a planned KvSparseCache decodes at the model's position_ids: pass them")
        layer_idx = cast(int, module.layer_idx)
        out = steps.decode(layer_idx, query[:, :, 0, :], key[:, :, 0, :], value[:, :, 0, :], position_ids[:, -1])
        return out.unsqueeze(1), None
    return _attention_through_host(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


@torch.compiler.disable
def _attention_through_host(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    ref = getattr(_active, "cache", None)
    cache: KvSparseCache | None = ref() if ref is not None else None
    layer_idx = cast(int, module.layer_idx)
    staged = cache._take(layer_idx) if cache is not None else None
    if staged is None or staged.key is not key:
        if staged is not None:  # not this call's: keep it for the call it belongs to
            cache._staged[layer_idx] = staged  # type: ignore[union-attr]
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if staged.prefill:
        spans = None
        if cache.prefill is not None and query.shape[2] == key.shape[2]:  # type: ignore[union-attr]
            spans = _token_spans(attention_mask, key)
        if spans is not None:
            out = cache._sale_prefill(layer_idx, query, key, value, scaling, spans)  # type: ignore[union-attr]
        else:
            out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
        cache._append_prefill(layer_idx, staged, attention_mask)  # type: ignore[union-attr]
        cache._plan()  # type: ignore[union-attr]
        return out, None
    return cache._decode(layer_idx, query, staged, scaling), None  # type: ignore[union-attr]


def register() -> None:
    """Registers the "kvsparse" attention function and its mask (SDPA's) with transformers."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, kvsparse_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def enable(model: Any) -> Any:
    """Switches a model to the "kvsparse" attention function (prefill stays SDPA; decode steps
    with a KvSparseCache go through kvsparse; without one the model runs as with SDPA)."""
    register()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model
