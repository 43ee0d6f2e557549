"""SALE prefill's quality on the model trained here (train_model.py): thresholds calibrated by
kvsparse-sale-calibrate's search on training-split windows, then the prompt prefilled through
SALE (kvsparse.torch.hf.KvSparseCache(prefill=...), the op's CUDA kernels on a GPU) and decoded
densely through kvsparse, against the same run with the prompt prefilled densely (SDPA).

    python3 tests/quality/train_model.py --out build/quality/model --context 16384 --batch 4 --steps 2520
    python3 tests/quality/sale_quality.py --model build/quality/model --out $OUT/sale     # the GPU
    python3 tests/quality/sale_quality.py --smoke --model /tmp/m --out /tmp/s             # CPU, CI

What it measures, per calibration bound theta (and for dense prefill):
- the thresholds: per layer the share of causal blocks skipped on the calibration windows and the
  worst window's L1 error per token (the search's bound);
- perplexity of held-out windows at each context, two ways: the prompt's own next-token NLL
  from the prefill's logits over its second half (where SALE's skipped blocks lie), and the NLL
  of the last --decode_tokens tokens, one dense decode step each after the prefill (SALE's
  effect through the K/V it leaves); each as a change against dense prefill with a 95% interval
  (paired per-token differences), and the share of blocks SALE skipped on those prompts;
- pass-key retrieval at several lengths and depths (greedy generation of the key), SALE prefill
  against dense prefill, with the blocks skipped.

Writes results.json and results.md (docs/ACCURACY.md, "SALE prefill on the model trained here").
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (pass keys, the perplexity interval)
import subjects  # noqa: E402  (the trained model, its text and pass keys)
import train_model  # noqa: E402  (windows of the text)

import kvsparse  # noqa: E402
import kvsparse.torch.hf as khf  # noqa: E402
import kvsparse.torch.ops  # noqa: E402
from kvsparse.tools import sale_calibrate  # noqa: E402
from kvsparse.torch.sale import SalePrefill  # noqa: E402


@torch.no_grad()
def window_nll(model: Any, tokens: torch.Tensor, n_decode: int, engine: Any, prefill: SalePrefill | None,
               device: str) -> tuple[list[float], list[float], khf.CacheStats]:
    """Prefill all but the last n_decode + 1 tokens (SALE with `prefill`, else SDPA), then one
    dense decode step per token through kvsparse. Returns the prompt's next-token NLL over its
    second half, each decode step's NLL and the cache's statistics."""
    x = tokens.to(device)[None]
    p = x.shape[1] - n_decode - 1
    with khf.KvSparseCache(model.config, engine, method=kvsparse.Dense(), prefill=prefill) as cache:
        out = model(x[:, :p], past_key_values=cache, use_cache=True)
        half = p // 2
        logits = out.logits[0, half : p - 1].float()
        prompt = torch.nn.functional.cross_entropy(logits, x[0, half + 1 : p], reduction="none").tolist()
        decode = []
        for i in range(n_decode):
            out = model(x[:, p + i : p + i + 1], past_key_values=cache, use_cache=True)
            decode.append(float(torch.nn.functional.cross_entropy(out.logits[0, -1].float()[None],
                                                                  x[0, p + i + 1][None])))
        return prompt, decode, cache.stats


def skipped_share(stats: khf.CacheStats) -> float:
    return stats.sale_skipped / stats.sale_prefills if stats.sale_prefills else 0.0


def change(nll: list[float], dense: list[float]) -> dict[str, Any]:
    c, lo, hi = harness.ppl_change_interval(nll, dense)
    return {"ppl": math.exp(float(np.mean(nll))), "ppl_change": c, "ppl_change_ci95": [lo, hi]}


def passkeys(subject: subjects.Subject, args: argparse.Namespace, engine: Any, prefill: SalePrefill | None,
             device: str) -> tuple[dict[str, float], float]:
    """harness.passkeys with the prompt prefilled through `prefill`, and the share of blocks SALE
    skipped over every document's layers."""
    stats: list[khf.CacheStats] = []
    acc = harness.passkeys(subject, args.passkey_lengths, args.passkey_depths, args.passkey_trials, engine,
                           kvsparse.Dense(), device, seed=5, prefill=prefill, stats=stats)
    n = sum(s.sale_prefills for s in stats)
    return acc, sum(s.sale_skipped for s in stats) / n if n else 0.0


def summary(results: dict[str, Any]) -> dict[str, Any]:
    """results without the per-token NLL lists (their count and mean instead): what results.json
    keeps."""
    out = json.loads(json.dumps(results))
    for row in [out.get("dense", {}), *out["runs"].values()]:
        for c in row.get("contexts", {}).values():
            for k in ("prompt_nll", "decode_nll"):
                v = c.pop(k)
                c[k.replace("_nll", "_tokens")], c[k + "_mean"] = len(v), float(np.mean(v))
    return out


def markdown(results: dict[str, Any]) -> str:
    rows = ["| prefill | blocks skipped (calibration) | ctx | blocks skipped | prompt ppl vs dense [95% CI] "
            "| decode ppl vs dense [95% CI] | pass keys (skipped) |", "|---|---|---|---|---|---|---|"]
    dense_pk = results["dense"]["passkey"]
    for name, row in results["runs"].items():
        pk = row["passkey"]
        for i, (ctx, c) in enumerate(row["contexts"].items()):
            pct = lambda d: f"{100 * d['ppl_change']:+.2f}% [{100 * d['ppl_change_ci95'][0]:+.2f}, {100 * d['ppl_change_ci95'][1]:+.2f}]"  # noqa: E731
            calib = f"{100 * row['calibration_skipped']:.1f}%" if i == 0 else ""
            keys = (f"{round(sum(pk.values()) * results['args']['passkey_trials'])}/"
                    f"{len(pk) * results['args']['passkey_trials']} (dense "
                    f"{round(sum(dense_pk.values()) * results['args']['passkey_trials'])}; "
                    f"{100 * row['passkey_skipped']:.1f}%)") if i == 0 else ""
            rows.append(f"| {name if i == 0 else ''} | {calib} | {ctx} | {100 * c['skipped']:.1f}% | {pct(c['prompt'])} "
                        f"| {pct(c['decode'])} | {keys} |")
    return "\n".join(rows) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint of train_model.py")
    p.add_argument("--out", required=True)
    p.add_argument("--theta", type=float, nargs="+", default=[0.4], help="calibration bounds (L1 error per token)")
    p.add_argument("--calib_context", type=int, default=16384)
    p.add_argument("--calib_windows", type=int, default=4, help="training-split windows (the paper: 5)")
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--windows", type=int, default=4, help="held-out windows per context")
    p.add_argument("--decode_tokens", type=int, default=64)
    p.add_argument("--passkey_lengths", type=int, nargs="+", default=[2048, 8192, 16384])
    p.add_argument("--passkey_depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    p.add_argument("--passkey_trials", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny contexts: checks the script")
    args = p.parse_args()
    if args.smoke:
        args.calib_context, args.calib_windows, args.contexts, args.windows = 640, 2, [640], 1
        args.decode_tokens, args.passkey_lengths, args.passkey_depths, args.passkey_trials = 4, [640], [0.5], 2
    device, out_dir, log = train_model.measurement_run(args.out, args.smoke)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    subject = subjects.trained(args.model, device, dtype, 48 << 20 if not args.smoke else 2 << 20)
    model, train_text, held = subject.model, subject.train, subject.held
    engine = kvsparse.torch.ops.InProcessEngine(gpu="off" if args.smoke else "auto", store_capacity="8G")
    log(f"model {args.model} on {device} ({dtype}); engine {engine.backend}")
    results: dict[str, Any] = {"model": json.loads((Path(args.model) / "config.json").read_text()),
                               "args": vars(args), "runs": {}}

    model.set_attn_implementation("sdpa")
    cal = [w[None] for w in train_model.windows_of(train_text, args.calib_context, args.calib_windows, 101)]
    prefills: dict[str, SalePrefill | None] = {"dense": None}
    for theta in args.theta:
        t0 = time.time()
        sp = sale_calibrate.calibrate(model, cal, theta=theta)
        prefills[f"SALE theta={theta:g}"] = sp
        sp.save(out_dir / f"sale-theta{theta:g}.json")
        skipped = [float(np.mean(row)) for row in sp.report["skipped"]]
        log(f"theta {theta:g}: calibrated in {time.time() - t0:.1f} s; blocks skipped per layer "
            f"{' '.join(f'{100 * s:.1f}%' for s in skipped)}; halvings {sp.report['halvings']}")
    khf.enable(model)

    for name, prefill in prefills.items():
        row: dict[str, Any] = {"contexts": {}}
        if prefill is not None:
            row["thresholds"] = prefill.thresholds
            row["calibration_skipped"] = float(np.mean([np.mean(r) for r in prefill.report["skipped"]]))
            row["calibration_error"] = prefill.report["error"]
        for ctx in args.contexts:
            t0 = time.time()
            prompt, decode, skipped, prefills_n = [], [], 0.0, 0
            for tokens in train_model.windows_of(held, ctx, args.windows, 303 + ctx):
                a, b, stats = window_nll(model, tokens, args.decode_tokens, engine, prefill, device)
                prompt += a
                decode += b
                skipped += stats.sale_skipped
                prefills_n += stats.sale_prefills
            row["contexts"][str(ctx)] = {"prompt_nll": prompt, "decode_nll": decode,  # per token: dropped on writing
                                         "skipped": skipped / prefills_n if prefills_n else 0.0,
                                         "seconds": time.time() - t0}
            log(f"{name} ctx {ctx}: prompt ppl {math.exp(np.mean(prompt)):.4f}, decode ppl "
                f"{math.exp(np.mean(decode)):.4f}, blocks skipped {100 * row['contexts'][str(ctx)]['skipped']:.1f}% "
                f"({time.time() - t0:.1f} s)")
        t0 = time.time()
        row["passkey"], row["passkey_skipped"] = passkeys(subject, args, engine, prefill, device)
        log(f"{name} pass keys: {row['passkey']}, blocks skipped {100 * row['passkey_skipped']:.1f}% "
            f"({time.time() - t0:.1f} s)")
        if name == "dense":
            results["dense"] = row
        else:
            for ctx, c in row["contexts"].items():
                d = results["dense"]["contexts"][ctx]
                c["prompt"] = change(c["prompt_nll"], d["prompt_nll"])
                c["decode"] = change(c["decode_nll"], d["decode_nll"])
                log(f"{name} ctx {ctx}: prompt ppl {100 * c['prompt']['ppl_change']:+.3f}% "
                    f"{[round(100 * x, 3) for x in c['prompt']['ppl_change_ci95']]}, decode ppl "
                    f"{100 * c['decode']['ppl_change']:+.3f}% {[round(100 * x, 3) for x in c['decode']['ppl_change_ci95']]}")
            results["runs"][name] = row
        (out_dir / "results.json").write_text(json.dumps(summary(results), indent=1))
    engine.close()
    (out_dir / "results.md").write_text(markdown(results))
    log(f"wrote {out_dir / 'results.json'} and results.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
