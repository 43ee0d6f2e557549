"""Sharded stores from Python: the placement function agrees with the server's bit for bit (the
vectors of kvstore/placement_test.cc), and a fleet of two store shards and a worker on loopback
decodes exactly as one embedded server, with each sequence on the shard the worker reads."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import kvsparse
from kvsparse.placement import expand_shard_list, sequence_key, shard_of, shard_weight

SHAPE = kvsparse.ModelShape(num_layers=2, num_q_heads=8, num_kv_heads=2, head_dim=64, dtype="fp32")


def test_same_vectors_as_the_server() -> None:
    assert sequence_key("") == 0xCBF29CE484222325
    assert sequence_key("s0") == 0x08D8FE07B578CF96
    assert sequence_key("chat-42") == 0x1FE9ED462E2CB5E0
    assert shard_weight(sequence_key("s0"), 0) == 0x9E08B15A2623020D
    assert shard_weight(sequence_key("chat-42"), 0) == 0x309737ECE042EA97
    want = {
        "": [0, 1, 2, 2, 2],
        "s0": [0, 0, 0, 3, 5],
        "s1": [0, 1, 1, 1, 5],
        "chat-42": [0, 1, 1, 3, 3],
        "sequence/\u00fc": [0, 1, 1, 1, 1],
    }
    for sid, shards in want.items():
        assert [shard_of(sid, n) for n in (1, 2, 3, 4, 7)] == shards, sid


def test_expand_shard_list() -> None:
    assert expand_shard_list("a:1, b:2") == ["a:1", "b:2"]
    assert expand_shard_list("kvsparse-store-{0..1}.kvsparse-store:50051") == [
        "kvsparse-store-0.kvsparse-store:50051",
        "kvsparse-store-1.kvsparse-store:50051",
    ]
    for bad in ["", "a:1,", "s-{3..1}:1", "s-{0..}:1", "s-{0..1}-{0..1}:1", "a:1,a:1", "s-{0..5000}:1"]:
        with pytest.raises(ValueError):
            expand_shard_list(bad)


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[kvsparse.LocalServer, list[kvsparse.LocalServer], kvsparse.LocalServer]]:
    """An embedded server, two store shards, and a worker of both."""
    with kvsparse.LocalServer(capacity="256M", gpu="off") as embedded:
        with kvsparse.LocalServer(role="store", capacity="256M", shard_index=0, shard_count=2) as a:
            with kvsparse.LocalServer(role="store", capacity="256M", shard_index=1, shard_count=2) as b:
                with kvsparse.LocalServer(role="worker", store=f"{a.target},{b.target}", gpu="off") as w:
                    yield embedded, [a, b], w


def test_sharded_fleet_decodes_like_one_server(fleet) -> None:  # type: ignore[no-untyped-def]
    embedded, shards, worker = fleet
    rng = np.random.default_rng(7)
    ids = [f"chat-{i}" for i in range(8)]
    q = rng.standard_normal((len(ids), 8, 64)).astype(np.float32)
    store_list = ",".join(s.target for s in shards)
    with kvsparse.Client(embedded.target) as one, kvsparse.Client(worker.target, store_target=store_list) as many:
        assert isinstance(many.store, kvsparse.ShardedKvStoreClient) and len(many.store) == 2
        many.store.check_placement()
        for sid in ids:
            k, v = (rng.standard_normal((2, 100 + len(sid), 2, 64)).astype(np.float32) for _ in range(2))
            for c in (one, many):
                c.store.create_sequence(sid, SHAPE)
                c.store.append(sid, k, v)
        for method in (kvsparse.Dense(), kvsparse.Santa(samples=32, allocation="prop", tile_size=32)):
            a = one.attention.decode(1, ids, q, method, seed=3)
            b = many.attention.decode(1, ids, q, method, seed=3)
            np.testing.assert_array_equal(a.output, b.output)
        # Each sequence is on its own shard, and only there.
        held = [sorted(i.sequence_id for i in s.list_sequences()) for s in many.store.shards]
        assert held == [sorted(s for s in ids if shard_of(s, 2) == i) for i in range(2)]
        assert all(held)
        # A list in the other order is caught, and a store refuses another shard's sequence.
        with kvsparse.ShardedKvStoreClient([shards[1].target, shards[0].target]) as wrong:
            with pytest.raises(kvsparse.FailedPrecondition, match=f"store {shards[1].target} .shard 0 of 2"):
                wrong.check_placement()
            with pytest.raises(kvsparse.FailedPrecondition, match="belongs to store shard"):
                wrong.create_sequence("new-one", SHAPE)
        for sid in ids:
            one.store.drop_sequence(sid)
            many.store.drop_sequence(sid)
