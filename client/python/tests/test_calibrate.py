"""kvsparse.tools.calibrate: the weight file it writes is what kvsparse-server's --hash_weights reads,
with the same MLP semantics (a decode with learned signatures selects exactly the keys the
Python MLPs rank first), and training raises top-k recall above SimHash's on keys with a shared
offset. SAAP: un-RoPE inverts transformers' RoPE, and the partitions cover the attention."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import kvsparse  # noqa: E402
import kvsparse.tools.calibrate as cal  # noqa: E402


def _layers(n_layers: int, h: int, hk: int, dims: list[int], seed: int) -> list[cal.LayerHash]:
    gen = torch.Generator().manual_seed(seed)
    return [cal.LayerHash(cal.HashMlps(h, dims, gen), cal.HashMlps(hk, dims, gen)) for _ in range(n_layers)]


@pytest.mark.parametrize("key_mlps", cal.KEY_MLPS)
def test_the_server_selects_what_the_python_mlps_rank_first(tmp_path: Path, key_mlps: str) -> None:
    # Key MLPs per kv head (shared by its query heads) or per query head (HashAttention's layout).
    layers_n, h, hkv, d, bits, n, top = 2, 4, 2, 16, 256, 96, 6
    hk = hkv if key_mlps == "kv" else h
    layers = _layers(layers_n, h, hk, [d, 24, bits], seed=3)
    path = tmp_path / "hash.bin"
    size = cal.write_hash_weights(path, layers)
    assert size == path.stat().st_size
    rng = np.random.default_rng(0)
    k = rng.standard_normal((layers_n, n, hkv, d)).astype(np.float32)
    v = rng.standard_normal((layers_n, n, hkv, d)).astype(np.float32)
    with kvsparse.LocalServer(capacity="256M", gpu="off", hash_weights=str(path)) as server, \
            kvsparse.Client(server.target, timeout=30.0) as c:
        c.store.create_sequence("s", kvsparse.ModelShape(layers_n, h, hkv, d, "fp32"),
                                kvsparse.Placement(signature_bits=bits))
        c.store.append("s", k, v)
        checked = 0
        for trial in range(300):
            q = rng.standard_normal((1, h, d)).astype(np.float32)
            layer = trial % layers_n
            sq, sk = cal.learned_signatures(layers[layer], torch.from_numpy(q[0])[:, None, :],
                                            torch.from_numpy(k[layer]).transpose(0, 1).contiguous())
            sk = sk.view(hkv, hk // hkv, n, bits).expand(hkv, h // hkv, n, bits)  # each query head's keys
            sim = torch.einsum("kgb,kgtb->kgt", sq.view(hkv, h // hkv, bits), sk)  # [Hkv, G, n]
            ordered = sim.sort(-1, descending=True).values
            if bool((ordered[..., top - 1] == ordered[..., top]).any()):
                continue  # a tie at the boundary: either key is a correct selection
            want = [sorted(set(sim[j].topk(top, -1).indices.flatten().tolist())) for j in range(hkv)]
            r = c.attention.decode(layer, ["s"], q, kvsparse.HashTopK(top_k=top, sink_tokens=0, local_tokens=0,
                                                                     bits=bits, learned=True),
                                   return_indices=True)
            got = [sorted(hd.fetched_tokens) for hd in sorted(r.heads, key=lambda x: x.kv_head)]
            assert got == want, f"trial {trial}"
            checked += 1
            if checked == 10:
                break
        assert checked == 10


def test_training_beats_simhash_on_keys_with_a_shared_offset() -> None:
    # Real keys share a large common component (SimHash's planes then spend most bits on it);
    # the MLPs learn to rank what varies.
    torch.manual_seed(0)
    w, h, t, d = 4, 4, 512, 16
    spread = torch.linspace(0.2, 2, d)
    k = (torch.randn(w, 1, t, d) * spread + 1.5)
    q = torch.randn(w, h, t, d) * spread
    layer = cal.train_layer(q, k, bits=32, hidden=64, linears=3, steps=300, queries_per_step=32,
                            top_fraction=1 / 16, min_top_k=4, min_position=64, seed=1)
    pos = torch.arange(256, 512, 8)
    qe, ke = q[0][:, pos], k[0]
    learned = cal.topk_recall(qe, ke, pos, *cal.learned_signatures(layer, qe, ke), fraction=1 / 16, min_top_k=4)
    simhash = cal.topk_recall(qe, ke, pos, *cal.simhash_signatures(qe, ke, 32), fraction=1 / 16, min_top_k=4)
    assert learned["recall"] > simhash["recall"] + 0.1, (learned, simhash)
    assert learned["mass"] > simhash["mass"] and math.isfinite(simhash["mass"])


def test_the_recall_measures_are_one_for_signatures_that_rank_as_the_scores() -> None:
    # "Signatures" q and k themselves (bits = d, scaled far above the tie-breaking noise) rank the
    # keys exactly by score: every measure against the true and oracle sets is 1.
    torch.manual_seed(0)
    h, hkv, t, d = 4, 2, 2048, 16
    q, k = torch.randn(h, 8, d) * 100, torch.randn(hkv, t, d)
    pos = torch.tensor([1500, 1600, 1700, 1800, 1900, 2000, 2040, 2047])
    r = cal.topk_recall(q, k, pos, q, k)
    ties = r.pop("boundary_ties")  # the k-th key alone holds its similarity: 1 per k chosen
    assert all(abs(x - 1) < 1e-6 for x in r.values()) and 0 < ties < 0.05, (r, ties)
    # Random 32-bit signatures find about the share they read, and many keys tie with the k-th
    # (33 similarity values over ~1,500 keys).
    sq, sk = torch.randn(h, 8, 32).sign(), torch.randn(hkv, t, 32).sign()
    r = cal.topk_recall(q, k, pos, sq, sk)
    assert r["oracle_recall"] < 0.2 and r["top32_in_1_16"] < 0.25 and r["boundary_ties"] > 0.3, r


@pytest.mark.parametrize("key_mlps", cal.KEY_MLPS)
def test_hashattention_recipe_beats_simhash_on_keys_with_a_shared_offset(key_mlps: str) -> None:
    # HashAttention's released recipe (top 32 beyond sink and window, positives x20, lr 1e-3).
    torch.manual_seed(0)
    w, h, t, d = 4, 4, 1024, 16
    spread = torch.linspace(0.2, 2, d)
    k = (torch.randn(w, 2, t, d) * spread + 1.5)
    q = torch.randn(w, h, t, d) * spread
    layer = cal.train_layer(q, k, recipe="hashattention", bits=32, hidden=64, steps=300, key_mlps=key_mlps,
                            queries_per_step=32, seed=1)
    assert layer.key.weights[0].shape[0] == (2 if key_mlps == "kv" else h)
    pos = torch.arange(512, 1024, 16)
    qe, ke = q[0][:, pos], k[0]
    learned = cal.topk_recall(qe, ke, pos, *cal.learned_signatures(layer, qe, ke))
    simhash = cal.topk_recall(qe, ke, pos, *cal.simhash_signatures(qe, ke, 32))
    assert learned["top32_in_1_16"] > simhash["top32_in_1_16"] + 0.1, (learned, simhash)
    assert learned["oracle_recall"] > simhash["oracle_recall"], (learned, simhash)


def test_unrope_inverts_transformers_rope() -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                      rope_theta=10000.0, max_position_embeddings=4096)
    rope = LlamaRotaryEmbedding(cfg)
    x = torch.randn(1, 2, 50, 32)
    pos = torch.arange(1000, 1050)[None]
    cos, sin = rope(x, pos)
    y, _ = apply_rotary_pos_emb(x, x, cos, sin)
    inv_freq, scale = rope.inv_freq.float(), float(rope.attention_scaling)
    back = cal.unrope(y, pos[0], inv_freq, scale)
    assert torch.allclose(back, x, atol=1e-4)


def test_saap_partitions_cover_the_attention(tmp_path: Path) -> None:
    # Keys on 8 directions; each query attends to the keys of one direction: the k-means buckets
    # recover the directions and the classifier learns which bucket holds a query's attention,
    # so 2 probes of 8 read a third of the rows and hold most of the mass. No RoPE (inv_freq 0).
    torch.manual_seed(0)
    w, h, hkv, t, d, c = 3, 1, 1, 1024, 16, 8
    dirs = torch.nn.functional.normalize(torch.randn(c, d), dim=-1)
    kb = torch.randint(0, c, (w, t))
    k = (dirs[kb] * 4 + 0.2 * torch.randn(w, t, d))[:, None]  # [W, 1, T, d]
    q = dirs[torch.randint(0, c, (w, h, t))] * 3 + 0.1 * torch.randn(w, h, t, d)
    inv_freq = torch.zeros(d // 2)
    layer = cal.train_saap_layer(q, k, inv_freq, 1.0, clusters=c, hidden=64, steps=300, queries_per_step=64,
                                 sink=4, local=4, lr=3e-3, seed=1)
    cov = cal.saap_coverage(layer, q[0], k[0], inv_freq, 1.0, probes=2, sink=4, local=4, queries=64)
    assert cov["saap_mass"] > 0.85 and cov["saap_rows"] < 0.4, cov
    size = cal.write_saap(tmp_path / "saap.bin", [layer, layer], inv_freq, 1.0)
    hidden = 64
    assert size == 40 + 4 * (d // 2 + 2 * hkv * c * d + 2 * h * (hidden * d + hidden + c * hidden + c))
    assert (tmp_path / "saap.bin").read_bytes()[:8] == b"KVSPSAAP"


def test_saap_through_the_server(tmp_path: Path) -> None:
    # Partitions written by kvsparse.tools.calibrate load in kvsparse-server (--saap_weights): SAAP
    # decodes read a subset of the rows, all buckets give dense attention, and the hash methods
    # are refused on such a server.
    torch.manual_seed(3)
    layers_n, h, hkv, d, c, hidden, n = 2, 4, 2, 16, 6, 8, 400
    layer = cal.SaapLayer(torch.nn.functional.normalize(torch.randn(hkv, c, d), dim=-1),
                          torch.randn(h, hidden, d), torch.randn(h, hidden), torch.randn(h, c, hidden), torch.randn(h, c))
    inv_freq = 10000.0 ** (-torch.arange(0, d, 2).float() / d)
    path = tmp_path / "saap.bin"
    cal.write_saap(path, [layer] * layers_n, inv_freq, 1.0)
    rng = np.random.default_rng(1)
    k = rng.standard_normal((layers_n, n, hkv, d)).astype(np.float32)
    v = rng.standard_normal((layers_n, n, hkv, d)).astype(np.float32)
    q = rng.standard_normal((1, h, d)).astype(np.float32)
    shape = kvsparse.ModelShape(layers_n, h, hkv, d, "fp32")
    with kvsparse.LocalServer(capacity="256M", gpu="off", saap_weights=str(path)) as server, \
            kvsparse.Client(server.target, timeout=30.0) as cl:
        method = kvsparse.Saap(probes=2, sink_tokens=8, local_tokens=16)
        cl.store.create_sequence("s", shape, kvsparse.placement_for(method))
        cl.store.append("s", k, v)
        r = cl.attention.decode(1, ["s"], q, method)
        assert np.isfinite(r.output).all()
        assert all(0 < hd.rows_fetched < n for hd in r.heads)
        full = cl.attention.decode(1, ["s"], q, kvsparse.Saap(probes=c, sink_tokens=8, local_tokens=16))
        dense = cl.attention.decode(1, ["s"], q, kvsparse.Dense())
        np.testing.assert_allclose(full.output, dense.output, rtol=1e-5, atol=1e-6)
        with pytest.raises(kvsparse.FailedPrecondition, match="SAAP"):
            cl.attention.decode(1, ["s"], q, kvsparse.HashTopK(top_k=8))
        with pytest.raises(kvsparse.InvalidArgument, match="probes"):
            cl.attention.decode(1, ["s"], q, kvsparse.Saap(probes=c + 1))
