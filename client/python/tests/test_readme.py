"""The README's Python examples run as written. The first, with three substitutions: a tiny Llama
with random weights and a byte-level tokenizer saved here in place of Llama-3.1-8B (no download),
the CPU in place of CUDA where there is no GPU, and a 1 GiB store in place of 64 GiB; it must
generate its 64 new tokens after the prompt (the model has no end-of-sequence token to stop at).
The gRPC client's, against a real kvsparse-server at the address it names (substituted), on the
plain install (no torch)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from kvsparse.torch import ops  # noqa: E402

README = Path(__file__).resolve().parents[3] / "README.md"
MODEL = "meta-llama/Llama-3.1-8B"


def readme_example() -> str:
    """The first ```python block of the README (the one on its first screen)."""
    m = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert m is not None, "README.md has no python example"
    return m.group(1)


def tiny_model(path: Path) -> None:
    """A Llama-architecture model with random weights and a byte-level tokenizer, saved as
    from_pretrained loads them."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=260, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=1024, bos_token_id=256, eos_token_id=None,
                                      pad_token_id=258)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    vocab = {chr(i) if chr(i).isprintable() and not chr(i).isspace() else f"<0x{i:02X}>": i for i in range(256)}
    vocab.update({"<s>": 256, "</s>": 257, "<pad>": 258, "<unk>": 259})
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                         unk_token="<unk>").save_pretrained(path)


def readme_block(containing: str) -> str:
    """The README's ```python block that contains `containing`."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if containing in b]
    assert len(blocks) == 1, f"README.md: {len(blocks)} python blocks contain {containing!r}"
    return blocks[0]


def test_the_readme_grpc_example_runs(server, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    code = readme_block("c.store.create_sequence(")
    assert "kvsparse.torch" not in code and "import torch" not in code, "the plain install has no torch"
    assert '"127.0.0.1:50051"' in code
    scope: dict = {}
    exec(compile(code.replace("127.0.0.1:50051", server.target), str(README), "exec"), scope)
    assert scope["r"].output.shape == (1, 32, 128)
    shape, rows = capsys.readouterr().out.split(") ")
    assert shape == "(1, 32, 128" and 0 < int(rows) < 512  # hash top-k read a share of the rows


def test_the_readme_example_generates(tmp_path: Path) -> None:
    if not ops.available():
        pytest.skip("libkvsparse_torch.so not built")
    code = readme_example()
    assert MODEL in code and ".cuda()" in code and 'store_capacity="64G"' in code, code
    tiny_model(tmp_path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    code = (code.replace(MODEL, str(tmp_path)).replace(".cuda()", f".to({device!r})")
            .replace('store_capacity="64G"', 'store_capacity="1G"'))
    scope: dict = {"long_prompt": "def f(x):\n    return x * 2\n" * 3}
    exec(compile(code, str(README), "exec"), scope)
    ids, out = scope["ids"], scope["out"]
    assert ids.shape[1] > 60 and out.shape == (1, ids.shape[1] + 64)
    assert torch.equal(out[:, : ids.shape[1]], ids)
    scope["engine"].close()
