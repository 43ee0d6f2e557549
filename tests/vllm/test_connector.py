"""kvsparse's KV connector (kvsparse.vllm.connector): what its scheduler half tells the CUDA
backend about a step, from a scheduler output of vLLM's own types. Runs wherever vLLM is
installed (CI: vLLM's CPU build); the backend itself is tested on a GPU (test_vllm_cuda.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
from vllm import SamplingParams  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402

from kvsparse.vllm.connector import batch_order, step_rows  # noqa: E402
from kvsparse.vllm.plugin import BlockLedger, prompt_tail_rows  # noqa: E402


def new_request(rid: str, computed: int, method: str | None = None) -> NewRequestData:
    params = SamplingParams(max_tokens=4, extra_args={"kvsparse_method": method} if method else None)
    fields = {f: None for f in NewRequestData.__dataclass_fields__}
    fields.update(req_id=rid, prompt_token_ids=[1, 2, 3], mm_features=[], sampling_params=params,
                  pooling_params=None, block_ids=([0],), num_computed_tokens=computed, lora_request=None)
    return NewRequestData(**fields)


def cached_requests(ids: list[str], computed: list[int]) -> CachedRequestData:
    data = CachedRequestData.make_empty()
    data.req_ids = ids
    data.num_computed_tokens = computed
    return data


def scheduler_output(new: list[NewRequestData], cached: CachedRequestData, counts: dict[str, int],
                     finished: set[str], preempted: set[str] | None = None) -> SchedulerOutput:
    fields = {f: None for f in SchedulerOutput.__dataclass_fields__}
    fields.update(scheduled_new_reqs=new, scheduled_cached_reqs=cached, num_scheduled_tokens=counts,
                  total_num_scheduled_tokens=sum(counts.values()), scheduled_spec_decode_tokens={},
                  scheduled_encoder_inputs={}, num_common_prefix_blocks=[0], finished_req_ids=finished,
                  free_encoder_mm_hashes=[], preempted_req_ids=preempted)
    return SchedulerOutput(**fields)


def test_rows_follow_the_v2_runners_order_with_each_requests_context() -> None:
    # b and d decode (one token each), a prefills a 300-token chunk after 256 (resumed after a
    # preemption: its blocks are new), c a new 40-token prompt.
    cached = cached_requests(["a", "b", "d"], [256, 1000, 17])
    cached.resumed_req_ids = {"a"}
    cached.new_block_ids = [([5, 6],), ([9],), None]
    out = scheduler_output(
        new=[new_request("c", 0, "top_k:top_k_fraction=0.25")],
        cached=cached,
        counts={"a": 300, "b": 1, "c": 40, "d": 1},
        finished={"x"},
        preempted={"y"},
    )
    rows = step_rows(out)
    assert rows.rows == [("b", 1000, 1), ("d", 17, 1), ("c", 0, 40), ("a", 256, 300)]
    assert rows.methods == {"c": "top_k:top_k_fraction=0.25"}
    # How a failed request is named to vLLM's scheduler: its newest block no other request holds
    # (b's first step in this ledger: its new block; d got none).
    assert rows.failure_blocks == {"c": 0, "a": 6, "b": 9}
    assert rows.finished == {"x"} and rows.preempted == {"y"}


def test_a_request_after_a_reused_prefix_names_its_blocks() -> None:
    """A new request vLLM starts after blocks of its prefix cache (num_computed_tokens > 0) comes
    with all its blocks (where the backend reads that prefix when no forward runs: a full graph's
    replay); a new request from its first token with none."""
    reused = new_request("r", 32)
    reused.block_ids = ([7, 8, 3],)
    out = scheduler_output(new=[reused, new_request("n", 0)], cached=cached_requests([], []),
                           counts={"r": 1, "n": 20}, finished=set())
    rows = step_rows(out)
    assert rows.prefix_blocks == {"r": [7, 8, 3]}
    assert rows.failure_blocks == {"r": 3, "n": 0}


def test_a_failed_request_is_named_by_a_block_no_other_request_holds() -> None:
    """With prefix caching requests share their prefix's blocks, and vLLM ends every request that
    holds a block reported as failed: each request is named by its newest block of its own,
    across steps (blocks added, a request finished and its blocks released, one resumed with new
    blocks). Naming the first block (before 2026-12-01) named the shared prefix: on an H200 a
    request refused at admission ended the two others that shared its prompt's first blocks."""
    ledger = BlockLedger()
    p, q = new_request("p", 0), new_request("q", 32)
    p.block_ids, q.block_ids = ([1, 2, 3],), ([1, 2, 4],)  # q reused p's first two blocks
    rows = step_rows(scheduler_output([p, q], cached_requests([], []), {"p": 40, "q": 8}, set()), ledger)
    assert rows.failure_blocks == {"p": 3, "q": 4}
    # r reuses all of p's three (full) blocks; p's newest is then shared, its next block its own.
    r = new_request("r", 48)
    r.block_ids = ([1, 2, 3, 7],)
    cached = cached_requests(["p", "q"], [40, 40])
    cached.new_block_ids = [([5],), None]
    rows = step_rows(scheduler_output([r], cached, {"p": 1, "q": 1, "r": 4}, set()), ledger)
    assert rows.failure_blocks == {"p": 5, "q": 4, "r": 7}
    # q finishes (its blocks released); p, preempted earlier, resumes with all-new blocks.
    cached = cached_requests(["p", "r"], [0, 52])
    cached.resumed_req_ids = {"p"}
    cached.new_block_ids = [([8, 9],), None]
    rows = step_rows(scheduler_output([], cached, {"p": 30, "r": 1}, {"q"}), ledger)
    assert rows.failure_blocks == {"p": 9, "r": 7}
    assert ledger.own_block("q") is None and ledger.holders[4] == 0


def test_a_prefix_a_live_request_holds_names_that_request() -> None:
    """A new request vLLM starts after whole blocks another live request holds at the same place
    is told to fork that request's sequence (BlockLedger.prefix_holder); a prefix that is not a
    whole number of blocks, or whose last block no live request holds, is not."""
    ledger = BlockLedger()
    p = new_request("p", 0)
    p.block_ids = ([1, 2, 3],)
    step_rows(scheduler_output([p], cached_requests([], []), {"p": 48}, set()), ledger, block_size=16)
    q, s, t = new_request("q", 32), new_request("s", 40), new_request("t", 16)
    q.block_ids, s.block_ids, t.block_ids = ([1, 2, 4],), ([1, 2, 3, 5],), ([6, 9],)
    rows = step_rows(scheduler_output([q, s, t], cached_requests(["p"], [48]), {"p": 1, "q": 1, "s": 8, "t": 4},
                                      set()), ledger, block_size=16)
    assert rows.prefix_sources == {"q": ("p", 32)}
    assert set(rows.prefix_blocks) == {"q", "s", "t"}  # where the prefix is read from otherwise
    # p finishes; q, which holds blocks 1 and 2 too, is the holder now.
    r = new_request("r", 32)
    r.block_ids = ([1, 2, 8],)
    rows = step_rows(scheduler_output([r], cached_requests(["q"], [33]), {"q": 1, "r": 1}, {"p"}), ledger,
                     block_size=16)
    assert rows.prefix_sources == {"r": ("q", 32)}


def test_a_kept_finished_request_holds_its_prefix_until_a_block_of_it_is_handed_out_afresh() -> None:
    """With keep > 0 a finished request stays a prefix holder (a chat's next turn forks its
    sequence) while vLLM's prefix cache still holds its blocks: a new request's prefix-cache hits
    on them keep it; a block of it handed out afresh (past a new request's hits, or a running
    request's new block) cuts its blocks there, and releases it where none are left; newer
    finished requests beyond `keep` release the oldest. Without keep (the default) a finished
    request is forgotten. Each step tells the worker which finished requests are kept and which
    kept ones were released (StepRows.kept, StepRows.released: the CUDA build's worker keeps and
    drops their sequences so)."""
    ledger = BlockLedger(keep=2)
    p = new_request("p", 0)
    p.block_ids = ([1, 2, 3],)
    step_rows(scheduler_output([p], cached_requests([], []), {"p": 48}, set()), ledger, block_size=16)
    q = new_request("q", 32)  # after p's first two blocks (hits); block 7 fresh
    q.block_ids = ([1, 2, 7],)
    rows = step_rows(scheduler_output([q], cached_requests([], []), {"q": 8}, {"p"}), ledger, block_size=16)
    assert rows.prefix_sources == {"q": ("p", 32)} and list(ledger.kept) == ["p"]
    assert rows.kept == {"p"} and rows.released == set()
    assert ledger.own_block("q") == 7  # a kept request's blocks name no live request's
    r = new_request("r", 0)  # handed p's third block afresh: p holds its first two still
    r.block_ids = ([3, 9],)
    rows = step_rows(scheduler_output([r], cached_requests(["q"], [40]), {"q": 1, "r": 20}, set()), ledger,
                     block_size=16)
    assert ledger.kept == {"p": [1, 2]} and rows.released == set() and rows.kept == set()
    s = new_request("s", 32)  # q, live, holds blocks 1 and 2: the live holder first
    s.block_ids = ([1, 2, 11],)
    rows = step_rows(scheduler_output([s], cached_requests(["q", "r"], [41, 20]), {"q": 1, "r": 1, "s": 4},
                                      set()), ledger, block_size=16)
    assert rows.prefix_sources == {"s": ("q", 32)}
    assert ledger.prefix_holders("s", [1, 2, 11], 32, 16) == ["q", "p"]
    t = new_request("t", 0)  # handed block 1 afresh (as though every holder had let it go): p has none left
    t.block_ids = ([1],)
    rows = step_rows(scheduler_output([t], cached_requests([], []), {"t": 4}, set()), ledger, block_size=16)
    assert "p" not in ledger.kept and rows.released == {"p"} and ledger.take_released() == []
    rows = step_rows(scheduler_output([], cached_requests(["s", "t"], [36, 4]), {"s": 1, "t": 1}, {"q"}), ledger,
                     block_size=16)
    assert rows.kept == {"q"}
    step_rows(scheduler_output([], cached_requests(["t"], [5]), {"t": 1}, {"r"}), ledger, block_size=16)
    assert list(ledger.kept) == ["q", "r"]
    rows = step_rows(scheduler_output([], cached_requests(["t"], [6]), {"t": 1}, {"s"}), ledger, block_size=16)
    assert list(ledger.kept) == ["r", "s"] and rows.kept == {"s"} and rows.released == {"q"}  # the oldest beyond 2
    # The worker side (BlockLedger.replace): blocks past a new request's hits are fresh.
    ledger.replace("u", [1, 2, 3, 4], hits=2)
    assert ledger.kept == {"s": [1, 2, 11]} and ledger.take_released() == ["r"]
    plain = BlockLedger()
    plain.replace("a", [1, 2])
    assert plain.finish("a") is False
    assert not plain.kept and plain.prefix_holder("b", [1, 2], 32, 16) is None


def test_the_cpu_workers_ledger_follows_whole_block_lists() -> None:
    """vLLM's CPU build: the worker sees each request's whole block list every step
    (BlockLedger.replace). A list that grew adds its new blocks only; a resumed request's new list
    replaces its old one; a block two requests share names neither while each has one of its own."""
    ledger = BlockLedger()
    ledger.replace("a", [1, 2, 3])
    ledger.replace("b", [1, 2, 4])
    assert ledger.own_block("a") == 3 and ledger.own_block("b") == 4
    ledger.replace("a", [1, 2, 3, 5])  # a grew: one block added, none counted twice
    assert ledger.blocks["a"] == [1, 2, 3, 5] and ledger.holders[1] == 2 and ledger.holders[3] == 1
    ledger.replace("a", [6, 7])  # resumed after a preemption: all-new blocks
    assert ledger.blocks["a"] == [6, 7] and ledger.holders[1] == 1 and 3 not in ledger.holders
    assert ledger.own_block("b") == 4 and ledger.own_block("a") == 7
    ledger.drop("b")
    assert ledger.own_block("b") is None and not ledger.holders.get(4)


def test_the_prompt_tail_is_the_multi_token_rows_after_the_decode_rows() -> None:
    """Both backends run vLLM's attention for a mixed step's prompt rows alone (PromptTail):
    (first row, first token, rows) where decode rows precede prompt rows, rows after the step's
    tokens being padding; None where there is nothing to leave out or a one-token row sits among
    the prompt rows (it could be a prompt's own: vLLM's attention for the whole batch)."""
    assert prompt_tail_rows([0, 1, 2, 10, 30], 30) == (2, 2, 4)
    assert prompt_tail_rows([0, 1, 2, 10, 30, 30, 30], 30) == (2, 2, 4)  # padded batch
    assert prompt_tail_rows([0, 1, 2, 3], 3) is None  # decode rows only
    assert prompt_tail_rows([0, 8, 30], 30) is None  # prompt rows only
    assert prompt_tail_rows([0, 1, 9, 10, 30], 30) is None  # a one-token row after a prompt row
    assert prompt_tail_rows([0, 1, 9, 30], 32) is None  # the rows do not cover the step's tokens


def test_batch_order_is_stable_for_equal_counts() -> None:
    assert batch_order({"r2": 1, "r0": 5, "r1": 1, "r3": 5}) == ["r2", "r1", "r0", "r3"]


def test_batch_order_is_vllms_own() -> None:
    """The order the connector computes is the one vLLM's V2 model runner sorts its batch by,
    where this vLLM has that rule as a function (vLLM 0.32's sort_batch_req_ids; in 0.24 it is
    inline in prepare_inputs, and the CUDA backend checks the order at run time): without
    speculative decoding, on batches of decode rows and prompt chunks of every size."""
    runner = pytest.importorskip("vllm.v1.worker.gpu.model_runner")
    sort = getattr(runner, "sort_batch_req_ids", None)
    if sort is None:
        pytest.skip("this vLLM sorts its batch inline (prepare_inputs)")
    import random

    rng = random.Random(0)
    for _ in range(200):
        counts = {f"r{i}": rng.choice([1, 1, 1, 2, 7, 256, 300]) for i in range(rng.randint(1, 12))}
        assert batch_order(counts) == sort(counts, {}, 1), counts


def test_engine_args_keep_vllms_prefix_caching_with_the_store_only_too(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvsparse.vllm import plugin

    monkeypatch.setenv(plugin.ENV_METHOD, "dense")  # engine_args writes it: restored after the test
    for kv in (None, "store"):  # vLLM's cache kept, or the store only (its prefix from the holders)
        if kv is None:
            monkeypatch.delenv(plugin.ENV_KV, raising=False)
        else:
            monkeypatch.setenv(plugin.ENV_KV, kv)
        args = plugin.engine_args()
        assert "enable_prefix_caching" not in args  # vLLM's default (on)
        assert args["attention_backend"] == "CUSTOM"
    assert plugin.engine_args(enable_prefix_caching=False)["enable_prefix_caching"] is False  # kwargs win


def test_finished_requests_are_kept_by_default_where_the_store_is_in_vllms_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvsparse.vllm import plugin

    monkeypatch.delenv(plugin.ENV_KEEP_FINISHED, raising=False)
    monkeypatch.delenv(plugin.ENV_KV, raising=False)
    monkeypatch.delenv(plugin.ENV_TARGET, raising=False)  # the CUDA build's default: in the worker
    assert plugin.finished_to_keep(prefix_caching=True) == plugin.KEEP_FINISHED_DEFAULT
    monkeypatch.setenv(plugin.ENV_TARGET, "inprocess")
    assert plugin.finished_to_keep(prefix_caching=True) == plugin.KEEP_FINISHED_DEFAULT
    monkeypatch.setenv(plugin.ENV_TARGET, "127.0.0.1:50051")  # a kvsparse-server's store outlives vLLM
    assert plugin.finished_to_keep(prefix_caching=True) == 0
    monkeypatch.setenv(plugin.ENV_KV, "store")  # the store only: its prefixes are there alone
    assert plugin.finished_to_keep(prefix_caching=True) == plugin.KEEP_ALL
    monkeypatch.setenv(plugin.ENV_KEEP_FINISHED, "0")
    with pytest.raises(ValueError, match="KVSPARSE_VLLM_KEEP_FINISHED=0"):
        plugin.finished_to_keep(prefix_caching=True)
    assert plugin.finished_to_keep(prefix_caching=False) == 0
