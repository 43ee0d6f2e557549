"""The optional parts say which extra they need: importing kvsparse.torch.ops / .hf / .sale or
kvsparse.tools.calibrate / .sale_calibrate without torch or transformers names
`pip install "kvsparse[...]"` (a bare ModuleNotFoundError before), while the gRPC client itself
imports without either."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _python(blocked: list[str], code: str) -> subprocess.CompletedProcess[str]:
    # A module set to None in sys.modules cannot be imported: as if it were not installed.
    prelude = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in blocked)
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=120)


def test_the_client_imports_without_torch_or_transformers() -> None:
    r = _python(["torch", "transformers"], "import kvsparse\nprint(kvsparse.Client.__name__)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "Client"


@pytest.mark.parametrize(
    "module, blocked, extra",
    [
        ("kvsparse.torch.ops", ["torch"], "torch"),
        ("kvsparse.torch.hf", ["torch"], "hf"),
        ("kvsparse.torch.hf", ["transformers"], "hf"),
        ("kvsparse.tools.calibrate", ["transformers"], "tools"),
        ("kvsparse.tools.sale_calibrate", ["transformers"], "tools"),
        ("kvsparse.torch.sale", ["torch"], "torch"),
    ],
)
def test_a_missing_extra_is_named(module: str, blocked: list[str], extra: str) -> None:
    r = _python(blocked, f"import {module}")
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError") and f'pip install "kvsparse[{extra}]"' in last, r.stderr
