"""kvsparse's vLLM plugin against vLLM's own attention backend, on vLLM's CPU build (run with
the Python of scripts/install_vllm_cpu.sh's venv): B requests of P prompt tokens each generate G
tokens greedily (tests/vllm/driver.py: one vLLM engine in one process, a tiny Llama with random
weights: the model of tests/vllm unless --model), once with vLLM's backend and once per kvsparse
method through a kvsparse-server on loopback (CPU engine), or with --target inprocess through
the engine in vLLM's process (the PyTorch op, KVSPARSE_VLLM_TARGET=inprocess: KVSPARSE_TORCH_LIB
must name a libkvsparse_torch.so built against the venv's torch). Printed per row: seconds of
generate(), output tokens/s, and for the plugin where its time went: the backend's forward in
all, vLLM's own attention (prompt rows), kvsparse's calls (gRPC: the engine's time inside them as the server reports it; in process: the
op calls, engine included), and the rest, the plugin's own overhead (its bookkeeping, and over
gRPC the calls, the server's handling and the tensor conversions), as a share of generate()'s time.

    build/vllm-venv/bin/python tests/bench/vllm_bench.py --batch 8 --prompt 512 --gen 128 --json out.json
    cmake -S . -B build-vllm-op -G Ninja -DKVSPARSE_ENABLE_CUDA=OFF \
        -DKVSPARSE_TORCH_PREFIX=$(build/vllm-venv/bin/python -c "import torch; print(torch.utils.cmake_prefix_path)")
    cmake --build build-vllm-op --target kvsparse_torch
    KVSPARSE_TORCH_LIB=$PWD/build-vllm-op/lib/libkvsparse_torch.so \
        build/vllm-venv/bin/python tests/bench/vllm_bench.py --target inprocess --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import kvsparse

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "vllm" / "driver.py"


def tiny_llama(path: str, layers: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=32, vocab_size=1024, max_position_embeddings=8192,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path)


def run(job: dict, method: str | None, target: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSPARSE_VLLM_")}
    if method:
        env.update(KVSPARSE_VLLM_METHOD=method, KVSPARSE_VLLM_TARGET=target)
    out = subprocess.run([sys.executable, str(DRIVER), json.dumps(job)], capture_output=True, text=True, env=env,
                         timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--model", default="", help="a model directory (default: a tiny random Llama)")
    p.add_argument("--methods", default="dense;top_k:top_k_fraction=0.125,sink_tokens=32,local_tokens=32",
                   help="kvsparse methods (parse_method text), separated by ;")
    p.add_argument("--target", choices=("server", "inprocess"), default="server",
                   help="a kvsparse-server on loopback, or the engine in vLLM's process (the op)")
    p.add_argument("--json", default="")
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="vllm-bench-")
    model = args.model or os.path.join(tmp, "model")
    if not args.model:
        tiny_llama(model, args.layers)
    prompts = [[1] + [(7 * i + r) % 1000 + 3 for i in range(args.prompt - 1)] for r in range(args.batch)]
    job = {"model": model, "prompts": prompts, "max_tokens": [args.gen] * args.batch, "max_num_seqs": args.batch,
           "max_num_batched_tokens": 2048, "max_model_len": args.prompt + args.gen + 16}
    rows = []
    inproc = args.target == "inprocess"
    print(f"| variant | s | output tok/s | forward s | vLLM attention s | {'op calls' if inproc else 'engine'} s | "
          "plugin's own s (share) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    with contextlib.ExitStack() as stack:
        target = "inprocess" if inproc else stack.enter_context(kvsparse.LocalServer(capacity="4G", gpu="off")).target
        for method in [None, *[m for m in args.methods.split(";") if m]]:
            r = run(job, method, target)
            t = r.get("timing", {})
            # In process the op's time (the engine inside) is the transport's; over gRPC the
            # engine's time is the server's report and the rest of the call is the plugin's.
            kvs = t.get("transport" if inproc else "engine", 0.0)
            own = t.get("forward", 0.0) - t.get("vllm_attention", 0.0) - kvs if t else 0.0
            row = {"variant": method or "vLLM's backend", "target": args.target, "seconds": r["seconds"],
                   "tokens_per_s": args.batch * args.gen / r["seconds"], "timing": t,
                   "plugin_own_seconds": own, "plugin_own_share": own / r["seconds"] if t else 0.0,
                   "batch": args.batch, "prompt": args.prompt, "gen": args.gen, "layers": args.layers}
            rows.append(row)
            print(f"| {row['variant']} | {r['seconds']:.2f} | {row['tokens_per_s']:.1f} | {t.get('forward', 0):.2f} | "
                  f"{t.get('vllm_attention', 0):.2f} | {kvs:.2f} | "
                  f"{own:.2f} ({row['plugin_own_share']:.0%}) |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
