"""kvsparse in vLLM: ``plugin`` (the ``vllm.general_plugins`` entry point, configured by
``KVSPARSE_VLLM_*`` variables; docs/VLLM.md), ``backend`` (the attention backend it registers on
vLLM's CPU build), ``cuda_backend`` and ``connector`` (the backend and the request bookkeeping on
vLLM's CUDA build; ``engine_args()`` selects them)."""

from kvsparse.vllm.plugin import engine_args

__all__ = ["engine_args"]
