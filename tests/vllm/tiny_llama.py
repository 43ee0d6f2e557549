"""The vLLM tests' model and requests (tests/vllm: the CPU build's and the CUDA build's): a tiny
Llama-architecture model with random weights, built from a config (no download), and four
prompts of 5, 100, 300 and 700 tokens (the last two prefilled in chunks of 256) leaving the batch
after 12, 4, 9 and 16 generated tokens."""

from __future__ import annotations

from pathlib import Path

PROMPTS = [[1] + [(7 * i + 3) % 1000 + 3 for i in range(n)] for n in (4, 99, 299, 699)]
MAX_TOKENS = [12, 4, 9, 16]


def save_tiny_llama(path: Path, head_dim: int) -> str:
    """Writes the model (2 layers, 8 query heads, 2 kv heads, vocabulary 1024) to path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=head_dim, vocab_size=1024, max_position_embeddings=4096,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)
