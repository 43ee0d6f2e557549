"""The attention backend of kvsparse's vLLM plugin (kvsparse.vllm.plugin says how it is enabled
and what it does): vLLM's CPU attention backend whose decode rows are answered by kvsparse.
Imported by vLLM (through the backend registry) in its worker process only.

vLLM's prefix caching works with vLLM's cache kept (KVSPARSE_VLLM_KV=both): a request that vLLM
starts after a prefix it reused from its prefix cache gets that prefix's K/V read from vLLM's
paged cache (the request's blocks) into its new sequence, layer by layer, before its first rows.
vLLM's CPU kernels lay a block's rows out for their instruction set (cpu_cache_layout finds where
by writing through vLLM's own cache update). With the K/V in the store only, vLLM's cache holds
no prefix: it is forked from the sequence of the request that holds it, live or finished and kept
(plugin.keep_store_prefixes), and what that request computes in the same step is copied from its
sequence in the store layer by layer (_copy_prefix)."""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
from vllm.config import get_current_vllm_config
from vllm import _custom_ops as vllm_ops
from vllm import envs as vllm_envs
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from kvsparse.errors import KvSparseError
from kvsparse.methods import ModelShape
from kvsparse.tensors import dtype_name
from kvsparse.torch.transport import step_seed
from kvsparse.vllm.plugin import (
    BACKEND_NAME,
    ENV_SEED,
    WORKER,
    PromptTail,
    connector_configured,
    copy_prefix_rows,
    observe,
    prompt_tail_rows,
    keep_store_prefixes,
    refuse_unsupported,
    store_only,
    vllm_attention,
)



class KvSparseImpl(CPUAttentionBackendImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: Any = None, sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None, *args: Any, **kwargs: Any) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, *args, **kwargs)
        refuse_unsupported(alibi_slopes, sliding_window, logits_soft_cap, kwargs.get("sinks"), kv_cache_dtype)
        config = get_current_vllm_config()
        self.prefix_caching = bool(config.cache_config.enable_prefix_caching)
        if store_only() and self.prefix_caching:
            keep_store_prefixes()
        WORKER.num_layers = config.model_config.get_num_layers(config.parallel_config)
        WORKER.connector = connector_configured(config)
        self.seed = int(os.environ.get(ENV_SEED, "0"))
        self.store_only = store_only()
        self.shape: ModelShape | None = None  # the sequences' shape, once the K/V dtype is seen

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: Any, output: torch.Tensor, output_scale: Any = None,
                output_block_scale: Any = None) -> torch.Tensor:
        if attn_metadata is None:  # profiling run
            return output
        t0 = time.perf_counter()
        try:
            return self._forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                 output_block_scale)
        finally:
            WORKER.timing["forward"] += time.perf_counter() - t0

    def _forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor, output_scale: Any,
                 output_block_scale: Any) -> torch.Tensor:
        w = WORKER
        timing = w.timing
        li = extract_layer_index(layer.layer_name)
        qsl = attn_metadata.query_start_loc.tolist()
        seq_lens = attn_metadata.seq_lens.tolist()
        rows = w.batch[: len(seq_lens)]
        if len(rows) != len(seq_lens):
            raise RuntimeError(f"kvsparse: {len(seq_lens)} rows in the batch, {len(rows)} request ids recorded")
        if self.shape is None:
            self.shape = ModelShape(w.num_layers, self.num_heads, self.num_kv_heads, self.head_size,
                                    dtype_name(query.dtype))
        transport = w.transport()
        kinds: dict[str, list[int]] = {"decode": [], "failed": [], "prefill": [], "later": []}
        for i, rid in enumerate(rows):
            kinds["failed" if rid in w.failed else
                  self._row(transport, layer, li, i, rid, qsl, seq_lens[i], query, key, value, output, kv_cache,
                            attn_metadata)].append(i)
        # Store only: rows whose reused prefix the holder's sequence gets in this step, later in
        # the batch (_copy_prefix), once every other row's K/V are in the store.
        for i in kinds.pop("later"):
            kinds[self._row(transport, layer, li, i, rows[i], qsl, seq_lens[i], query, key, value, output, kv_cache,
                            attn_metadata, last=True)].append(i)
        decode, failed, prefill = kinds["decode"], kinds["failed"], bool(kinds["prefill"])
        # vLLM's attention where its cache holds the K/V: for prompt rows, and for the rows of
        # requests kvsparse failed, whose outputs feed the K/V the next layers write into vLLM's
        # cache (blocks that prefix caching may hand to requests sharing the prompt).
        vllm_ran = not self.store_only and bool(prefill or not decode or failed)
        if vllm_ran:
            t0 = time.perf_counter()
            w.vllm_rows_skipped += vllm_attention(
                super().forward, getattr(attn_metadata, "prompt_tail", None), len(decode), bool(failed), layer,
                query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
            timing["vllm_attention"] += time.perf_counter() - t0
        by_method: dict[Any, list[int]] = {}
        for i in decode:
            by_method.setdefault(w.sequences[rows[i]].method, []).append(i)
        n = attn_metadata.num_actual_tokens
        out = output[:n].view(n, self.num_heads, self.head_size)
        for method, idx in by_method.items():
            tok = torch.tensor([qsl[i] for i in idx], dtype=torch.long)
            ids = [w.sequences[rows[i]].sequence_id for i in idx]
            q = query[tok].view(len(idx), self.num_heads, self.head_size)
            new_k = key[tok].view(len(idx), self.num_kv_heads, self.head_size)
            new_v = value[tok].view(len(idx), self.num_kv_heads, self.head_size)
            t0 = time.perf_counter()
            try:
                result, stats = transport.decode(li, ids, q, method, new_k, new_v,
                                                 step_seed(self.seed, w.step, li), self.scale)
            except KvSparseError as e:
                w.fail([rows[i] for i in idx], e)
                failed.extend(idx)
                continue
            finally:
                timing["transport"] += time.perf_counter() - t0
            timing["engine"] += stats.engine_seconds
            observe(method, len(idx), stats)
            out[tok] = result.to(out.dtype).view(len(idx), self.num_heads, self.head_size)
            for i in idx:
                w.sequences[rows[i]].lengths[li] += 1
        if not vllm_ran:  # no attention of vLLM's for them (vLLM discards their tokens)
            for i in failed:
                out[qsl[i]:qsl[i + 1]] = 0
        return output


    def _row(self, transport: Any, layer: Any, li: int, i: int, rid: str, qsl: list[int], seq_len: int,
             query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor,
             kv_cache: torch.Tensor, attn_metadata: Any, last: bool = False) -> str:
        """Batch row i of request `rid` at layer li: "decode" (kvsparse answers it after the rows'
        loop), "prefill" (a prompt chunk: its K/V appended to the store, and with the store only
        its attention computed here), "failed" (WORKER.fail), or "later" (store only: its reused
        prefix is not in its holder's sequence yet at this layer; `last`: fail it then)."""
        w = WORKER
        a, b = qsl[i], qsl[i + 1]
        start = seq_len - (b - a)  # tokens before this step's
        try:
            seq = w.sequence(rid, self.shape)
            if seq.lengths[li] != start:
                seq = self._begin_at(transport, layer, li, rid, seq, start, kv_cache,
                                     attn_metadata.block_table[i], key, last)
                if seq is None:
                    return "later"
            if b - a == 1 and start > 0:
                return "decode"
            # A prompt (or a chunk of one): its K/V to the store; its attention vLLM's, or (store
            # only) computed here over the store's rows of the prompt before it.
            t0 = time.perf_counter()
            transport.append(seq.sequence_id, li, key[a:b], value[a:b], start)
            if self.store_only:
                self._prompt_attention(transport, seq.sequence_id, li, start, query[a:b], key[a:b],
                                       value[a:b], output[a:b])
            w.timing["transport"] += time.perf_counter() - t0
        except KvSparseError as e:
            w.fail([rid], e)
            return "failed"
        seq.lengths[li] = start + b - a
        return "prefill"

    def _begin_at(self, transport: Any, layer: Any, li: int, rid: str, seq: Any, start: int, kv_cache: torch.Tensor,
                  blocks: torch.Tensor, like: torch.Tensor, last: bool) -> Any:
        """A request whose sequence does not hold the `start` tokens vLLM computed before this
        step: preempted and recomputed (a fresh sequence where it holds more), and, where vLLM
        starts it after a prefix it reused from its prefix cache, that prefix forked in the store
        from the live request that holds it (every layer at once: the layers after this one then
        hold it), as far as that request's sequence holds it, the rest (or all of it) read from
        vLLM's cache into this layer (vLLM writes this step's K/V there before the forward); with
        the store only, copied from that request's sequence in the store at this layer
        (_copy_prefix; None: not there yet)."""
        held = seq.lengths[li]
        if start > 0 and not self.prefix_caching:
            raise RuntimeError(f"kvsparse holds {held} tokens of request {rid} at layer {li}, vLLM's context is "
                               f"{start}")
        if held > start:
            seq = WORKER.restart(rid, self.shape)  # preempted, recomputed from its first token
        if start > 0 and li == 0 and not any(seq.lengths):
            seq = WORKER.fork_prefix(rid, self.shape, blocks.tolist(), start, kv_cache.shape[2]) or seq
        held = seq.lengths[li]
        if start > held and self.store_only:
            return seq if self._copy_prefix(transport, li, rid, seq, held, start, like, last) else None
        if start > held:  # the request's own tokens up to `held`: the same K/V as vLLM's cache holds
            k0, v0 = cached_prefix(kv_cache, blocks, start, layer.isa)
            transport.append(seq.sequence_id, li, k0[held:], v0[held:], held)
            seq.lengths[li] = start
            WORKER.prefix_imports += start - held if li == 0 else 0
        return seq

    def _copy_prefix(self, transport: Any, li: int, rid: str, seq: Any, held: int, start: int, like: torch.Tensor,
                     last: bool) -> bool:
        """Store only: tokens [held, start) of layer li of a reused prefix, copied from the sequence
        of the request that holds it (WORKER.prefix_sources: live, or finished and kept), read
        back from the store (plugin.copy_prefix_rows: False where it is not there yet)."""
        holder = WORKER.prefix_sources.get(rid)
        source = WORKER.sequences.get(holder) if holder is not None else None
        if not copy_prefix_rows(lambda sid, layer, n: transport.rows(sid, layer, n, self.num_kv_heads, like),
                                transport.append, rid, holder, source, seq, li, held, start, last):
            return False
        WORKER.prefix_copies += start - held if li == 0 else 0
        return True

    def _prompt_attention(self, transport: Any, sequence_id: str, layer: int, start: int, q: torch.Tensor,
                          k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        """Causal attention of a prompt chunk's queries (positions start ..) over the prompt's
        tokens before the chunk (read back from the store) and the chunk's own, in fp32; a whole
        prompt (start 0) through SALE when KVSPARSE_VLLM_SALE names its thresholds."""
        n, hkv, d = k.shape
        sale = WORKER.sale(WORKER.num_layers) if start == 0 else None
        if sale is not None:
            from kvsparse.torch import ops

            o, skipped = ops.sale_prefill(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          sale.layer(layer), scale=self.scale, params=sale.params)
            out.view(n, self.num_heads, d).copy_(o.transpose(0, 1).to(out.dtype))
            WORKER.sale_prefills += 1
            WORKER.sale_skipped += float(skipped.mean())
            return
        kk, vv = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, n, d]
        if start > 0:
            k0, v0 = transport.rows(sequence_id, layer, start, hkv, k)
            kk, vv = torch.cat([k0.to(k.dtype), kk], 1), torch.cat([v0.to(v.dtype), vv], 1)
        g = self.num_heads // hkv
        qf = q.transpose(0, 1).float()  # [H, n, d]
        kf = kk.float().repeat_interleave(g, 0)
        vf = vv.float().repeat_interleave(g, 0)
        allowed = torch.arange(start + n)[None, :] <= (start + torch.arange(n))[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, attn_mask=allowed, scale=self.scale)
        out.view(n, self.num_heads, d).copy_(o.transpose(0, 1).to(out.dtype))

    def do_kv_cache_update(self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        if self.store_only:  # vLLM's cache holds no K/V: the store has them
            return
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)


# The bit patterns cpu_cache_layout writes: base + digit, finite numbers of the cache's dtype (as
# integers of its width), one base-1024 digit of each element's index per pass.
_PATTERN_BASE = {2: 0x3C00, 4: 0x3F800000}
_DIGIT = 1024


@functools.lru_cache(maxsize=8)
def cpu_cache_layout(isa: str, block_size: int, head_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Where vLLM's CPU cache update (ops.cpu_attn_reshape_and_cache, with instruction set `isa`)
    puts element (token o of a block, channel c) of a K row and of a V row inside a block's interior
    for one kv head: two index maps of block_size * head_size positions, entry o * head_size + c.
    Found by writing distinct bit patterns through that same update into a scratch block and
    reading where each landed; NotImplementedError when they do not land once each inside the
    block (a layout this reading does not know)."""
    width = torch.empty((), dtype=dtype).element_size()
    if width not in _PATTERN_BASE:
        raise NotImplementedError(f"kvsparse reads vLLM's CPU cache of 2- or 4-byte elements, not {dtype}")
    as_int = {2: torch.int16, 4: torch.int32}[width]
    n = block_size * head_size
    index = torch.arange(n, dtype=torch.int64)
    found = [torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)]
    scale = 1
    while scale < n:
        digit = (index // scale) % _DIGIT + _PATTERN_BASE[width]
        rows = digit.to(as_int).view(dtype).view(block_size, 1, head_size)
        cache = torch.zeros(1, 1, 2 * block_size, head_size, dtype=dtype)
        k_cache, v_cache = cache.chunk(2, dim=2)
        vllm_ops.cpu_attn_reshape_and_cache(rows, rows, k_cache, v_cache, torch.arange(block_size), isa)
        for side, part in enumerate((k_cache, v_cache)):
            got = part.reshape(-1).view(as_int).to(torch.int64) - _PATTERN_BASE[width]
            if bool(((got < 0) | (got >= _DIGIT)).any()):
                raise NotImplementedError(f"vLLM's CPU cache layout ({isa}) leaves parts of a block unwritten")
            found[side] += got * scale
        scale *= _DIGIT
    maps = []
    for f in found:  # f[position] = the element written there; invert it
        where = torch.full((n,), -1, dtype=torch.int64)
        where[f] = torch.arange(n, dtype=torch.int64)
        if bool((where < 0).any()):
            raise NotImplementedError(f"vLLM's CPU cache layout ({isa}) is not a permutation of a block's rows")
        maps.append(where)
    return maps[0], maps[1]


def cached_prefix(kv_cache: torch.Tensor, blocks: torch.Tensor, tokens: int,
                  isa: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V ([tokens, Hkv, d]) of a request's first `tokens` tokens from vLLM's CPU paged
    cache ([blocks, Hkv, block size, 2 d]: per kv head a block's K rows, then its V rows, each laid
    out as cpu_cache_layout finds) through its block ids (at least the blocks that hold them)."""
    num_blocks, hkv, size, two_d = kv_cache.shape
    d = two_d // 2
    ids = blocks[:(tokens + size - 1) // size].long()
    k_map, v_map = cpu_cache_layout(isa, size, d, kv_cache.dtype)
    halves = kv_cache.view(num_blocks, hkv, 2, size * d)[ids]  # [blocks, Hkv, K or V, the interior]
    out = []
    for side, where in enumerate((k_map, v_map)):
        rows = halves[:, :, side].index_select(2, where).view(len(ids), hkv, size, d)
        out.append(rows.permute(0, 2, 1, 3).reshape(-1, hkv, d)[:tokens])
    return out[0], out[1]


class KvSparseMetadataBuilder(CPUAttentionMetadataBuilder):
    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> Any:
        """vLLM's metadata, and with vLLM's cache kept, where a step mixes decode rows (one token
        each, first in vLLM's batch order) with prompt rows, also the metadata of the prompt rows
        alone (`prompt_tail`): the backend then runs vLLM's attention for those only, the decode
        rows being kvsparse's."""
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        meta.prompt_tail = None
        if store_only() or not isinstance(meta.causal, bool) or meta.dynamic_causal is not None:
            return meta
        where = prompt_tail_rows(meta.query_start_loc.tolist(), meta.num_actual_tokens)
        if where is None:
            return meta
        first, a, rows = where
        starts = meta.query_start_loc[first:rows + 1] - a
        seq_lens = meta.seq_lens[first:rows]
        scheduler = vllm_ops.cpu_attn_get_scheduler_metadata(
            num_reqs=rows - first, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, seq_lens=seq_lens, dtype=self.dtype, query_start_loc=starts, causal=meta.causal,
            sliding_window_size=self.window_size, isa=self.isa, enable_kv_split=vllm_envs.VLLM_CPU_ATTN_SPLIT_KV,
            dynamic_causal=None, kv_cache_dtype=self.kv_cache_dtype)
        tail = replace(meta, num_actual_tokens=meta.num_actual_tokens - a, max_query_len=int(starts.diff().max()),
                       max_seq_len=int(seq_lens.max()), query_start_loc=starts, seq_lens=seq_lens,
                       block_table=meta.block_table[first:rows], slot_mapping=meta.slot_mapping[a:],
                       scheduler_metadata=scheduler)
        meta.prompt_tail = PromptTail(first, a, tail)
        return meta


class KvSparseBackend(CPUAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type:
        return KvSparseImpl

    @staticmethod
    def get_builder_cls() -> type:
        return KvSparseMetadataBuilder

    @classmethod
    def customize_spec(cls, spec: Any) -> Any:
        """Store only: what vLLM's KV budget counts per token and kv head is a few bytes (vLLM's
        block table still covers every token), so it admits requests by kvsparse's capacity."""
        if not store_only():
            return spec
        return replace(spec, state_content_bytes=2 * spec.dtype.itemsize)
