"""SALE prefill through the op (kvsparse.torch.ops.sale_prefill, the CPU reference of kernels/sale.h):
at tau 0 it is torch's causal scaled-dot-product attention (GQA, a ragged length, bf16 and
fp32); on a prompt with a sink and a few planted keys a threshold skips blocks while the output
stays close; bad input raises kvsparse's errors."""

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


@pytest.mark.gpu
def test_cuda_tensors_say_the_kernel_is_not_there_yet() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    q = torch.randn(4, 100, 16, device="cuda")
    k = torch.randn(2, 100, 16, device="cuda")
    with pytest.raises(kvsparse.KvSparseError, match="no CUDA kernel yet"):
        ops.sale_prefill(q, k, k, 0.1)
