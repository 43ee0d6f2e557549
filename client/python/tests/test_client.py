"""The Python client against a real kvsparse-server: every RPC of both services, tensors in and
out (numpy and torch; fp32, fp16, bf16), the exception for each kind of bad input."""

from __future__ import annotations

import dataclasses
import time

import grpc
import ml_dtypes
import numpy as np
import pytest

import kvsparse

SHAPE = kvsparse.ModelShape(num_layers=2, num_q_heads=8, num_kv_heads=2, head_dim=64, dtype="fp32")
DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}


def rows(rng: np.random.Generator, layers: int, tokens: int, dtype: str = "fp32") -> np.ndarray:
    return rng.standard_normal((layers, tokens, SHAPE.num_kv_heads, SHAPE.head_dim)).astype(DTYPES[dtype])


def dense_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """softmax(q K^T / sqrt(d)) V per query head in float64; q [H, d], k and v [n, Hkv, d]."""
    h, d = q.shape
    g = h // k.shape[1]
    out = np.empty((h, d))
    for i in range(h):
        kk, vv = k[:, i // g].astype(np.float64), v[:, i // g].astype(np.float64)
        s = kk @ q[i].astype(np.float64) / np.sqrt(d)
        p = np.exp(s - s.max())
        out[i] = p @ vv / p.sum()
    return out


def test_health_and_stats(client: kvsparse.Client) -> None:
    assert client.store.health() == "SERVING"
    assert client.attention.health() == "SERVING"
    stats = client.store.stats()
    assert stats.capacity_bytes == 2 << 30
    assert stats.capacity_policy == "reject"


def test_sequence_lifecycle(client: kvsparse.Client) -> None:
    info = client.store.create_sequence("s1", SHAPE, kvsparse.Placement(signature_bits=32))
    assert info.shape == SHAPE and info.placement.signature_bits == 32
    assert info.layer_lengths == [0, 0]
    with pytest.raises(kvsparse.AlreadyExists):
        client.store.create_sequence("s1", SHAPE)
    assert [s.sequence_id for s in client.store.list_sequences()] == ["s1"]
    assert client.store.sequence_info("s1").incarnation == info.incarnation
    client.store.drop_sequence("s1")
    with pytest.raises(kvsparse.NotFound) as err:
        client.store.sequence_info("s1")
    assert err.value.code == grpc.StatusCode.NOT_FOUND and "s1" in err.value.details
    assert isinstance(err.value, LookupError)


def test_fork_shares_a_prefix(client: kvsparse.Client) -> None:
    """A fork holds its source's first tokens with their whole pages shared (counted once in the
    store's bytes); each side then appends on its own, and the fork outlives its source."""
    rng = np.random.default_rng(3)
    k, v = rows(rng, 2, 300), rows(rng, 2, 300)
    client.store.create_sequence("src", SHAPE)
    client.store.append("src", k, v)
    used = client.store.stats().bytes_used
    fork = client.store.fork_sequence("src", "fork", 200)
    assert fork.layer_lengths == [200, 200] and fork.incarnation != client.store.sequence_info("src").incarnation
    page_tokens = fork.page_tokens
    page_bytes = page_tokens * 2 * SHAPE.head_dim * 4  # a slot: an fp32 K row and its V row
    assert fork.bytes_shared == (200 // page_tokens) * 4 * page_bytes > 0  # 4 (layer, kv head) lanes
    assert client.store.stats().bytes_used - used < fork.bytes_used  # the shared pages once
    k2, v2 = rows(rng, 2, 50), rows(rng, 2, 50)
    client.store.append("fork", k2, v2)
    for layer in range(2):
        g = client.store.gather("fork", layer, list(range(250)), kv_heads=[1])
        np.testing.assert_array_equal(g.k, np.concatenate([k[layer, :200, 1], k2[layer, :, 1]]))
        np.testing.assert_array_equal(g.v, np.concatenate([v[layer, :200, 1], v2[layer, :, 1]]))
        g = client.store.gather("src", layer, list(range(300)), kv_heads=[0])
        np.testing.assert_array_equal(g.k, k[layer, :, 0])
    with pytest.raises(kvsparse.FailedPrecondition, match="holds 300"):
        client.store.fork_sequence("src", "long", 301)
    with pytest.raises(kvsparse.NotFound):
        client.store.fork_sequence("nope", "other", 1)
    client.store.drop_sequence("src")
    assert client.store.sequence_info("fork").bytes_shared == 0
    g = client.store.gather("fork", 1, [0, 199, 249], kv_heads=[0])
    np.testing.assert_array_equal(g.v, np.stack([v[1, 0, 0], v[1, 199, 0], v2[1, 49, 0]]))
    assert client.store.stats().bytes_used == client.store.sequence_info("fork").bytes_used
    client.store.drop_sequence("fork")


def test_append_declares_its_size(server: kvsparse.LocalServer) -> None:
    """Every append says its message's size in kvsparse-request-bytes, so that the server takes
    that share of its request budget (--max_append_bytes_in_flight) before reading the body
    rather than the largest message's."""
    seen: list[tuple[str, dict[str, str], int]] = []

    class Capture(grpc.UnaryUnaryClientInterceptor):
        def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
            seen.append((details.method, dict(details.metadata or []), request.ByteSize()))
            return continuation(details, request)

    channel = grpc.intercept_channel(kvsparse.grpc.channel.open_channel(server.target), Capture())
    with kvsparse.KvStoreClient(channel=channel) as store:
        store.create_sequence("sized", SHAPE)
        k = rows(np.random.default_rng(5), SHAPE.num_layers, 10)
        assert store.append("sized", k, k).num_tokens == 10
        store.drop_sequence("sized")
    appends = [(md, size) for method, md, size in seen if method.endswith("/Append")]
    assert len(appends) == 1
    md, size = appends[0]
    assert md.get("kvsparse-request-bytes") == str(size) and size > 2 * k.nbytes
    channel.close()


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_append_gather_round_trip(client: kvsparse.Client, dtype: str) -> None:
    rng = np.random.default_rng(1)
    shape = kvsparse.ModelShape(2, 8, 2, 64, dtype)
    client.store.create_sequence("rt", shape)
    k, v = rows(rng, 2, 100, dtype), rows(rng, 2, 100, dtype)
    resp = client.store.append("rt", k, v)
    assert resp.num_tokens == 100 and resp.first_token == 0
    # A retried append with the old expected length is refused, nothing is appended twice.
    with pytest.raises(kvsparse.FailedPrecondition):
        client.store.append("rt", k, v, expected_length=0)
    toks = [5, 99, 0, 5]
    got = client.store.gather("rt", 1, {0: toks, 1: toks[:2]})
    assert got.layer_length == 100
    assert got.k.dtype == np.dtype(DTYPES[dtype])
    assert np.array_equal(got.k[:4], k[1, toks, 0]) and np.array_equal(got.v[4:], v[1, toks[:2], 1])
    uniq = client.store.gather("rt", 1, toks, kv_heads=[0], kind="v", unique=True)
    assert uniq.k is None and uniq.heads[0].token_indices == [0, 5, 99] and uniq.heads[0].counts == [1, 2, 1]
    assert np.array_equal(uniq.v, v[1, [0, 5, 99], 0])


def test_torch_tensors_in_and_out(client: kvsparse.Client) -> None:
    torch = pytest.importorskip("torch")
    shape = kvsparse.ModelShape(1, 8, 2, 64, "bf16")
    client.store.create_sequence("t", shape)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, 50, 2, 64, generator=gen).to(torch.bfloat16)
    v = torch.randn(1, 50, 2, 64, generator=gen).to(torch.bfloat16)
    client.store.append("t", k, v)
    got = client.store.gather("t", 0, {1: [3, 7]}, like=k)
    assert isinstance(got.k, torch.Tensor) and got.k.dtype == torch.bfloat16
    assert torch.equal(got.k, k[0, [3, 7], 1]) and torch.equal(got.v, v[0, [3, 7], 1])
    q = torch.randn(1, 8, 64, generator=gen).to(torch.bfloat16)
    out = client.attention.decode(0, ["t"], q).output
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.shape == (1, 8, 64)


def test_dense_decode_matches_reference(client: kvsparse.Client) -> None:
    rng = np.random.default_rng(2)
    client.store.create_sequence("a", SHAPE)
    client.store.create_sequence("b", SHAPE)
    k, v = rows(rng, 2, 300), rows(rng, 2, 300)
    client.store.append("a", k, v)
    client.store.append("b", k[:, :120], v[:, :120])
    q = rng.standard_normal((2, 8, 64)).astype(np.float32)
    res = client.attention.decode(1, ["a", "b"], q, kvsparse.Dense())
    assert res.output.shape == (2, 8, 64) and res.output.dtype == np.float32
    np.testing.assert_allclose(res.output[0], dense_reference(q[0], k[1], v[1]), rtol=0, atol=2e-5)
    np.testing.assert_allclose(res.output[1], dense_reference(q[1], k[1, :120], v[1, :120]), rtol=0, atol=2e-5)
    assert len(res.heads) == 4 and res.heads[0].rows_fetched == 300 and res.heads[2].rows_fetched == 120
    assert res.dense_equivalent_bytes == 2 * 2 * 64 * 4 * (300 + 120)
    assert res.rows_cached == 0 and [h.rows_cached for h in res.heads] == [0] * 4  # the CPU engine: no row cache


def test_decode_appends_the_new_token(client: kvsparse.Client) -> None:
    rng = np.random.default_rng(3)
    client.store.create_sequence("s", SHAPE)
    k, v = rows(rng, 2, 40), rows(rng, 2, 40)
    client.store.append("s", k, v)
    q = rng.standard_normal((1, 8, 64)).astype(np.float32)
    nk = rng.standard_normal((1, 2, 64)).astype(np.float32)
    nv = rng.standard_normal((1, 2, 64)).astype(np.float32)
    res = client.attention.decode(0, ["s"], q, new_k=nk, new_v=nv)
    assert client.store.sequence_info("s").layer_lengths == [41, 40]
    want = dense_reference(q[0], np.concatenate([k[0], nk]), np.concatenate([v[0], nv]))
    np.testing.assert_allclose(res.output[0], want, atol=2e-5)


@pytest.mark.parametrize(
    "method, max_rel",
    [
        (kvsparse.Santa(samples=64, allocation="prop", tile_size=64), 0.5),
        (kvsparse.Santa(samples=256, allocation="flash", tile_size=64), 0.5),
        (kvsparse.Santa(samples=64, sampler="iid", allocation="global"), 0.5),
        # SimHash signatures on random keys pick poorly (docs/ACCURACY.md): the client's path only.
        (kvsparse.HashTopK(top_k_fraction=0.05, sink_tokens=8, local_tokens=16), None),
        (kvsparse.VAttention(epsilon=0.1, delta=0.1, sink_tokens=8, local_tokens=16, top_k_fraction=0.05), 0.1),
        (kvsparse.VAttention(predictor="exact", sink_tokens=8, local_tokens=16, top_k_fraction=0.05), 0.1),
        (kvsparse.VAttention(predictor="exact", bound="clt-ratio", sink_tokens=8, local_tokens=16,
                             top_k_fraction=0.05), 0.1),
        # Over 2-bit compressed keys: each head's own samples, and one sample per kv head (S = 256
        # reads about the rows of the union of 4 heads' 64 here, with a smaller error: each query
        # head of this test points at keys of its own).
        (kvsparse.Santa(samples=64, tile_size=64, scores="compressed"), 0.5),
        (kvsparse.Santa(samples=256, tile_size=64, scores="compressed", proposal="group"), 0.4),
    ],
    ids=["prop", "flash", "iid", "hash", "vattention", "vattention-exact", "vattention-ratio",
         "compressed-prop", "compressed-group"],
)
def test_sparse_methods(client: kvsparse.Client, method: kvsparse.Method, max_rel: float | None) -> None:
    rng = np.random.default_rng(4)
    n = 2048
    client.store.create_sequence("m", SHAPE, kvsparse.placement_for(method))
    k, v = rows(rng, 2, n), rows(rng, 2, n)
    client.store.append("m", k, v)
    # Peaked attention, as real heads have: each query head points at a few keys of its kv head.
    needles = rng.choice(n, size=(8, 4), replace=False)
    q = np.stack([0.6 * k[1, needles[h], h // 4].sum(0) for h in range(8)])[None].astype(np.float32)
    res = client.attention.decode(1, ["m"], q, method, seed=7)
    again = client.attention.decode(1, ["m"], q, method, seed=7)
    assert np.array_equal(res.output, again.output)  # same seed, same rows
    assert np.isfinite(res.output).all()
    if max_rel is not None:
        dense = dense_reference(q[0], k[1], v[1])
        rel = np.linalg.norm(res.output[0] - dense) / np.linalg.norm(dense)
        assert rel < max_rel, f"relative L2 {rel}"
    row = SHAPE.head_dim * 4
    for h in res.heads:
        assert 0 < h.rows_fetched <= n and len(h.budgets) == 4
        assert h.dense_equivalent_bytes == 2 * n * row and h.bytes_read > 0
    if not isinstance(method, kvsparse.VAttention):  # its budget may cover the whole residual
        assert sum(h.rows_fetched for h in res.heads) < 2 * n, "reads fewer rows than dense"
    # S2ANTA states each query head's standard error relative to its output (issue 50): positive
    # and finite; the other methods state none.
    # vAttention states the error its budget promises at 1 - delta, at most the epsilon asked.
    for h in res.heads:
        if isinstance(method, kvsparse.Santa):
            assert len(h.standard_error) == 4 and all(0 < e < float("inf") for e in h.standard_error)
        else:
            assert h.standard_error == []
        if isinstance(method, kvsparse.VAttention):
            assert len(h.epsilon) == 4 and all(0 <= e <= method.epsilon for e in h.epsilon)
        else:
            assert h.epsilon == []
    if isinstance(method, kvsparse.Santa) and method.proposal == "group":
        # One sample of S (+1 from the rounding) per kv head, not the union of its 4 heads' S.
        assert all(h.rows_fetched <= method.samples + 1 for h in res.heads)
    if isinstance(method, kvsparse.VAttention) and method.bound == "clt-ratio":
        # One normal approximation of the output: no larger a budget than Theorem 4.3's two.
        paper = client.attention.decode(1, ["m"], q, dataclasses.replace(method, bound="clt"), seed=7)
        assert sum(sum(h.budgets) for h in res.heads) <= sum(sum(h.budgets) for h in paper.heads)


def test_decode_stream_matches_unary(client: kvsparse.Client) -> None:
    rng = np.random.default_rng(5)
    client.store.create_sequence("st", SHAPE)
    k, v = rows(rng, 2, 64), rows(rng, 2, 64)
    client.store.append("st", k, v)
    qs = [rng.standard_normal((1, 8, 64)).astype(np.float32) for _ in range(4)]
    with client.attention.stream() as stream:
        got = [stream.decode(i % 2, ["st"], q) for i, q in enumerate(qs)]
    assert [r.request_id for r in got] == [1, 2, 3, 4]
    for i, (q, r) in enumerate(zip(qs, got)):
        assert np.array_equal(r.output, client.attention.decode(i % 2, ["st"], q).output)


def test_stream_error_ends_the_stream(client: kvsparse.Client) -> None:
    q = np.zeros((1, 8, 64), np.float32)
    with client.attention.stream() as stream:
        with pytest.raises(kvsparse.NotFound):
            stream.decode(0, ["missing"], q)
        with pytest.raises(kvsparse.NotFound):  # the stream is over: the same error again
            stream.decode(0, ["missing"], q)


def test_bad_input_raises_the_right_exception(client: kvsparse.Client) -> None:
    client.store.create_sequence("bad", SHAPE)
    client.store.append("bad", np.zeros((2, 4, 2, 64), np.float32), np.zeros((2, 4, 2, 64), np.float32))
    q = np.zeros((1, 8, 64), np.float32)
    with pytest.raises(kvsparse.NotFound):
        client.attention.decode(0, ["nope"], q)
    with pytest.raises(kvsparse.InvalidArgument) as err:  # H = 6 against the model's 8
        client.attention.decode(0, ["bad"], np.zeros((1, 6, 64), np.float32))
    assert "q has 6 heads" in err.value.details and isinstance(err.value, ValueError)
    with pytest.raises(kvsparse.InvalidArgument):  # B = 2 q rows for one sequence
        client.attention.decode(0, ["bad"], np.zeros((2, 8, 64), np.float32))
    with pytest.raises(kvsparse.InvalidArgument):  # layer outside the model
        client.attention.decode(5, ["bad"], q)
    with pytest.raises(kvsparse.InvalidArgument):  # int32 cannot travel
        client.attention.decode(0, ["bad"], q.astype(np.int32))
    with pytest.raises(kvsparse.InvalidArgument):  # new_k without new_v
        client.attention.decode(0, ["bad"], q, new_k=np.zeros((1, 2, 64), np.float32))
    with pytest.raises(kvsparse.InvalidArgument):  # fp16 rows into an fp32 sequence
        client.store.append("bad", np.zeros((1, 1, 2, 64), np.float16), np.zeros((1, 1, 2, 64), np.float16))
    with pytest.raises(kvsparse.FailedPrecondition):  # hash top-k without signatures
        client.attention.decode(0, ["bad"], q, kvsparse.HashTopK())
    with pytest.raises(kvsparse.InvalidArgument):
        client.attention.decode(0, ["bad"], q, kvsparse.Santa(samples=0))
    # Every reason a method's parameters are refused, in one error.
    with pytest.raises(kvsparse.InvalidArgument) as err:
        client.attention.decode(0, ["bad"], q, kvsparse.VAttention(epsilon=2.0, delta=0.0, top_k_fraction=3.0))
    for reason in ("epsilon must be in (0, 1), got 2", "delta must be in (0, 1), got 0",
                   "top_k_fraction must be in [0, 1], got 3"):
        assert reason in err.value.details, err.value.details
    with pytest.raises(kvsparse.OutOfRange):
        client.store.gather("bad", 0, {0: [4]})
    nan_q = q.copy()
    nan_q[0, 3, 5] = np.nan
    for method in (kvsparse.Dense(), kvsparse.Santa(samples=8), kvsparse.VAttention(predictor="exact")):
        with pytest.raises(kvsparse.InvalidArgument, match="NaN, an infinity"):  # every method alike
            client.attention.decode(0, ["bad"], nan_q, method)
    # K and V: finite and below 2^32, or the append is refused naming the row, and nothing is kept.
    before = client.store.sequence_info("bad").layer_lengths[0]
    for bad in (np.nan, np.inf, -np.inf, 3e38):
        k = np.zeros((1, 2, 2, 64), np.float32)
        k[0, 1, 1, 7] = bad
        with pytest.raises(kvsparse.InvalidArgument, match=r"token 1 of the append, kv head 1, element 7"):
            client.store.append("bad", k, np.zeros_like(k))
        with pytest.raises(kvsparse.InvalidArgument, match="v holds"):
            client.store.append("bad", np.zeros_like(k), k)
    assert client.store.sequence_info("bad").layer_lengths[0] == before
    client.store.create_sequence("hollow", SHAPE, kvsparse.Placement(k_tier="device"))
    for method in (kvsparse.Dense(), kvsparse.Santa(samples=8), kvsparse.VAttention(predictor="exact", base_rate=1e-6)):
        with pytest.raises(kvsparse.FailedPrecondition, match="holds no tokens"):
            client.attention.decode(0, ["hollow"], q, method)
    with pytest.raises(kvsparse.InvalidArgument, match="more than once"):
        client.attention.decode(0, ["bad", "bad"], np.zeros((2, 8, 64), np.float32))
    assert client.store.health() == "SERVING"  # and the server keeps serving


def test_deadline(client: kvsparse.Client) -> None:
    rng = np.random.default_rng(6)
    client.store.create_sequence("long", SHAPE)
    k = rows(rng, 2, 32768)
    client.store.append("long", k, k)
    q = np.ones((1, 8, 64), np.float32)
    client.attention.decode(0, ["long"], q)  # the resident state synced: the next call is pure work
    with pytest.raises(kvsparse.DeadlineExceeded) as err:  # tens of ms of dense work in 1 ms
        client.attention.decode(0, ["long"], q, timeout=1e-3)
    assert isinstance(err.value, TimeoutError)
    assert client.store.health() == "SERVING"


def test_closed_server_is_unavailable() -> None:
    with kvsparse.LocalServer() as server:
        target = server.target
    with kvsparse.KvStoreClient(target, timeout=2.0) as c:
        with pytest.raises(kvsparse.Unavailable) as err:
            c.stats()
    assert isinstance(err.value, ConnectionError)


def test_server_limits_refuse_with_resource_exhausted() -> None:
    # --max_sequences bounds the store, --max_concurrent_streams the open DecodeStreams; both
    # answer RESOURCE_EXHAUSTED and the server goes on serving.
    with kvsparse.LocalServer(capacity="64M", gpu="off", max_sequences=1, max_concurrent_streams=1) as server, \
            kvsparse.Client(server.target, timeout=10.0) as c:
        c.store.create_sequence("one", SHAPE)
        with pytest.raises(kvsparse.ResourceExhausted, match="max_sequences"):
            c.store.create_sequence("two", SHAPE)
        c.store.append("one", np.zeros((2, 4, 2, 64), np.float32), np.zeros((2, 4, 2, 64), np.float32))
        q = np.ones((1, 8, 64), np.float32)
        with c.attention.stream() as first:
            first.decode(0, ["one"], q)  # open and serving
            with c.attention.stream() as second:
                with pytest.raises(kvsparse.ResourceExhausted, match="max_concurrent_streams"):
                    second.decode(0, ["one"], q)
        with c.attention.stream() as again:  # the first closed: a slot is free
            again.decode(0, ["one"], q)
        assert c.store.health() == "SERVING"


def test_idle_stream_is_cancelled_and_frees_its_slot() -> None:
    # --stream_idle_timeout: an abandoned stream would hold its --max_concurrent_streams slot.
    with kvsparse.LocalServer(capacity="64M", gpu="off", max_concurrent_streams=1, stream_idle_timeout="1s") as server, \
            kvsparse.Client(server.target, timeout=10.0) as c:
        c.store.create_sequence("one", SHAPE)
        c.store.append("one", np.zeros((2, 4, 2, 64), np.float32), np.zeros((2, 4, 2, 64), np.float32))
        q = np.ones((1, 8, 64), np.float32)
        with c.attention.stream() as idle:
            for _ in range(3):  # busy: requests 0.4 s apart keep it open
                idle.decode(0, ["one"], q)
                time.sleep(0.4)
            time.sleep(2.5)
            with pytest.raises(kvsparse.Cancelled):
                idle.decode(0, ["one"], q)
        with c.attention.stream() as again:  # its slot is free again
            again.decode(0, ["one"], q)
