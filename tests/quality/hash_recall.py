"""How well learned HashAttention signatures find the keys that matter, per training recipe and
signature width, on the model trained here (train_model.py): recall against the oracle top-k row.

    python3 tests/quality/hash_recall.py --model build/quality/model --out $OUT/hash    # a GPU
    python3 tests/quality/hash_recall.py --smoke --model /tmp/m --out /tmp/h           # CPU, CI

Captures every layer's post-RoPE queries and keys over --train_windows windows of the training
split and --eval_windows held-out ones (kvsparse.tools.calibrate.capture_both), then for each
configuration RECIPE:BITS:KEY_MLPS:STEPS (kvsparse.tools.calibrate.RECIPES; key MLPs per "kv" head or
per "query" head) trains every layer's MLPs and measures on the held-out windows, per layer,
calibrate.topk_recall's figures at --fraction (1/32: what HashTopK(top_k_fraction=1/32) reads):
the share of the oracle top-k row's keys the signatures pick (oracle_recall) and the attention
mass of what HashTopK would read against the oracle's (oracle_mass), the equal-size recall of the
whole prefix (recall, the figure of earlier runs) and HashAttention's own measure (the true top
32 among the first n/16 by signature, top32_in_1_16), beside SimHash at the same bits, and the
same on as many training windows ("fit_": what the MLPs fit against what carries to held-out text).
Writes results.json after every configuration (a run cut short keeps what it finished) and
stops starting new configurations after --minutes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_model  # noqa: E402  (the corpus of the training run)

import kvsparse.tools.calibrate as calibrate  # noqa: E402


def parse_config(s: str) -> dict[str, Any]:
    """RECIPE:BITS:KEY_MLPS:STEPS -> its fields (checked)."""
    parts = s.split(":")
    if len(parts) != 4 or parts[0] not in calibrate.RECIPES or parts[2] not in calibrate.KEY_MLPS:
        raise argparse.ArgumentTypeError(
            f"{s!r}: want RECIPE:BITS:KEY_MLPS:STEPS with RECIPE in {sorted(calibrate.RECIPES)} and KEY_MLPS in "
            f"{calibrate.KEY_MLPS}")
    bits, steps = int(parts[1]), int(parts[3])
    if bits % 32 or not 32 <= bits <= 256 or steps < 1:
        raise argparse.ArgumentTypeError(f"{s!r}: bits a multiple of 32 in [32, 256], steps >= 1")
    return {"recipe": parts[0], "bits": bits, "key_mlps": parts[2], "steps": steps}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint of train_model.py")
    p.add_argument("--out", required=True, help="directory for results.json")
    p.add_argument("--context", type=int, default=16384, help="tokens per window (train and held out)")
    p.add_argument("--train_windows", type=int, default=64)
    p.add_argument("--eval_windows", type=int, default=4)
    p.add_argument("--eval_queries", type=int, default=256, help="query positions per held-out window")
    p.add_argument("--fraction", type=float, default=1 / 32, help="top-k fraction the recall is measured at")
    p.add_argument("--configs", type=parse_config, nargs="+",
                   default=[parse_config(c) for c in ("kvsparse:32:kv:1500", "hashattention:32:kv:2000",
                                                      "hashattention:64:kv:2000", "hashattention:128:kv:2000")],
                   help="RECIPE:BITS:KEY_MLPS:STEPS, one training and measurement each")
    p.add_argument("--minutes", type=float, default=0.0, help="start no configuration after this (0: no limit)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny windows and steps: checks the script")
    args = p.parse_args()
    if args.smoke:
        args.context, args.train_windows, args.eval_windows, args.eval_queries = 512, 2, 1, 16
        args.configs = [parse_config(c) for c in ("kvsparse:32:kv:4", "hashattention:64:query:4")]
    t_start = time.time()
    device, out_dir, log = train_model.measurement_run(args.out, args.smoke)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    model.set_attn_implementation("sdpa")
    train_text, held = train_model.corpus(48 << 20 if not args.smoke else 2 << 20)
    cal_train = train_model.windows_of(train_text, args.context, args.train_windows, 101)
    cal_eval = train_model.windows_of(held, args.context, args.eval_windows, 202)
    captured = calibrate.capture_both(model, cal_train, cal_eval)
    log(f"model {args.model} on {device}: captured {len(captured[0])} layers over {args.train_windows} + "
        f"{args.eval_windows} windows of {args.context} tokens")
    gen = torch.Generator().manual_seed(args.seed + 7)
    pos = torch.randint(min(1024, args.context // 2), args.context, (args.eval_queries,), generator=gen).to(device)
    result: dict[str, Any] = {
        "model": str(args.model), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "command": " ".join(sys.argv), "context": args.context, "train_windows": args.train_windows,
        "eval_windows": args.eval_windows, "eval_queries": args.eval_queries, "fraction": args.fraction,
        "recipes": {name: vars(r) for name, r in calibrate.RECIPES.items()}, "runs": [],
    }
    for cfg in args.configs:
        if args.minutes and time.time() - t_start > args.minutes * 60:
            log(f"time budget spent: {cfg} not run")
            continue
        t0 = time.time()
        rows = []
        for i, (q, k) in enumerate(captured[0]):
            layer = calibrate.train_layer(q, k, recipe=cfg["recipe"], bits=cfg["bits"], steps=cfg["steps"],
                                          key_mlps=cfg["key_mlps"], seed=args.seed + i)
            row: dict[str, Any] = {"layer": i}
            # Held out, and the first training windows (as many): how well the MLPs fit what
            # they were trained on against how they carry to text they did not see.
            held = captured[1][i]
            fit = (q[: args.eval_windows], k[: args.eval_windows])
            for name, learned, (qe, ke) in (("learned", layer, held), ("simhash", None, held), ("fit", layer, fit)):
                r = calibrate.windows_recall(learned, qe, ke, pos, bits=cfg["bits"], fraction=args.fraction,
                                             seed=args.seed, simhash_seed=args.seed + i)
                row.update({f"{name}_{key}": round(x, 4) for key, x in r.items()})
            rows.append(row)
            log(f"{cfg['recipe']}:{cfg['bits']}:{cfg['key_mlps']}:{cfg['steps']} layer {i}: oracle-row recall "
                f"learned {row['learned_oracle_recall']:.3f} (mass {row['learned_oracle_mass']:.3f}; on training "
                f"windows {row['fit_oracle_recall']:.3f}; ties at the boundary {row['learned_boundary_ties']:.2f} per "
                f"key chosen), SimHash {row['simhash_oracle_recall']:.3f}; top32 in n/16 learned "
                f"{row['learned_top32_in_1_16']:.3f}")
        mean = {key: round(sum(r[key] for r in rows) / len(rows), 4) for key in rows[0] if key != "layer"}
        result["runs"].append({**cfg, "seconds": round(time.time() - t0, 1), "layers": rows, "mean": mean})
        log(f"{cfg}: mean oracle-row recall learned {mean['learned_oracle_recall']:.3f} "
            f"(SimHash {mean['simhash_oracle_recall']:.3f}), mass {mean['learned_oracle_mass']:.3f}, "
            f"equal-size recall {mean['learned_recall']:.3f}, top32 in n/16 {mean['learned_top32_in_1_16']:.3f}, "
            f"on training windows {mean['fit_oracle_recall']:.3f}, ties {mean['learned_boundary_ties']:.2f} "
            f"({time.time() - t0:.0f} s)")
        (out_dir / "results.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
