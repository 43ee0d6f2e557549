"""Import-time help for the optional parts of the package: a module that needs an extra
(``pip install "kvsparse[torch]"``, ``"kvsparse[hf]"`` or ``"kvsparse[tools]"``) says which one when the import fails,
instead of a bare ``ModuleNotFoundError: No module named 'torch'``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def needs(module: str, extra: str, *packages: str) -> Iterator[None]:
    """Wraps the imports of ``module`` (e.g. "kvsparse.torch.ops") that need ``packages``, which the
    extra ``extra`` of pyproject.toml brings."""
    try:
        yield
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top not in packages:
            raise
        raise ModuleNotFoundError(
            f"{module} needs {top}, which is not installed: pip install \"kvsparse[{extra}]\"", name=e.name
        ) from e
