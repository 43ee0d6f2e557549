"""kvsparse in vLLM: ``plugin`` (the ``vllm.general_plugins`` entry point, configured by
``KVSPARSE_VLLM_*`` variables; docs/VLLM.md) and ``backend`` (the attention backend it
registers)."""
