"""Fixtures: a real kvsparse-server on a loopback port (the binary of this repository's build,
$KVSPARSE_SERVER, or kvsparse-server on PATH) and clients of it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import kvsparse


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        have_gpu = torch.cuda.is_available()
    except ImportError:
        have_gpu = False
    if not have_gpu:
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def server() -> Iterator[kvsparse.LocalServer]:
    # The CPU engine (also on a GPU machine): the tests compare its outputs bit for bit; the GPU
    # paths are the tests marked gpu.
    with kvsparse.LocalServer(capacity="2G", default_deadline="60s", gpu="off") as s:
        yield s


@pytest.fixture()
def client(server: kvsparse.LocalServer) -> Iterator[kvsparse.Client]:
    with kvsparse.Client(server.target, timeout=30.0) as c:
        yield c
        for info in c.store.list_sequences():  # each test starts from an empty store
            c.store.drop_sequence(info.sequence_id)
