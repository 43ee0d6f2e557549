"""kvsparse's requests in vLLM's KV-connector interface (``kv_transfer_config``;
``kvsparse.vllm.engine_args`` sets it). On vLLM's CUDA build the scheduler's half tells the
worker's half, each step, which request each row of the batch is, how many of its tokens vLLM
has computed before the step, the methods of new requests, and which requests finished or were
preempted; the worker's half hands that to the attention backend (kvsparse.vllm.cuda_backend).
On both builds the worker's half reports the requests kvsparse could not serve (its server
unreachable, a sequence lost) as blocks that failed to load, so vLLM fails those requests and
keeps serving. Loads and saves nothing: vLLM's own blocks are not touched.

The row order is vLLM 0.24.0's V2 GPU model runner's (vllm/v1/worker/gpu/model_runner.py,
``prepare_inputs``: the scheduled requests sorted by their token counts, decode rows first). That
rule is vLLM's, not an interface: ``batch_order`` below is the one place it is written, and the
backend checks every step that the batch it is handed has the token counts this order gives,
failing with this module named when a vLLM changes it; tests/vllm/test_connector.py compares it
with vLLM's own sorting where a vLLM has it as a function (0.32's ``sort_batch_req_ids``: decode
rows first, then by token count, which is the same order without speculative decoding).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvsparse.vllm import plugin
from kvsparse.vllm.plugin import EXTRA_ARG, BlockLedger

VLLM_VERSION = "0.24.0"  # the vLLM whose batch order batch_order follows


@dataclass
class StepRows(KVConnectorMetadata):
    """One step as the attention backend needs it: rows[i] = (request id, tokens vLLM computed
    for it before the step, tokens it has in the step), in the batch's order; the method text of
    each request new in this step that asked for one; for each request of the step, a KV block no
    other live request holds (BlockLedger: how a failed request is named to vLLM's scheduler);
    requests to forget."""

    rows: list[tuple[str, int, int]] = field(default_factory=list)
    methods: dict[str, str] = field(default_factory=dict)
    failure_blocks: dict[str, int] = field(default_factory=dict)
    # The blocks of each new request that starts after a prefix vLLM reused from its prefix
    # cache (where the backend reads that prefix from, when no forward runs: a full graph).
    prefix_blocks: dict[str, list[int]] = field(default_factory=dict)
    # Of those, the ones whose prefix a live request, or a finished one kept as a holder, holds
    # (BlockLedger.prefix_holder): request id -> (that request's id, the prefix's tokens); its
    # kvsparse sequence is forked in the store.
    prefix_sources: dict[str, tuple[str, int]] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    preempted: set[str] = field(default_factory=set)
    # Of the finished ones, those the ledger keeps as prefix holders (KVSPARSE_VLLM_KEEP_FINISHED):
    # the worker keeps their sequences; and requests kept before that the ledger released (vLLM
    # handed their blocks out afresh, or newer ones pushed them out): their sequences can go.
    kept: set[str] = field(default_factory=set)
    released: set[str] = field(default_factory=set)


def batch_order(num_scheduled_tokens: dict[str, int]) -> list[str]:
    """The order of a step's requests in vLLM 0.24.0's V2 model runner (its prepare_inputs):
    a stable sort of the scheduler's requests by their token counts."""
    return sorted(num_scheduled_tokens, key=num_scheduled_tokens.__getitem__)


def step_rows(scheduler_output: Any, ledger: BlockLedger | None = None, block_size: int = 16) -> StepRows:
    """The step's StepRows; `ledger` (the connector's, kept across steps) updated with it;
    `block_size`: vLLM's KV block size."""
    ledger = ledger if ledger is not None else BlockLedger()
    ledger.update(scheduler_output, block_size)
    counts: dict[str, int] = scheduler_output.num_scheduled_tokens
    computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    computed.update(zip(cached.req_ids, cached.num_computed_tokens))
    methods, prefix_blocks, prefix_sources = {}, {}, {}
    for r in scheduler_output.scheduled_new_reqs:
        extra = getattr(r.sampling_params, "extra_args", None) or {}
        if extra.get(EXTRA_ARG):
            methods[r.req_id] = str(extra[EXTRA_ARG])
        blocks = getattr(r, "block_ids", None)
        if blocks and blocks[0] and r.num_computed_tokens > 0:
            prefix_blocks[r.req_id] = list(blocks[0])
            holder = ledger.prefix_holder(r.req_id, blocks[0], r.num_computed_tokens, block_size)
            if holder is not None:
                prefix_sources[r.req_id] = (holder, r.num_computed_tokens)
    own = {rid: ledger.own_block(rid) for rid in counts}
    finished = set(scheduler_output.finished_req_ids)
    return StepRows(
        rows=[(rid, computed[rid], counts[rid]) for rid in batch_order(counts)],
        methods=methods,
        failure_blocks={rid: b for rid, b in own.items() if b is not None},
        prefix_blocks=prefix_blocks,
        prefix_sources=prefix_sources,
        finished=finished,
        preempted=set(getattr(scheduler_output, "preempted_req_ids", None) or ()),
        kept={rid for rid in finished if rid in ledger.kept},
        released=set(ledger.take_released()),
    )


def _on_cuda() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda())


class KvSparseConnector(KVConnectorBase_V1):
    """vLLM's KV connector slot used for request bookkeeping only (``kv_role="kv_both"``)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        # Scheduler side. On vLLM's CUDA build it keeps finished requests as prefix holders
        # (KVSPARSE_VLLM_KEEP_FINISHED) for the worker (StepRows.kept); on the CPU build the
        # worker keeps its own ledger (kvsparse.vllm.plugin.Worker).
        prefix_caching = bool(vllm_config.cache_config.enable_prefix_caching)
        self.ledger = BlockLedger(keep=plugin.finished_to_keep(prefix_caching) if _on_cuda() else 0)
        self.block_size = int(vllm_config.cache_config.block_size)

    # Scheduler side.
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return step_rows(scheduler_output, self.ledger, self.block_size)

    # Worker side. On vLLM's CPU build the plugin learns the batch from the V1 model runner
    # (kvsparse.vllm.plugin) and uses the connector only to report failed requests.
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if _on_cuda():
            from kvsparse.vllm.cuda_backend import CUDA_WORKER

            assert isinstance(connector_metadata, StepRows)
            CUDA_WORKER.begin_step(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if _on_cuda():
            from kvsparse.vllm.cuda_backend import CUDA_WORKER

            CUDA_WORKER.end_step()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """A block of each request kvsparse failed (its server unreachable, its sequence lost):
        vLLM's scheduler, with kv_load_failure_policy "fail" (its default), ends those requests
        with an error and keeps serving the rest. Each is a block of the request's own
        (BlockLedger), so that requests sharing its prefix through vLLM's prefix cache go on."""
        if _on_cuda():
            from kvsparse.vllm.cuda_backend import CUDA_WORKER

            return CUDA_WORKER.failed_blocks()
        from kvsparse.vllm.plugin import WORKER

        return WORKER.failed_blocks()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
