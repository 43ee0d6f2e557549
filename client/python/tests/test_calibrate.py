"""kvsparse.calibrate: the weight file it writes is what kvsparse-server's --hash_weights reads,
with the same MLP semantics (a decode with learned signatures selects exactly the keys the
Python MLPs rank first), and training raises top-k recall above SimHash's on keys with a shared
offset."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import kvsparse  # noqa: E402
import kvsparse.calibrate as cal  # noqa: E402


def _layers(n_layers: int, h: int, hkv: int, dims: list[int], seed: int) -> list[cal.LayerHash]:
    gen = torch.Generator().manual_seed(seed)
    return [cal.LayerHash(cal.HashMlps(h, dims, gen), cal.HashMlps(hkv, dims, gen)) for _ in range(n_layers)]


def test_the_server_selects_what_the_python_mlps_rank_first(tmp_path: Path) -> None:
    layers_n, h, hkv, d, bits, n, top = 2, 4, 2, 16, 256, 96, 6
    layers = _layers(layers_n, h, hkv, [d, 24, bits], seed=3)
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
            sq = cal.sign_bits(layers[layer].query(torch.from_numpy(q[0])[:, None, :])).detach()  # [H, 1, bits]
            sk = cal.sign_bits(layers[layer].key(torch.from_numpy(k[layer]).transpose(0, 1).contiguous())).detach()
            sim = torch.einsum("kgb,ktb->kgt", sq.view(hkv, h // hkv, bits), sk)  # [Hkv, G, n]
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
