"""A method's text form (the CLI's, vLLM's KVSPARSE_VLLM_METHOD and per-request method): every
method class written by method_text reads back equal through parse_method, bad text names what is
wrong, and the flagship's text is what vLLM's plugin serves by default."""

from __future__ import annotations

import pytest

import kvsparse
from kvsparse.methods import FLAGSHIP, FLAGSHIP_TEXT, METHOD_NAMES, method_text, parse_method

METHODS = [
    kvsparse.Dense(),
    kvsparse.Santa(),
    kvsparse.Santa(samples=512, scores="compressed", proposal="group", correction="ratio"),
    kvsparse.Santa(samples=64, sampler="iid", allocation="global", bernoulli_qk_samples=8),
    kvsparse.HashTopK(top_k_fraction=1 / 64, sink_tokens=4, local_tokens=0, learned=True),
    kvsparse.VAttention(epsilon=0.05, delta=0.01, predictor="compressed", sampler="importance",
                        bound="clt-ratio", base_rate=0.02),
    kvsparse.Saap(probes=2),
    kvsparse.TopK(top_k_fraction=0.03125, scores="exact"),
]


@pytest.mark.parametrize("method", METHODS, ids=lambda m: method_text(m))
def test_text_reads_back_equal(method: kvsparse.Method) -> None:
    text = method_text(method)
    assert text.split(":")[0] in METHOD_NAMES
    assert parse_method(text) == method


def test_defaults_are_the_bare_name() -> None:
    assert [method_text(cls()) for cls in METHOD_NAMES.values()] == list(METHOD_NAMES)


def test_bad_text_names_the_problem() -> None:
    with pytest.raises(ValueError, match="unknown method 'santta'"):
        parse_method("santta:samples=4")
    with pytest.raises(ValueError, match="samples='many' is not a int"):
        parse_method("santa:samples=many")
    with pytest.raises(ValueError, match="not a method"):
        method_text("santa")  # type: ignore[arg-type]


def test_flagship_is_the_plugins_default() -> None:
    assert FLAGSHIP == kvsparse.Santa(samples=128, allocation="prop", scores="compressed")
    assert method_text(FLAGSHIP) == "santa:scores=compressed"  # prop and S = 128 are Santa's defaults
    plugin = pytest.importorskip("kvsparse.vllm.plugin", exc_type=ImportError)
    assert parse_method(plugin.DEFAULT_CUDA_METHOD) == FLAGSHIP and plugin.DEFAULT_CUDA_METHOD == FLAGSHIP_TEXT
