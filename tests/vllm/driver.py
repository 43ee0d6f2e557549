"""One vLLM generation for the plugin tests (a process of its own: vLLM's backend registry and
its engine are per process). Reads a JSON job from argv[1], prints one JSON line: the generated
token ids per prompt, and seconds; "then_methods" in the job (a list of per-request method
lists) generates the same prompts again in the same engine with each, their tokens in "then".
The plugin is on when the environment enables it (KVSPARSE_VLLM_METHOD, KVSPARSE_VLLM_TARGET);
then it also reports how many requests the plugin began again after a preemption.
"kv_cache_memory_bytes" in the job sizes vLLM's own KV cache (small: requests are preempted);
"prefix_caching" turns vLLM's prefix caching on; "connector" configures kvsparse's KV connector
(requests kvsparse fails end alone). Each generation's finish reasons are printed beside its tokens."""

from __future__ import annotations

import json
import os
import sys
import time

JOB = json.loads(sys.argv[1])
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "kv_cache_memory_bytes" not in JOB:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of vLLM's own KV cache
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402


def main() -> None:
    job = JOB
    extra = {"kv_cache_memory_bytes": job["kv_cache_memory_bytes"]} if "kv_cache_memory_bytes" in job else {}
    if job.get("connector"):
        extra["kv_transfer_config"] = {"kv_connector": "KvSparseConnector",
                                       "kv_connector_module_path": "kvsparse.vllm.connector", "kv_role": "kv_both"}
    llm = LLM(
        model=job["model"],
        dtype=job.get("dtype", "float32"),
        max_model_len=job.get("max_model_len", 2048),
        enforce_eager=True,
        skip_tokenizer_init=True,
        enable_prefix_caching=job.get("prefix_caching", False),
        max_num_seqs=job.get("max_num_seqs", 8),
        max_num_batched_tokens=job.get("max_num_batched_tokens", 256),
        block_size=32,
        seed=0,
        **extra,
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]

    reasons: list[list[str]] = []

    def generate(methods: list[str | None]) -> list[list[int]]:
        params = [
            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False,
                           extra_args={"kvsparse_method": m} if m else None)
            for n, m in zip(job["max_tokens"], methods)
        ]
        outs = llm.generate(prompts, params, use_tqdm=False)
        reasons.append([str(o.outputs[0].finish_reason) for o in outs])
        return [list(o.outputs[0].token_ids) for o in outs]

    t0 = time.perf_counter()
    result: dict = {"tokens": generate(job.get("methods") or [None] * len(prompts))}
    result["seconds"] = time.perf_counter() - t0
    # The same prompts again in the same engine, once per list of per-request methods
    # (one engine start for several generations).
    result["then"] = [generate(methods) for methods in job.get("then_methods", [])]
    result["finish_reasons"] = reasons
    if os.environ.get("KVSPARSE_VLLM_METHOD"):  # the plugin ran in this process (one-process vLLM)
        from kvsparse.vllm.plugin import WORKER

        result["restarts"] = WORKER.restarts
        result["prefix_imports"] = WORKER.prefix_imports
        result["prefix_forks"] = WORKER.prefix_forks
        result["prefix_forks_finished"] = WORKER.prefix_forks_finished
        result["prefix_copies"] = WORKER.prefix_copies
        result["vllm_rows_skipped"] = WORKER.vllm_rows_skipped
        result["timing"] = WORKER.timing
        result["sale"] = {"prefills": WORKER.sale_prefills, "skipped": WORKER.sale_skipped}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
