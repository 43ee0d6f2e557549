"""Trains the model kvsparse measures its quality on: a small Llama-architecture decoder (RoPE,
GQA with 4 query heads per kv head, head dim 128, bf16) trained from scratch on one GPU within a
time budget (default 7.5 minutes), on the Python standard library's source files (on every
machine with Python; no download), with a share of synthetic retrieval documents (a pass key
buried in filler text and asked for at the end) so that it learns retrieval heads.

Bytes are tokens (vocabulary 256 + 2 specials), so no tokenizer is needed. The model is a
transformers LlamaForCausalLM (what kvsparse.torch.hf plugs into); the checkpoint is written in
bf16 safetensors shards of at most 15 MB (what comes back from the GPU machine: files of at most
16 MiB, 64 MiB in all). Printed at the end and written to metrics.json: training loss, held-out
perplexity at the training context (dense attention), and pass-key accuracy over lengths and
depths (dense attention).

    python3 tests/quality/train_model.py --out /tmp/model            # the GPU machine, ~8 min
    python3 tests/quality/train_model.py --smoke --out /tmp/m        # CPU, seconds: the harness
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import sysconfig
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import transformers

BOS, PAD = 256, 257
VOCAB = 258


def corpus(limit_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """The standard library's .py files (not site-packages) as bytes separated by BOS: every 20th
    file by name goes to the held-out set."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    train, held = [], []
    total = 0
    for i, p in enumerate(files):
        try:
            data = p.read_bytes()
        except OSError:
            continue
        (held if i % 20 == 0 else train).append(np.frombuffer(data, np.uint8).astype(np.int16))
        total += len(data)
        if total >= limit_bytes:
            break

    def join(parts: list[np.ndarray]) -> np.ndarray:
        out = []
        for a in parts:
            out.append(np.array([BOS], np.int16))
            out.append(a)
        return np.concatenate(out)

    return join(train), join(held)


def passkey_doc(rng: random.Random, text: np.ndarray, length: int, depth: float | None = None) -> tuple[list[int], str]:
    """A pass key buried at `depth` (fraction of the filler) in `length` tokens of filler, asked
    for at the end; returns the tokens up to and including the answer and the answer."""
    key = f"{rng.randrange(10000, 100000)}"
    needle = f"\n# The pass key is {key}. Remember it. {key} is the pass key.\n".encode()
    question = f"\n# What is the pass key? The pass key is {key}".encode()
    n_fill = length - len(needle) - len(question) - 1
    start = rng.randrange(0, len(text) - n_fill - 1)
    fill = text[start : start + n_fill].tolist()
    at = int((rng.random() if depth is None else depth) * n_fill)
    toks = [BOS] + fill[:at] + list(needle) + fill[at:] + list(question)
    return toks, key


def batch(rng: random.Random, text: np.ndarray, b: int, t: int, passkey_share: float, device: str) -> torch.Tensor:
    rows = []
    for _ in range(b):
        if rng.random() < passkey_share:
            toks, _ = passkey_doc(rng, text, t)
        else:
            s = rng.randrange(0, len(text) - t - 1)
            toks = text[s : s + t].tolist()
        rows.append(toks[:t] + [PAD] * (t - len(toks)))
    return torch.tensor(rows, dtype=torch.long, device=device)


def make_model(args: argparse.Namespace) -> transformers.LlamaForCausalLM:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads // 4,  # GQA groups of 4
        head_dim=args.head_dim,
        max_position_embeddings=4 * args.context,
        rope_theta=args.rope_theta,
        bos_token_id=BOS,
        pad_token_id=PAD,
        eos_token_id=None,
        tie_word_embeddings=True,
    )
    torch.manual_seed(args.seed)
    model = transformers.LlamaForCausalLM(cfg)
    model.set_attn_implementation("sdpa")
    return model


@torch.no_grad()
def windows_of(text: np.ndarray, context: int, count: int, seed: int) -> list[torch.Tensor]:
    """`count` windows of `context` tokens at random starts of `text` (the same for a seed)."""
    rng = random.Random(seed)
    return [torch.tensor(text[s : s + context].tolist()) for s in
            (rng.randrange(0, len(text) - context - 1) for _ in range(count))]


def measurement_run(out: str, smoke: bool) -> tuple[str, Path, Callable[[str], None]]:
    """A measuring script's device (CUDA unless --smoke or none), its output directory (made) and
    a log that prefixes the seconds since this call."""
    device = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    def log(s: str) -> None:
        print(f"[{time.time() - t_start:6.1f} s] {s}", flush=True)

    return device, out_dir, log


def held_out_ppl(model, held: np.ndarray, t: int, windows: int, device: str) -> float:
    rng = random.Random(7)
    nll, count = 0.0, 0
    for _ in range(windows):
        s = rng.randrange(0, len(held) - t - 1)
        x = torch.tensor(held[s : s + t].tolist(), device=device)[None]
        with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=device != "cpu"):
            logits = model(x).logits.float()
        nll += float(torch.nn.functional.cross_entropy(logits[0, :-1], x[0, 1:], reduction="sum"))
        count += t - 1
    return math.exp(nll / count)


@torch.no_grad()
def passkey_accuracy(model, held: np.ndarray, lengths: list[int], depths: list[float], trials: int, device: str) -> dict[str, float]:
    rng = random.Random(11)
    out: dict[str, float] = {}
    for n in lengths:
        for depth in depths:
            ok = 0
            for _ in range(trials):
                toks, key = passkey_doc(rng, held, n, depth)
                prompt = toks[: len(toks) - len(key)]
                x = torch.tensor(prompt, device=device)[None]
                with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=device != "cpu"):
                    gen = model.generate(x, max_new_tokens=len(key), do_sample=False, pad_token_id=PAD)
                ok += bytes(gen[0, len(prompt) :].tolist()).decode(errors="replace") == key
            out[f"{n}@{depth:.1f}"] = ok / trials
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="checkpoint and metrics.json go here")
    p.add_argument("--minutes", type=float, default=7.5, help="training time budget")
    p.add_argument("--steps", type=int, default=0,
                   help="train exactly this many steps (the cosine's horizon; --minutes is then only "
                        "a safety stop): the same model on any GPU, where a time budget gives a "
                        "faster GPU more steps")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8, help="query heads (kv heads: a quarter)")
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--rope_theta", type=float, default=100000.0)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--passkey_share", type=float, default=0.25)
    p.add_argument("--corpus_mb", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--passkey_trials", type=int, default=10, help="pass keys per (length, depth) cell at the end; 0: none")
    p.add_argument("--smoke", action="store_true", help="tiny model, CPU, a few steps: checks the harness")
    args = p.parse_args()
    if args.smoke:
        # A fixed number of steps, not a time budget: the same work on a fast or a loaded machine
        # (the time budget is then only a safety stop).
        args.minutes, args.context, args.batch, args.layers, args.hidden = 10.0, 256, 2, 2, 64
        args.heads, args.head_dim, args.ffn, args.corpus_mb = 4, 16, 128, 2
        args.steps = args.steps or 40
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    t0 = time.time()
    train, held = corpus(args.corpus_mb << 20)
    print(f"corpus: {len(train) / 1e6:.1f} M train tokens, {len(held) / 1e6:.2f} M held out ({time.time() - t0:.0f} s)", flush=True)
    model = make_model(args).to(device)
    params = sum(x.numel() for x in model.parameters())
    print(f"model: {params / 1e6:.1f} M parameters, {args.layers} layers, H={args.heads}, Hkv={args.heads // 4}, d={args.head_dim}, context {args.context}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=device == "cuda")
    budget = args.minutes * 60
    warmup = 50 if not args.smoke else 2
    start = time.time()
    step, losses, total_steps = 0, [], None
    while True:
        elapsed = time.time() - start
        if elapsed >= budget or (args.steps > 0 and step >= args.steps):
            break
        if args.steps > 0:
            total_steps = args.steps
        elif step >= 20 and step % 20 == 0:  # the cosine's horizon from the rate so far
            total_steps = max(step + 1, int(budget / (elapsed / step)))
        horizon = total_steps or 10**9
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / horizon))))
        for g in opt.param_groups:
            g["lr"] = lr
        x = batch(rng, train, args.batch, args.context, args.passkey_share, device)
        labels = x.masked_fill(x == PAD, -100)
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device != "cpu"):
            loss = model(x, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        step += 1
        if step % 50 == 0 or step == 1:
            tok_s = step * args.batch * args.context / (time.time() - start)
            print(f"step {step}: loss {np.mean(losses[-50:]):.3f}, lr {lr:.2e}, {tok_s / 1e3:.0f} k tokens/s, {time.time() - start:.0f} s", flush=True)
    train_s = time.time() - start
    model.eval()
    ppl = held_out_ppl(model, held, args.context, 4 if not args.smoke else 1, device)
    lengths = [2048, 4096, 8192] if not args.smoke else [256]
    trials = args.passkey_trials if not args.smoke else 1
    keys = passkey_accuracy(model, held, lengths, [0.1, 0.5, 0.9], trials, device) if trials > 0 else {}
    metrics = {
        "parameters": params,
        "steps": step,
        "train_seconds": round(train_s, 1),
        "tokens_seen": step * args.batch * args.context,
        "final_train_loss": float(np.mean(losses[-50:])),
        "held_out_ppl_at_context": ppl,
        "passkey_accuracy": keys,
        "args": vars(args),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
    }
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size="15MB", safe_serialization=True)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    print(json.dumps({k: v for k, v in metrics.items() if k != "args"}, indent=1), flush=True)
    sizes = {f.name: f.stat().st_size for f in out.iterdir()}
    print("checkpoint:", {k: f"{v / 2**20:.1f} MiB" for k, v in sizes.items()}, flush=True)


if __name__ == "__main__":
    sys.exit(main())
