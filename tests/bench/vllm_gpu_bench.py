"""vLLM's CUDA build, its FlashAttention backend against kvsparse's (kvsparse.vllm.cuda_backend), on
a Llama-3.1-8B-shaped model with random weights (vLLM's load_format "dummy": only config.json is
written), one prompt length and batch per row pair, each run in a process of its own
(tests/vllm/cuda_driver.py): greedy decode of --steps tokens after the prompt; the step time from
vLLM's engine-core timestamps over the steps in which every request of the batch decoded (other
requests' prefill chunks excluded: a batch needs --steps above its prompts' chunk count for such
steps to exist), so the prefill is not in it; first_tokens_seconds is the time to the last
request's first token (every prompt prefilled).

Rows (JSON list, --out): n, batch, backend ("flash_attn", "kvsparse:<method>" with vLLM's paged
cache kept, or "kvsparse-store:<method>" with the K/V in kvsparse's store only,
KVSPARSE_VLLM_KV=store), tokens_per_s, ms_per_step, kv_gpu_bytes (the K/V of the batch's tokens
in vLLM's paged cache as its spec counts them, plus kvsparse's GPU state where it runs: with
vLLM's cache kept, kvsparse adds GPU memory rather than saving it), decoding_together (the most
requests vLLM decoded at once: under a KV budget, --kv_cache_memory, what it could hold),
floor_ms (weights plus the batch's K/V at the GPU's HBM bandwidth, --hbm_gbps), and the
command. Runs on a GPU host with vLLM's CUDA build (scripts/gpu_vllm_install.sh):

    python3 tests/bench/vllm_gpu_bench.py --lens 32768,131072 --batches 1 --out vllm-gpu.json
    # capacity: vLLM's KV budget for two 64k sequences; how many each backend decodes at once
    python3 tests/bench/vllm_gpu_bench.py --lens 65536 --batches 8 --kv_cache_seqs 2 \
        --backends "flash_attn;kvsparse-store:$FLAGSHIP" --store_kv_cache_memory 1G --store_capacity 90G
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from kvsparse.methods import FLAGSHIP_TEXT
from kvsparse.torch.ops import _bytes  # sizes as the engine's settings take them ("1G", "8Gi")

DRIVER = Path(__file__).resolve().parents[1] / "vllm" / "cuda_driver.py"


def write_config(path: Path, layers: int) -> None:
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=1 << 18,
                rope_theta=500000.0, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                torch_dtype="bfloat16").save_pretrained(path)


def run(spec: dict, timeout: int) -> dict:
    r = subprocess.run([sys.executable, str(DRIVER), json.dumps(spec)], capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0:
        return {"error": r.stderr[-3000:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lens", default="32768")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--steps", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--backends", default=f"flash_attn;kvsparse:{FLAGSHIP_TEXT}",
                    help="\";\"-separated: flash_attn, kvsparse:<method text>")
    ap.add_argument("--gpu_memory_utilization", type=float, default=0.85)
    ap.add_argument("--store_capacity", default="48G", help="kvsparse's host-memory store")
    ap.add_argument("--row_cache", default="0.005",
                    help="kvsparse's row cache (KVSPARSE_VLLM_ROW_CACHE); a comma-separated list runs each "
                         "kvsparse backend once per value, the row's row_cache saying which")
    ap.add_argument("--kv_cache_seqs", type=float, default=0,
                    help="vLLM's KV budget (kv_cache_memory_bytes) for flash_attn and kvsparse rows: this many "
                         "sequences of n + steps tokens in FlashAttention's spec (0: --gpu_memory_utilization's share)")
    ap.add_argument("--store_kv_cache_memory", default="1G",
                    help="vLLM's KV budget for kvsparse-store rows (its cache keeps 2 elements a token and kv head)")
    ap.add_argument("--chunk", type=int, default=8192, help="vLLM's max_num_batched_tokens (prompt chunk)")
    ap.add_argument("--hbm_gbps", type=float, default=4800.0, help="H200: 4.8 TB/s")
    ap.add_argument("--profile_steps", type=int, default=0,
                    help="torch.profiler over this many decode steps of each row (after 8 of them): a Chrome "
                         "trace beside --out and its summary in the row (tests/bench/trace_summary.py)")
    ap.add_argument("--timeout", type=int, default=540)
    ap.add_argument("--out", default="vllm-gpu-bench.json")
    args = ap.parse_args()
    command = "python3 tests/bench/vllm_gpu_bench.py " + " ".join(sys.argv[1:])
    model = Path(tempfile.mkdtemp(prefix="llama8b-shape-"))
    write_config(model, args.layers)
    weights = 2 * (128256 * 4096 * 2 + args.layers * (4096 * (4096 + 2 * 1024 + 4096) + 3 * 4096 * 14336))
    kv_token = 2 * args.layers * 8 * 128 * 2  # K and V, bf16, per token
    store_token = 2 * args.layers * 8 * 1 * 2  # kvsparse.vllm.patches.STORE_SLOT_HEAD_SIZE elements, bf16
    rows = []
    for n in [int(x) for x in args.lens.split(",")]:
        for b in [int(x) for x in args.batches.split(",")]:
            runs = [(backend, rc) for backend in args.backends.split(";")
                    for rc in (args.row_cache.split(",") if backend.startswith("kvsparse") else [None])]
            for backend, row_cache in runs:
                method = backend.split(":", 1)[1] if backend.startswith("kvsparse") else None
                store = backend.startswith("kvsparse-store:")
                env = {"KVSPARSE_VLLM_STORE_CAPACITY": args.store_capacity,
                       "KVSPARSE_VLLM_ROW_CACHE": row_cache or "0"}
                budget = (_bytes(args.store_kv_cache_memory) if store
                          else int(args.kv_cache_seqs * (n + args.steps + 16) * kv_token))
                if store:
                    env["KVSPARSE_VLLM_KV"] = "store"
                spec = {
                    "model": str(model), "load_format": "dummy", "prompt_len": n, "batch": b,
                    "max_tokens": args.steps, "max_model_len": n + args.steps + 16, "max_num_seqs": max(b, 1),
                    "max_num_batched_tokens": args.chunk, "gpu_memory_utilization": args.gpu_memory_utilization,
                    "kv_cache_memory_bytes": budget or None, "kvsparse": method, "kvsparse_env": env,
                }
                if args.profile_steps:
                    name = backend.split(":", 1)[0]
                    spec["profile"] = {"after": -(-n * b // args.chunk) + 8, "steps": args.profile_steps,
                                       "trace": str(Path(args.out).with_name(f"trace-{n}-{b}-{name}.json.gz"))}
                out = run(spec, args.timeout)
                row = {"n": n, "batch": b, "backend": backend, "command": command}
                if row_cache is not None:
                    row["row_cache"] = float(row_cache)
                if "error" in out:
                    row["error"] = out["error"]
                    print(json.dumps(row)[:3000], flush=True)
                    rows.append(row)
                    continue
                per_token = out["decode_seconds_per_token"]
                # The step at the row's batch: over the steps in which every request decoded
                # (other requests' prefill steps excluded); without such steps (requests that
                # never decoded together), the slowest request's first-to-last token time.
                step = out.get("together_seconds_per_step") or (max(per_token) if per_token else float("nan"))
                gpu_state = out.get("kvsparse", {}).get("engine_memory", {}).get("gpu_bytes", 0)
                row.update(
                    # requests decode together, as many as vLLM held at once
                    tokens_per_s=min(b, max(out["decoding_together"], 1)) / step, ms_per_step=1e3 * step,
                    kv_gpu_bytes=n * b * (store_token if store else kv_token) + gpu_state,
                    vllm_kv_cache_memory_bytes=budget or None, decoding_together=out["decoding_together"],
                    seconds=out["seconds"], first_tokens_seconds=out.get("first_tokens_seconds"),
                    together_steps=out.get("together_steps", 0),
                    first_to_last_ms=1e3 * max(per_token) if per_token else None,
                    kvsparse_gpu_state_bytes=gpu_state, vllm_kv_capacity_tokens=out["kv_cache_gpu_tokens"],
                    floor_ms=1e3 * (weights + n * b * kv_token) / (args.hbm_gbps * 1e9),
                    cudagraph_mode=out["cudagraph_mode"], kvsparse=out.get("kvsparse"),
                    profile=out.get("profile"),
                )
                if args.profile_steps:  # the profiled steps and the profiler's stop are in its time
                    row["note"] = "profiled: tokens_per_s and ms_per_step include the profiler's steps"
                print(json.dumps(row), flush=True)
                rows.append(row)
                Path(args.out).write_text(json.dumps(rows, indent=1))
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CACHE_ROOT", "/tmp/vllm-cache")
    main()
