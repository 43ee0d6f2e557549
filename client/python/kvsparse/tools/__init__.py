"""Offline tools (the ``tools`` extra: torch and transformers): ``calibrate``
(``kvsparse-calibrate``: learned HashAttention and SAAP weights for a model) and
``sale_calibrate`` (``kvsparse-sale-calibrate``: SALE's prefill thresholds)."""
