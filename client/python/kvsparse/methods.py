"""Selection methods of a Decode call, and the model shape and placement of a sequence.

Each method is a frozen dataclass whose fields are the method's parameters in
``proto/kvsparse/v1/attention.proto``; ``to_proto`` fills the wire message. The placement a
method needs of a sequence is ``placement_for(method)``.

The defaults of the fields and the words of the enum-valued ones are read from the proto (its
``text_default`` and ``text_word`` options, the one home of both, which the CLI's ``--method``
reads too), so that a method's text form (``parse_method``) means the same everywhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Union, cast

from kvsparse.tensors import proto_dtype
from kvsparse.v1 import attention_pb2, tensor_pb2

TierName = Literal["host", "device"]


def _field(message: str, name: str) -> Any:
    return attention_pb2.DESCRIPTOR.message_types_by_name[message].fields_by_name[name]


def _default(message: str, name: str) -> Any:
    """Field `name` of proto message `message`'s default (its text_default option) as its Python
    value: the word of an enum-valued field, a float or an int."""
    f = _field(message, name)
    text = f.GetOptions().Extensions[attention_pb2.text_default]
    if f.enum_type is not None:
        return text
    if f.cpp_type in (f.CPPTYPE_FLOAT, f.CPPTYPE_DOUBLE):
        return float(text)
    if f.cpp_type == f.CPPTYPE_BOOL:
        return text.lower() in ("true", "1")
    return int(text)


def _words(enum: str) -> dict[str, int]:
    """An enum's words (its values' text_word options) and their wire values."""
    values = attention_pb2.DESCRIPTOR.enum_types_by_name[enum].values
    words = {v.GetOptions().Extensions[attention_pb2.text_word]: v.number for v in values}
    words.pop("", None)  # UNSPECIFIED
    return words


@dataclass(frozen=True)
class ModelShape:
    """Layers L, query heads H, kv heads Hkv (a divisor of H), head dim d and the K/V dtype."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bf16"

    def to_proto(self, out: tensor_pb2.ModelShape) -> None:
        out.num_layers = self.num_layers
        out.num_q_heads = self.num_q_heads
        out.num_kv_heads = self.num_kv_heads
        out.head_dim = self.head_dim
        out.dtype = proto_dtype(self.dtype)


_TIERS = {"host": tensor_pb2.TIER_HOST, "device": tensor_pb2.TIER_DEVICE}


@dataclass(frozen=True)
class Placement:
    """What the decode worker keeps on its device for a sequence: K and/or V rows, bit
    signatures of the keys (HashAttention, vAttention's hash predictor), and compressed keys
    (every key quantized to ``compressed_key_bits`` bits per channel: 1, 2, 4 or 8; the
    ``TopK`` method scores them). The store always holds every row in host memory."""

    k_tier: TierName = "host"
    v_tier: TierName = "host"
    signature_bits: int = 0
    compressed_key_bits: int = 0

    def to_proto(self, out: tensor_pb2.Placement) -> None:
        out.k_tier = _TIERS[self.k_tier]
        out.v_tier = _TIERS[self.v_tier]
        out.signature_bits = self.signature_bits
        out.compressed_key_bits = self.compressed_key_bits


@dataclass(frozen=True)
class Dense:
    """Exact attention over every row: the reference."""

    def to_proto(self, out: attention_pb2.Method) -> None:
        out.dense.SetInParent()


_SAMPLERS = _words("SantaSampler")
_ALLOCATIONS = _words("SantaAllocation")
_SCORE_SOURCES = _words("ScoreSource")
_CORRECTIONS = _words("SantaCorrection")
_PROPOSALS = _words("SantaProposal")
_BERNOULLI_MODES = _words("BernoulliQkMode")
_BERNOULLI_SAMPLERS = _words("BernoulliSampler")
_PREDICTORS = _words("TopKPredictor")
_BOUNDS = _words("BudgetBound")
_TARGETS = _words("VerifyTarget")
_RESIDUAL_SAMPLERS = _words("ResidualSampler")


def _word(table: dict[str, int], field: str, value: str) -> int:
    """The wire value of an enum field's word; ValueError names the field and the words."""
    if value not in table:
        raise ValueError(f"{field}: {value!r} is not one of {', '.join(table)}")
    return table[value]


@dataclass(frozen=True)
class Santa:
    """SANTA / S2ANTA: ``samples`` rows of V per query head drawn from softmax(qK^T)
    (i.i.d., stratified or systematic; global, proportional or flash tile allocation).
    ``scores="exact"`` reads every key: the sequence keeps K on the device; only sampled V rows
    cross. ``scores="compressed"`` draws from the scores of the sequence's compressed keys (K
    stays in host memory); ``correction="ratio"`` then fetches the sampled K rows too and
    weights each row by exp(exact - approximate score), normalised (the ratio estimator of
    softmax(qK^T) V), ``"none"`` reads V rows only and estimates softmax(qK~^T) V.
    ``proposal="group"`` (with compressed scores and the ratio correction) draws the ``samples``
    once per kv head from the mean of its query heads' softmax, so S rows cross per kv head
    instead of the union of each head's S; its bias shows where the heads attend apart
    (docs/ACCURACY.md). Both engines serve it; the GPU in captured steps too.
    ``uniform_floor=a`` (compressed scores, ratio correction) draws from (1 - a) softmax + a
    uniform instead, a floor under tokens the compressed scores understate; the CPU engine
    serves it (on a GPU deployment such calls run there)."""

    samples: int = _default("SantaParams", "samples")
    sampler: Literal["iid", "stratified", "systematic"] = _default("SantaParams", "sampler")
    allocation: Literal["global", "prop", "flash"] = _default("SantaParams", "allocation")
    tile_size: int = _default("SantaParams", "tile_size")  # 0: the server's default
    bernoulli_qk_samples: int = _default("SantaParams", "bernoulli_qk_samples")  # 0: exact scores
    bernoulli_mode: Literal["head", "mean_group_query"] = _default("SantaParams", "bernoulli_mode")
    bernoulli_sampler: Literal["iid", "stratified"] = _default("SantaParams", "bernoulli_sampler")
    scores: Literal["exact", "compressed"] = _default("SantaParams", "scores")
    correction: Literal["ratio", "none"] = _default("SantaParams", "correction")
    proposal: Literal["head", "group"] = _default("SantaParams", "proposal")
    uniform_floor: float = _default("SantaParams", "uniform_floor")

    def to_proto(self, out: attention_pb2.Method) -> None:
        p = out.santa
        p.sampler = _word(_SAMPLERS, "sampler", self.sampler)
        p.allocation = _word(_ALLOCATIONS, "allocation", self.allocation)
        p.samples = self.samples
        p.tile_size = self.tile_size
        p.bernoulli_qk_samples = self.bernoulli_qk_samples
        p.bernoulli_mode = _word(_BERNOULLI_MODES, "bernoulli_mode", self.bernoulli_mode)
        p.bernoulli_sampler = _word(_BERNOULLI_SAMPLERS, "bernoulli_sampler", self.bernoulli_sampler)
        p.scores = _word(_SCORE_SOURCES, "scores", self.scores)
        p.correction = _word(_CORRECTIONS, "correction", self.correction)
        p.proposal = _word(_PROPOSALS, "proposal", self.proposal)
        p.uniform_floor = self.uniform_floor


@dataclass(frozen=True)
class HashTopK:
    """HashAttention: sink + local window + the top-k tokens by Hamming similarity of bit
    signatures (``top_k`` rows, or ``top_k_fraction`` of the sequence when top_k is 0)."""

    top_k: int = _default("HashTopKParams", "top_k")
    top_k_fraction: float = _default("HashTopKParams", "top_k_fraction")
    sink_tokens: int = _default("HashTopKParams", "sink_tokens")
    local_tokens: int = _default("HashTopKParams", "local_tokens")
    bits: int = _default("HashTopKParams", "bits")  # 0: the sequence's signature bits
    # The server's learned signatures (--hash_weights), not SimHash: the proto's source=learned.
    learned: bool = _default("HashTopKParams", "source") == "learned"

    def to_proto(self, out: attention_pb2.Method) -> None:
        _fill_selection(out.hash_top_k, self)


@dataclass(frozen=True)
class VAttention:
    """vAttention: sink + local + predicted top-k, plus a uniform sample of the rest sized so that
    the output is (epsilon, delta)-accurate: a guarantee with ``predictor="exact"``, a target with
    ``predictor="hash"`` (a head whose heavy token the signatures miss is not covered).
    ``predictor="compressed"`` ranks by the sequence's compressed keys
    (``Placement(compressed_key_bits=2)``) and bounds every other token's score by their stored
    error norms, so the budget's range of x is sound without K on the device.
    ``sampler="importance"`` (exact or compressed predictor, ``bound`` clt or clt-ratio) draws
    the residual i.i.d. in proportion to the predictor's softmax and weights each draw by exact
    over predicted, instead of the paper's uniform sample: far fewer rows where attention is
    heavy-tailed."""

    epsilon: float = _default("VAttentionParams", "epsilon")
    delta: float = _default("VAttentionParams", "delta")
    top_k: int = _default("VAttentionParams", "top_k")
    top_k_fraction: float = _default("VAttentionParams", "top_k_fraction")
    sink_tokens: int = _default("VAttentionParams", "sink_tokens")
    local_tokens: int = _default("VAttentionParams", "local_tokens")
    predictor: Literal["hash", "exact", "compressed"] = _default("VAttentionParams", "predictor")
    base_rate: float = _default("VAttentionParams", "base_rate")
    # clt-ratio: the delta method on N^/D^
    bound: Literal["clt", "clt-ratio", "hoeffding"] = _default("VAttentionParams", "bound")
    target: Literal["output", "numerator", "denominator"] = _default("VAttentionParams", "target")
    bits: int = _default("VAttentionParams", "bits")
    learned: bool = _default("VAttentionParams", "source") == "learned"  # the proto's source
    sampler: Literal["uniform", "importance"] = _default("VAttentionParams", "sampler")

    def to_proto(self, out: attention_pb2.Method) -> None:
        p = out.vattention
        _fill_selection(p, self)
        p.epsilon = self.epsilon
        p.delta = self.delta
        p.predictor = _word(_PREDICTORS, "predictor", self.predictor)
        p.base_rate = self.base_rate
        p.bound = _word(_BOUNDS, "bound", self.bound)
        p.target = _word(_TARGETS, "target", self.target)
        p.sampler = _word(_RESIDUAL_SAMPLERS, "sampler", self.sampler)


@dataclass(frozen=True)
class Saap:
    """SAAP (asymmetric partitions): sink + local window + every key in the ``probes`` buckets the
    GQA group's query classifiers rank highest, then exact attention over those rows. Needs the
    server's partitions (``--saap_weights``, from ``kvsparse-calibrate --saap_out``); the
    sequence keeps each key's bucket as a 32-bit signature."""

    probes: int = _default("SaapParams", "probes")
    sink_tokens: int = _default("SaapParams", "sink_tokens")
    local_tokens: int = _default("SaapParams", "local_tokens")

    def to_proto(self, out: attention_pb2.Method) -> None:
        p = out.saap
        p.probes = self.probes
        p.sink_tokens = self.sink_tokens
        p.local_tokens = self.local_tokens


@dataclass(frozen=True)
class TopK:
    """Top-k by scores: sink + local window + the ``top_k`` tokens (or ``top_k_fraction`` of the
    sequence) of highest score per query head, then exact attention over them. ``scores``:
    "compressed" scores every key from the sequence's compressed keys
    (``Placement(compressed_key_bits=2)``: a few bits per key on the device, only the chosen K and
    V rows cross); "exact" scores every full-precision key: the oracle top-k."""

    top_k: int = _default("TopKParams", "top_k")
    top_k_fraction: float = _default("TopKParams", "top_k_fraction")
    sink_tokens: int = _default("TopKParams", "sink_tokens")
    local_tokens: int = _default("TopKParams", "local_tokens")
    scores: Literal["compressed", "exact"] = _default("TopKParams", "scores")

    def to_proto(self, out: attention_pb2.Method) -> None:
        p = out.top_k
        p.top_k = self.top_k
        p.top_k_fraction = self.top_k_fraction
        p.sink_tokens = self.sink_tokens
        p.local_tokens = self.local_tokens
        p.scores = _word(_SCORE_SOURCES, "scores", self.scores)


Method = Union[Dense, Santa, HashTopK, VAttention, Saap, TopK]


def _fill_selection(p: Any, m: "HashTopK | VAttention") -> None:
    """The fields HashAttention and vAttention share: the fixed set and the signatures."""
    p.top_k = m.top_k
    p.top_k_fraction = m.top_k_fraction
    p.sink_tokens = m.sink_tokens
    p.local_tokens = m.local_tokens
    p.bits = m.bits
    p.source = attention_pb2.SIGNATURE_SOURCE_LEARNED if m.learned else attention_pb2.SIGNATURE_SOURCE_SIMHASH


def placement_for(method: Method, signature_bits: int = 32, compressed_key_bits: int = 2) -> Placement:
    """The placement a method reads from, as attention.proto says it (``method_reads`` on a
    method's message, ``value_reads`` on the enum value that changes it; the C++ side reads the
    same options, rpc::PlacementFor): K on the device for exact scores (SANTA with exact scores,
    exact top-k, vAttention's exact predictor), key signatures for HashAttention and vAttention's
    hash predictor (the method's bits, else `signature_bits`), each key's 32-bit bucket for SAAP,
    compressed keys (of `compressed_key_bits`) for top-k and the compressed predictors; nothing
    for dense. K and V stay in host memory otherwise."""
    wire = attention_pb2.Method()
    method.to_proto(wire)
    kind = wire.WhichOneof("kind")
    if kind is None:
        return Placement()
    params = getattr(wire, kind)
    reads = params.DESCRIPTOR.GetOptions().Extensions[attention_pb2.method_reads]
    for f in params.DESCRIPTOR.fields:
        if f.enum_type is not None:
            value = f.enum_type.values_by_number[getattr(params, f.name)]
            reads = value.GetOptions().Extensions[attention_pb2.value_reads] or reads
    if reads == "keys_on_device":
        return Placement(k_tier="device")
    if reads == "signatures":
        return Placement(signature_bits=getattr(params, "bits", 0) or signature_bits)
    if reads == "signatures_32":
        return Placement(signature_bits=32)
    if reads == "compressed_keys":
        return Placement(compressed_key_bits=compressed_key_bits)
    return Placement()


METHOD_NAMES: dict[str, type] = {
    "dense": Dense,
    "santa": Santa,
    "hash_top_k": HashTopK,
    "vattention": VAttention,
    "saap": Saap,
    "top_k": TopK,
}


def method_text(method: Method) -> str:
    """The text form parse_method (and the CLI's --method) reads: ``name`` and the fields that
    differ from the method's defaults (``santa:samples=256,scores=compressed``);
    parse_method(method_text(m)) == m."""
    names = {cls: name for name, cls in METHOD_NAMES.items()}
    name = names.get(type(method))
    if name is None:
        raise ValueError(f"not a method: {method!r}")
    defaults = type(method)()
    parts = []
    for f in dataclasses.fields(method):
        value = getattr(method, f.name)
        if value == getattr(defaults, f.name):
            continue
        if f.name == "learned":  # the proto's source field
            parts.append(f"source={'learned' if value else 'simhash'}")
        else:
            parts.append(f"{f.name}={str(value).lower() if isinstance(value, bool) else value!s}")
    return name + (":" + ",".join(parts) if parts else "")


# The proto's enum field a dataclass shows as a bool: `learned` is source=learned (and
# source=simhash its default), as the text form (the proto's fields) writes it.
_SOURCE_WORDS = {word: word == "learned" for word in _words("SignatureSource")}


def _word_problem(name: str, key: str, value: Any) -> str | None:
    """Why an enum field's word is refused (not one of the proto's words for it), or None."""
    message = attention_pb2.Method.DESCRIPTOR.fields_by_name[name].message_type
    field = message.fields_by_name.get(key)
    if field is None or field.enum_type is None or not isinstance(value, str):
        return None
    words = _words(field.enum_type.name)
    return None if value in words else f"{name}: {key}={value!r} is not one of {', '.join(words)}"


def parse_method(spec: str) -> Method:
    """A method from its text form, ``name`` or ``name:field=value,field=value`` with the names
    of the server's metrics labels (``dense``, ``santa``, ``hash_top_k``, ``vattention``,
    ``saap``, ``top_k``) and the proto's fields and words (attention.proto, "A method's text
    form"; the CLI's ``--method`` reads the same text), e.g. ``top_k:top_k_fraction=0.03125`` or
    ``santa:samples=256,allocation=prop``; every field left out takes its default. A HashTopK or
    VAttention takes ``source=learned`` (the proto's field) or ``learned=true`` (the dataclass's).
    ValueError names every problem at once, as the CLI's reading does (rpc/method_text.h): fields
    the method lacks, values of the wrong type, words its enums do not have (the values' ranges
    are the engine's to check)."""
    name, _, params = spec.strip().partition(":")
    name = name.strip()
    cls = METHOD_NAMES.get(name)
    if cls is None:
        raise ValueError(f"unknown method {name!r}: one of {', '.join(METHOD_NAMES)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    defaults = cls()
    kwargs: dict[str, Any] = {}
    problems: list[str] = []
    for part in filter(None, (p.strip() for p in params.split(","))):
        key, eq, text = part.partition("=")
        key, text = key.strip(), text.strip()
        if key == "source" and "learned" in fields and eq:
            if text in _SOURCE_WORDS:
                kwargs["learned"] = _SOURCE_WORDS[text]
            else:
                problems.append(f"{name}: source={text!r} is not one of {', '.join(sorted(_SOURCE_WORDS))}")
            continue
        if not eq or key not in fields:
            problems.append(f"{name}: {part!r} is not field=value of {', '.join(fields)}")
            continue
        kind = type(getattr(defaults, key))
        if kind is bool and text.lower() in ("0", "1", "true", "false"):
            kwargs[key] = text.lower() in ("1", "true")
            continue
        try:
            if kind is bool:
                raise ValueError(text)
            kwargs[key] = kind(text)
        except ValueError:
            problems.append(f"{name}: {key}={text!r} is not a {kind.__name__}")
            continue
        word = _word_problem(name, key, kwargs[key])
        if word is not None:
            problems.append(word)
    if problems:
        raise ValueError("; ".join(problems))
    return cast(Method, cls(**kwargs))


# The flagship: the configuration the project measures against the memory floor and serves where
# the K/V live in host memory with nothing named (vLLM's CUDA build): S2ANTA's proportional
# sample of S = 128 per query head, drawn from the 2-bit compressed keys' scores, the sampled K
# and V rows from host memory (the ratio correction). Its speed, its quality and what it misses
# (a public model's perplexity): docs/PERF.md, docs/ACCURACY.md ("The flagship on SmolLM2 on an
# H200", where the group mixture at S = 512 is the measured candidate to replace it).
FLAGSHIP_TEXT = "santa:samples=128,allocation=prop,scores=compressed"
FLAGSHIP = parse_method(FLAGSHIP_TEXT)
