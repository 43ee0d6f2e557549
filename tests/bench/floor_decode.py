"""The floor baseline of the end-to-end benchmark (e2e_bench.py's `flash` and `weights` rows): what
a vLLM user's decode step costs with the KV cache resident on the GPU.

- The K/V of every layer live in preallocated sequence-major buffers, [B, max_len, Hkv, d] each, on
  the model's device (nothing grows or moves during decoding).
- The attention function registered as "kvsparse_floor" writes the step's key and value at each
  row's position (the model's position_ids) and attends over exactly the row's length with
  FlashAttention-2's varlen kernel as PyTorch ships it (torch.ops.aten._flash_attention_forward with
  seqused_k: the lengths are a device tensor, the bound max_len a constant, so the launch is the
  same every step). For one query token and GQA the kernel folds each kv head's query heads into
  one tile and splits the keys across the multiprocessors (split-KV), the decode kernel vLLM's
  FLASH_ATTN backend also runs.
- Nothing in the step reads the host, so torch.compile(mode="reduce-overhead", fullgraph=True)
  records the whole step as one CUDA graph.

On a CPU (the benchmark's --device cpu smoke run) the attention is SDPA over each row's valid
slice, eagerly: the harness's code paths, not a floor.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

ATTN = "kvsparse_floor"

# The cache the registered attention function writes to (one decodes at a time in a process; a
# global, so that the traced step reads no Python object per call).
_cache: "FloorCache | None" = None


class FloorLayer(CacheLayerMixin):
    """One layer's resident K and V, [B, max_len, Hkv, d] each; the attention function writes them."""

    is_compileable = True
    is_sliding = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, batch: int, max_len: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.keys = torch.zeros(batch, max_len, kv_heads, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        torch._dynamo.mark_static_address(self.keys)
        torch._dynamo.mark_static_address(self.values)
        self.length = 0  # tokens loaded before decoding (each step's position comes from the model)
        self.dtype, self.device = dtype, device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # The step's token is written by the attention function, at the model's positions.
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length + 1, 0  # the mask is not used: a constant size, no recompiles

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return int(self.keys.shape[1])

    def reset(self) -> None:
        raise NotImplementedError


class FloorCache(Cache):
    """A transformers Cache with every layer's K/V resident in preallocated buffers (see the module's
    text). Use as a context manager: one is active in a process at a time."""

    def __init__(self, config: Any, batch: int, max_len: int, device: torch.device | str,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        layers = int(config.num_hidden_layers)
        kv_heads = int(config.num_key_value_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        device = torch.device(device)
        super().__init__(layers=[FloorLayer(batch, max_len, kv_heads, head_dim, dtype, device) for _ in range(layers)])
        self.batch, self.max_len = batch, max_len
        # The varlen kernel's row offsets into the flattened buffers (constant), and the query rows'.
        self.cu_k = torch.arange(0, (batch + 1) * max_len, max_len, dtype=torch.int32, device=device)
        self.cu_q = torch.arange(0, batch + 1, dtype=torch.int32, device=device)
        self.rows = torch.arange(batch, device=device)

    def load(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """A prompt's K/V ([B, Hkv, n, d], as a prefill leaves them) into layer `layer`."""
        ly = self.layers[layer]
        n = key.shape[2]
        ly.keys[:, :n].copy_(key.transpose(1, 2))
        ly.values[:, :n].copy_(value.transpose(1, 2))
        ly.length = n

    def bytes(self) -> int:
        return sum(ly.keys.numel() * ly.keys.element_size() * 2 for ly in self.layers)

    def __enter__(self) -> "FloorCache":
        global _cache
        if _cache is not None:
            raise RuntimeError("another FloorCache is active in this process")
        _cache = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _cache
        _cache = None


def floor_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0,
                            scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """One decode step's attention of a layer over the active FloorCache (SDPA without one, or for
    a prompt of several tokens)."""
    cache = _cache
    if cache is None or query.shape[2] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise RuntimeError("the floor baseline decodes at the model's position_ids: pass them")
    ly = cache.layers[module.layer_idx]
    pos = position_ids[:, -1]
    ly.keys[cache.rows, pos] = key[:, :, 0, :]
    ly.values[cache.rows, pos] = value[:, :, 0, :]
    B, H, _, d = query.shape
    hkv = ly.keys.shape[2]
    scale = scaling if scaling is not None else d ** -0.5
    if query.device.type != "cuda":  # the CPU smoke run: SDPA over each row's valid slice
        outs = []
        for b in range(B):
            n = int(pos[b]) + 1
            k = ly.keys[b, :n].transpose(0, 1).unsqueeze(0)
            v = ly.values[b, :n].transpose(0, 1).unsqueeze(0)
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                query[b : b + 1], k, v, scale=scale, enable_gqa=H != hkv))
        return torch.cat(outs).transpose(1, 2), None
    out = torch.ops.aten._flash_attention_forward(
        query[:, :, 0, :],  # [B, H, d]: one query token per row
        ly.keys.view(B * cache.max_len, hkv, d),
        ly.values.view(B * cache.max_len, hkv, d),
        cache.cu_q, cache.cu_k, 1, cache.max_len, 0.0, False, False,
        scale=scale, seqused_k=(pos + 1).to(torch.int32),
    )[0]
    return out.unsqueeze(1), None  # [B, 1, H, d]


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


def register() -> None:
    """Registers the "kvsparse_floor" attention function (its decode steps need no mask)."""
    AttentionInterface.register(ATTN, floor_attention_forward)
    AttentionMaskInterface.register(ATTN, _no_mask)
