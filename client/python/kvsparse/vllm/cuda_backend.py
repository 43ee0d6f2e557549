"""kvsparse's attention backend for vLLM's CUDA build (vLLM 0.24.0, its V2 GPU model runner),
registered in vLLM's custom backend slot (``AttentionBackendEnum.CUSTOM``) by the plugin
(kvsparse.vllm.plugin); ``kvsparse.vllm.engine_args()`` gives the engine arguments that select it.

vLLM's FlashAttention backend with the decode rows answered by kvsparse's engine in the worker
process (kvsparse.torch.ops.InProcessEngine, on vLLM's GPU): vLLM's paged KV cache is written
(by the backend's forward, ``forward_includes_kv_cache_update``) at every step, generated tokens
too, since vLLM's prefix caching hands their blocks to later requests; prompt attention is
vLLM's, and in a step that mixes decode and prompt rows it runs for the prompt rows alone
(KvSparseCudaMetadataBuilder's ``prompt_tail``); each request's prompt K/V are appended to its kvsparse
sequence (created with the placement its method reads: compressed keys on the GPU for the
default method, the K/V in the engine's host-memory store); decode rows go through a
``DecodeSteps`` plan per method over the requests decoding, re-planned when that set changes,
one call per layer with no host synchronisation. The request of each row comes from the KV
connector (kvsparse.vllm.connector).

With KVSPARSE_VLLM_KV=store the K/V live in kvsparse's store only: vLLM's paged cache keeps a few
bytes a token (kvsparse.vllm.patches.shrink_store_only_spec), so vLLM admits requests by
kvsparse's capacity, nothing is written there, and the backend computes each prompt chunk's
causal attention itself: vLLM's FlashAttention over the chunk's K/V and the prompt's earlier rows
read back from the store, or SALE's kernels for a request's first chunk (its prompt up to there:
a prompt of its own) when KVSPARSE_VLLM_SALE names thresholds. Steps that mix prompt and decode rows then run no attention twice.

vLLM's prefix caching stays on: a request that vLLM starts after a prefix it reused from another
request's blocks has its sequence forked in the store from the request that holds the prefix (live,
or finished and kept as a holder: KVSPARSE_VLLM_KEEP_FINISHED), and what that request's sequence
does not hold is read from vLLM's cache (layer by layer, before its first chunk) or, with the
store only, copied from the holder's sequence in the store (CudaWorker.copy_prefix).

A request kvsparse cannot serve fails alone (CudaWorker's text): vLLM learns it through the KV
connector and ends it with an error; the others keep decoding. Each method's plan steps are
counted on the worker's Prometheus counters (plugin.observe, vLLM's /metrics): from the plans'
statistics, summed on the GPU and read every FIGURES_EVERY steps and when a plan ends.

Inside vLLM's CUDA graphs: where the deployment's method has a captured step (the default, the
flagship, and the other compressed-key, resident and signature methods; not dense over host
memory, vAttention's hash predictor or SAAP) and KVSPARSE_VLLM_FULL_GRAPHS is not 0, the backend declares
``UNIFORM_SINGLE_TOKEN_DECODE``: vLLM records each decode-only step whole in its full graphs,
kvsparse's plan over its batch slots inside (kvsparse.vllm.slot_plan), and runs steps with prompt
rows piecewise, their decode rows through the same plan. A request asking for another method then
fails alone naming the setting (behind the OpenAI server's admission check, kvsparse.vllm.middleware,
it is answered 400 before it gets here: plugin.other_method_refusal, the one rule). Otherwise (``AttentionCGSupport.NEVER``) attention runs between
vLLM's piecewise graphs, the decode rows through a plan per method over the requests decoding,
re-planned when that set changes.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import grpc
import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata
from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
)

from kvsparse.errors import KvSparseError
from kvsparse.methods import ModelShape, parse_method, placement_for
from kvsparse.tensors import dtype_name
from kvsparse.vllm import plugin
from kvsparse.vllm.connector import VLLM_VERSION, StepRows
from kvsparse.vllm.plugin import RequestSequence
from kvsparse.vllm.slot_plan import SlotPlan




@dataclass
class _Group:
    """The decode rows of one method in a step: their request ids, token indices and positions
    (each sequence's length before the step, pinned host memory until copied into the plan's
    positions at the step's first layer)."""

    rids: list[str]
    tokens: torch.Tensor | slice
    positions: torch.Tensor
    staged: bool = False


@dataclass
class _Plan:
    """A method's plan over its decoding requests, and the device tensor its steps read their
    positions from (one tensor for the plan's life: its layers' calls see the same buffers step
    after step and are replayed as CUDA graphs, kvsparse.torch.ops.DecodeSteps)."""

    rids: list[str]
    steps: Any
    positions: torch.Tensor


@dataclass
class _Step:
    prefill: list[tuple[int, str, int, int]]  # (row, request id, start, count)
    groups: dict[str, _Group]  # by method text
    token_starts: list[int]
    failed: list[tuple[int, int]] = field(default_factory=list)  # (first token, tokens): zeros
    # Requests whose first rows follow a prefix vLLM reused from its prefix cache: the prefix's
    # K/V are read from vLLM's paged cache into the request's sequence, layer by layer.
    imports: set[str] = field(default_factory=set)
    # The decode rows in the slot plan (CudaWorker.slot_rows): every row one of them, each its
    # own slot (the batch in; vLLM's uniform decode), or their slots and tokens (device tensors).
    slot_uniform: bool = False
    slot_index: torch.Tensor | None = None
    slot_tokens: torch.Tensor | None = None


@dataclass
class _PlanFigures:
    """A method's decode figures not yet on the worker's Prometheus counters (plugin.observe):
    the rows its plans' steps read and, of them, those found in the GPU's row cache, summed where
    the plan keeps its statistics (a captured plan's on the device: no synchronisation a step),
    and the sequence-layers and dense-equivalent bytes, counted on the host."""

    method: Any
    row_bytes: int  # a row's halves in host memory (K and/or V of one kv head)
    rows: Any = None  # [2] int64: rows read, row-cache hits
    sequence_layers: int = 0
    dense_bytes: int = 0
    steps: int = 0


# Steps of a method between two updates of the worker's counters (and whenever its plan ends).
FIGURES_EVERY = 32


@dataclass
class CudaWorker:
    """The backend's state in a vLLM worker process: the engine, each live request's sequence,
    the plan per method, and the step the connector bound.

    A request kvsparse cannot serve (a method that does not parse, or that the engine refuses; a
    store over its capacity; a plan's step refused) fails alone: its rows are answered with zeros
    (with vLLM's own attention in steps where that ran: its prompt's K/V in vLLM's cache stay
    right for the requests that share them) and a KV block of its own is reported as a failed load through kvsparse's KV connector, so that
    vLLM's scheduler ends it with an error (kv_load_failure_policy "fail", vLLM's default) and
    keeps serving the others, as on the CPU build (kvsparse.vllm.plugin.Worker.fail)."""

    sequences: dict[str, RequestSequence] = field(default_factory=dict)
    # Finished requests the connector's ledger keeps as prefix holders (StepRows.kept,
    # KVSPARSE_VLLM_KEEP_FINISHED): their sequences, for the requests that start after their
    # prefix to fork, until the ledger releases them (StepRows.released) or the store is full.
    kept: dict[str, RequestSequence] = field(default_factory=dict)
    methods: dict[str, str] = field(default_factory=dict)  # request id -> method text
    plans: dict[str, _Plan] = field(default_factory=dict)  # by method text
    rows: StepRows | None = None
    step: _Step | None = None
    restarts: int = 0
    replans: int = 0
    # Store only: (prompt chunk, layer) pairs whose attention the backend computed, and those of
    # them SALE prefilled with their shares of causal blocks skipped, summed (on the device).
    prompt_attentions: int = 0
    sale_prefills: int = 0
    sale_skipped: Any = 0.0
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why
    # The latest failures' reasons ("request id: why"), kept after vLLM ends the requests.
    failures: deque[str] = field(default_factory=lambda: deque(maxlen=64))
    # request id -> a KV block of its own (kvsparse.vllm.plugin.BlockLedger)
    failure_blocks: dict[str, int] = field(default_factory=dict)
    figures: dict[str, _PlanFigures] = field(default_factory=dict)  # by method text
    layer_graphs: tuple[int, int] = (0, 0)  # layer graphs recorded and replayed by closed plans
    # Steps the connector bound, those with prompt rows, and layer calls that wrote vLLM's paged
    # cache (with vLLM's cache kept: every layer call outside vLLM's full graphs).
    steps: int = 0
    prompt_steps: int = 0
    cache_writes: int = 0
    # Decode rows of steps with prompt rows left out of vLLM's attention there (summed over
    # layers; KvSparseCudaMetadataBuilder's prompt_tail).
    vllm_rows_skipped: int = 0
    prefix_imports: int = 0  # prompt tokens read from vLLM's prefix cache into sequences
    prefix_forks: int = 0  # prompt tokens of such prefixes forked in the store from another request
    prefix_forks_finished: int = 0  # of them, forked from finished requests kept as holders
    # With the K/V in the store only: prefix tokens the holder computed in the same step, copied
    # from its sequence in the store layer by layer (copy_prefix; counted at layer 0).
    prefix_copies: int = 0
    # Why the latest reused prefixes were read from vLLM's cache rather than forked ("request id:
    # why"): no live request holds them, or the store refused.
    fork_misses: deque[str] = field(default_factory=lambda: deque(maxlen=16))
    # vLLM's full decode graphs (kvsparse.vllm.slot_plan): the plan over the batch slots, the
    # step's decode rows in it (row = slot -> request id), steps with such rows and, of them,
    # those whose attention ran outside vLLM's graphs (the rest replayed inside them).
    slots: SlotPlan | None = None
    slots_tried: bool = False
    slot_rows: dict[int, str] = field(default_factory=dict)
    slot_steps: int = 0
    slot_forward_steps: int = 0
    shape: ModelShape | None = None  # the model's, once its attention ran
    layers: dict[int, Any] = field(default_factory=dict)  # vLLM's attention layers (their caches)
    _engine: Any = None

    def engine(self) -> Any:
        if self._engine is None:
            from kvsparse.torch.ops import InProcessEngine

            settings = plugin.cuda_settings()
            device = torch.cuda.current_device()
            self._engine = InProcessEngine(gpu="on", device=device, **settings)
        return self._engine

    def begin_step(self, rows: StepRows) -> None:
        gone = rows.finished | rows.preempted
        keep = {rid for rid in rows.kept if rid in self.sequences and rid not in self.failed}
        for rid in rows.released:
            self.release(rid)
        if self.slots is None:
            for rid in gone:
                self.forget(rid, keep=rid in keep)
        for rid in rows.finished:
            self.methods.pop(rid, None)
            self.failed.pop(rid, None)
            self.failure_blocks.pop(rid, None)
        self.failure_blocks.update(rows.failure_blocks)
        for rid, text in rows.methods.items():
            try:
                parse_method(text)  # checked at admission by the middleware where it runs
            except ValueError as e:
                self.fail([rid], e)
                continue
            why = None if self.slots is None else plugin.other_method_refusal(text, self.slots.text)
            if why is not None:
                self.fail([rid], ValueError(why))
                continue
            self.methods[rid] = text
        self.rows = rows
        self.step = None
        self.slot_rows = {}
        self.steps += 1
        if self.slots is not None:
            # The slots move off the requests gone (they have no rows) with the step's other
            # changes, in one rebind; then their sequences, no longer held, are dropped.
            self.stage_slots()
            for rid in gone:
                self.forget(rid, keep=rid in keep)

    def fail(self, rids: list[str], error: Exception) -> None:
        """Requests kvsparse cannot serve (the class text): forgotten, answered with zeros until
        vLLM ends them."""
        for rid in rids:
            self._mark_failed(rid, error)
        for rid in rids:
            self.forget(rid)

    def _mark_failed(self, rid: str, error: Exception) -> None:
        if getattr(error, "code", None) == grpc.StatusCode.RESOURCE_EXHAUSTED and self.kept:
            # The store is full: the finished requests kept for their prefixes go first (the
            # connector's ledger may still name them: a request after their prefix then reads it
            # from vLLM's cache, _fork_prefix's miss).
            plugin.LOG.warning("kvsparse: the store is full: releasing %d finished requests' sequences kept for "
                               "their prefixes", len(self.kept))
            for kept in list(self.kept):
                self.release(kept)
        if rid not in self.failed:
            plugin.LOG.warning("kvsparse: failing request %s: %s", rid, error)
            self.failed[rid] = str(error)
            self.failures.append(f"{rid}: {error}")

    def failed_blocks(self) -> set[int]:
        """A KV block of its own of every failed request vLLM still runs (kvsparse.vllm.connector)."""
        return {self.failure_blocks[r] for r in self.failed if r in self.failure_blocks}

    def end_step(self) -> None:
        if self.slots is not None:
            rids = [rid for rid in self.slot_rows.values() if rid in self.sequences]
            if rids and self.shape is not None:
                s = self.slots
                self.count_step(s.text, s.steps, rids, self.shape, s.q.element_size(),
                                entries=s.slots * self.shape.num_kv_heads)
            self.slots.idle()  # a replay vLLM runs without a step writes nothing
        self.rows = None
        self.step = None
        self.slot_rows = {}

    # ---- vLLM's full decode graphs: the plan over the batch slots (kvsparse.vllm.slot_plan). ----

    def make_slots(self, impl: "KvSparseCudaImpl", device: torch.device) -> None:
        """The deployment method's plan over vLLM's batch slots (once, at the first forward
        outside a capture: vLLM's profiling run, so its memory counts there), unless
        KVSPARSE_VLLM_FULL_GRAPHS is 0, the method has no captured step here, or the plan would
        be too large (SlotPlan.too_large; logged)."""
        self.slots_tried = True
        if not plugin.full_graphs_asked() or self.shape is None:
            return
        text = os.environ[plugin.ENV_METHOD]
        why = SlotPlan.too_large(self.shape, impl.max_num_seqs, impl.max_tokens,
                                 torch.cuda.get_device_properties(device).total_memory)
        if why is not None:
            plugin.LOG.warning("kvsparse: %s decodes outside vLLM's full CUDA graphs: %s", text, why)
            return
        try:
            slots = SlotPlan.create(self.engine(), text, self.shape, impl.max_num_seqs, max_tokens=impl.max_tokens,
                                    seed=impl.seed, scale=impl.scale, device=device)
        except (KvSparseError, ValueError) as e:
            why = str(e)
        else:
            if slots.steps.captured:
                self.slots = slots
                plugin.LOG.info("kvsparse: %s decodes inside vLLM's full CUDA graphs over %d batch slots", text,
                                slots.slots)
                return
            why = f"the method has no captured step here ({slots.steps.mode})"
            slots.close(self.engine())
        plugin.LOG.warning("kvsparse: %s decodes outside vLLM's full CUDA graphs: %s", text, why)

    def stage_slots(self) -> None:
        """The bound step's decode rows into the slot plan (slot i serves row i): each row's
        request admitted (a prefix vLLM reused read from its cache first), the plan moved where
        the rows changed, the positions staged, the sequences' lengths advanced by the step. The
        other rows (prompts, failed requests) are idle slots; vLLM's forward takes the prompts."""
        slots = self.slots
        assert slots is not None and self.rows is not None
        if self.shape is None:
            return
        want: list[str | None] = [None] * slots.slots
        staged: dict[int, str] = {}
        for i, (rid, start, count) in enumerate(self.rows.rows[:slots.slots]):
            if rid in self.failed or count != 1 or start == 0:
                continue
            try:
                if self._admit(rid, start, self.shape):
                    self._import_prefix(rid, start)
            except (KvSparseError, ValueError) as e:
                self.fail([rid], e)
                continue
            want[i] = self.sequences[rid].sequence_id
            staged[i] = rid
        self._bind_slots(want)
        staged = {i: rid for i, rid in staged.items() if rid not in self.failed}
        slots.stage([self.rows.rows[i][1] if i in staged else -1 for i in range(slots.slots)])
        for rid in staged.values():
            seq = self.sequences[rid]
            seq.lengths = [n + 1 for n in seq.lengths]
        self.slot_rows = staged
        self.slot_steps += 1 if staged else 0

    def unbind_slots(self, sequence_ids: set[str]) -> None:
        """Slots holding these sequences back to their placeholders (a plan holds its sequences:
        before they are dropped)."""
        if self.slots is not None and sequence_ids & set(self.slots.ids):
            self._bind_slots([None if sid in sequence_ids else sid for sid in self.slots.ids])

    def _bind_slots(self, want: list[str | None]) -> None:
        slots = self.slots
        assert slots is not None
        by_sequence = {seq.sequence_id: rid for rid, seq in self.sequences.items()}
        bound = [by_sequence[sid] for sid in slots.ids if sid in by_sequence]
        try:
            refused = slots.bind(want)
        except KvSparseError as e:  # the plan holds none: the requests it was to hold fail
            for rid in bound + [by_sequence[sid] for sid in want if sid in by_sequence]:
                self._mark_failed(rid, e)
            return
        for rid in bound if refused is not None else []:  # a step refused since the last commit
            self._mark_failed(rid, refused)

    def _fork_prefix(self, rid: str, start: int, shape: ModelShape) -> int:
        """A request vLLM starts after `start` tokens it reused from its prefix cache, whose blocks
        a live request, or a finished one kept as a holder, holds (the connector's
        prefix_sources): its sequence forked from that request's in the store, as much of the
        prefix as that request's sequence holds in every layer (its whole pages shared). That request may be computing the rest of the prefix in
        this very step (vLLM hands out a block as soon as it is scheduled): those tokens are read
        from vLLM's cache, written before any is read (KvSparseCudaImpl.forward). The tokens
        forked: 0 where no live request holds the prefix, it failed, or the store refuses (the
        whole prefix is then read from vLLM's cache)."""
        assert self.rows is not None
        holder, tokens = self.rows.prefix_sources.get(rid, (None, 0))
        source = self._holder_sequence(holder)
        n = source.held(start) if source is not None and tokens == start else 0
        if n == 0:
            why = ("no live request holds it" if holder is None else
                   f"{holder} has no sequence" if source is None else
                   f"the connector named {holder} for {tokens} tokens, vLLM's context is {start}" if tokens != start
                   else f"{holder}'s sequence holds none of it yet")
            self.fork_misses.append(f"{rid}: {why}")
            return 0
        method = parse_method(self.method_text(rid))
        try:
            self.sequences[rid] = RequestSequence.fork(self.engine().fork_sequence, source, n, method, shape)
        except KvSparseError as e:
            plugin.LOG.info("kvsparse: request %s reads its prefix from vLLM's cache: forking %s's sequence: %s",
                            rid, holder, e)
            self.fork_misses.append(f"{rid}: forking {holder}'s sequence: {e}")
            return 0
        self.prefix_forks += n
        if holder in self.kept:
            self.prefix_forks_finished += n
        return n

    def _import_prefix(self, rid: str, start: int) -> None:
        """A request whose first step is one token after a prefix vLLM reused from its prefix
        cache: the prefix's K/V (after what a fork gave its sequence) read from vLLM's paged
        cache (its blocks, from the connector) into its sequence in every layer, before the step
        (a full graph's replay runs no forward)."""
        assert self.rows is not None and self.shape is not None
        blocks = self.rows.prefix_blocks.get(rid)
        if blocks is None or len(self.layers) < self.shape.num_layers:
            raise ValueError(f"request {rid} starts after {start} tokens of vLLM's prefix cache, whose blocks "
                             "kvsparse was not told")
        seq = self.sequences[rid]
        held = seq.lengths[0]
        if plugin.store_only():  # vLLM's cache holds no K/V: the holder's sequence holds the prefix
            for li in range(self.shape.num_layers):
                self.copy_prefix(rid, seq, li, held, start, last=True)
            return
        for li in range(self.shape.num_layers):
            kv_cache = self.layers[li].kv_cache
            k0, v0 = cached_prefix(kv_cache, torch.tensor(blocks, device=kv_cache.device), start)
            self.engine().append(seq.sequence_id, li, k0[held:], v0[held:], held)
            seq.lengths[li] = start
        self.prefix_imports += start - held

    def _holder_sequence(self, holder: str | None) -> RequestSequence | None:
        """The sequence of the request holding a reused prefix (the connector's prefix_sources):
        live, or finished and kept; None where there is none or it failed."""
        if holder is None or holder in self.failed:
            return None
        return self.sequences.get(holder) or self.kept.get(holder)

    def copy_prefix(self, rid: str, seq: RequestSequence, li: int, held: int, start: int, last: bool) -> bool:
        """With the K/V in the store only: tokens [held, start) of layer li of a prefix vLLM reused,
        copied from the sequence of the request that holds it (the connector's prefix_sources:
        live, or finished and kept), read back from the store (plugin.copy_prefix_rows: False where
        it is not there yet)."""
        assert self.rows is not None
        holder, _ = self.rows.prefix_sources.get(rid, (None, 0))
        source = self._holder_sequence(holder)
        # read_rows: [Hkv, start, d] in host memory
        if not plugin.copy_prefix_rows(self.engine().read_rows, self.engine().append, rid, holder, source, seq, li,
                                       held, start, last):
            return False
        self.prefix_copies += start - held if li == 0 else 0
        return True

    def method_text(self, rid: str) -> str:
        return self.methods.get(rid) or os.environ[plugin.ENV_METHOD]

    def sequence(self, rid: str, shape: ModelShape) -> RequestSequence:
        seq = self.sequences.get(rid)
        if seq is None:
            method = parse_method(self.method_text(rid))
            seq = RequestSequence.create(self.engine().create_sequence, method, shape)
            self.sequences[rid] = seq
        return seq

    def forget(self, rid: str, keep: bool = False) -> None:
        """Drops a request's sequence, first ending any plan that holds it; with `keep`, a
        finished request kept as a prefix holder, its sequence moves to `kept` instead."""
        for text, held in list(self.plans.items()):
            if rid in held.rids:
                self.close_plan(text)
        seq = self.sequences.pop(rid, None)
        if seq is not None:
            self.unbind_slots({seq.sequence_id})
            if keep:
                self.kept[rid] = seq
                return
            self._drop(rid, seq)

    def release(self, rid: str) -> None:
        """A finished request no longer kept as a prefix holder: its sequence out of the store."""
        seq = self.kept.pop(rid, None)
        if seq is not None:
            self._drop(rid, seq)

    def _drop(self, rid: str, seq: RequestSequence) -> None:
        try:
            self.engine().drop_sequence(seq.sequence_id)
        except KvSparseError as e:  # nothing left to free
            plugin.LOG.warning("kvsparse: dropping the sequence of request %s: %s", rid, e)

    def count_step(self, text: str, plan: Any, rids: list[str], shape: ModelShape, element_bytes: int,
                   entries: int | None = None) -> None:
        """A step of a method's plan done (every layer): its figures into the method's
        _PlanFigures, onto the counters every FIGURES_EVERY steps. entries: the statistics'
        (sequence, kv head) entries to sum (default: the first len(rids) sequences')."""
        f = self.figures.get(text)
        if f is None:
            method = self.sequences[rids[0]].method
            p = placement_for(method)
            halves = (p.k_tier == "host") + (p.v_tier == "host")
            f = self.figures[text] = _PlanFigures(method, halves * shape.head_dim * element_bytes)
        stats = plan.stats()  # [layers, 4, B * H]: block 0 rows read, block 3 row-cache hits
        # Slices only: an index list ([0, 3]) would be copied to the GPU from pageable memory,
        # which waits for every kernel queued before it (a synchronisation a step, 2.7 ms of the
        # host's lead lost at 128k on an H200: docs/PERF.md, "The flagship inside vLLM").
        m = entries if entries is not None else len(rids) * shape.num_kv_heads
        step = torch.stack((stats[:, 0, :m].sum(dtype=torch.int64), stats[:, 3, :m].sum(dtype=torch.int64)))
        f.rows = step if f.rows is None else f.rows + step
        f.sequence_layers += len(rids) * shape.num_layers
        kv_row = 2 * shape.num_kv_heads * shape.head_dim * element_bytes  # K and V of a token
        f.dense_bytes += sum(sum(self.sequences[r].lengths) for r in rids) * kv_row
        f.steps += 1
        if f.steps % FIGURES_EVERY == 0:
            self.flush_figures(text)

    def flush_figures(self, text: str | None = None) -> None:
        """A method's figures (every method's: None) onto the worker's counters (one
        synchronisation with the device)."""
        for t in [text] if text is not None else list(self.figures):
            f = self.figures.get(t)
            if f is None or f.rows is None:
                continue
            rows, hits = (int(x) for x in f.rows.tolist())
            plugin.observe(f.method, f.sequence_layers, SimpleNamespace(
                rows_fetched=rows, rows_cached=hits, bytes_fetched=(rows - hits) * f.row_bytes,
                bytes_device=hits * f.row_bytes, dense_equivalent_bytes=f.dense_bytes, engine_seconds=0.0,
                selection_seconds=0.0))
            f.rows, f.sequence_layers, f.dense_bytes = None, 0, 0

    def close_plan(self, text: str) -> None:
        """Ends a plan, its written rows the store's. A step it refused (its sequences no longer
        whole) fails the plan's requests."""
        held = self.plans.pop(text)
        self.flush_figures(text)
        recorded, replayed = held.steps.graph_counts()
        self.layer_graphs = (self.layer_graphs[0] + recorded, self.layer_graphs[1] + replayed)
        try:
            held.steps.commit()
        except KvSparseError as e:
            for rid in held.rids:
                self._mark_failed(rid, e)
        finally:
            held.steps.close()

    def plan(self, text: str, g: _Group, max_tokens: int, seed: int, scale: float, dtype: str,
             device: torch.device) -> _Plan:
        """The plan of a method over exactly the group's requests (in this order), re-planned
        when the set changed since the last step; the group's positions in its positions tensor
        (once a step)."""
        held = self.plans.get(text)
        if held is None or held.rids != g.rids:
            if held is not None:
                self.close_plan(text)
            ids = [self.sequences[r].sequence_id for r in g.rids]
            steps = self.engine().plan_steps(ids, self.sequences[g.rids[0]].method, max_tokens=max_tokens, seed=seed,
                                             scale=scale, dtype=dtype)
            held = self.plans[text] = _Plan(list(g.rids), steps, torch.empty(len(g.rids), dtype=torch.long,
                                                                                device=device))
            self.replans += 1
        if not g.staged:
            held.positions.copy_(g.positions, non_blocking=True)
            g.staged = True
        return held

    def prepare(self, shape: ModelShape, num_tokens: int, device: torch.device) -> _Step:
        """The bound step's rows sorted into prompt rows and decode groups (once per step)."""
        if self.step is not None:
            return self.step
        assert self.rows is not None
        starts, prefill, decode, failed, imports = [], [], {}, [], set()
        token = 0
        for i, (rid, start, count) in enumerate(self.rows.rows):
            starts.append(token)
            token += count
            if i in self.slot_rows:  # staged before the step (stage_slots)
                continue
            if rid not in self.failed:
                try:
                    if self._admit(rid, start, shape):
                        imports.add(rid)
                except (KvSparseError, ValueError) as e:  # a method the engine refuses, a full store
                    self.fail([rid], e)
            if rid in self.failed:
                failed.append((starts[-1], count))
            elif count == 1 and start > 0 and rid not in imports:
                decode.setdefault(self.method_text(rid), []).append(i)
            else:
                prefill.append((i, rid, start, count))
        if token != num_tokens:
            raise RuntimeError(
                f"kvsparse.vllm.connector's batch order (written against vLLM {VLLM_VERSION}) gives "
                f"{token} tokens, vLLM's batch has {num_tokens}: this vLLM orders its batch differently"
            )
        groups = {}
        for text, rows in decode.items():
            rids = [self.rows.rows[i][0] for i in rows]
            tok = [starts[i] for i in rows]
            tokens: torch.Tensor | slice = (
                slice(tok[0], tok[0] + len(tok)) if tok == list(range(tok[0], tok[0] + len(tok)))
                else torch.tensor(tok, dtype=torch.long).pin_memory().to(device, non_blocking=True)
            )
            pos = torch.tensor([self.rows.rows[i][1] for i in rows], dtype=torch.long).pin_memory()
            groups[text] = _Group(rids, tokens, pos)
        for text in [t for t in self.plans if t not in groups]:
            self.close_plan(text)  # nobody decodes with it any more: its rows go to the store
        self.step = _Step(prefill, groups, starts, failed, imports)
        if self.slot_rows:
            rows = sorted(self.slot_rows)
            self.step.slot_uniform = len(rows) == len(self.rows.rows)  # one token a row: token i is row i
            if not self.step.slot_uniform:
                self.step.slot_index = torch.tensor(rows, dtype=torch.long).pin_memory().to(device, non_blocking=True)
                self.step.slot_tokens = torch.tensor([starts[i] for i in rows], dtype=torch.long).pin_memory().to(
                    device, non_blocking=True)
        self.prompt_steps += 1 if prefill else 0
        return self.step

    def _admit(self, rid: str, start: int, shape: ModelShape) -> bool:
        """The request's sequence holding the tokens vLLM computed before this step (a fresh one
        for a request vLLM computes again from its first token, after a preemption). True where
        the sequence is new and vLLM starts the request after a prefix it reused from its prefix
        cache (with vLLM's cache kept): the forward reads that prefix, or what a fork from the live
        request holding it left out, from vLLM's cache."""
        if rid not in self.sequences and start > 0:
            forked = self._fork_prefix(rid, start, shape)
            if forked > 0:
                return forked < start
        seq = self.sequence(rid, shape)
        if seq.lengths[0] == start:
            return False
        if start != 0:
            if seq.lengths[0] == 0:  # from vLLM's cache, or with the store only from the holder's sequence
                return True
            raise ValueError(f"kvsparse holds {seq.lengths[0]} tokens of request {rid}, vLLM's context is {start}")
        self.restarts += 1
        self.forget(rid)
        self.sequence(rid, shape)
        return False

    def close(self) -> None:
        for text in list(self.plans):
            self.close_plan(text)
        if self.slots is not None:
            self.unbind_slots(set(self.slots.ids))
        for rid in list(self.sequences):
            self.forget(rid)
        for rid in list(self.kept):  # finished requests kept as prefix holders
            self.release(rid)
        if self.slots is not None:
            self.slots.close(self.engine())
            self.slots = None


CUDA_WORKER = CudaWorker()


class KvSparseCudaImpl(FlashAttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, alibi_slopes: Any,
                 sliding_window: int | None, kv_cache_dtype: str, logits_soft_cap: float | None = None,
                 *args: Any, **kwargs: Any) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, *args, **kwargs)
        plugin.refuse_unsupported(alibi_slopes, sliding_window, logits_soft_cap, kwargs.get("sinks"),
                                  kv_cache_dtype)
        config = get_current_vllm_config()
        if not plugin.connector_configured(config):
            raise ValueError(
                "kvsparse's CUDA backend learns each row's request from kvsparse's KV connector: run vLLM with "
                "kvsparse.vllm.engine_args() (or --kv-transfer-config naming KvSparseConnector, docs/VLLM.md)"
            )
        self.num_layers = config.model_config.get_num_layers(config.parallel_config)
        from kvsparse.torch.ops import gpu_shape_refusal

        why = gpu_shape_refusal(ModelShape(self.num_layers, num_heads, num_kv_heads, head_size,
                                           dtype_name(config.model_config.dtype)))
        if why is not None:  # its steps would not be captured inside vLLM's CUDA graphs
            raise ValueError(f"kvsparse's CUDA backend cannot serve this model's attention: {why}")
        self.max_tokens = config.model_config.max_model_len
        self.max_num_seqs = config.scheduler_config.max_num_seqs  # the batch slots
        self.store_only = plugin.store_only()
        self.seed = int(os.environ.get(plugin.ENV_SEED, "0"))
        self.shape: ModelShape | None = None  # the sequences' shape, once the K/V dtype is seen

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor, output_scale: Any = None,
                output_block_scale: Any = None) -> torch.Tensor:
        w = CUDA_WORKER
        li = extract_layer_index(layer.layer_name)
        if self.shape is None:
            self.shape = ModelShape(self.num_layers, self.num_heads, self.num_kv_heads, self.head_size,
                                    dtype_name(query.dtype))
            w.shape = self.shape
        w.layers.setdefault(li, layer)
        if not w.slots_tried and not torch.cuda.is_current_stream_capturing():
            w.make_slots(self, query.device)
        if attn_metadata is None or w.rows is None:  # profiling, warm-up and graph-capture runs
            n = 0 if attn_metadata is None else attn_metadata.num_actual_tokens
            if w.slots is not None and 0 < n <= w.slots.slots and attn_metadata.max_query_len == 1:
                # vLLM's full decode graph of n rows (its capture, or the eager pass before it):
                # the rows' K/V into vLLM's cache, then the slot plan, every slot idle (positions
                # -1) until a step binds them.
                self.do_kv_cache_update(layer, key, value, kv_cache, attn_metadata.slot_mapping)
                w.slots.decode_rows(li, query, key, value, output[:n].view(n, self.num_heads, self.head_size), n)
                return output
            if self.store_only:  # vLLM's cache holds no K/V to attend over; these outputs are not used
                return output
            if attn_metadata is not None:
                self.do_kv_cache_update(layer, key, value, kv_cache, attn_metadata.slot_mapping)
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        shape = self.shape
        step = w.prepare(shape, attn_metadata.num_actual_tokens, query.device)
        if not self.store_only:
            # Every row's K/V into vLLM's cache, decode rows too: vLLM's prefix caching hands
            # the blocks of generated tokens to later requests (a chat's next turn), whose
            # prefix the backend reads from there (tests/vllm/test_vllm_cuda.py, the follow-up).
            # First, as vLLM's own backends have it: a prefix read below may end in blocks
            # another request of this step computes.
            self.do_kv_cache_update(layer, key, value, kv_cache, attn_metadata.slot_mapping)
            w.cache_writes += 1
        # Store only: a row whose reused prefix its holder writes later in this step's batch goes
        # after the others (_prefill_row's False).
        later = [entry for entry in step.prefill
                 if not self._prefill_row(w, li, step, entry, query, key, value, kv_cache, attn_metadata, output)]
        for entry in later:
            self._prefill_row(w, li, step, entry, query, key, value, kv_cache, attn_metadata, output, last=True)
        vllm_attention = not self.store_only and bool(step.prefill or not (step.groups or w.slot_rows))
        if vllm_attention:
            decode_rows = sum(len(g.rids) for g in step.groups.values()) + len(w.slot_rows)
            w.vllm_rows_skipped += plugin.vllm_attention(
                super().forward, getattr(attn_metadata, "prompt_tail", None), decode_rows, bool(step.failed), layer,
                query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
        n = attn_metadata.num_actual_tokens
        out = output[:n].view(n, self.num_heads, self.head_size)
        for text, g in step.groups.items():
            self._decode(w, li, text, g, query, key, value, out, shape.dtype)
        if w.slot_rows:
            self._decode_slots(w, li, step, query, key, value, out)
        # vLLM ends these requests and drops their tokens. Where vLLM's attention computed their
        # rows, its output stays: the next layers' K/V of a failed request's prompt go into vLLM's
        # cache, where prefix caching hands them to the requests sharing that prompt (zeros there
        # changed their tokens: tests/vllm/test_vllm_cuda.py, the full-graphs test).
        for a, count in [] if vllm_attention else step.failed:
            output[a:a + count] = 0
        return output

    def _prefill_row(self, w: CudaWorker, li: int, step: _Step, entry: tuple[int, str, int, int], query: torch.Tensor,
                     key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: Any,
                     output: torch.Tensor, last: bool = False) -> bool:
        """One prompt row (or a row after a reused prefix) at layer li: the prefix first where the
        request imports one (from vLLM's cache; with the store only from the holder's sequence,
        CudaWorker.copy_prefix), then its K/V into the store, and with the store only its attention.
        False where the holder's sequence does not hold the prefix yet at this layer (not `last`)."""
        row, rid, start, count = entry
        a = step.token_starts[row]
        if rid in w.failed:  # at an earlier layer of this step
            return True
        seq = w.sequences[rid]
        try:
            held = seq.lengths[li]
            if rid in step.imports and held < start:  # the prefix vLLM reused (or a fork's rest), first
                if self.store_only:
                    if not w.copy_prefix(rid, seq, li, held, start, last):
                        return False
                else:
                    # The request's row of the step's block table (the batch's order, which the
                    # connector's rows follow).
                    k0, v0 = cached_prefix(kv_cache, attn_metadata.block_table[row], start)
                    w.engine().append(seq.sequence_id, li, k0[held:], v0[held:], held)
                    w.prefix_imports += start - held if li == 0 else 0
            w.engine().append(seq.sequence_id, li, key[a:a + count], value[a:a + count], start)
            if self.store_only:
                self._prompt_attention(w, seq.sequence_id, li, start, query[a:a + count], key[a:a + count],
                                       value[a:a + count], output[a:a + count])
        except KvSparseError as e:  # the store full, the sequence refused
            w.fail([rid], e)
            step.failed.append((a, count))
            return True
        seq.lengths[li] = start + count
        return True

    def _decode(self, w: CudaWorker, li: int, text: str, g: _Group, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, out: torch.Tensor, dtype: str) -> None:
        """One layer of the decode rows of one method, through its plan. A failure fails every
        request of the plan (their steps are no longer whole), whose rows get zeros."""
        b = len(g.rids)
        if not any(r in w.failed for r in g.rids):
            try:
                held = w.plan(text, g, self.max_tokens, self.seed, self.scale, dtype, query.device)
                q = query[g.tokens].view(b, self.num_heads, self.head_size)
                k = key[g.tokens].view(b, self.num_kv_heads, self.head_size)
                v = value[g.tokens].view(b, self.num_kv_heads, self.head_size)
                if isinstance(g.tokens, slice) and out.dtype == q.dtype:  # into vLLM's output rows
                    held.steps.decode(li, q, k, v, held.positions, out=out[g.tokens])
                else:
                    out[g.tokens] = held.steps.decode(li, q, k, v, held.positions).to(out.dtype)
                for rid in g.rids:
                    w.sequences[rid].lengths[li] += 1
                if li == self.num_layers - 1:
                    w.count_step(text, held.steps, g.rids, self.shape, query.element_size())
                return
            except KvSparseError as e:
                w.fail(g.rids, e)
        else:
            w.fail([r for r in g.rids if r not in w.failed], KvSparseError("a request of the same plan failed"))
        out[g.tokens] = 0

    def _decode_slots(self, w: CudaWorker, li: int, step: _Step, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, out: torch.Tensor) -> None:
        """One layer of the step's decode rows through the slot plan, outside vLLM's graphs (a
        step with prompt rows, or a batch vLLM has no full graph for). A failure fails every
        request in the slots (their steps are no longer whole), whose rows get zeros."""
        assert w.slots is not None
        w.slot_forward_steps += 1 if li == 0 else 0
        try:
            if step.slot_uniform:
                w.slots.decode_rows(li, query, key, value, out, len(w.slot_rows))
            else:
                w.slots.decode_gathered(li, query, key, value, out, step.slot_index, step.slot_tokens)
        except KvSparseError as e:
            rids = list(w.slot_rows.values())
            for i in w.slot_rows:
                out[step.token_starts[i]] = 0
            w.slot_rows = {}
            w.fail(rids, e)

    def _prompt_attention(self, w: CudaWorker, sequence_id: str, layer: int, start: int, q: torch.Tensor,
                          k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        """Store only: causal attention of a prompt chunk's queries (positions start ..) over the
        prompt's tokens before the chunk (read back from the store) and the chunk's own, by vLLM's
        FlashAttention over contiguous K/V; a first chunk (start 0) through SALE's kernels when
        KVSPARSE_VLLM_SALE names thresholds."""
        n, h, hkv, d = q.shape[0], self.num_heads, self.num_kv_heads, self.head_size
        q, k, v, o = q.view(n, h, d), k.view(n, hkv, d), v.view(n, hkv, d), out.view(n, h, d)
        w.prompt_attentions += 1
        sale = plugin.sale_thresholds(self.num_layers) if start == 0 else None
        if sale is not None:
            from kvsparse.torch import ops

            res, skipped = ops.sale_prefill(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                            sale.layer(layer), scale=self.scale, params=sale.params)
            o.copy_(res.transpose(0, 1))
            w.sale_prefills += 1
            w.sale_skipped = w.sale_skipped + skipped.mean()
            return
        if start > 0:
            k0, v0 = w.engine().read_rows(sequence_id, layer, start)  # [Hkv, start, d], host memory
            k = torch.cat([k0.transpose(0, 1).to(k.device, k.dtype), k])
            v = torch.cat([v0.transpose(0, 1).to(v.device, v.dtype), v])
        cu = torch.tensor([0, n, 0, start + n], dtype=torch.int32).to(q.device, non_blocking=True)
        flash_attn_varlen_func(q=q, k=k, v=v, out=o, cu_seqlens_q=cu[:2], max_seqlen_q=n, cu_seqlens_k=cu[2:],
                               max_seqlen_k=start + n, softmax_scale=self.scale, causal=True,
                               fa_version=self.vllm_flash_attn_version)

    def do_kv_cache_update(self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        if self.store_only:  # vLLM's cache holds no K/V: the store has them
            return
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)


def cached_prefix(kv_cache: torch.Tensor, blocks: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V ([tokens, Hkv, d], on the GPU) of a request's first `tokens` tokens from
    vLLM's paged cache ([blocks, 2, block size, Hkv, d]) through its block ids (at least the
    blocks that hold them, in order)."""
    size = kv_cache.shape[2]
    blocks = blocks[:(tokens + size - 1) // size].long()
    k, v = kv_cache.unbind(1)
    shape = (-1, *k.shape[2:])
    return k[blocks].reshape(shape)[:tokens], v[blocks].reshape(shape)[:tokens]


class KvSparseCudaMetadataBuilder(FlashAttentionMetadataBuilder):
    # Attention runs eagerly between vLLM's piecewise graphs, unless the slot plan exists (made
    # at vLLM's profiling run, before vLLM asks): then vLLM's full decode graphs hold it (module
    # text).
    _cudagraph_support = AttentionCGSupport.NEVER

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> Any:
        """vLLM's metadata and, with vLLM's cache kept, in a step whose decode rows (one token
        each: vLLM's V2 model runner orders its batch by tokens, fewest first) precede prompt
        rows, the metadata of the prompt rows alone (`prompt_tail`, kvsparse.vllm.plugin.PromptTail):
        the forward then runs vLLM's attention for those only. Built by FlashAttention's own
        builder over those rows without its ahead-of-time schedule (`fast_build`: such a step runs
        outside vLLM's full graphs, and the schedule's buffer holds the whole batch's)."""
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        meta.prompt_tail = None
        c = common_attn_metadata
        if (plugin.store_only() or meta.use_cascade or self.dcp_world_size > 1 or not isinstance(c.causal, bool)
                or c.mm_req_doc_ranges is not None):
            return meta
        where = plugin.prompt_tail_rows(c.query_start_loc_cpu.tolist(), c.num_actual_tokens)
        if where is None:
            return meta
        first, a, rows = where
        starts = c.query_start_loc_cpu[first:rows + 1] - a
        bound = c.seq_lens_cpu_upper_bound  # exact for prompt rows (vLLM's text)
        tail = CommonAttentionMetadata(
            query_start_loc=c.query_start_loc[first:rows + 1] - a, query_start_loc_cpu=starts,
            seq_lens=c.seq_lens[first:rows], num_reqs=rows - first, num_actual_tokens=c.num_actual_tokens - a,
            max_query_len=int(starts.diff().max()),
            max_seq_len=int(bound[first:rows].max()) if bound is not None else c.max_seq_len,
            block_table_tensor=c.block_table_tensor[first:rows], slot_mapping=c.slot_mapping[a:c.num_actual_tokens],
            causal=c.causal)
        meta.prompt_tail = plugin.PromptTail(first, a, super().build(0, tail, fast_build=True))
        return meta

    @classmethod
    def get_cudagraph_support(cls, vllm_config: Any, kv_cache_spec: Any) -> AttentionCGSupport:
        if CUDA_WORKER.slots is not None:
            return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        return cls._cudagraph_support


class KvSparseCudaBackend(FlashAttentionBackend):
    # The impl's forward writes vLLM's paged cache where vLLM's attention will read it (module
    # text): vLLM then calls no separate cache update per layer.
    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type:
        return KvSparseCudaImpl

    @staticmethod
    def get_builder_cls() -> type:
        return KvSparseCudaMetadataBuilder
