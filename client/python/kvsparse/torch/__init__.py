"""kvsparse in PyTorch (needs the ``torch`` extra; ``hf`` also transformers): ``ops``, the
``torch.ops.kvsparse`` operators and ``InProcessEngine`` (the engine in this process, from
``libkvsparse_torch.so``); ``hf``, transformers' ``generate`` over kvsparse (``KvSparseCache``);
``transport``, the step loop's way to the engine (gRPC or in-process) shared by ``hf`` and the
vLLM plugin; ``sale``, SALE prefill's thresholds file. Import the modules themselves
(``from kvsparse.torch import ops``): this package imports nothing heavy."""
