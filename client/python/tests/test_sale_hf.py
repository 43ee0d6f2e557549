"""SALE in the Hugging Face path (kvsparse.torch.sale, KvSparseCache(prefill=...)) with a small random
Llama on the CPU: kvsparse-sale-calibrate records each layer's prompt q/k/v and writes
per-layer, per-head thresholds within the bound; the file round-trips; a cache with all
thresholds 0 generates dense prefill's tokens through SALE, and the calibrated one generates
with its layers' prompts through SALE (counted in the cache's stats); a left-padded batch goes
through SALE row by row, a mask with holes through SDPA; on a CUDA device the kernels run."""

from __future__ import annotations

import json
import pathlib

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kvsparse  # noqa: E402
import kvsparse.torch.hf  # noqa: E402
from kvsparse.torch import ops  # noqa: E402
from kvsparse.torch import sale  # noqa: E402
from kvsparse.tools import sale_calibrate  # noqa: E402

pytestmark = pytest.mark.skipif(not ops.available(), reason="libkvsparse_torch.so not built")

LAYERS = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=4096)
    path = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def load(path: pathlib.Path) -> "transformers.LlamaForCausalLM":
    return transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def generate(model, ids: torch.Tensor, prefill: "sale.SalePrefill | None", mask: torch.Tensor | None = None):
    engine = ops.InProcessEngine(gpu="off", store_capacity="256M")
    try:
        kvsparse.torch.hf.enable(model)
        with kvsparse.torch.hf.KvSparseCache(model.config, engine, prefill=prefill) as cache:
            out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=6, do_sample=False)
            return out[:, ids.shape[1]:], cache.stats
    finally:
        engine.close()


def test_calibrate_then_generate(model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    out_file = tmp_path / "sale.json"
    assert sale_calibrate.main(["--model", str(model_dir), "--random_tokens", "--tokens", "700", "--samples", "2",
                      "--theta", "0.4", "--out", str(out_file)]) == 0
    doc = json.loads(out_file.read_text())
    assert doc["format"] == sale.FORMAT and doc["theta"] == 0.4
    assert len(doc["thresholds"]) == LAYERS and all(len(row) == 4 for row in doc["thresholds"])
    assert all(e <= 0.4 for row in doc["report"]["error"] for e in row), doc["report"]["error"]
    prefill = sale.SalePrefill.load(out_file)
    assert prefill.thresholds == doc["thresholds"] and prefill.params == ops.SaleParams()

    model = load(model_dir)
    ids = torch.randint(0, 300, (1, 500), generator=torch.Generator().manual_seed(1))
    dense, stats = generate(model, ids, None)
    assert stats.sale_prefills == 0
    zero = sale.SalePrefill([[0.0] * 4 for _ in range(LAYERS)])
    through, stats = generate(model, ids, zero)
    assert stats.sale_prefills == LAYERS and stats.sale_skipped == 0.0
    assert torch.equal(through, dense), (through, dense)  # every block: dense attention
    tokens, stats = generate(model, ids, prefill)
    assert stats.sale_prefills == LAYERS and tokens.shape == dense.shape
    # A left-padded batch: each row through SALE over its own tokens, dense prefill's tokens at tau 0.
    batch = torch.cat([ids[:, :400], ids[:, :400]])
    mask = torch.ones_like(batch)
    mask[1, :50] = 0
    dense, _ = generate(model, batch, None, mask)
    through, stats = generate(model, batch, zero, mask)
    assert stats.sale_prefills == 2 * LAYERS
    assert torch.equal(through, dense), (through, dense)
    # Tokens that are not one span (a hole in the mask) prefill through SDPA.
    mask[0, 100:110] = 0
    _, stats = generate(model, batch, zero, mask)
    assert stats.sale_prefills == 0


@pytest.mark.gpu
def test_cuda_model_prefills_through_the_kernels(model_dir: pathlib.Path) -> None:
    """A bf16 model on a CUDA device with the GPU engine: the prompt's attention through SALE's
    CUDA kernels (tau 0: within bf16 rounding of SDPA's first logits; a threshold: blocks
    skipped, finite logits), a left-padded batch included."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=64, max_position_embeddings=4096, initializer_range=0.08)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).cuda().eval()
    ids = torch.randint(0, 300, (2, 1200), generator=torch.Generator().manual_seed(2)).cuda()
    mask = torch.ones_like(ids)
    mask[1, :300] = 0

    def first_logits(prefill):
        with ops.InProcessEngine(gpu="on", store_capacity="256M") as engine:
            kvsparse.torch.hf.enable(model)
            with kvsparse.torch.hf.KvSparseCache(model.config, engine, prefill=prefill) as cache:
                out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2,
                                     do_sample=False, output_logits=True, return_dict_in_generate=True)
                return out.logits[0].float(), cache.stats

    dense, stats = first_logits(None)
    assert stats.sale_prefills == 0
    zero, stats = first_logits(sale.SalePrefill([[0.0] * 4 for _ in range(LAYERS)]))
    assert stats.sale_prefills == 2 * LAYERS and stats.sale_skipped == 0.0
    assert float((zero - dense).abs().max()) < 0.15
    sparse, stats = first_logits(sale.SalePrefill([[0.05] * 4 for _ in range(LAYERS)]))
    assert stats.sale_prefills == 2 * LAYERS and stats.sale_skipped > 0.0
    assert torch.isfinite(sparse).all()


def test_bad_files_and_shapes_are_refused(model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="not a SALE thresholds file"):
        sale.SalePrefill.load(bad)
    model = load(model_dir)
    engine = ops.InProcessEngine(gpu="off", store_capacity="64M")
    try:
        with pytest.raises(ValueError, match="thresholds for 1 layers"):
            kvsparse.torch.hf.KvSparseCache(model.config, engine, prefill=sale.SalePrefill([[0.0] * 4]))
    finally:
        engine.close()
