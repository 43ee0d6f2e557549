"""``kvsparse-sale-calibrate``: SALE's per-layer, per-head thresholds for a Hugging Face causal LM
(the SALE paper's halving search), written as a file ``kvsparse.torch.sale.SalePrefill.load``
reads (needs the ``tools`` extra: torch and transformers).

    kvsparse-sale-calibrate --model DIR --random_tokens --tokens 4096 --samples 4 --theta 0.4 --out sale.json

The calibration runs the model over sample prompts, records each layer's post-RoPE q, k and v,
and per layer halves every head's threshold from tau0 until the head's L1 error against dense
attention, ``||O - O~||_1 / n``, is at most theta on every sample. The search is
``kernels::SaleHalvingSearch``, reached through ``torch.ops.kvsparse.sale_calibrate``
(``calibrate_layer``): a model on the CPU runs its rounds on the reference (exact arithmetic); a
bf16 / fp16 model on a CUDA device on SALE's CUDA kernels (the error of the kernels' output at
each threshold against their own output with every block), which takes seconds where the
reference takes hours at 16k-token samples.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any, Sequence

from kvsparse._extras import needs

with needs("kvsparse.tools.sale_calibrate", "tools", "torch", "transformers"):
    import torch
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvsparse.torch import ops
from kvsparse.torch.ops import SaleParams
from kvsparse.torch.sale import SalePrefill


# ---- Recording each layer's prompt attention inputs ------------------------------------------

_RECORD = "kvsparse_sale_record"
_records: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
_scales: dict[int, float] = {}


def _record_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    layer = int(module.layer_idx)
    _scales[layer] = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    for b in range(query.shape[0]):
        if _on_device(query):  # kept as they are, for SALE's CUDA kernels
            _records.setdefault(layer, []).append((query[b].detach().clone(), key[b].detach().clone(),
                                                   value[b].detach().clone()))
        else:
            _records.setdefault(layer, []).append(
                (query[b].detach().float().cpu(), key[b].detach().float().cpu(), value[b].detach().float().cpu()))
    out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    return out, None


def _on_device(t: torch.Tensor) -> bool:
    """Whether the search runs on SALE's CUDA kernels: bf16 / fp16 tensors on a CUDA device."""
    return t.is_cuda and t.dtype in (torch.bfloat16, torch.float16)


def record(model: Any, prompts: Sequence[torch.Tensor]
           ) -> tuple[dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]], dict[int, float]]:
    """Runs the model over each prompt (token ids [1, n]) and returns, per layer, each prompt's
    (q [H, n, d], k [Hkv, n, d], v) after RoPE, and the layer's softmax scale: float32 CPU tensors,
    or for a bf16 / fp16 model on a CUDA device the model's own tensors there."""
    AttentionInterface.register(_RECORD, _record_forward)
    AttentionMaskInterface.register(_RECORD, sdpa_mask)
    before = model.config._attn_implementation
    _records.clear()
    _scales.clear()
    try:
        model.set_attn_implementation(_RECORD)
        with torch.no_grad():
            for ids in prompts:
                model(ids.to(model.device), use_cache=False)
        return dict(_records), dict(_scales)
    finally:
        model.set_attn_implementation(before)
        _records.clear()
        _scales.clear()


def calibrate_layer(samples: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], scale: float, *,
                    theta: float, tau0: float, max_halvings: int, params: SaleParams
                    ) -> tuple[list[float], list[float], list[float], list[int]]:
    """The halving search over one layer's samples (q [H, n, d], k and v [Hkv, n, d], all on the
    CPU or all on one CUDA device): every head starts at tau0; a head whose worst sample's L1
    error per token is at most theta keeps its threshold, the others halve it, and a head still
    over theta after max_halvings halvings is dense (0). Returns per head tau, the worst sample's
    error at it, the mean share of blocks skipped and the halvings."""
    tau, err, skipped, halvings = ops._call(
        torch.ops.kvsparse.sale_calibrate, [s[0] for s in samples], [s[1] for s in samples],
        [s[2] for s in samples], float(theta), float(tau0), int(max_halvings), float(scale),
        params.block_q, params.block_k, params.sink_tokens, params.local_tokens,
    )
    return [float(t) for t in tau], [float(e) for e in err], [float(x) for x in skipped], [int(h) for h in halvings]


def calibrate(model: Any, prompts: Sequence[torch.Tensor], *, theta: float = 0.4, tau0: float = 0.008,
              max_halvings: int = 24, params: SaleParams = SaleParams()) -> SalePrefill:
    """Per-layer, per-head thresholds for `model` over the sample `prompts` (the header)."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    records, scales = record(model, prompts)
    ops.load_library()
    thresholds: list[list[float]] = []
    report: dict[str, Any] = {"error": [], "skipped": [], "halvings": []}
    for layer in range(int(text.num_hidden_layers)):
        tau, err, skipped, halvings = calibrate_layer(
            records[layer], scales[layer], theta=theta, tau0=tau0, max_halvings=max_halvings, params=params)
        thresholds.append(tau)
        report["error"].append(err)
        report["skipped"].append(skipped)
        report["halvings"].append(halvings)
    return SalePrefill(thresholds, params, theta, report)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kvsparse-sale-calibrate",
        description="Per-layer, per-head SALE thresholds for a Hugging Face causal LM (the halving "
                    "search of the SALE paper), written as a file kvsparse.torch.sale.SalePrefill.load reads.",
    )
    ap.add_argument("--model", required=True, help="a transformers model directory (or hub id in the cache)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", type=pathlib.Path, help="a UTF-8 text file: samples are consecutive windows of it")
    src.add_argument("--random_tokens", action="store_true", help="samples of uniformly random token ids (a smoke run)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per sample")
    ap.add_argument("--samples", type=int, default=4, help="sample prompts (the paper: 5)")
    ap.add_argument("--theta", type=float, default=0.4, help="L1 error bound per token and head (the paper: 0.4 for Llama-3.1)")
    ap.add_argument("--tau0", type=float, default=0.008, help="first threshold, halved until the bound holds")
    ap.add_argument("--max_halvings", type=int, default=24, help="then the head is dense (threshold 0)")
    ap.add_argument("--block_q", type=int, default=SaleParams.block_q)
    ap.add_argument("--block_k", type=int, default=SaleParams.block_k)
    ap.add_argument("--sink_tokens", type=int, default=SaleParams.sink_tokens)
    ap.add_argument("--local_tokens", type=int, default=SaleParams.local_tokens)
    ap.add_argument("--device", default="cpu",
                    help="where the model runs: cpu (the reference's search, float32) or cuda (SALE's kernels, --dtype)")
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16",
                    help="the model's dtype on a CUDA device")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, type=pathlib.Path)
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, args.dtype) if str(args.device).startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    g = torch.Generator().manual_seed(args.seed)
    if args.text is not None:
        ids = AutoTokenizer.from_pretrained(args.model)(args.text.read_text(), return_tensors="pt").input_ids[0]
        if ids.numel() < args.samples * args.tokens:
            ap.error(f"{args.text}: {ids.numel()} tokens, fewer than --samples x --tokens")
        prompts = [ids[i * args.tokens:(i + 1) * args.tokens][None] for i in range(args.samples)]
    else:
        vocab = int(model.config.get_text_config().vocab_size)
        prompts = [torch.randint(0, vocab, (1, args.tokens), generator=g) for _ in range(args.samples)]
    params = SaleParams(args.block_q, args.block_k, args.sink_tokens, args.local_tokens)
    print(f"calibrating {args.model}: {args.samples} samples x {args.tokens} tokens, theta {args.theta}",
          file=sys.stderr)
    result = calibrate(model, prompts, theta=args.theta, tau0=args.tau0, max_halvings=args.max_halvings,
                       params=params)
    result.save(args.out)
    for layer, taus in enumerate(result.thresholds):
        skipped = result.report["skipped"][layer]
        print(f"layer {layer}: tau {' '.join(f'{t:.2g}' for t in taus)}; "
              f"blocks skipped {100 * sum(skipped) / len(skipped):.1f}% (mean over heads)", file=sys.stderr)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
