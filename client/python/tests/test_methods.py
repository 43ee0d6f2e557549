"""A method's text form (the CLI's, vLLM's KVSPARSE_VLLM_METHOD and per-request method): every
method class written by method_text reads back equal through parse_method, bad text names what is
wrong, the flagship's text is what vLLM's plugin serves by default, the dataclasses have the
proto's fields with the proto's defaults, and the CLI (rpc/method_text.h, C++) reads each text as
the same message."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path
from typing import get_args

import pytest
from google.protobuf import text_format

import kvsparse
from kvsparse.grpc.local_server import find_server_binary
from kvsparse.methods import FLAGSHIP, FLAGSHIP_TEXT, METHOD_NAMES, method_text, parse_method
from kvsparse.v1 import attention_pb2, tensor_pb2

METHODS = [
    kvsparse.Dense(),
    kvsparse.Santa(),
    kvsparse.Santa(samples=512, scores="compressed", proposal="group", correction="ratio"),
    kvsparse.Santa(scores="compressed", uniform_floor=0.05),
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
    # Every problem at once, enum words included (vLLM's admission check refuses them with 400
    # instead of the engine failing the request later).
    with pytest.raises(ValueError) as every:
        parse_method("santa:allocation=bogus,samples=many,nope=1,scores=compressed")
    message = str(every.value)
    for problem in ("allocation='bogus' is not one of global, prop, flash", "samples='many' is not a int",
                    "'nope=1' is not field=value"):
        assert problem in message, message
    assert "scores=" not in message  # a good field among bad ones is not named
    with pytest.raises(ValueError, match="source='sha' is not one of learned, simhash"):
        parse_method("hash_top_k:source=sha")
    with pytest.raises(ValueError, match="not a method"):
        method_text("santa")  # type: ignore[arg-type]


def test_flagship_is_the_plugins_default() -> None:
    assert FLAGSHIP == kvsparse.Santa(samples=128, allocation="prop", scores="compressed")
    assert method_text(FLAGSHIP) == "santa:scores=compressed"  # prop and S = 128 are Santa's defaults
    plugin = pytest.importorskip("kvsparse.vllm.plugin", exc_type=ImportError)
    assert parse_method(plugin.DEFAULT_CUDA_METHOD) == FLAGSHIP and plugin.DEFAULT_CUDA_METHOD == FLAGSHIP_TEXT


def _proto_of(method: kvsparse.Method) -> attention_pb2.Method:
    out = attention_pb2.Method()
    method.to_proto(out)
    return out


def test_every_method_of_the_proto_has_its_dataclass() -> None:
    # Method's oneof is the list of methods (attention.proto): a method added there without its
    # dataclass here (or a dataclass without its message) fails here, not at a user's parse.
    oneof = attention_pb2.Method.DESCRIPTOR.oneofs_by_name["kind"]
    assert sorted(f.name for f in oneof.fields) == sorted(METHOD_NAMES)
    assert set(get_args(kvsparse.methods.Method)) == set(METHOD_NAMES.values())


@pytest.mark.parametrize("name", list(METHOD_NAMES))
def test_the_dataclasses_have_the_protos_fields_and_defaults(name: str) -> None:
    # The proto is the schema (attention.proto, "A method's text form"): each dataclass has its
    # message's fields (the dataclass's bool `learned` is the proto's enum `source`), and its
    # defaults send the proto's text defaults.
    cls = METHOD_NAMES[name]
    message = attention_pb2.Method.DESCRIPTOR.fields_by_name[name].message_type
    proto_fields = {f.name for f in message.fields}
    ours = {("source" if f.name == "learned" else f.name) for f in dataclasses.fields(cls)}
    assert ours == proto_fields
    sent = getattr(_proto_of(cls()), name)
    for f in message.fields:
        default = f.GetOptions().Extensions[attention_pb2.text_default]
        value = getattr(sent, f.name)
        if f.enum_type is not None:
            word = f.enum_type.values_by_number[value].GetOptions().Extensions[attention_pb2.text_word]
            assert word == default, (name, f.name)
        else:
            assert value == pytest.approx(float(default), rel=1e-7), (name, f.name)


def _what(p: tensor_pb2.Placement) -> tuple[int, int, int, int]:
    """A placement's meaning: an UNSPECIFIED tier is host memory."""
    host = tensor_pb2.TIER_HOST
    return p.k_tier or host, p.v_tier or host, p.signature_bits, p.compressed_key_bits


def _cli() -> str | None:
    try:
        server = Path(find_server_binary())
    except FileNotFoundError:
        return None
    cli = server.with_name("kvsparse")
    return str(cli) if cli.exists() and os.access(cli, os.X_OK) else None


@pytest.mark.skipif(_cli() is None, reason="needs the kvsparse CLI beside kvsparse-server (the C++ build)")
@pytest.mark.parametrize("method", METHODS + [parse_method("vattention:source=learned,bound=hoeffding")],
                         ids=lambda m: method_text(m))
def test_the_cli_reads_each_text_as_the_same_message(method: kvsparse.Method) -> None:
    # One text form: the C++ CLI (`kvsparse method`, rpc/method_text.h) and parse_method read a
    # text into the same message, every field included.
    text = method_text(method)
    run = subprocess.run([str(_cli()), "method", f"--method={text}"], capture_output=True, text=True,
                         timeout=30)
    assert run.returncode == 0, run.stderr
    first, _, rest = run.stdout.partition("\n")
    message, _, placement = rest.rstrip("\n").rpartition("\n")
    assert parse_method(first) == method  # its text form reads back here too
    theirs = text_format.Parse(message, attention_pb2.Method())
    assert theirs == _proto_of(method), text
    # The placement it reads: rpc::PlacementFor there, placement_for here, from the same options.
    assert placement.startswith("placement:"), run.stdout
    ours = tensor_pb2.Placement()
    kvsparse.placement_for(method).to_proto(ours)
    theirs_placement = text_format.Parse(placement.removeprefix("placement:"), tensor_pb2.Placement())
    assert _what(theirs_placement) == _what(ours), text


def test_source_is_the_protos_name_for_learned() -> None:
    assert parse_method("hash_top_k:source=learned") == kvsparse.HashTopK(learned=True)
    assert parse_method("hash_top_k:learned=true") == kvsparse.HashTopK(learned=True)
    assert method_text(kvsparse.VAttention(learned=True)) == "vattention:source=learned"
    with pytest.raises(ValueError, match="source='sim' is not one of learned, simhash"):
        parse_method("vattention:source=sim")
