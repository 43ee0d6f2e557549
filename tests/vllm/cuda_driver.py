"""One vLLM generation on vLLM's CUDA build for the GPU tests and the benchmark (a process of its
own: vLLM's backend registry and engine are per process). Reads a JSON job from argv[1], prints
one JSON line: the generated token ids per prompt, seconds, vLLM's CUDA-graph mode, the decode
time per token of each request (vLLM's own timestamps: first to last token over the tokens after
the first), the time per step over the steps in which every request decoded (StepClock), with "logprobs": k vLLM's top-k log-probabilities at each generated position, and
with "kvsparse" in the job (a method text) kvsparse's worker figures: the requests whose sequences
are live at the end, plans made, requests restarted, layer graphs recorded and replayed, and
kvsparse's counters as vLLM's /metrics would serve them.

vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the worker's state can be read.
Job fields: model (a directory with config.json; load_format "dummy" gives random weights without
weight files), prompts (token id lists) or prompt_len + batch (random prompts), max_tokens (a
list or one number), dtype, max_model_len, gpu_memory_utilization, max_num_seqs,
max_num_batched_tokens, kv_cache_memory_bytes (vLLM's KV budget instead of a share of the GPU),
enforce_eager, methods (per request), kvsparse (method text or absent: vLLM's FlashAttention),
kvsparse_env (extra KVSPARSE_VLLM_* settings), follow_up (a chat's two turns after the
generation: {"prompt": index, "max_tokens", "suffix": token ids, "tokens"}, "follow_up" in the
result), outage (true: the K/V in a kvsparse-server store, KVSPARSE_SERVER, that stops after the
generation and starts again, "outage" in the result). The result's "decoding_together" is the most
requests whose decode intervals (first to last token, vLLM's timestamps) overlap: how many the
engine served at once."""

from __future__ import annotations

import json
import os
import sys
import time

JOB = json.loads(sys.argv[1])
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# vLLM imports FlashInfer for its top-k/top-p sampler on CUDA; greedy decoding does not need it,
# and scripts/gpu_vllm_wheels.sh does not bring it.
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
for k in [k for k in os.environ if k.startswith("KVSPARSE_VLLM_")]:
    del os.environ[k]
os.environ.update(JOB.get("kvsparse_env", {}))

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402


def prompts(job: dict) -> list[list[int]]:
    if "prompts" in job:
        return job["prompts"]
    import random

    rng = random.Random(0)
    return [[1] + [rng.randrange(3, 30000) for _ in range(job["prompt_len"] - 1)] for _ in range(job["batch"])]


def kvsparse_counters(w: object) -> dict:
    """kvsparse's counters in this process's Prometheus registry (vLLM's worker runs here), after
    the worker's pending figures: 'name{label=value,...}' -> value."""
    from prometheus_client import REGISTRY, CollectorRegistry, multiprocess

    w.flush_figures()  # type: ignore[attr-defined]
    registry = REGISTRY
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    out = {}
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name.startswith("kvsparse_decode") and sample.name.endswith("_total"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


class StepProfiler:
    """torch.profiler over `steps` of the engine's steps after the first `after` (the offline
    engine's step, wrapped on the instance): each step the range "driver.step". The trace is
    written and summarised by finish(), after the generation."""

    def __init__(self, llm: "LLM", after: int, steps: int, trace: str) -> None:
        self.engine, self.after, self.steps, self.trace = llm.llm_engine, after, steps, trace
        self.inner = self.engine.step
        self.engine.step = self.step
        self.n = 0
        self.prof = None
        self.stopped = False

    def step(self):  # type: ignore[no-untyped-def]
        import torch
        from torch.profiler import ProfilerActivity, profile, record_function

        if self.n == self.after:
            self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self.prof.__enter__()
        self.n += 1
        if self.prof is None or self.stopped:
            return self.inner()
        with record_function("driver.step"):
            out = self.inner()
        if self.n == self.after + self.steps:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            self.stopped = True
        return out

    def finish(self) -> dict | None:
        """The window's trace written to `trace` and its summary (None if it never closed)."""
        if not self.stopped:
            return None
        self.prof.export_chrome_trace(self.trace)  # type: ignore[union-attr]
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
        from trace_summary import load, summarize

        return summarize(load(self.trace), self.steps, "driver.step")


class StepClock:
    """The engine core's outputs per step (its get_output, wrapped on the instance): when each
    step's outputs were made (the engine core's monotonic timestamp) and which requests got a
    token in it."""

    def __init__(self, llm: "LLM") -> None:
        self.core = llm.llm_engine.engine_core
        self.inner = self.core.get_output
        self.core.get_output = self.get_output
        self.steps: list[tuple[float, list[str]]] = []

    def get_output(self):  # type: ignore[no-untyped-def]
        out = self.inner()
        rids = [o.request_id for o in out.outputs if o.new_token_ids]
        if rids:
            self.steps.append((out.timestamp, rids))
        return out

    def together(self, batch: int) -> dict:
        """Seconds per step over the steps in which every one of `batch` requests decoded (each
        had its first token before the step): the decode step at that batch, prefill steps of
        other requests excluded. Empty if fewer than two such steps."""
        seen: set[str] = set()
        ts = []
        for t, rids in self.steps:
            if len(rids) == batch and all(r in seen for r in rids):
                ts.append(t)
            seen.update(rids)
        if len(ts) < 2:
            return {}
        return {"together_seconds_per_step": (ts[-1] - ts[0]) / (len(ts) - 1), "together_steps": len(ts)}


def annotate_attention() -> None:
    """kvsparse's attention calls as the profiler's range "kvsparse.attention", and the plugin's
    own work of a step (the connector's bind and its end: admission, slots, positions, figures)
    as "kvsparse.plugin" (profiled jobs)."""
    from torch.profiler import record_function

    from kvsparse.vllm import cuda_backend

    def wrapped(cls: type, name: str, label: str) -> None:
        inner = getattr(cls, name)

        def annotated(self, *a, **k):  # type: ignore[no-untyped-def]
            with record_function(label):
                return inner(self, *a, **k)

        setattr(cls, name, annotated)

    wrapped(cuda_backend.KvSparseCudaImpl, "forward", "kvsparse.attention")
    wrapped(cuda_backend.CudaWorker, "begin_step", "kvsparse.plugin")
    wrapped(cuda_backend.CudaWorker, "end_step", "kvsparse.plugin")


ROUNDS: list[list] = []  # each generation's outputs, in order


def generate_round(llm: "LLM", ps: list[list[int]], params: list) -> list:
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], params, use_tqdm=False)
    ROUNDS.append(outs)
    return outs


def top_logprobs(outs: list) -> list:
    """Per request and generated position: {token: logprob} of vLLM's top tokens there."""
    return [[{str(t): float(lp.logprob) for t, lp in pos.items()} for pos in o.outputs[0].logprobs] for o in outs]


def follow_up(llm: "LLM", ps: list[list[int]], job: dict) -> dict:
    """A chat's two turns after the generation: prompt follow_up["prompt"] alone with
    follow_up["max_tokens"] tokens (decode-only steps after its prefill), then that prompt with
    its generated tokens and follow_up["suffix"] with follow_up["tokens"] more: vLLM's prefix
    caching reuses the first turn's blocks, generated tokens included. Both turns' tokens, the
    second turn's prompt, both turns' top log-probabilities (with "logprobs") and, with kvsparse,
    the prompt tokens read from vLLM's prefix cache into the second turn's sequence."""
    f = job["follow_up"]
    first = generate_round(llm, [ps[f["prompt"]]], [SamplingParams(temperature=0, max_tokens=f["max_tokens"],
                                                                    ignore_eos=True, detokenize=False,
                                                                    logprobs=job.get("logprobs"))])
    said = list(first[0].outputs[0].token_ids)
    imported = 0
    if job.get("kvsparse"):
        from kvsparse.vllm.cuda_backend import CUDA_WORKER

        imported = CUDA_WORKER.prefix_imports
    turn = ps[f["prompt"]] + said + f["suffix"]
    again = generate_round(llm, [turn], [SamplingParams(temperature=0, max_tokens=f["tokens"], ignore_eos=True,
                                                        detokenize=False, logprobs=job.get("logprobs"))])
    result: dict = {"first": [said], "prompt": turn, "tokens": [list(again[0].outputs[0].token_ids)]}
    if job.get("logprobs"):
        result["first_logprobs"], result["logprobs"] = top_logprobs(first), top_logprobs(again)
    if job.get("kvsparse"):
        result["prefix_imports"] = CUDA_WORKER.prefix_imports - imported
    return result


def start_outage_store(target: str | None = None) -> "subprocess.Popen":
    """A kvsparse-server store for the outage job (tests/vllm/store_process.py), at `target` or
    a free local port, named to the backend as KVSPARSE_VLLM_TARGET."""
    from store_process import free_target, start_store

    if target is None:
        target = free_target()
        os.environ["KVSPARSE_VLLM_TARGET"] = target
    proc = start_store(target)
    proc.target = target  # type: ignore[attr-defined]
    return proc


def outage(llm: "LLM", ps: list[list[int]], params: list, store: "subprocess.Popen") -> dict:
    """The store stops after the first generation: the same prompts again (each request's
    finish reason), then a store at the same address again and the prompts until every request
    is served (up to 10 tries, a second apart: the engine's channel reconnects with a backoff)."""
    store.terminate()
    store.wait(timeout=30)
    during = generate_round(llm, ps, params)
    store = start_outage_store(store.target)  # type: ignore[attr-defined]
    try:
        for tries in range(1, 11):
            after = generate_round(llm, ps, params)
            if all(str(o.outputs[0].finish_reason) == "length" for o in after):
                break
            time.sleep(1)
    finally:
        store.terminate()
    return {"during": [str(o.outputs[0].finish_reason) for o in during],
            "after": [str(o.outputs[0].finish_reason) for o in after], "tries": tries,
            "tokens_after": [list(o.outputs[0].token_ids) for o in after]}


def main() -> None:
    job = JOB
    if job.get("profile") and job.get("kvsparse"):
        annotate_attention()
    extra: dict = {}
    if job.get("kvsparse"):
        from kvsparse.vllm import engine_args

        extra = engine_args(job["kvsparse"])
    else:
        extra = {"attention_backend": job.get("backend", "FLASH_ATTN"), "enable_prefix_caching": False}
    if "enable_prefix_caching" in job:
        extra["enable_prefix_caching"] = job["enable_prefix_caching"]
    if job.get("kv_cache_memory_bytes"):
        extra["kv_cache_memory_bytes"] = job["kv_cache_memory_bytes"]
    store = start_outage_store() if job.get("outage") else None  # before the engine reads its target
    llm = LLM(
        model=job["model"],
        load_format=job.get("load_format", "auto"),
        dtype=job.get("dtype", "bfloat16"),
        max_model_len=job.get("max_model_len", 4096),
        enforce_eager=job.get("enforce_eager", False),
        skip_tokenizer_init=True,
        gpu_memory_utilization=job.get("gpu_memory_utilization", 0.5),
        max_num_seqs=job.get("max_num_seqs", 8),
        max_num_batched_tokens=job.get("max_num_batched_tokens", 2048),
        disable_log_stats=False,
        seed=0,
        **extra,
    )
    profiler = None
    if job.get("profile"):
        pj = job["profile"]
        profiler = StepProfiler(llm, pj["after"], pj["steps"], pj["trace"])
    ps = prompts(job)
    n = job["max_tokens"]
    counts = n if isinstance(n, list) else [n] * len(ps)
    methods = job.get("methods") or [None] * len(ps)
    params = [
        SamplingParams(temperature=0, max_tokens=c, ignore_eos=True, detokenize=False,
                       logprobs=job.get("logprobs"), extra_args={"kvsparse_method": m} if m else None)
        for c, m in zip(counts, methods)
    ]
    clock = StepClock(llm)
    t0, m0 = time.perf_counter(), time.monotonic()
    outs = generate_round(llm, ps, params)
    seconds = time.perf_counter() - t0
    later = {}
    if job.get("follow_up"):
        later["follow_up"] = follow_up(llm, ps, job)
    if store is not None:
        later["outage"] = outage(llm, ps, params, store)
    per_token = []
    for o in outs:
        m = o.metrics
        k = len(o.outputs[0].token_ids)
        if m is not None and k > 1 and m.last_token_ts > m.first_token_ts:
            per_token.append((m.last_token_ts - m.first_token_ts) / (k - 1))
    spans = [(o.metrics.first_token_ts, o.metrics.last_token_ts) for o in outs if o.metrics is not None]
    together = max((sum(a <= t <= b for a, b in spans) for t, _ in spans), default=0)
    config = llm.llm_engine.vllm_config
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "finish_reasons": [str(o.outputs[0].finish_reason) for o in outs],
        "seconds": seconds,
        "decode_seconds_per_token": per_token,
        "decoding_together": together,
        # the last request's first token, from the generation's start: every prompt's prefill
        "first_tokens_seconds": max((o.metrics.first_token_ts for o in outs if o.metrics is not None),
                                    default=m0) - m0,
        **clock.together(len(ps)),
        "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
        "prefix_caching": bool(config.cache_config.enable_prefix_caching),
        "attention_backend": str(config.attention_config.backend),
        "kv_cache_gpu_tokens": int(getattr(config.cache_config, "num_gpu_blocks", 0) or 0)
        * int(config.cache_config.block_size),
    }
    if profiler is not None:
        result["profile"] = profiler.finish()
    if job.get("logprobs"):
        result["logprobs"] = top_logprobs(outs)
    result.update(later)
    if job.get("kvsparse"):
        from kvsparse.vllm.cuda_backend import CUDA_WORKER as w

        result["kvsparse"] = {
            "live_requests": sorted(w.sequences),
            # the request of the last generation with the most tokens (the last to finish)
            "last_finisher": max(ROUNDS[-1], key=lambda o: len(o.outputs[0].token_ids)).request_id,
            "plans_made": w.replans,
            "restarts": w.restarts,
            "prompt_attentions": w.prompt_attentions,
            "failed": sorted(w.failed),
            "failures": list(w.failures),
            "sale_prefills": w.sale_prefills,
            "steps": w.steps,
            "prompt_steps": w.prompt_steps,
            "cache_writes": w.cache_writes,
            "vllm_rows_skipped": w.vllm_rows_skipped,
            "prefix_imports": w.prefix_imports,
            "prefix_forks": w.prefix_forks,
            "prefix_forks_finished": w.prefix_forks_finished,
            "prefix_copies": w.prefix_copies,
            "kept_requests": sorted(w.kept),
            "fork_misses": list(w.fork_misses),
            "engine_memory": w.engine().memory() if w._engine is not None and store is None else {},
            # recorded and replayed, by the plans closed and those still live
            "layer_graphs": [sum(x) for x in zip(w.layer_graphs, *(p.steps.graph_counts() for p in w.plans.values()))],
            # vLLM's full decode graphs (kvsparse.vllm.slot_plan): whether the slot plan serves,
            # its steps with decode rows, those of them run outside vLLM's graphs, its moves.
            "full_graphs": w.slots is not None,
            "slot_steps": w.slot_steps,
            "slot_forward_steps": w.slot_forward_steps,
            "slot_rebinds": w.slots.rebinds if w.slots is not None else 0,
            "metrics": kvsparse_counters(w),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
