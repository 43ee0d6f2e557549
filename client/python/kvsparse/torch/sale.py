"""SALE prefill's thresholds for a Hugging Face model (../shared/seeds, SALE; kernels/sale.h): the
prompt's attention computed over the blocks that low-bit estimates mark as important, one
threshold per layer and query head, calibrated offline by the paper's halving search
(``kvsparse-sale-calibrate``, kvsparse/tools/sale_calibrate.py).

    prefill = kvsparse.torch.sale.SalePrefill.load("sale.json")
    with kvsparse.torch.hf.KvSparseCache(model.config, engine, method=..., prefill=prefill) as cache:
        model.generate(ids, past_key_values=cache, ...)

The file is JSON: the block geometry, theta, tau0 and ``thresholds[layer][head]`` with the error
and share of blocks skipped at each.

SALE is off by default (a cache without ``prefill`` prefills through SDPA). A model on a CUDA
device prefills through SALE's kernels (kernels/cuda/sale.h, measured in docs/PERF.md: bf16 or
fp16, head_dim 64 or 128, the paper's block geometry); on the CPU through its reference
(kernels/sale.h).
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import asdict, dataclass, field
from typing import Any

from kvsparse.torch.ops import SaleParams

FORMAT = "kvsparse-sale-thresholds/1"


@dataclass(frozen=True)
class SalePrefill:
    """SALE's thresholds for a model: ``thresholds[layer][query head]`` in [0, 1) (0: that
    head's prompt attention is dense), with the block geometry they were calibrated for."""

    thresholds: list[list[float]]
    params: SaleParams = SaleParams()
    theta: float | None = None  # the L1 bound of the calibration, for the record
    report: dict[str, Any] = field(default_factory=dict)  # per layer: error, skipped, halvings

    def layer(self, i: int) -> list[float]:
        return self.thresholds[i]

    def save(self, path: str | pathlib.Path) -> None:
        doc = {"format": FORMAT, "params": asdict(self.params), "theta": self.theta,
               "thresholds": self.thresholds, "report": self.report}
        pathlib.Path(path).write_text(json.dumps(doc, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | pathlib.Path) -> "SalePrefill":
        doc = json.loads(pathlib.Path(path).read_text())
        if doc.get("format") != FORMAT:
            raise ValueError(f"{path}: not a SALE thresholds file (format {doc.get('format')!r}, want {FORMAT!r})")
        thresholds = [[float(t) for t in row] for row in doc["thresholds"]]
        if any(not 0.0 <= t < 1.0 for row in thresholds for t in row):
            raise ValueError(f"{path}: thresholds must be in [0, 1)")
        return cls(thresholds, SaleParams(**doc["params"]), doc.get("theta"), doc.get("report", {}))
