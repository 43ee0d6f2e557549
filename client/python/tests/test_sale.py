"""SALE prefill through the op (kvsparse.torch.ops.sale_prefill): on CPU tensors the reference of
kernels/sale.h, on CUDA tensors the kernels of kernels/cuda/sale.h. At tau 0 it is torch's causal
scaled-dot-product attention (GQA, a ragged length, short prompts, bf16 / fp16 / fp32); on a
prompt with a sink and a few planted keys a threshold skips blocks while the output stays
close, the CUDA kernels skipping the reference's blocks; bad input raises kvsparse's errors."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import kvsparse  # noqa: E402
from kvsparse.torch import ops  # noqa: E402

pytestmark = pytest.mark.skipif(not ops.available(), reason="libkvsparse_torch.so not built")


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    g = q.shape[0] // k.shape[0]
    return torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(g, 0), v.float().repeat_interleave(g, 0), is_causal=True
    )


@pytest.mark.parametrize("dtype,n", [(torch.float32, 333), (torch.bfloat16, 700)])
def test_tau_zero_is_causal_attention(dtype: torch.dtype, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    q = torch.randn(8, n, 64, generator=g).to(dtype)
    k = torch.randn(2, n, 64, generator=g).to(dtype)
    v = torch.randn(2, n, 64, generator=g).to(dtype)
    out, skipped = ops.sale_prefill(q, k, v, 0.0)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.all(skipped == 0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), sdpa(q, k, v), atol=tol, rtol=tol)
    # A leading batch dimension of 1 is accepted and kept.
    out4, _ = ops.sale_prefill(q[None], k[None], v[None], [0.0] * 8)
    assert out4.shape == (1, 8, n, 64)


def test_a_threshold_skips_blocks_of_a_peaked_prompt() -> None:
    g = torch.Generator().manual_seed(0)
    n, d = 1024, 64
    q = 0.3 * torch.randn(4, n, d, generator=g)
    k = 0.3 * torch.randn(2, n, d, generator=g)
    v = torch.randn(2, n, d, generator=g)
    sink = torch.randn(d, generator=g) / d**0.5
    k[:, 0] += 14 * d**0.5 * sink  # every query attends to token 0 (logit about 17)
    q += 1.2 * sink
    out, skipped = ops.sale_prefill(q, k, v, 0.004)
    dense = sdpa(q, k, v)
    assert float(skipped.min()) > 0.2, skipped  # sink and local hold about half the causal blocks here
    err = (out - dense).abs().sum(dim=(1, 2)) / n  # the paper's L1 error per token, per head
    assert float(err.max()) < 0.4, err


def test_bad_input_is_refused() -> None:
    q = torch.randn(4, 100, 16)
    k = torch.randn(2, 100, 16)
    with pytest.raises(kvsparse.InvalidArgument, match="tau"):
        ops.sale_prefill(q, k, k, [0.1, 0.1])  # one threshold per query head
    with pytest.raises(kvsparse.InvalidArgument, match="local_tokens"):
        ops.sale_prefill(q, k, k, 0.1, params=ops.SaleParams(local_tokens=32))
    with pytest.raises(kvsparse.InvalidArgument):
        ops.sale_prefill(q, k[:, :50], k[:, :50], 0.1)


def test_calibration_halves_each_head_to_its_bound() -> None:
    """kvsparse-sale-calibrate's search (calibrate_layer) on CPU samples runs on the reference:
    every head with a threshold meets theta on every sample, and one halving fewer would not."""
    from kvsparse.tools import sale_calibrate

    samples = [peaked_prompt(1024, 64, torch.float32, seed=s, heads=4) for s in (1, 2)]
    scale, theta = 64**-0.5, 0.05
    tau, err, skipped, halvings = sale_calibrate.calibrate_layer(
        samples, scale, theta=theta, tau0=0.008, max_halvings=12, params=ops.SaleParams())
    assert len(tau) == 4 and all(t > 0 for t in tau), tau
    assert all(e <= theta for e in err), err
    assert max(halvings) > 0 and min(skipped) > 0.1, (halvings, skipped)
    for h, t in enumerate(tau):
        if halvings[h] == 0:
            continue
        looser = list(tau)
        looser[h] = 2 * t
        worst = 0.0
        for q, k, v in samples:
            dense, _ = ops.sale_prefill(q, k, v, 0.0, scale=scale)
            out, _ = ops.sale_prefill(q, k, v, looser, scale=scale)
            worst = max(worst, float((out[h] - dense[h]).abs().sum()) / q.shape[1])
        assert worst > theta, (h, t, worst)


def cuda_or_skip() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def peaked_prompt(n: int, d: int, dtype: torch.dtype, seed: int = 0, heads: int = 8, kv_heads: int = 2):
    """A sink every query attends to (logit about 17), a few planted keys, noise elsewhere."""
    g = torch.Generator().manual_seed(seed)
    q = 0.3 * torch.randn(heads, n, d, generator=g)
    k = 0.3 * torch.randn(kv_heads, n, d, generator=g)
    v = torch.randn(kv_heads, n, d, generator=g)
    sink = torch.randn(d, generator=g) / d**0.5
    k[:, 0] += 14 * d**0.5 * sink
    q += 1.2 * sink
    for t in torch.randint(min(300, n // 2), n, (6,), generator=g).tolist():  # a few heavy keys past the start
        k[:, t] += 10 * d**0.5 * sink
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,n", [(128, 1500), (64, 700), (64, 200), (128, 40)])
def test_cuda_kernels_at_tau_zero_are_causal_attention(dtype: torch.dtype, d: int, n: int) -> None:
    """On CUDA tensors the op runs SALE's kernels: every block at tau 0 (a ragged last block, a
    prompt shorter than sink + local, one block), GQA groups of 4, output on the device."""
    cuda_or_skip()
    q, k, v = (t.cuda() for t in peaked_prompt(n, d, dtype, seed=n))
    out, skipped = ops.sale_prefill(q, k, v, 0.0)
    assert out.device == q.device and out.dtype == dtype and out.shape == q.shape
    assert skipped.device == q.device and torch.all(skipped == 0)
    torch.testing.assert_close(out.float(), sdpa(q, k, v), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_kernels_skip_the_blocks_the_reference_skips(dtype: torch.dtype) -> None:
    """At a threshold the CUDA selection skips the reference's blocks (int8 estimates on both
    sides; a block may differ only where an estimate sits within rounding of its threshold) and
    the output stays as close to dense attention as the reference's."""
    cuda_or_skip()
    q, k, v = peaked_prompt(2048, 128, dtype, seed=3)
    out_cpu, skipped_cpu = ops.sale_prefill(q, k, v, 0.004)
    out, skipped = ops.sale_prefill(q.cuda(), k.cuda(), v.cuda(), 0.004)
    assert float(skipped_cpu.min()) > 0.2, skipped_cpu
    torch.testing.assert_close(skipped.cpu(), skipped_cpu, atol=2e-3, rtol=0)
    torch.testing.assert_close(out.cpu().float(), out_cpu.float(), atol=2e-2, rtol=2e-2)
    dense = sdpa(q, k, v)
    err = (out.cpu().float() - dense).abs().sum(dim=(1, 2)) / q.shape[1]
    err_cpu = (out_cpu.float() - dense).abs().sum(dim=(1, 2)) / q.shape[1]
    torch.testing.assert_close(err, err_cpu, atol=0.02, rtol=0.05)


@pytest.mark.gpu
def test_cuda_kernels_take_views_at_any_offset() -> None:
    """q, k and v may be views that start off a 16-byte boundary (slices of a larger buffer): the
    op copies them and returns what it returns for the same values in fresh tensors."""
    cuda_or_skip()
    q, k, v = (t.cuda() for t in peaked_prompt(700, 128, torch.bfloat16, seed=5))

    def at_offset(t: torch.Tensor, elements: int) -> torch.Tensor:
        buf = torch.empty(t.numel() + elements, dtype=t.dtype, device=t.device)
        view = buf[elements:].view(t.shape)
        view.copy_(t)
        return view

    out, skipped = ops.sale_prefill(q, k, v, 0.004)
    for e in (1, 3, 4):  # 2, 6 and 8 bytes past the buffer's start
        qv, kv, vv = at_offset(q, e), at_offset(k, e), at_offset(v, e)
        assert qv.data_ptr() % 16 != 0
        out_v, skipped_v = ops.sale_prefill(qv, kv, vv, 0.004)
        torch.testing.assert_close(out_v, out, atol=0, rtol=0)
        torch.testing.assert_close(skipped_v, skipped, atol=0, rtol=0)


@pytest.mark.gpu
def test_cuda_refusals_name_what_the_kernels_take() -> None:
    cuda_or_skip()
    q = torch.randn(4, 100, 16, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 100, 16, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(kvsparse.KvSparseError, match="head_dim 64 or 128"):
        ops.sale_prefill(q, k, k, 0.1)
    q32 = torch.randn(4, 100, 64, device="cuda")
    k32 = torch.randn(2, 100, 64, device="cuda")
    with pytest.raises(kvsparse.KvSparseError, match="bf16 or fp16"):
        ops.sale_prefill(q32, k32, k32, 0.1)
    with pytest.raises(kvsparse.InvalidArgument, match="one device"):
        ops.sale_prefill(q32, k32.cpu(), k32, 0.1)
    from kvsparse.tools import sale_calibrate

    qb, kb = q32.bfloat16(), k32.bfloat16()
    with pytest.raises(kvsparse.InvalidArgument, match="every sample on one device"):
        sale_calibrate.calibrate_layer([(qb, kb, kb), (qb.cpu(), kb.cpu(), kb.cpu())], 0.125, theta=0.1,
                                       tau0=0.008, max_halvings=4, params=ops.SaleParams())


@pytest.mark.gpu
def test_cuda_calibration_is_the_references_search() -> None:
    """kvsparse-sale-calibrate's search (calibrate_layer) with its rounds on the CUDA kernels
    against the same search on the reference, on the same bf16 prompts: each head's error at its
    threshold within theta, the same thresholds (a head may end one halving apart only where its
    error sits within rounding of theta)."""
    cuda_or_skip()
    from kvsparse.tools import sale_calibrate

    samples = [peaked_prompt(1536, 128, torch.bfloat16, seed=s) for s in (5, 6)]
    scale = 128**-0.5
    search = dict(theta=0.1, tau0=0.008, max_halvings=24, params=ops.SaleParams())
    tau_c, err_c, skip_c, halv_c = sale_calibrate.calibrate_layer(samples, scale, **search)
    cuda = [tuple(t.cuda() for t in s) for s in samples]
    tau, err, skipped, halvings = sale_calibrate.calibrate_layer(cuda, scale, **search)
    assert all(e <= 0.1 for t, e in zip(tau, err) if t > 0), err
    assert max(halv_c) > 0 and any(s > 0.1 for s in skipped), (halv_c, skipped)  # the search did work
    moved = [abs(a - b) for a, b in zip(halvings, halv_c)]
    assert max(moved) <= 1 and sum(moved) <= 2, (halvings, halv_c, err, err_c)
    for h, (a, b) in enumerate(zip(halvings, halv_c)):
        if a == b:
            assert tau[h] == pytest.approx(tau_c[h]) and skipped[h] == pytest.approx(skip_c[h], abs=5e-3)
