"""The attention backend of kvsparse's vLLM plugin (kvsparse.vllm.plugin says how it is enabled
and what it does): vLLM's CPU attention backend whose decode rows are answered by kvsparse.
Imported by vLLM (through the backend registry) in its worker process only."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any

import torch
from vllm.config import get_current_vllm_config
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
    connector_configured,
    observe,
    refuse_prefix_caching,
    refuse_unsupported,
    store_only,
)



class KvSparseImpl(CPUAttentionBackendImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: Any = None, sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None, *args: Any, **kwargs: Any) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, *args, **kwargs)
        refuse_unsupported(alibi_slopes, sliding_window, logits_soft_cap, kwargs.get("sinks"), kv_cache_dtype)
        config = get_current_vllm_config()
        refuse_prefix_caching(config)
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
        shape = self.shape
        transport = w.transport()
        decode: list[int] = []  # rows answered by kvsparse
        failed: list[int] = []  # rows of requests kvsparse failed (WORKER.fail): zeros
        prefill = False
        for i, rid in enumerate(rows):
            a, b = qsl[i], qsl[i + 1]
            if rid in w.failed:
                failed.append(i)
                continue
            start = seq_lens[i] - (b - a)  # tokens before this step's
            try:
                seq = w.sequence(rid, shape)
                if seq.lengths[li] != start:
                    if start != 0:
                        raise RuntimeError(
                            f"kvsparse holds {seq.lengths[li]} tokens of request {rid} at layer {li}, vLLM's "
                            f"context is {start}"
                        )
                    seq = w.restart(rid, shape)  # preempted, recomputed from its first token
                if b - a == 1 and start > 0:
                    decode.append(i)
                    continue
                # A prompt (or a chunk of one): its K/V to the store; its attention vLLM's, or
                # (store only) computed here over the store's rows of the prompt before it.
                t0 = time.perf_counter()
                transport.append(seq.sequence_id, li, key[a:b], value[a:b], start)
                if self.store_only:
                    self._prompt_attention(transport, seq.sequence_id, li, start, query[a:b], key[a:b],
                                           value[a:b], output[a:b])
                timing["transport"] += time.perf_counter() - t0
            except KvSparseError as e:
                w.fail([rid], e)
                failed.append(i)
                continue
            seq.lengths[li] = start + b - a
            prefill = True
        if not self.store_only and (prefill or not decode):
            t0 = time.perf_counter()
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                            output_block_scale)
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
        for i in failed:  # vLLM discards these rows' tokens when it fails the requests
            out[qsl[i]:qsl[i + 1]] = 0
        return output


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


class KvSparseMetadataBuilder(CPUAttentionMetadataBuilder):
    pass


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
