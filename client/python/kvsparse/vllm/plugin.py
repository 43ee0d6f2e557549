"""vLLM plugin: vLLM's decode attention through kvsparse, for dense (GQA) models.

Install beside vLLM (``pip install ./client/python``; there is no ``kvsparse[vllm]`` extra,
docs/VLLM.md says why) and switch it on per deployment with environment variables (the plugin
is a ``vllm.general_plugins`` entry point, loaded by every vLLM process; without
``KVSPARSE_VLLM_METHOD`` it does nothing):

    KVSPARSE_VLLM_METHOD=top_k:top_k_fraction=0.03125   # the default method (parse_method's text)
    KVSPARSE_VLLM_TARGET=127.0.0.1:50051                # a kvsparse-server, or "inprocess"
    KVSPARSE_VLLM_SEED=0                                # the sampled methods' seed (default 0)
    KVSPARSE_VLLM_KV=both                               # or "store": the K/V in kvsparse only
    KVSPARSE_VLLM_SALE=sale.json                        # with "store": prompts through SALE
    python -m vllm.entrypoints.openai.api_server --model ...

A request may ask for another method: ``SamplingParams(extra_args={"kvsparse_method":
"hash_top_k:top_k_fraction=0.05"})`` (``vllm_xargs`` in the OpenAI API).

How it works (vLLM 0.32, the V1 model runner):
- The attention backend (kvsparse.vllm.backend) is vLLM's own CPU backend with its decode rows
  answered by kvsparse: each request of the batch has one kvsparse sequence (created the first
  time the request is scheduled, with the placement its method reads); a prefill chunk's K/V
  are appended to it in bulk and its attention is vLLM's; a decode row's query and new K/V go
  to kvsparse in one Decode call per layer and method (the token is appended and attended to in
  the same call), whose output replaces the row's.
- Which request a batch row is comes from the model runner (its persistent batch's request
  ids, recorded each step); requests that finish or are aborted have their sequences dropped
  the step vLLM reports them; a request preempted and recomputed from its first token gets a
  fresh sequence.
- By default vLLM keeps its own paged KV cache as well (the plugin moves decode attention's
  reads to kvsparse: bandwidth). With KVSPARSE_VLLM_KV=store the K/V live in the store only:
  vLLM's cache keeps 2 elements a token and kv head, so its KV budget admits requests by
  kvsparse's capacity, and prompt attention is computed by the plugin over the rows read back
  from the store (docs/VLLM.md, "Capacity").
- With the K/V in the store only, KVSPARSE_VLLM_SALE names SALE's thresholds file
  (``kvsparse-sale-calibrate``, kvsparse.torch.sale): a prompt prefilled in one chunk (its length
  at most vLLM's max_num_batched_tokens) attends through SALE's block-sparse prefill
  (``torch.ops.kvsparse.sale_prefill``: the CPU reference on vLLM's CPU build); the later chunks
  of a chunked prompt attend densely over the store's rows, as without it.

With vLLM's prefix caching (on by default), a request vLLM starts after a prefix it reused from
its cache gets that prefix forked in the store from the request that holds it, or read from vLLM's
paged cache into its sequence (both builds). With KVSPARSE_VLLM_KV=store, where vLLM's cache holds
no K/V, the prefix comes from the holder's sequence in the store alone (finished requests kept as
holders while vLLM's cache holds their blocks, finished_to_keep).

Limits of this version, each refused with a message: sliding windows, ALiBi, logits
soft-capping, attention sinks, quantized KV caches.

On vLLM's CUDA build (vLLM 0.24.0) the backend is kvsparse.vllm.cuda_backend, in vLLM's custom
backend slot, and the requests of a batch come from kvsparse's KV connector
(kvsparse.vllm.connector); ``engine_args()`` gives the engine arguments that select both. There
too KVSPARSE_VLLM_KV=store keeps the K/V in kvsparse's store only (vLLM's cache a few bytes a
token, kvsparse.vllm.patches says how on 0.24.0) and computes prompt attention in the backend,
through SALE's CUDA kernels for whole prompts when KVSPARSE_VLLM_SALE names thresholds.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import grpc

from kvsparse.errors import FailedPrecondition, KvSparseError
from kvsparse.methods import (
    FLAGSHIP_TEXT,
    METHOD_NAMES,
    Method,
    ModelShape,
    Placement,
    parse_method,
    placement_for,
)

# Under vLLM's logger: its processes (the OpenAI server's engine core too) print it with vLLM's own
# lines; a logger outside "vllm" went unseen in the server's log.
LOG = logging.getLogger("vllm.kvsparse")

ENV_METHOD = "KVSPARSE_VLLM_METHOD"
ENV_TARGET = "KVSPARSE_VLLM_TARGET"
ENV_SEED = "KVSPARSE_VLLM_SEED"
# Where prompts' K/V live: "both" (default: vLLM's paged cache too, prompt attention vLLM's) or
# "store" (kvsparse's store only: vLLM's cache keeps a few bytes a token, prompt attention is
# computed here over the rows read back from the store; vLLM's KV budget then admits
# requests by kvsparse's capacity, not by its own).
ENV_KV = "KVSPARSE_VLLM_KV"
# SALE's thresholds file for the prompts (store only: the plugin computes prompt attention then).
ENV_SALE = "KVSPARSE_VLLM_SALE"
# Finished requests whose sequences the worker keeps while vLLM's prefix cache still holds their
# blocks, so that a later request starting after them (a chat's next turn) forks its prefix in
# the store instead of reading it from vLLM's cache (BlockLedger); their tokens stay in the store
# until then. vLLM's CPU build (the worker's own ledger) and its CUDA build (the KV connector's
# ledger, StepRows.kept / released). By default only with the store in vLLM's worker process
# (KVSPARSE_VLLM_TARGET=inprocess; the CUDA build's default): a kvsparse-server's store outlives a
# vLLM process that is killed (vLLM's OpenAI server stops its engine so), and kept sequences would
# stay there.
ENV_KEEP_FINISHED = "KVSPARSE_VLLM_KEEP_FINISHED"
KEEP_FINISHED_DEFAULT = 4
# vLLM's CUDA build: set to 0 to serve decode rows outside vLLM's full graphs (per-request
# methods; kvsparse.vllm.cuda_backend's module text).
ENV_FULL_GRAPHS = "KVSPARSE_VLLM_FULL_GRAPHS"


def full_graphs_asked() -> bool:
    """Whether the deployment asks for its decode steps inside vLLM's full CUDA graphs
    (KVSPARSE_VLLM_FULL_GRAPHS not 0; vLLM's CUDA build), where one method is captured: its own."""
    return os.environ.get(ENV_FULL_GRAPHS, "1") != "0"


def other_method_refusal(text: str, deployment: str) -> str | None:
    """Why a request naming the method ``text`` is refused by a deployment that decodes inside
    vLLM's full CUDA graphs with its method ``deployment``, or None where it is that method (the
    same parameters, however written). REQUIRES: both parse."""
    if parse_method(text) == parse_method(deployment):
        return None
    return (f"this deployment decodes inside vLLM's full CUDA graphs with its method {deployment!r} only; the "
            f"request asked for {text!r} (set {ENV_FULL_GRAPHS}=0 to serve per-request methods)")


# With the K/V in the store only and vLLM's prefix caching on (vLLM's CPU build), the count kept
# when KVSPARSE_VLLM_KEEP_FINISHED is not set: every finished request whose blocks vLLM's prefix
# cache still holds (the store is then the only place their prefix's K/V are).
KEEP_ALL = 1 << 30


def keep_finished() -> int:
    # The CUDA build's store is in its worker unless a target says otherwise (cuda_settings); the
    # CPU build has no default target (it is refused unset).
    default = KEEP_FINISHED_DEFAULT if os.environ.get(ENV_TARGET, "inprocess") == "inprocess" else 0
    text = os.environ.get(ENV_KEEP_FINISHED) or str(default)
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"{ENV_KEEP_FINISHED} must be a count of requests (0 keeps none), not {text!r}")
    return n


def store_only() -> bool:
    kv = os.environ.get(ENV_KV, "both")
    if kv not in ("both", "store"):
        raise ValueError(f"{ENV_KV} must be 'both' or 'store', not {kv!r}")
    return kv == "store"


def sale_path() -> str | None:
    """KVSPARSE_VLLM_SALE, checked: SALE prefills prompts only where the plugin computes their
    attention (KVSPARSE_VLLM_KV=store)."""
    path = os.environ.get(ENV_SALE) or None
    if path is not None and not store_only():
        raise ValueError(f"{ENV_SALE} needs {ENV_KV}=store: with vLLM's own cache, prompt attention is vLLM's")
    return path


_SALE: dict[str, Any] = {}  # thresholds files loaded, by path


def sale_thresholds(num_layers: int) -> Any:
    """SALE's thresholds (kvsparse.torch.sale.SalePrefill) when KVSPARSE_VLLM_SALE names them,
    checked against the model's layers (loaded once per process); else None. Both backends."""
    path = sale_path()
    if path is None:
        return None
    sale = _SALE.get(path)
    if sale is None:
        from kvsparse.torch.sale import SalePrefill

        sale = SalePrefill.load(path)
        if len(sale.thresholds) != num_layers:
            raise ValueError(f"{path}: thresholds for {len(sale.thresholds)} layers, the model has {num_layers}")
        _SALE[path] = sale
    return sale


# The SamplingParams.extra_args key of a request's own method.
EXTRA_ARG = "kvsparse_method"
BACKEND_NAME = "KVSPARSE"
BACKEND_PATH = "kvsparse.vllm.backend.KvSparseBackend"
CUDA_BACKEND_PATH = "kvsparse.vllm.cuda_backend.KvSparseCudaBackend"
CONNECTOR = "KvSparseConnector"  # kvsparse.vllm.connector's class, as kv_transfer_config names it


def connector_configured(config: Any) -> bool:
    """Whether vLLM runs kvsparse's KV connector (its kv_transfer_config names it)."""
    kv = getattr(config, "kv_transfer_config", None)
    return kv is not None and getattr(kv, "kv_connector", None) == CONNECTOR


def enabled() -> bool:
    return bool(os.environ.get(ENV_METHOD))


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers the attention backend when
    KVSPARSE_VLLM_METHOD is set (checking it first), in each vLLM process; idempotent. On vLLM's
    CUDA build, kvsparse.vllm.cuda_backend in vLLM's custom backend slot (selected by
    ``engine_args()``); on its CPU build, kvsparse.vllm.backend in place of vLLM's CPU backend."""
    if not enabled():
        return
    parse_method(os.environ[ENV_METHOD])  # a bad method stops vLLM here, with its reason
    store_only()  # and a bad KVSPARSE_VLLM_KV
    path = sale_path()  # and SALE without the store, or a thresholds file that does not load
    if path is not None:
        from kvsparse.torch.sale import SalePrefill

        SalePrefill.load(path)
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from kvsparse.vllm import patches

    if current_platform.is_cuda():
        cuda_settings()  # bad capacities stop vLLM here
        register_backend(AttentionBackendEnum.CUSTOM, CUDA_BACKEND_PATH)
        if store_only():
            patches.shrink_store_only_spec()
        return
    if not current_platform.is_cpu():
        raise RuntimeError(f"kvsparse's vLLM plugin runs on vLLM's CUDA and CPU builds; unset {ENV_METHOD} here")
    # The request ids of a batch come from the V1 model runner (the one vLLM's CPU build runs).
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, BACKEND_PATH)
    # vLLM's CPU platform always answers its own backend (CPU_ATTN): point that name at ours.
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    patches.record_batches()


# The method of engine_args() when KVSPARSE_VLLM_METHOD is not set: the flagship
# (kvsparse.methods.FLAGSHIP_TEXT).
DEFAULT_CUDA_METHOD = FLAGSHIP_TEXT


def engine_args(method: str | None = None, **kwargs: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` / ``EngineArgs`` that decode through kvsparse on vLLM's
    CUDA build: the custom attention backend and kvsparse's KV connector (request bookkeeping).
    vLLM's prefix caching stays on: a prefix vLLM reuses is forked from the store's sequence of a
    request that holds it (finished requests kept as holders, KVSPARSE_VLLM_KEEP_FINISHED), or
    read from vLLM's cache into the request's sequence; with the K/V in kvsparse's store only
    (KVSPARSE_VLLM_KV=store) it comes from the store alone. ``method`` (default:
    KVSPARSE_VLLM_METHOD, else DEFAULT_CUDA_METHOD) is put in KVSPARSE_VLLM_METHOD for vLLM's
    worker processes. ``kwargs`` are added (and win). The same from the command line:
    ``--attention-backend CUSTOM --kv-transfer-config '{"kv_connector": "KvSparseConnector",
    "kv_connector_module_path": "kvsparse.vllm.connector", "kv_role": "kv_both"}'``."""
    text = method or os.environ.get(ENV_METHOD) or DEFAULT_CUDA_METHOD
    parse_method(text)
    os.environ[ENV_METHOD] = text
    args: dict[str, Any] = {
        "attention_backend": "CUSTOM",
        "kv_transfer_config": {
            "kv_connector": CONNECTOR,
            "kv_connector_module_path": "kvsparse.vllm.connector",
            "kv_role": "kv_both",
        },
    }
    args.update(kwargs)
    return args


# Where the CUDA backend's engine keeps what (vLLM's CUDA build; the engine runs in the worker
# process on vLLM's GPU): its host-memory store's capacity, the GPU memory for per-sequence state
# (compressed keys, signatures, row caches), the row cache as a fraction of a sequence's tokens.
ENV_STORE_CAPACITY = "KVSPARSE_VLLM_STORE_CAPACITY"
ENV_GPU_CAPACITY = "KVSPARSE_VLLM_GPU_CAPACITY"
ENV_ROW_CACHE = "KVSPARSE_VLLM_ROW_CACHE"
CUDA_DEFAULTS = {ENV_STORE_CAPACITY: "32G", ENV_GPU_CAPACITY: "8G", ENV_ROW_CACHE: "0.005"}


def cuda_settings() -> dict[str, Any]:
    """InProcessEngine's arguments for the CUDA backend, from the environment (CUDA_DEFAULTS);
    KVSPARSE_VLLM_TARGET, when it names a kvsparse-server store (host:port), holds the K/V there."""
    get = lambda name: os.environ.get(name) or CUDA_DEFAULTS[name]  # noqa: E731
    row_cache = float(get(ENV_ROW_CACHE))
    if not 0 <= row_cache <= 1:
        raise ValueError(f"{ENV_ROW_CACHE} must be a fraction in [0, 1], not {row_cache}")
    settings: dict[str, Any] = {"gpu_capacity": get(ENV_GPU_CAPACITY), "gpu_row_cache": row_cache}
    target = os.environ.get(ENV_TARGET, "inprocess")
    if target == "inprocess":
        settings["store_capacity"] = get(ENV_STORE_CAPACITY)
    else:
        settings["store"] = target
    return settings


def finished_to_keep(prefix_caching: bool) -> int:
    """How many finished requests a ledger keeps as prefix holders (KVSPARSE_VLLM_KEEP_FINISHED,
    keep_finished). With the K/V in the store only and vLLM's prefix caching on, a prefix vLLM
    reuses has its K/V in kvsparse's store only, in the sequence of the request that computed it:
    every finished request is kept while vLLM's cache holds its blocks (KEEP_ALL) where the
    setting is not given, and 0 is refused (a reused prefix would have no K/V anywhere)."""
    keep = keep_finished()
    if not (store_only() and prefix_caching):
        return keep
    if not os.environ.get(ENV_KEEP_FINISHED):
        return KEEP_ALL
    if keep == 0:
        raise ValueError(f"with {ENV_KV}=store and vLLM's prefix caching on, a prefix vLLM reuses has its K/V only "
                         f"in kvsparse's store: {ENV_KEEP_FINISHED}=0 would drop them when their request finishes "
                         f"(keep finished requests, or turn prefix caching off: --no-enable-prefix-caching)")
    return keep


def copy_prefix_rows(read: Callable[[str, int, int], tuple[Any, Any]], append: Callable[..., None], rid: str,
                     holder: str | None, source: "RequestSequence | None", seq: "RequestSequence", li: int, held: int,
                     start: int, last: bool) -> bool:
    """With the K/V in the store only (both builds): tokens [held, start) of layer li of a prefix
    vLLM reused for request `rid`, copied into `seq` from `source`, the sequence of the request
    `holder` that holds it (live, or finished and kept), through `read` (sequence id, layer, count
    -> K, V as [Hkv, count, d]) and `append` (a transport's or an engine's). False where `source`
    does not hold them yet at this layer (its request computes them in this step, later in the
    batch); FailedPrecondition where no sequence holds the prefix, or (`last`) still not."""
    reused = f"request {rid} starts after {start} tokens vLLM reused from its prefix cache"
    if source is None:
        raise FailedPrecondition(
            f"{reused}, and no request's sequence in kvsparse's store holds them (with {ENV_KV}=store vLLM's "
            f"cache holds no K/V: the request that computed them is gone, e.g. released when the store was full)")
    if source.lengths[li] < start:
        if last:
            raise FailedPrecondition(f"{reused}, and request {holder}, which holds them, has {source.lengths[li]} "
                                     f"of them at layer {li} after the step's rows")
        return False
    k0, v0 = read(source.sequence_id, li, start)
    append(seq.sequence_id, li, k0[:, held:].transpose(0, 1).contiguous(), v0[:, held:].transpose(0, 1).contiguous(),
           held)
    seq.lengths[li] = start
    return True


def keep_store_prefixes() -> None:
    """vLLM's CPU build with the K/V in the store only and prefix caching on: the worker's ledger
    keeps what finished_to_keep says."""
    WORKER.blocks.keep = finished_to_keep(prefix_caching=True)


def refuse_unsupported(alibi_slopes: Any, sliding_window: Any, logits_soft_cap: Any, sinks: Any,
                       kv_cache_dtype: str) -> None:
    """What neither backend implements, refused with its name when vLLM builds a layer."""
    refused = {
        "ALiBi": alibi_slopes is not None,
        "sliding windows": sliding_window is not None,
        "logits soft-capping": bool(logits_soft_cap),
        "attention sinks": sinks is not None,
        f"KV cache dtype {kv_cache_dtype}": kv_cache_dtype not in ("auto", "bfloat16", "float16", "float32"),
    }
    for what, present in refused.items():
        if present:
            raise NotImplementedError(f"kvsparse's vLLM plugin does not support {what} in this version")


class BlockLedger:
    """Each live request's KV blocks (the first group's), kept from the scheduler's outputs step
    after step (the connector, both builds) or from the model runner's requests (the CPU build's
    worker), and which of them no other live request holds. vLLM ends every request that holds
    a block reported as failed to load, and with prefix caching requests share the blocks of a
    common prefix (a system prompt): a failed request is named by a block of its own, its newest
    one not shared (a block being written, the newest, never is), so the requests sharing its
    prefix keep decoding.

    With `keep` > 0, up to `keep` finished requests (the newest) stay as prefix holders: vLLM
    keeps a finished request's blocks in its prefix cache until it hands them out again, so a
    block a kept request holds still holds its tokens until vLLM allocates it afresh (`fresh`:
    not a prefix-cache hit), which cuts that kept request's blocks there (and releases it where
    none are left). Released requests are collected for the worker (`take_released`: their
    sequences can go)."""

    def __init__(self, keep: int = 0) -> None:
        self.blocks: dict[str, list[int]] = {}
        self.holders: Counter[int] = Counter()
        self.keep = keep
        self.kept: dict[str, list[int]] = {}  # finished holders, oldest first
        self.kept_by_block: dict[int, set[str]] = {}
        self.released: list[str] = []

    def update(self, scheduler_output: Any, block_size: int) -> None:
        """A step's scheduler output (the connector, every build): finished requests kept or
        dropped, preempted ones dropped, the new blocks added (those past a new request's
        prefix-cache hits, and every block of a resumed request, as fresh)."""
        for rid in scheduler_output.finished_req_ids:
            self.finish(rid)
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self.drop(rid)
        for r in scheduler_output.scheduled_new_reqs:
            blocks = getattr(r, "block_ids", None)
            self.drop(r.req_id)
            new = list(blocks[0]) if blocks and blocks[0] else []
            self.fresh(new[r.num_computed_tokens // block_size:])
            self._add(r.req_id, new)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        for rid, blocks in zip(cached.req_ids, getattr(cached, "new_block_ids", None) or ()):
            if rid in resumed:  # a resumed request's blocks are all new
                self.drop(rid)
            if blocks and blocks[0]:
                self.fresh(blocks[0])
                self._add(rid, list(blocks[0]))

    def replace(self, rid: str, blocks: Sequence[int], hits: int = 0) -> None:
        """A request's blocks, all of them (the worker side of vLLM's CPU build, which sees each
        request's whole list every step; `hits`: the blocks a new request starts after, from
        vLLM's prefix cache). A list that grew by blocks at its end (a step's usual case) adds
        only those: the cost is the step's new blocks, not the request's. Blocks past the hits
        are fresh (all of a list that changed otherwise: a resumed request's)."""
        old = self.blocks.get(rid)
        if old and len(blocks) >= len(old) and blocks[0] == old[0] and blocks[len(old) - 1] == old[-1]:
            self.fresh(blocks[len(old):])
            self._add(rid, list(blocks[len(old):]))
            return
        self.drop(rid)
        self.fresh(blocks[hits:] if old is None else blocks)
        self._add(rid, list(blocks))

    def finish(self, rid: str) -> bool:
        """A request that finished: kept as a prefix holder (the oldest kept one released beyond
        `keep`), or forgotten (False)."""
        blocks = self.blocks.get(rid)
        self.drop(rid)
        if self.keep <= 0 or not blocks:
            return False
        self.kept[rid] = blocks
        for b in blocks:
            self.kept_by_block.setdefault(b, set()).add(rid)
        while len(self.kept) > self.keep:
            self.release(next(iter(self.kept)))
        return True

    def fresh(self, blocks: Sequence[int]) -> None:
        """Blocks vLLM hands out afresh: a kept request holding one keeps only its blocks before
        it (those still hold its tokens; a prefix-cache hit ending at one of them is still its
        prefix), and is released where none are left. vLLM hands a finished request's last block,
        which it does not cache unless full, out again first."""
        for b in blocks:
            for rid in list(self.kept_by_block.get(b, ())):
                held = self.kept[rid]
                cut = held.index(b)
                self._unindex(rid, held[cut:])
                del held[cut:]
                if not held:
                    self.release(rid)

    def release(self, rid: str) -> None:
        """A kept request no longer held (its sequence can go: take_released)."""
        if rid not in self.kept:
            return
        self._unindex(rid, self.kept.pop(rid))
        self.released.append(rid)

    def _unindex(self, rid: str, blocks: Sequence[int]) -> None:
        """Kept request `rid` no longer holds `blocks` (kept_by_block)."""
        for b in blocks:
            holders = self.kept_by_block.get(b)
            if holders is not None:
                holders.discard(rid)
                if not holders:
                    del self.kept_by_block[b]

    def release_all(self) -> None:
        for rid in list(self.kept):
            self.release(rid)

    def take_released(self) -> list[str]:
        out, self.released = self.released, []
        return out

    def own_block(self, rid: str) -> int | None:
        """The request's newest block no other live request holds (its newest where every one is
        shared; None where it has none)."""
        blocks = self.blocks.get(rid)
        if not blocks:
            return None
        return next((b for b in reversed(blocks) if self.holders[b] == 1), blocks[-1])

    def prefix_holder(self, rid: str, blocks: Sequence[int], tokens: int, block_size: int) -> str | None:
        """Another live request holding, at the same place in its list, the block that ends the
        first `tokens` tokens of `blocks` (a prefix vLLM reused from its prefix cache for request
        `rid`): vLLM shares a cached block only between requests whose first tokens up to it are
        the same (its block hashes chain every block before them, with the LoRA, multimodal
        inputs and cache salt), so that request computed, or itself reused, those tokens, and
        its kvsparse sequence can be forked instead of the prefix copied; else a kept finished
        request holding it there (not handed out afresh since, so its tokens are still those).
        None where `tokens` is not a whole number of blocks or no request holds that block."""
        return next(iter(self.prefix_holders(rid, blocks, tokens, block_size)), None)

    def prefix_holders(self, rid: str, blocks: Sequence[int], tokens: int, block_size: int) -> list[str]:
        """Every request prefix_holder could name, the live ones first (the worker forks the one
        whose sequence holds the most of the prefix: a live one may be computing it in this very
        step)."""
        if tokens <= 0 or tokens % block_size or len(blocks) < tokens // block_size:
            return []
        i = tokens // block_size - 1
        b = blocks[i]
        found = []
        if self.holders.get(b, 0) - (b in self.blocks.get(rid, ())) >= 1:
            found = [other for other, held in self.blocks.items() if other != rid and len(held) > i and held[i] == b]
        return found + [k for k in self.kept_by_block.get(b, ()) if len(self.kept[k]) > i and self.kept[k][i] == b]

    def _add(self, rid: str, blocks: list[int]) -> None:
        self.blocks.setdefault(rid, []).extend(blocks)
        self.holders.update(blocks)

    def drop(self, rid: str) -> None:
        """Forgets a request (finished, preempted or failed) and its blocks."""
        for b in self.blocks.pop(rid, ()):
            self.holders[b] -= 1
            if self.holders[b] <= 0:
                del self.holders[b]


@dataclass
class PromptTail:
    """The rows of a step from `first_row` on (from token `first_token`), each with more than one
    token, and vLLM's attention metadata for them alone (both backends' metadata builders): in a
    step that mixes decode rows (one token each, first in vLLM's batch order) with prompt rows,
    vLLM's attention runs for the prompt rows only, the decode rows being kvsparse's."""

    first_row: int
    first_token: int
    metadata: Any


def prompt_tail_rows(query_start_loc: Sequence[int], num_tokens: int) -> tuple[int, int, int] | None:
    """Where a step's prompt rows begin and end, (first row, first token, rows), when its rows are
    decode rows (one token each) followed by prompt rows (more than one each) up to its
    `num_tokens` tokens (rows after them are padding); None for any other step (decode rows or
    prompt rows only, a one-token row among the prompt rows)."""
    rows = sum(1 for r in range(len(query_start_loc) - 1) if query_start_loc[r] < num_tokens)
    counts = [query_start_loc[r + 1] - query_start_loc[r] for r in range(rows)]
    first = next((r for r, c in enumerate(counts) if c > 1), rows)
    if first in (0, rows) or any(c <= 1 for c in counts[first:]) or query_start_loc[rows] != num_tokens:
        return None
    return first, int(query_start_loc[first]), rows


def vllm_attention(forward: Callable[..., Any], tail: PromptTail | None, decode_rows: int, failed: bool, layer: Any,
                   query: Any, key: Any, value: Any, kv_cache: Any, attn_metadata: Any, output: Any,
                   output_scale: Any, output_block_scale: Any) -> int:
    """vLLM's attention (`forward`, the backend's parent's) for a step (both backends): for the
    prompt rows alone where the step's first rows are exactly its `decode_rows` rows that kvsparse
    answers and no request failed in it (`tail`), else for the whole batch. Returns the rows left
    out."""
    if tail is not None and not failed and decode_rows == tail.first_row:
        a = tail.first_token
        forward(layer, query[a:], key[a:], value[a:], kv_cache, tail.metadata, output[a:], output_scale,
                output_block_scale)
        return a
    forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
    return 0


@dataclass
class RequestSequence:
    """A vLLM request's kvsparse sequence (both backends)."""

    sequence_id: str
    method: Method
    lengths: list[int]  # tokens appended per layer

    @staticmethod
    def create(create: Callable[[str, ModelShape, Placement], None], method: Method,
               shape: ModelShape) -> "RequestSequence":
        """A new sequence for a request, created through `create` (a transport's or an engine's)
        with the placement its method reads."""
        sid = f"vllm-{uuid.uuid4().hex}"
        create(sid, shape, placement_for(method))
        return RequestSequence(sid, method, [0] * shape.num_layers)

    def held(self, tokens: int) -> int:
        """How many of the first `tokens` tokens this sequence holds in every layer (a request
        vLLM computes them for may be part way through its step)."""
        return min(tokens, *self.lengths)

    @staticmethod
    def fork(fork: Callable[[str, str, int, Placement], None], source: "RequestSequence", tokens: int,
             method: Method, shape: ModelShape) -> "RequestSequence":
        """A new sequence for a request whose first `tokens` tokens are `source`'s first ones (a
        prefix vLLM reused from its cache while the request that computed it is live): forked in
        the store through `fork` (a transport's or an engine's), the prefix's whole pages shared,
        with the placement the request's method reads."""
        sid = f"vllm-{uuid.uuid4().hex}"
        fork(source.sequence_id, sid, tokens, placement_for(method))
        return RequestSequence(sid, method, [tokens] * shape.num_layers)


@dataclass
class Worker:
    """The plugin's state in a vLLM worker process: the transport, each live request's
    sequence, and the current batch's request ids."""

    batch: list[str] = field(default_factory=list)
    methods: dict[str, Method] = field(default_factory=dict)
    sequences: dict[str, RequestSequence] = field(default_factory=dict)
    step: int = 0
    num_layers: int = 0
    restarts: int = 0  # sequences begun again: requests preempted and recomputed
    # Requests kvsparse failed (request id -> reason) and each live request's KV blocks in vLLM's
    # cache (the connector names a failed request to vLLM's scheduler by a block of its own).
    failed: dict[str, str] = field(default_factory=dict)
    # Finished requests are kept as prefix holders (KVSPARSE_VLLM_KEEP_FINISHED), their sequences
    # with them, until the ledger releases them.
    blocks: BlockLedger = field(default_factory=lambda: BlockLedger(keep=keep_finished()))
    # Prompt tokens read from vLLM's paged cache into sequences: prefixes vLLM reused from its
    # prefix cache (kvsparse.vllm.backend).
    prefix_imports: int = 0
    # Prompt tokens of such prefixes shared in the store instead, forked from the request that
    # holds them (BlockLedger.prefix_holders).
    prefix_forks: int = 0
    # Of those, the tokens forked from finished requests kept as holders (KVSPARSE_VLLM_KEEP_FINISHED).
    prefix_forks_finished: int = 0
    # With the K/V in the store only: the request whose sequence holds each new request's reused
    # prefix (request id -> holder id, fork_prefix), for the prefix's tokens its sequence did not
    # hold yet when forked (it computes them in the same step): copied in the store layer by layer
    # (kvsparse.vllm.backend), their count in prefix_copies (at layer 0).
    prefix_sources: dict[str, str] = field(default_factory=dict)
    prefix_copies: int = 0
    # Rows of steps that mixed decode and prompt rows left out of vLLM's attention (the decode rows,
    # kvsparse's), over the layers (kvsparse.vllm.backend).
    vllm_rows_skipped: int = 0
    connector: bool = False  # kvsparse's KV connector is configured: failures can be reported
    # Seconds in the backend's forward (all layers and steps), split: vLLM's own attention
    # (prompt rows), the transport's calls (append and decode: gRPC or the op), and the engine's
    # time inside them as the transport reports it. What is left is the plugin's bookkeeping.
    timing: dict[str, float] = field(
        default_factory=lambda: {"forward": 0.0, "vllm_attention": 0.0, "transport": 0.0, "engine": 0.0}
    )
    # SALE prefill (KVSPARSE_VLLM_SALE): (prompt, layer) pairs attended through it, and their shares
    # of causal blocks skipped, summed (mean: / sale_prefills).
    sale_prefills: int = 0
    sale_skipped: float = 0.0
    _transport: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def transport(self) -> Any:
        if self._transport is None:
            from kvsparse.torch.transport import make_transport

            target = os.environ.get(ENV_TARGET, "")
            if not target:
                raise RuntimeError(f"{ENV_TARGET} is not set: a kvsparse-server address, or 'inprocess'")
            if target == "inprocess":
                from kvsparse.torch.ops import InProcessEngine

                self._transport = make_transport(InProcessEngine(), timeout=60.0, stream=False)
            else:
                self._transport = make_transport(target, timeout=60.0, stream=False)
            atexit.register(self.close)
        return self._transport

    def sale(self, num_layers: int) -> Any:
        return sale_thresholds(num_layers)

    def default_method(self) -> Method:
        return parse_method(os.environ[ENV_METHOD])

    def on_step(self, req_ids: list[str], finished: set[str], requests: dict[str, Any], block_size: int) -> None:
        with self._lock:
            self.batch = req_ids
            self.step += 1
            for rid in finished:
                # Kept as a prefix holder with its sequence (BlockLedger.finish), or dropped.
                if rid in self.failed or rid not in self.sequences or not self.blocks.finish(rid):
                    self.drop(rid)
                    self.blocks.drop(rid)
                self.methods.pop(rid, None)
                self.failed.pop(rid, None)
                self.prefix_sources.pop(rid, None)
            for rid in [r for r in self.blocks.blocks if r not in requests]:  # preempted
                self.blocks.drop(rid)
            for rid in req_ids:
                request = requests.get(rid)
                blocks = getattr(request, "block_ids", None)
                if blocks and blocks[0]:
                    hits = getattr(request, "num_computed_tokens", 0) // block_size
                    self.blocks.replace(rid, blocks[0], hits)
                if rid not in self.methods:
                    try:
                        self.methods[rid] = self._method_of(request)
                    except ValueError as e:  # a method text that does not parse: this request fails
                        self.methods[rid] = self.default_method()
                        self.fail([rid], e)
            self._drop_released()

    def fail(self, rids: list[str], error: Exception) -> None:
        """Requests kvsparse could not serve (the server unreachable, a sequence lost, a method
        refused): their sequences are forgotten, their rows answered with zeros, and vLLM fails
        them through the KV connector's load-error report (kvsparse.vllm.connector), so vLLM's
        engine keeps serving the others. Without the connector vLLM could not be told, so the
        error is raised (it stops vLLM's engine, with its reason) rather than answered with zeros."""
        if not self.connector:
            raise error
        for rid in rids:
            if rid not in self.failed:
                LOG.warning("kvsparse: failing request %s: %s", rid, error)
                self.failed[rid] = str(error)
            self.sequences.pop(rid, None)
        if getattr(error, "code", None) == grpc.StatusCode.RESOURCE_EXHAUSTED and self.blocks.kept:
            # The store is full: the finished requests kept for their prefixes go first.
            LOG.warning("kvsparse: the store is full: releasing %d finished requests' sequences kept for "
                        "their prefixes", len(self.blocks.kept))
            self.blocks.release_all()
            self._drop_released()

    def _drop_released(self) -> None:
        """The sequences of the finished requests the ledger no longer keeps, out of the store."""
        for rid in self.blocks.take_released():
            self.drop(rid)

    def failed_blocks(self) -> set[int]:
        """A KV block of its own (BlockLedger) of every failed request vLLM still runs: what the
        connector reports as blocks that failed to load (vLLM's kv_load_failure_policy "fail"
        then ends those requests with an error, and only those: with prefix caching others may
        hold the failed request's prefix blocks)."""
        own = (self.blocks.own_block(r) for r in self.failed)
        return {b for b in own if b is not None}

    def _method_of(self, request: Any) -> Method:
        params = getattr(request, "sampling_params", None)
        extra = getattr(params, "extra_args", None) or {}
        spec = extra.get(EXTRA_ARG)
        return parse_method(spec) if spec else self.default_method()

    def sequence(self, rid: str, shape: ModelShape) -> RequestSequence:
        seq = self.sequences.get(rid)
        if seq is None:
            method = self.methods.get(rid) or self.default_method()
            seq = RequestSequence.create(self.transport().create, method, shape)
            self.sequences[rid] = seq
        return seq

    def fork_prefix(self, rid: str, shape: ModelShape, blocks: Sequence[int], tokens: int,
                    block_size: int) -> RequestSequence | None:
        """The sequence of a request vLLM starts after `tokens` tokens it reused from its prefix
        cache, forked from the request that holds them (BlockLedger.prefix_holders: live ones,
        then finished ones kept) whose sequence holds the most of them in every layer (a live
        one may be computing the last ones in this very step: vLLM hands out a block as soon as
        it schedules it; the caller reads the rest from vLLM's cache). None where there is none
        or the fork is refused (the caller reads the whole prefix from vLLM's cache)."""
        held = {h: self.sequences[h].held(tokens) for h in self.blocks.prefix_holders(rid, blocks, tokens, block_size)
                if h in self.sequences and h not in self.failed}
        holder = max(held, key=held.__getitem__, default=None)  # the first of equals: a live one
        if holder is not None:
            self.prefix_sources[rid] = holder
        n = held[holder] if holder is not None else 0
        if n == 0:
            return None
        source = self.sequences[holder]
        method = self.methods.get(rid) or self.default_method()
        try:
            seq = RequestSequence.fork(self.transport().fork, source, n, method, shape)
        except KvSparseError as e:
            LOG.warning("kvsparse: request %s reads its prefix from vLLM's cache: forking %s's sequence: %s",
                        rid, holder, e)
            return None
        self.drop(rid)  # an empty sequence made for it before
        self.sequences[rid] = seq
        self.prefix_forks += n
        if holder in self.blocks.kept:
            self.prefix_forks_finished += n
        return seq

    def restart(self, rid: str, shape: ModelShape) -> RequestSequence:
        """A request vLLM computes again from its first token (after a preemption)."""
        self.restarts += 1
        self.drop(rid)
        return self.sequence(rid, shape)

    def drop(self, rid: str) -> None:
        seq = self.sequences.pop(rid, None)
        if seq is None:
            return
        try:
            self.transport().drop([seq.sequence_id])
        except KvSparseError as e:  # the server is gone (or restarted): nothing left to free there
            LOG.warning("kvsparse: dropping the sequence of request %s: %s", rid, e)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close([s.sequence_id for s in self.sequences.values()])
            self.sequences.clear()
            self._transport = None


def observe(method: Method, sequences: int, stats: Any) -> None:
    """Decode figures on the worker's Prometheus counters (both backends; the server's metric
    names): `sequences` sequence-layers decoded, and `stats`' rows_fetched, rows_cached, bytes by
    tier (bytes_device: read on the worker's device; bytes_fetched: read across its boundary,
    host memory or the store's process), dense_equivalent_bytes, engine_seconds and
    selection_seconds (0: not timed)."""
    global _METRICS
    if _METRICS is None:
        _METRICS = _Metrics()
    name = next(n for n, cls in METHOD_NAMES.items() if cls is type(method))
    _METRICS.observe(name, sequences, stats)


class _Metrics:
    """kvsparse's decode counters in the vLLM worker's Prometheus registry. vLLM's /metrics
    serves its API server's registry; the worker's counters reach it when vLLM runs with
    PROMETHEUS_MULTIPROC_DIR set (prometheus_client's multiprocess mode), as docs/VLLM.md says."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Histogram

        self.calls = Counter("kvsparse_decode_sequence_layers", "Sequence-layers decoded through kvsparse",
                             ["method"])
        self.rows = Counter("kvsparse_decode_fetched_rows", "K and V rows read by kvsparse's decode steps",
                            ["method"])
        self.bytes = Counter("kvsparse_decode_fetched_bytes", "Bytes read by kvsparse's decode steps, by tier "
                             "(device: on the worker's device; fetched: across its boundary)", ["method", "tier"])
        self.dense = Counter("kvsparse_decode_dense_equivalent_bytes",
                             "Bytes dense attention would have read for the same steps", ["method"])
        self.cached = Counter("kvsparse_decode_cached_rows", "Fetched rows found in the GPU's row cache "
                              "(read on the device, not fetched)", ["method"])
        # Histograms as the server's: its latency buckets (10 us doubling up to 30 s).
        buckets = [10e-6 * 2**i for i in range(22)]
        self.engine = Histogram("kvsparse_decode_engine_seconds", "Whole engine time per decode call "
                                "(where the transport reports it: gRPC)", ["method"], buckets=buckets)
        self.stage = Histogram("kvsparse_decode_stage_seconds", "Engine time per decode call by stage (the GPU "
                               "engine times one call in its --gpu_stage_timing_every)", ["method", "stage"],
                               buckets=buckets)

    def observe(self, name: str, sequences: int, s: Any) -> None:
        self.calls.labels(name).inc(sequences)
        self.rows.labels(name).inc(s.rows_fetched)
        self.bytes.labels(name, "device").inc(s.bytes_device)
        self.bytes.labels(name, "fetched").inc(s.bytes_fetched)
        self.dense.labels(name).inc(s.dense_equivalent_bytes)
        self.cached.labels(name).inc(s.rows_cached)
        if s.engine_seconds > 0:
            self.engine.labels(name).observe(s.engine_seconds)
        if s.selection_seconds > 0:
            self.stage.labels(name, "selection").observe(s.selection_seconds)


_METRICS: _Metrics | None = None  # made at the first observation (a registry holds each name once)
WORKER = Worker()
