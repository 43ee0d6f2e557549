"""kvsparse's backend for vLLM's CUDA build (kvsparse.vllm.cuda_backend, kvsparse.vllm.connector)
in vLLM's real engine on a GPU: a tiny Llama-architecture model with random weights generates
greedily in a process of its own per run (tests/vllm/cuda_driver.py), four requests of different
lengths joining and leaving the batch, prompts prefilled in chunks, vLLM's CUDA graphs on (no
enforce_eager):
- dense through kvsparse gives vLLM's FlashAttention tokens (up to near-ties of the random
  model's logits; where the tokens agree, the log-probabilities within LOGPROB_TOL), and vLLM ran
  piecewise CUDA graphs, with vLLM's prefix caching on (the prompts
  are prefixes of each other: a later request starts after blocks vLLM reuses, read from its cache
  into the request's sequence; a chat's second turn starts after blocks of the first turn's
  generated tokens); with the K/V in the store only, prefix caching is refused;
- vLLM's OpenAI server with kvsparse's backend, connector and admission check (the flagship
  inside vLLM's full graphs): a bad method answered 400, requests served, a request asking for
  another method failing alone with the reason in the server's log, kvsparse's counters on
  /metrics;
- every method generates, each request with its own; finished requests' sequences are dropped
  (at the next step vLLM runs, when it tells the worker); kvsparse's counters (vLLM's /metrics)
  count every step's layers and rows under each method;
- a captured method (top-k over 2-bit keys) decodes inside vLLM's full decode graphs with the
  tokens it gives between vLLM's piecewise graphs, a request asking for another method failing
  alone while the requests sharing its prompt's blocks decode;
- a request kvsparse cannot serve ends with an error while the others decode vLLM's tokens; a
  kvsparse-server store that stops fails the requests that need it, and vLLM serves again once a
  store listens there again;
- with the K/V in kvsparse's store only (KVSPARSE_VLLM_KV=store), a KV budget in which vLLM's own
  backend cannot hold one request serves the batch with vLLM's tokens, prompt attention computed
  by the backend (over the store's rows for later chunks, through SALE's kernels at tau 0).
Skipped without a GPU or without vLLM's CUDA build (scripts/gpu_vllm_wheels.sh brings it to a GPU
host without network)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
# vllm.platforms, not vllm: without vLLM, "vllm" resolves to this tests/vllm folder.
pytest.importorskip("vllm.platforms")
from vllm.platforms import current_platform  # noqa: E402

if not current_platform.is_cuda():
    pytest.skip("needs vLLM's CUDA build", allow_module_level=True)

from openai_server import api_server, complete  # noqa: E402
from tiny_llama import MAX_TOKENS, PROMPTS, save_tiny_llama  # noqa: E402

from kvsparse.methods import FLAGSHIP_TEXT  # noqa: E402

DRIVER = Path(__file__).with_name("cuda_driver.py")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), head_dim=64)


# A chat's two turns (tests/vllm/cuda_driver.py's follow_up): the 100-token prompt alone with 40
# tokens generated in decode-only steps, then that prompt, its tokens and three more: vLLM's prefix
# caching reuses the first turn's 8 full blocks of 16 tokens (128), 28 of those tokens generated.
FOLLOW_UP = {"prompt": 1, "max_tokens": 40, "suffix": [17, 29, 31], "tokens": 16}


@pytest.fixture(scope="module")
def own(model: str) -> dict:
    """vLLM's own FlashAttention tokens and top-2 log-probabilities, with an ample KV budget."""
    out = generate(model, logprobs=2, follow_up=FOLLOW_UP)
    assert "error" not in out, out["error"]
    return out


def generate(model: str, kvsparse: str | None = None, **job: object) -> dict:
    spec = {"model": model, "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "max_num_batched_tokens": 256,
            "gpu_memory_utilization": 0.2, "kvsparse": kvsparse, **job}
    env = {**os.environ, "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT", "/tmp/vllm-cache")}
    run = subprocess.run([sys.executable, str(DRIVER), json.dumps(spec)], capture_output=True, text=True, env=env,
                         timeout=900)
    if run.returncode != 0:
        return {"error": run.stderr[-6000:]}
    return json.loads(run.stdout.strip().splitlines()[-1])


# Greedy tokens of a random tiny model meet near-ties (two tokens within bf16's rounding): where
# kvsparse's dense token differs from vLLM's, vLLM must have ranked it second, this close behind.
NEAR_TIE = 0.05  # nats


def assert_same_tokens_up_to_near_ties(own: dict, through: dict) -> None:
    for r, (a, b) in enumerate(zip(own["tokens"], through["tokens"])):
        if a == b:
            continue
        i = next(j for j in range(len(a)) if a[j] != b[j])
        top = own["logprobs"][r][i]
        assert str(b[i]) in top, f"request {r} token {i}: {b[i]} is not in vLLM's top {top}"
        gap = top[str(a[i])] - top[str(b[i])]
        assert gap < NEAR_TIE, f"request {r} token {i}: kvsparse chose {b[i]}, {gap:.3f} nats below vLLM's {a[i]}"


# Where kvsparse's dense tokens agree with vLLM's so far, the log-probability of the next token
# under each (the same model and K/V, attention by two kernels in bf16) differs by rounding; a
# prefix row read from a slot not yet written, or stale, moves it by far more.
LOGPROB_TOL = 0.05  # nats (0.004 seen on an H200, 2026-12-02)


def largest_logprob_gap(own: dict, through: dict) -> float:
    """The largest |log p_vLLM - log p_kvsparse| of a generated token over the positions where
    both runs' tokens agree up to and including it."""
    worst = 0.0
    for r, (a, b) in enumerate(zip(own["tokens"], through["tokens"])):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                break
            worst = max(worst, abs(own["logprobs"][r][i][str(x)] - through["logprobs"][r][i][str(x)]))
    return worst


def live_ids(worker: dict) -> list[str]:
    """The requests whose sequences are live, by the ids vLLM's LLM gave them (the engine's
    internal ids add a suffix: "3-9f70adb9")."""
    return [rid.rsplit("-", 1)[0] for rid in worker["live_requests"]]


def test_dense_through_kvsparse_gives_vllms_tokens_with_cuda_graphs(model: str, own: dict) -> None:
    # No finished request kept as a prefix holder (the default keeps 4): the chat's second turn
    # below reads its prefix from vLLM's cache, the path this test checks (the holders' fork:
    # test_a_finished_request_kept_as_a_holder_gives_its_prefix_to_the_next).
    through = generate(model, "dense", follow_up=FOLLOW_UP, logprobs=2, kvsparse_env={"KVSPARSE_VLLM_KEEP_FINISHED": "0"})
    assert "error" not in through, through["error"]
    assert [len(t) for t in through["tokens"]] == MAX_TOKENS
    assert_same_tokens_up_to_near_ties(own, through)
    gap = largest_logprob_gap(own, through)
    print(f"largest log-probability gap against vLLM's: {gap:.4f} nats")
    assert gap < LOGPROB_TOL, gap
    assert sum(a == b for a, b in zip(own["tokens"], through["tokens"])) >= 3
    assert "PIECEWISE" in through["cudagraph_mode"], through["cudagraph_mode"]
    assert "CUSTOM" in through["attention_backend"]
    w = through["kvsparse"]
    # Every finished request's sequence is dropped at the next step vLLM runs: only the request
    # that finished in the last step is still live when the engine goes idle.
    assert live_ids(w) == [w["last_finisher"]]
    assert w["plans_made"] >= 2  # the decoding set changed as requests left
    assert w["restarts"] == 0
    # Dense with its K/V in the store (host memory) has no captured step: its plans run as eager
    # calls and record no layer graphs (an H200, 2026-11-30). The flagship's plans inside vLLM
    # record and replay them (tests/bench/vllm_gpu_bench.py's rows, docs/PERF.md).
    assert w["layer_graphs"] == [0, 0], w["layer_graphs"]
    # vLLM's paged cache is written at every layer of every step that ran the model, decode-only
    # steps included (vLLM binds one step with nothing to run at the end of each of the three
    # generations, tests/vllm/cuda_driver.py's main and follow_up).
    layers = 2  # tests/vllm/tiny_llama.py
    assert 0 < w["prompt_steps"] < w["steps"], w
    assert w["cache_writes"] == layers * (w["steps"] - 3), w
    # In steps that mix decode and prompt rows (the short requests decode while the long prompts
    # prefill in chunks), vLLM's attention ran for the prompt rows alone.
    assert w["vllm_rows_skipped"] > 0, w
    # vLLM's prefix caching is on (kvsparse.vllm.engine_args keeps vLLM's default with its cache
    # kept), and a request admitted after the first step started after blocks an earlier prompt
    # had filled (the prompts extend each other) while that request still ran: its sequence was
    # forked from that request's in the store (the prefix's whole pages shared), what that
    # request computes in the same step read from vLLM's cache.
    assert through["prefix_caching"] is True
    assert w["prefix_forks"] > 0, w["fork_misses"]
    # A chat's next turn reads the first turn's blocks from vLLM's prefix cache, generated tokens
    # included: vLLM's cache holds their K/V (written at every step; when decode-only steps wrote
    # nothing there, the turn read whatever those slots held).
    # The second turn is compared with vLLM's own tokens for the same prompt, computed whole:
    # the first turn's tokens may differ from vLLM's at a near-tie, and the second turn's prompt
    # with them.
    mine = through["follow_up"]
    assert_same_tokens_up_to_near_ties({"tokens": own["follow_up"]["first"],
                                        "logprobs": own["follow_up"]["first_logprobs"]}, {"tokens": mine["first"]})
    assert mine["prefix_imports"] >= 128 > len(PROMPTS[FOLLOW_UP["prompt"]]), mine
    theirs = generate(model, prompts=[mine["prompt"]], max_tokens=[FOLLOW_UP["tokens"]], logprobs=2)
    assert "error" not in theirs, theirs["error"]
    assert_same_tokens_up_to_near_ties(theirs, mine)
    gap = largest_logprob_gap(theirs, mine)
    print(f"second turn: largest log-probability gap against vLLM's: {gap:.4f} nats")
    assert gap < LOGPROB_TOL, gap


def test_the_openai_server_decodes_through_kvsparse_and_serves_its_metrics(model: str, tmp_path: Path) -> None:
    """vLLM's OpenAI server on the CUDA build with kvsparse's backend, its KV connector and its
    admission check (docs/VLLM.md's command line), CUDA graphs on, the flagship the deployment's
    method (decoding inside vLLM's full graphs): a request naming a method kvsparse does not know
    is refused with HTTP 400 naming the field; requests with the deployment's method generate, a
    later one after the prefix an earlier one left in vLLM's cache; a request asking for another
    method is refused with HTTP 400 too (the full graphs serve the deployment's method only: the
    error names KVSPARSE_VLLM_FULL_GRAPHS; it failed in the worker with a generic 5xx before the
    check knew) and the server keeps serving; /metrics serves kvsparse's counters."""
    from kvsparse.vllm.cuda_backend import FIGURES_EVERY

    # FlashInfer's sampler off, as tests/vllm/cuda_driver.py has it: scripts/gpu_vllm_wheels.sh
    # does not bring FlashInfer (vLLM imports it for its sampler unless told not to).
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "KVSPARSE_VLLM_METHOD": FLAGSHIP_TEXT,
           "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT", "/tmp/vllm-cache"), "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    connector = json.dumps({"kv_connector": "KvSparseConnector", "kv_connector_module_path": "kvsparse.vllm.connector",
                            "kv_role": "kv_both"})
    args = ("--dtype", "bfloat16", "--max-model-len", "2048", "--gpu-memory-utilization", "0.2", "--max-num-seqs", "4",
            "--attention-backend", "CUSTOM", "--kv-transfer-config", connector,
            "--middleware", "kvsparse.vllm.middleware.MethodCheck")
    with api_server(model, tmp_path / "api.log", env, *args, start_seconds=400) as (base, api):
        bad = {"model": model, "prompt": PROMPTS[1], "max_tokens": 8, "vllm_xargs": {"kvsparse_method": "bogus"}}
        with pytest.raises(urllib.error.HTTPError) as refused:
            complete(base, bad)
        assert refused.value.code == 400
        assert json.load(refused.value)["error"]["param"] == "vllm_xargs.kvsparse_method"
        tokens = 17  # 16 decode steps a request (its first token from the prefill)
        body = {"model": model, "prompt": PROMPTS[1], "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        first = complete(base, body)["choices"][0]["token_ids"]
        assert len(first) == tokens
        with pytest.raises(urllib.error.HTTPError) as other:
            complete(base, {**body, "vllm_xargs": {"kvsparse_method": "dense"}})
        assert other.value.code == 400
        error = json.load(other.value)["error"]
        assert error["param"] == "vllm_xargs.kvsparse_method" and "KVSPARSE_VLLM_FULL_GRAPHS=0" in error["message"]
        for _ in range(2):  # the prompt's blocks from vLLM's prefix cache, its holder finished
            assert complete(base, body)["choices"][0]["token_ids"] == first
        metrics = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
        # Counters reach /metrics every FIGURES_EVERY steps of a plan (and when it ends): 48
        # steps of one request, 2 layers each (tests/vllm/tiny_llama.py).
        layers = 2
        santa = [x for x in metrics.splitlines() if x.startswith('kvsparse_decode_sequence_layers_total{method="santa"}')]
        assert santa and float(santa[0].split()[-1]) >= FIGURES_EVERY * layers, metrics[-3000:]
        assert 'kvsparse_decode_fetched_bytes_total{method="santa",tier="fetched"}' in metrics
        assert api.poll() is None, (tmp_path / "api.log").read_text()[-3000:]


def test_every_method_generates_each_request_its_own(model: str) -> None:
    methods = ["santa:samples=64,allocation=prop,scores=compressed", "top_k:top_k_fraction=0.25",
               "hash_top_k:top_k_fraction=0.25", "santa:samples=64"]
    out = generate(model, "dense", methods=methods)
    assert "error" not in out, out["error"]
    assert [len(t) for t in out["tokens"]] == MAX_TOKENS
    assert live_ids(out["kvsparse"]) == [out["kvsparse"]["last_finisher"]]
    # kvsparse's counters (what vLLM's /metrics serves): every decode step of every layer counted
    # under its method, rows read, and bytes read across the host link within dense's.
    counters = out["kvsparse"]["metrics"]
    decoded = {"santa": MAX_TOKENS[0] - 1 + MAX_TOKENS[3] - 1, "top_k": MAX_TOKENS[1] - 1,
               "hash_top_k": MAX_TOKENS[2] - 1}  # the first token of each comes from its prefill
    for name, steps in decoded.items():
        assert counters[f"kvsparse_decode_sequence_layers_total{{method={name}}}"] == 2 * steps, counters
        assert counters[f"kvsparse_decode_fetched_rows_total{{method={name}}}"] > 0, counters
        fetched = counters[f"kvsparse_decode_fetched_bytes_total{{method={name},tier=fetched}}"]
        assert 0 < fetched <= counters[f"kvsparse_decode_dense_equivalent_bytes_total{{method={name}}}"], counters
    santa_fetched = counters["kvsparse_decode_fetched_bytes_total{method=santa,tier=fetched}"]
    assert santa_fetched < counters["kvsparse_decode_dense_equivalent_bytes_total{method=santa}"] / 2



def test_a_captured_method_decodes_inside_vllms_full_cuda_graphs(model: str) -> None:
    """A deployment whose method has a captured step (top-k over 2-bit keys: deterministic, so
    its tokens can be compared) decodes inside vLLM's full decode graphs (kvsparse.vllm.slot_plan):
    vLLM keeps FULL_AND_PIECEWISE, most steps with decode rows replay inside vLLM's graph (no
    forward runs), the plan moves as requests join and leave, and the tokens equal those of the
    same method served between vLLM's piecewise graphs (KVSPARSE_VLLM_FULL_GRAPHS=0) up to
    near-ties, with vLLM's prefix caching on (later prompts start after blocks of earlier ones). A
    request asking for another method fails alone naming the setting, and the requests that share
    its prompt's first blocks keep decoding: a failed request is named to vLLM by a block of its
    own (kvsparse.vllm.plugin.BlockLedger). Naming its first block, requests 2 and 3 ended with
    request 1 on an H200 (docs/data/vllm-gpu-2026-12-01-full-graphs-h200/first-block-named.json)."""
    method = "top_k:top_k_fraction=0.25"
    outside = generate(model, method, logprobs=2, kvsparse_env={"KVSPARSE_VLLM_FULL_GRAPHS": "0"})
    assert "error" not in outside, outside["error"]
    assert outside["kvsparse"]["full_graphs"] is False
    assert "PIECEWISE" in outside["cudagraph_mode"] and "FULL" not in outside["cudagraph_mode"]
    inside = generate(model, method, methods=[None, "santa:samples=64", None, None])
    assert "error" not in inside, inside["error"]
    w = inside["kvsparse"]
    assert w["full_graphs"] is True and inside["cudagraph_mode"].endswith("FULL_AND_PIECEWISE"), inside["cudagraph_mode"]
    assert w["slot_rebinds"] >= 2, w
    assert 0 < w["slot_forward_steps"] < w["slot_steps"], w  # the rest replayed inside vLLM's graphs
    assert w["prefix_imports"] + w["prefix_forks"] > 0, w
    reasons = inside["finish_reasons"]
    assert reasons[1] not in ("length", "stop") and all(reasons[r] == "length" for r in (0, 2, 3)), reasons
    assert any("KVSPARSE_VLLM_FULL_GRAPHS" in f for f in w["failures"]), w["failures"]
    keep = (0, 2, 3)
    assert_same_tokens_up_to_near_ties({"tokens": [outside["tokens"][r] for r in keep],
                                        "logprobs": [outside["logprobs"][r] for r in keep]},
                                       {"tokens": [inside["tokens"][r] for r in keep]})
    assert live_ids(w) == [w["last_finisher"]]


def test_a_finished_request_kept_as_a_holder_gives_its_prefix_to_the_next(model: str) -> None:
    """By default (KVSPARSE_VLLM_KEEP_FINISHED unset: 4 with the store in vLLM's worker) the
    connector's ledger keeps finished requests as prefix holders (StepRows.kept) and the worker
    keeps their sequences: a chat's second turn, which
    starts after the first turn's 8 full blocks (128 tokens) once the first turn's request has
    finished, forks them from that request's sequence in the store instead of reading them from
    vLLM's cache, and dense still gives vLLM's tokens for the second turn. At most 4 finished
    requests' sequences are kept."""
    out = generate(model, "dense", logprobs=2, follow_up=FOLLOW_UP)
    assert "error" not in out, out["error"]
    w, mine = out["kvsparse"], out["follow_up"]
    assert w["prefix_forks_finished"] >= 128, (w["prefix_forks_finished"], w["fork_misses"])
    assert mine["prefix_imports"] < 128, mine
    assert 0 < len(w["kept_requests"]) <= 4, w["kept_requests"]
    theirs = generate(model, prompts=[mine["prompt"]], max_tokens=[FOLLOW_UP["tokens"]], logprobs=2)
    assert "error" not in theirs, theirs["error"]
    assert_same_tokens_up_to_near_ties(theirs, mine)
    assert largest_logprob_gap(theirs, mine) < LOGPROB_TOL


def test_a_request_kvsparse_cannot_serve_fails_alone(model: str, own: dict) -> None:
    """With kvsparse's KV connector (engine_args), a request whose method does not parse and one
    whose method the engine refuses (a fraction over 1) each end with an error, and the other
    requests of the batch decode vLLM's tokens (no admission check here: the offline engine)."""
    out = generate(model, "dense", methods=[None, "bogus", "top_k:top_k_fraction=2", None])
    assert "error" not in out, out["error"]
    reasons = out["finish_reasons"]
    assert reasons[1] not in ("length", "stop") and reasons[2] not in ("length", "stop"), reasons
    assert reasons[0] == reasons[3] == "length", reasons
    for r in (0, 3):
        assert len(out["tokens"][r]) == MAX_TOKENS[r]
    kept = {"tokens": [out["tokens"][r] for r in (0, 3)]}
    assert_same_tokens_up_to_near_ties({"tokens": [own["tokens"][r] for r in (0, 3)],
                                        "logprobs": [own["logprobs"][r] for r in (0, 3)]}, kept)


def test_a_store_outage_fails_its_requests_and_vllm_keeps_serving(model: str) -> None:
    """With the K/V in a kvsparse-server store (KVSPARSE_VLLM_TARGET=host:port): once the store
    stops, the requests that need it end with an error and vLLM's engine keeps running; once a
    store listens at the address again, the same requests are served (the engine's channel
    reconnects; new requests create their sequences there)."""
    if not os.environ.get("KVSPARSE_SERVER"):
        pytest.skip("needs kvsparse-server (KVSPARSE_SERVER)")
    out = generate(model, "dense", outage=True)
    assert "error" not in out, out["error"]
    assert out["finish_reasons"] == ["length"] * len(PROMPTS), out["finish_reasons"]
    o = out["outage"]
    assert all(r not in ("length", "stop") for r in o["during"]), o
    assert o["after"] == ["length"] * len(PROMPTS), o
    assert [len(t) for t in o["tokens_after"]] == MAX_TOKENS
    assert out["kvsparse"]["failures"], out["kvsparse"]


# The tiny model's K/V: 2 layers x 2 kv heads x 64 x (K and V) x 2 bytes = 1 KiB a token. 256 KiB
# of vLLM's cache holds 256 tokens: less than one request of max_model_len 4,096 with
# FlashAttention's own spec, 16,384 tokens with the store's 2 elements a token and kv head.
SMALL_KV_BUDGET = 256 << 10
STORE = {"KVSPARSE_VLLM_KV": "store"}


# The two store-only serving tests below count every prompt chunk's attention (and SALE's
# prefills): with vLLM's prefix caching off, as engine_args had it with the store only until
# 2026-12-02 (the prompts extend each other, so with it on a later request starts after reused
# blocks; test_store_only_with_prefix_caching_takes_each_prefix_from_the_store covers that).
NO_PREFIX_CACHING = {"enable_prefix_caching": False}


def test_store_only_serves_a_batch_over_vllms_kv_budget(model: str, own: dict) -> None:
    own_small = generate(model, kv_cache_memory_bytes=SMALL_KV_BUDGET)
    assert "error" in own_small  # vLLM's own backend cannot hold one request in this budget
    through = generate(model, "dense", kv_cache_memory_bytes=SMALL_KV_BUDGET, kvsparse_env=STORE,
                       **NO_PREFIX_CACHING)
    assert "error" not in through, through["error"]
    # kvsparse.vllm.patches.shrink_store_only_spec took effect: the budget holds the whole batch.
    assert through["kv_cache_gpu_tokens"] >= sum(len(p) for p in PROMPTS) + sum(MAX_TOKENS)
    assert [len(t) for t in through["tokens"]] == MAX_TOKENS
    assert_same_tokens_up_to_near_ties(own, through)
    assert sum(a == b for a, b in zip(own["tokens"], through["tokens"])) >= 3
    w = through["kvsparse"]
    # Every prompt chunk of both layers had its attention computed by the backend: the 300- and
    # 700-token prompts in chunks of 256 (their later chunks over the store's rows).
    assert w["prompt_attentions"] >= 2 * (1 + 1 + 2 + 3)
    assert w["sale_prefills"] == 0 and w["restarts"] == 0
    assert "PIECEWISE" in through["cudagraph_mode"]
    assert through["decoding_together"] >= 2


def test_store_only_with_prefix_caching_takes_each_prefix_from_the_store(model: str, own: dict) -> None:
    """With the K/V in the store only and vLLM's prefix caching on as engine_args leaves it
    (refused until 2026-12-02, then off there until this test had run on an H200), a prefix vLLM reuses
    comes from the store alone: forked from the sequence of the request that holds it, what that
    request computes in the same step copied from its sequence layer by layer, finished requests
    kept as holders while vLLM's cache holds their blocks. A chat's second turn forks the first
    turn's 128 tokens from its finished request's sequence; nothing is read from vLLM's cache;
    dense gives vLLM's tokens (up to near-ties). Keeping no finished request is refused."""
    out = generate(model, "dense", logprobs=2, follow_up=FOLLOW_UP, kvsparse_env=STORE)
    assert "error" not in out, out["error"]
    assert out["prefix_caching"] is True
    w, mine = out["kvsparse"], out["follow_up"]
    assert w["prefix_imports"] == 0 and w["prefix_forks_finished"] >= 128, (w["prefix_forks_finished"], w["fork_misses"])
    assert_same_tokens_up_to_near_ties(own, out)
    theirs = generate(model, prompts=[mine["prompt"]], max_tokens=[FOLLOW_UP["tokens"]], logprobs=2)
    assert "error" not in theirs, theirs["error"]
    assert_same_tokens_up_to_near_ties(theirs, mine)
    refused = generate(model, "dense", kvsparse_env={**STORE, "KVSPARSE_VLLM_KEEP_FINISHED": "0"})
    assert "error" in refused and "KVSPARSE_VLLM_KEEP_FINISHED=0" in refused["error"], refused["error"][-2000:]


def test_store_only_with_sale_and_sparse_methods(model: str, own: dict, tmp_path: Path) -> None:
    from kvsparse.torch.sale import SalePrefill

    thresholds = tmp_path / "sale.json"
    SalePrefill([[0.0] * 8, [0.0] * 8]).save(thresholds)  # tau 0: SALE's kernels, every block computed
    env = {**STORE, "KVSPARSE_VLLM_SALE": str(thresholds)}
    through = generate(model, "dense", kv_cache_memory_bytes=SMALL_KV_BUDGET, kvsparse_env=env,
                       **NO_PREFIX_CACHING)
    assert "error" not in through, through["error"]
    assert_same_tokens_up_to_near_ties(own, through)
    # Each request's first chunk (a whole prompt, or the start of one) went through SALE in both
    # layers; the later chunks attended over the store's rows.
    assert through["kvsparse"]["sale_prefills"] == 2 * len(PROMPTS)
    methods = ["santa:samples=64,allocation=prop,scores=compressed", "top_k:top_k_fraction=0.25",
               "hash_top_k:top_k_fraction=0.25", "santa:samples=64"]
    out = generate(model, "dense", methods=methods, kv_cache_memory_bytes=SMALL_KV_BUDGET, kvsparse_env=STORE,
                   **NO_PREFIX_CACHING)
    assert "error" not in out, out["error"]
    assert [len(t) for t in out["tokens"]] == MAX_TOKENS
