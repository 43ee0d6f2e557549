"""The decode engine in this process, over torch tensors: ``torch.ops.kvsparse.*`` (the
libtorch extension ``libkvsparse_torch.so`` built from the repository's op/) and ``InProcessEngine``,
its Python face.

On a CUDA device the engine decodes on the GPU backend: q and the output stay in the caller's
CUDA tensors, ordered on the caller's current CUDA stream; the store is this process's pinned
host memory, whose rows the GPU reads in place. Without a device (or a method the GPU backend
does not run) the same calls run on the CPU engine.

    engine = kvsparse.torch.ops.InProcessEngine(store_capacity="64G")
    engine.create_sequence("s", kvsparse.ModelShape(32, 32, 8, 128, "bf16"),
                           kvsparse.Placement(signature_bits=32))
    engine.append("s", layer, k, v)                  # [tokens, Hkv, d] CUDA or CPU tensors
    out, stats = engine.decode(layer, ["s"], q, kvsparse.HashTopK(top_k_fraction=0.02))

Build the extension with ``bash scripts/install_op.sh`` (``PYTHON=...`` for another interpreter):
it builds against this environment's torch and puts the library into the installed package. Or
``cmake -DKVSPARSE_TORCH_PREFIX=$(python -c "import torch; print(torch.utils.cmake_prefix_path)")``
(scripts/python_test.sh does). ``load_library`` finds it through $KVSPARSE_TORCH_LIB, then
beside this module, then in the repository's build/lib.
"""

from __future__ import annotations

import base64
import dataclasses
import math
import os
import re
import warnings
from pathlib import Path
from typing import Any, TypeVar

import grpc

from kvsparse._extras import needs

with needs("kvsparse.torch.ops", "torch", "torch"):
    import torch

from kvsparse.errors import KvSparseError, from_code
from kvsparse.grpc.channel import Credentials
from kvsparse.methods import Dense, Method, ModelShape, Placement
from kvsparse.v1 import attention_pb2

_LIB_NAME = "libkvsparse_torch.so"
_loaded: str | None = None

# Columns of the statistics tensor decode returns, one row per (sequence, kv head).
STAT_COLUMNS = (
    "rows_selected",
    "rows_fetched",
    "rows_cached",
    "bytes_host",
    "bytes_device",
    "bytes_remote",
    "dense_equivalent_bytes",
    "key_features_head",  # Bernoulli qK^T's K-feature reads (Santa(bernoulli_qk_samples=...))
    "key_features_group",
)
# The stated errors' columns (decode(..., return_errors=True)): per query head, the relative
# error the method states for its output, NaN where it states none (engine HeadStats): S2ANTA's
# standard error from its own draws, vAttention's promised epsilon at probability 1 - delta,
# top-k's certified upper bound on the share of attention its rows leave out (over compressed keys).
ERROR_COLUMNS = ("standard_error", "epsilon", "missed_mass_bound")


def find_library() -> str:
    env = os.environ.get("KVSPARSE_TORCH_LIB")
    if env:
        return env
    here = Path(__file__).resolve().parent / _LIB_NAME
    if here.exists():
        return str(here)
    repo = Path(__file__).resolve().parents[4] / "build" / "lib" / _LIB_NAME
    if repo.exists():
        return str(repo)
    raise FileNotFoundError(
        f"{_LIB_NAME} not found: build it into this package with `bash scripts/install_op.sh` from the "
        "repository (PYTHON=... for another interpreter), or set KVSPARSE_TORCH_LIB"
    )


def load_library(path: str | None = None) -> str:
    """Loads the extension once; returns its path."""
    global _loaded
    if _loaded is None:
        lib = path or find_library()
        torch.ops.load_library(lib)
        _loaded = lib
        _register_fakes()
    return _loaded


def available() -> bool:
    """Whether the extension can be loaded in this process."""
    try:
        load_library()
        return True
    except (FileNotFoundError, OSError, RuntimeError):
        return False


def _register_fakes() -> None:
    """Shapes of the tensor ops for torch.compile's tracing (no engine call)."""

    def decoded(sequence_ids, q, new_k):  # type: ignore[no-untyped-def]
        # One statistics row per (sequence, kv head): Hkv is new_k's, or unknown to the tracer.
        if new_k is not None:
            rows = len(sequence_ids) * new_k.shape[1]
        else:
            rows = torch.library.get_ctx().new_dynamic_size()
        return torch.empty_like(q), torch.empty((rows, len(STAT_COLUMNS)), dtype=torch.long, device="cpu")

    @torch.library.register_fake("kvsparse::decode")
    def _(engine, layer, sequence_ids, q, new_k, new_v, method, seed, scale):  # type: ignore[no-untyped-def]
        return decoded(sequence_ids, q, new_k)

    @torch.library.register_fake("kvsparse::decode_with_errors")
    def _(engine, layer, sequence_ids, q, new_k, new_v, method, seed, scale):  # type: ignore[no-untyped-def]
        errors = torch.empty((q.shape[0] * q.shape[1], len(ERROR_COLUMNS)), dtype=torch.float32, device="cpu")
        return (*decoded(sequence_ids, q, new_k), errors)

    @torch.library.register_fake("kvsparse::step_decode")
    def _(engine, plan, layer, q, new_k, new_v, positions):  # type: ignore[no-untyped-def]
        return torch.empty_like(q)

    @torch.library.register_fake("kvsparse::step_decode_into")
    def _(engine, plan, layer, q, new_k, new_v, positions, out):  # type: ignore[no-untyped-def]
        return None

    @torch.library.register_fake("kvsparse::append")
    def _(engine, sequence_id, layer, k, v, expected_length):  # type: ignore[no-untyped-def]
        return None


_ERROR = re.compile(r"kvsparse ([A-Z_]+): (.*?)(?:\nException raised from|\Z)", re.S)


def _translate(e: RuntimeError) -> KvSparseError | RuntimeError:
    m = _ERROR.search(str(e))
    if m is None:
        return e
    code = getattr(grpc.StatusCode, m.group(1), grpc.StatusCode.UNKNOWN)
    return from_code(code, m.group(2).strip())


def _call(op: Any, *args: Any) -> Any:
    try:
        return op(*args)
    except RuntimeError as e:
        raise _translate(e) from None


def method_wire(method: Method) -> str:
    """The op's method argument: the method as the wire's kvsparse.v1.Method, serialized and in
    base64, so the op decodes and defaults it with the server's codec (rpc::FromProto)."""
    m = attention_pb2.Method()
    method.to_proto(m)
    return base64.b64encode(m.SerializeToString()).decode("ascii")


def gpu_shape_refusal(shape: ModelShape) -> str | None:
    """Why the GPU backend's kernels do not take sequences of this shape (every reason, e.g.
    ``"GQA group of 3 (the GPU's: 1, 2, 4, 8)"``), or None where they do: the engine's own rule
    (engine/gpu_shape.h), asked before decoding. Calls on such sequences run on the CPU engine."""
    load_library()
    why = _call(torch.ops.kvsparse.gpu_shape_refusal, shape.num_q_heads, shape.num_kv_heads, shape.head_dim,
                shape.dtype)
    return why or None


def _bytes(x: int | str) -> int:
    if isinstance(x, int):
        return x
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    s = x.strip().upper().removesuffix("B")
    if len(s) > 1 and s[-1] == "I" and s[-2] in units:  # Kubernetes' "8Gi": the same binary unit
        s = s[:-1]
    return int(float(s[:-1]) * units[s[-1]]) if s and s[-1] in units else int(s)


_Self = TypeVar("_Self", bound="_Closing")


class _Closing:
    """``close()`` on leaving a ``with`` block and when collected."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class InProcessEngine(_Closing):
    """A decode engine in this process over a store in this process (see the module's text) or,
    with ``store``, over a ``kvsparse-server`` store in another (``--role=store``): sequences are
    created, appended and dropped there, and each decode call gathers the rows it needs through the
    store's Gather RPC (the GPU backend stages them for its kernels; hash top-k fetches only its
    row cache's misses). q and the output stay on the GPU either way.

    Args:
        store: "host:port" of a kvsparse-server store; None (default): a store in this process.
        store_credentials: how that store is reached when it serves TLS or asks for tokens
            (``kvsparse.Credentials``: ca, cert + key, token; as the gRPC clients take it and as
            kvsparse-server's workers reach their store, ``--store_tls_*`` / ``--store_token``);
            None: plaintext, no token.
        gpu: "auto" (the GPU backend when a CUDA device is there), "on" or "off".
        device: CUDA device of the GPU backend.
        store_capacity: bytes of K/V pages the store holds ("64G"; this process's store only).
        capacity_policy: "reject" or "evict-lru" (this process's store only).
        gpu_capacity: GPU memory for per-sequence state (signatures, resident rows, compressed
            keys, row caches); None: ``resident_capacity``, as kvsparse-server's
            ``--gpu_capacity``.
        gpu_row_cache: HashAttention's row cache, rows per kv head as a fraction of the tokens;
            None: kvsparse-server's ``--gpu_row_cache`` default.
        resident_capacity: device-tier state (the CPU engine's resident rows, and the GPU's unless
            ``gpu_capacity``); None: kvsparse-server's ``--resident_capacity`` default. The
            engine reads these settings as the server reads its flags.
        hash_weights: a learned HashAttention weight file (``kvsparse.tools.calibrate``): hash top-k and
            vAttention's hash predictor then sign with its MLPs (``learned=True`` in the method),
            as kvsparse-server's ``--hash_weights``.
        saap_weights: SAAP partitions (``kvsparse-calibrate --saap_out``) for the ``Saap`` method,
            as kvsparse-server's ``--saap_weights``.
        key_widths: per-channel widths of the compressed keys (``kvsparse-key-widths``),
            as kvsparse-server's ``--key_widths``: sequences of that model and bits keep their
            compressed keys at those widths, on the CPU engine and the GPU's.
    """

    def __init__(
        self,
        *,
        gpu: str = "auto",
        device: int = 0,
        store_capacity: int | str = "16G",
        capacity_policy: str = "reject",
        gpu_capacity: int | str | None = None,
        gpu_row_cache: float | None = None,
        resident_capacity: int | str | None = None,
        huge_pages: bool = True,
        store: str | None = None,
        store_credentials: Credentials | None = None,
        hash_weights: str | None = None,
        saap_weights: str | None = None,
        key_widths: str | None = None,
    ) -> None:
        creds = store_credentials or Credentials()
        if creds.server_name is not None:
            raise ValueError(
                "store_credentials.server_name: the op checks the store's name against its address only"
            )
        if store is None and store_credentials is not None:
            raise ValueError("store_credentials: for a store in another process (store='host:port')")
        load_library()
        self._handle: int | None = _call(
            torch.ops.kvsparse.engine_create,
            gpu,
            device,
            _bytes(store_capacity),
            capacity_policy,
            0 if gpu_capacity is None else _bytes(gpu_capacity),  # 0: the engine's default
            math.nan if gpu_row_cache is None else float(gpu_row_cache),
            0 if resident_capacity is None else _bytes(resident_capacity),
            huge_pages,
            store or "",
            str(hash_weights or ""),
            str(saap_weights or ""),
            str(creds.ca or ""),
            str(creds.cert or ""),
            str(creds.key or ""),
            str(creds.token or ""),
            str(key_widths or ""),
        )
        self.backend: str = torch.ops.kvsparse.engine_backend(self._handle)

    @property
    def handle(self) -> int:
        if self._handle is None:
            raise from_code(grpc.StatusCode.FAILED_PRECONDITION, "this engine is closed")
        return self._handle

    def close(self) -> None:
        if self._handle is not None:
            torch.ops.kvsparse.engine_destroy(self._handle)
            self._handle = None

    def memory(self) -> dict[str, int]:
        """Bytes held: GPU memory for sequences (and its capacity), the store's pages (and its
        capacity), the CPU engine's resident state."""
        keys = ("gpu_bytes", "gpu_capacity", "store_bytes", "store_capacity", "cpu_resident_bytes")
        return dict(zip(keys, torch.ops.kvsparse.engine_memory(self.handle)))

    def create_sequence(self, sequence_id: str, shape: ModelShape, placement: Placement = Placement()) -> None:
        _call(
            torch.ops.kvsparse.create_sequence,
            self.handle,
            sequence_id,
            shape.num_layers,
            shape.num_q_heads,
            shape.num_kv_heads,
            shape.head_dim,
            shape.dtype,
            placement.k_tier,
            placement.v_tier,
            placement.signature_bits,
            placement.compressed_key_bits,
        )

    def fork_sequence(
        self, source_id: str, sequence_id: str, num_tokens: int, placement: Placement | None = None
    ) -> None:
        """A new sequence holding the first ``num_tokens`` tokens of ``source_id`` (a prompt's
        common prefix), which keeps them too: their whole pages are shared in the store, not
        copied, and each sequence grows on its own. ``placement``: the source's when None. The
        source may be in a step plan (its rows below its lengths never change)."""
        p = placement or Placement()
        _call(
            torch.ops.kvsparse.fork_sequence,
            self.handle,
            source_id,
            sequence_id,
            num_tokens,
            placement is None,
            p.k_tier,
            p.v_tier,
            p.signature_bits,
            p.compressed_key_bits,
        )

    def drop_sequence(self, sequence_id: str) -> None:
        _call(torch.ops.kvsparse.drop_sequence, self.handle, sequence_id)

    def layer_lengths(self, sequence_id: str) -> list[int]:
        return list(_call(torch.ops.kvsparse.sequence_lengths, self.handle, sequence_id))

    def read_rows(self, sequence_id: str, layer: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of tokens [0, count) of one layer as the store holds them: [Hkv, count, d]
        each, on the CPU in the sequence's dtype (OutOfRange past the layer's length)."""
        k, v = _call(torch.ops.kvsparse.read_rows, self.handle, sequence_id, layer, count)
        return k, v

    def append(
        self, sequence_id: str, layer: int, k: torch.Tensor, v: torch.Tensor, expected_length: int | None = None
    ) -> None:
        """Appends k, v ([tokens, Hkv, d], CUDA or CPU) to one layer of a sequence."""
        _call(
            torch.ops.kvsparse.append,
            self.handle,
            sequence_id,
            layer,
            k,
            v,
            -1 if expected_length is None else expected_length,
        )

    def plan_steps(
        self,
        sequence_ids: list[str],
        method: Method = Dense(),
        *,
        max_tokens: int,
        seed: int = 0,
        scale: float = 0.0,
        dtype: str = "bf16",
        eager: bool = False,
        warm_pages: bool = True,
        layer_graphs: bool = True,
        bounds: list[int] | None = None,
    ) -> "DecodeSteps":
        """Plans decode steps over a batch of sequences (each already holding its prompt in
        every layer) whose lengths stay at or below ``max_tokens`` (or each one's ``bounds``
        entry, where non-zero): see ``DecodeSteps``."""
        return DecodeSteps(
            self, sequence_ids, method, max_tokens=max_tokens, seed=seed, scale=scale, dtype=dtype, eager=eager,
            warm_pages=warm_pages, layer_graphs=layer_graphs, bounds=bounds,
        )

    def decode(
        self,
        layer: int,
        sequence_ids: list[str],
        q: torch.Tensor,
        method: Method = Dense(),
        *,
        new_k: torch.Tensor | None = None,
        new_v: torch.Tensor | None = None,
        seed: int = 0,
        scale: float = 0.0,
        return_errors: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        """One layer of one decode step: q [B, H, d]; new_k / new_v [B, Hkv, d] appended first.
        Returns the output [B, H, d] (q's dtype and device) and the statistics [B * Hkv, 9]
        (int64 on the CPU; columns STAT_COLUMNS), and with ``return_errors`` the errors the
        method states for each query head's output, [B * H, 3] float32 on the CPU (columns
        ERROR_COLUMNS: S2ANTA's standard error and vAttention's epsilon relative to the output's
        norm, top-k's certified bound on the attention mass its rows leave out; NaN where the
        method states none; the CPU engine states them all, the GPU backend vAttention's
        epsilon and S2ANTA's standard error over compressed keys with per-head proposals). q on the GPU backend's device stays there; a call the backend does not take (a
        method or placement it does not run, a model shape its kernels do not take) runs on the
        CPU engine, said by a warning once per engine and reason."""
        result = _call(
            torch.ops.kvsparse.decode_with_errors if return_errors else torch.ops.kvsparse.decode,
            self.handle,
            layer,
            list(sequence_ids),
            q,
            new_k,
            new_v,
            method_wire(method),
            seed & (2**63 - 1),
            float(scale),
        )
        if q.is_cuda:
            for why in torch.ops.kvsparse.engine_refusals(self.handle):
                warnings.warn(f"kvsparse: decode calls run on the CPU engine, q and the output through host "
                              f"memory: {why}", UserWarning, stacklevel=2)
        return result


class DecodeSteps(_Closing):
    """Decode steps over a fixed batch, each layer's call capturable in a CUDA graph.

    Planned once (``InProcessEngine.plan_steps``): on the GPU backend the store reserves the
    sequences' pages up to ``max_tokens``, the device state makes room for as many rows, and every
    layer's tables are built in device memory of the plan's own. ``decode(layer, q, new_k, new_v,
    positions)`` is then one layer of a step with nothing of the host: a kernel writes the step's
    token at ``positions`` (a CUDA int64 tensor: each sequence's length before the step) into the
    store's pinned pages and the resident rows, and the method's kernels run, on the current
    stream. It can be recorded in ``torch.cuda.CUDAGraph`` (or by ``torch.compile``'s CUDA graphs)
    and replayed step after step with new positions, queries and tokens in the same tensors.
    ``commit()`` (outside a graph) waits for the stream and makes the written rows the store's;
    ``stats()`` gives the last step's rows read (a captured plan's without a synchronisation).

    Captured: dense with K and V on the GPU, S2ANTA prop and flash, hash top-k with SimHash
    signatures (each step signs its key on the device), top-k and S2ANTA-prop over compressed keys
    (each step appends its key to them on the device, quantizing a group where it closes). Where
    the engine cannot capture the method, placement or device (``mode`` says why: no GPU,
    vAttention, SAAP, learned signatures, dense with a half in host memory), the same calls run as ordinary
    decode calls that append at each layer's end (positions must equal the lengths). A captured
    step writes exactly at each sequence's next row (``positions`` = its length); any other
    position writes nothing, gives that sequence zeros and makes ``commit`` raise OutOfRange; a
    negative one leaves the slot idle for the step (nothing written, zeros, no error), and
    ``rebind`` moves the plan to other sequences under graphs already recorded.
    Either way layer l of a step at position p draws its random numbers as an eager ``decode``
    with seed ``seed + l * 2**32 + p``. Where K or V rows are in host memory, a captured step
    reads one word of each page of the next layer on a side stream after each layer
    (``warm_pages``, on by default), so that the next layer's row fetch finds the host link's
    address translations warm; the side stream joins at the last layer, so a graph must record
    whole steps (layers 0 to L - 1 in order). Called outside a graph (a model server running
    attention eagerly between graphs of its own), a captured plan records a layer's kernels as a
    CUDA graph the second time the layer is called with the same q, new_k, new_v, positions and
    ``out`` tensors and replays it from then on: one launch instead of a dozen (``layer_graphs``,
    on by default; ``graph_counts()`` says how many were recorded and replayed). While a captured
    plan lives, its sequences' own decode calls and drops are refused; ``close`` (or leaving the
    ``with`` block) releases them.
    """

    def __init__(
        self,
        engine: InProcessEngine,
        sequence_ids: list[str],
        method: Method = Dense(),
        *,
        max_tokens: int,
        seed: int = 0,
        scale: float = 0.0,
        dtype: str = "bf16",
        eager: bool = False,
        warm_pages: bool = True,
        layer_graphs: bool = True,
        bounds: list[int] | None = None,
    ) -> None:
        self._engine = engine
        self.sequence_ids = list(sequence_ids)
        self.max_tokens = max_tokens
        self._plan: int | None = _call(
            torch.ops.kvsparse.plan_steps,
            engine.handle,
            self.sequence_ids,
            method_wire(method),
            max_tokens,
            seed & (2**63 - 1),
            float(scale),
            dtype,
            eager,
            warm_pages,
            layer_graphs,
            list(bounds or []),
        )
        self.mode: str = torch.ops.kvsparse.step_plan_mode(engine.handle, self._plan)

    @property
    def captured(self) -> bool:
        """Whether the steps can be recorded in a CUDA graph (else they run as eager calls)."""
        return self.mode == "captured"

    @property
    def plan(self) -> int:
        if self._plan is None:
            raise from_code(grpc.StatusCode.FAILED_PRECONDITION, "these steps are closed")
        return self._plan

    def decode(
        self,
        layer: int,
        q: torch.Tensor,
        new_k: torch.Tensor,
        new_v: torch.Tensor,
        positions: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One layer of a step: q [B, H, d], new_k / new_v [B, Hkv, d] (the step's token),
        positions [B] int64 (the lengths before the step). Returns the output [B, H, d]: ``out``
        when given (contiguous, q's shape, dtype and device), written in place."""
        if out is None:
            return _call(torch.ops.kvsparse.step_decode, self._engine.handle, self.plan, layer, q, new_k, new_v,
                         positions)
        _call(torch.ops.kvsparse.step_decode_into, self._engine.handle, self.plan, layer, q, new_k, new_v, positions,
              out)
        return out

    def rebind(self, sequence_ids: list[str], bounds: list[int] | None = None) -> None:
        """Moves the plan to other sequences, as many as it has (its batch slots). A captured
        plan binds them in the same device memory, so a CUDA graph recorded from its ``decode``
        calls replays over them: a model server captures its graphs once, over placeholder
        sequences in idle slots (``bounds`` entry = their length: nothing reserved past it;
        negative positions leave a slot idle: nothing written, zeros), and rebinds when its batch
        changes. Waits for the current stream; rows written since the last ``commit`` are dropped
        (commit first). On an error the plan holds no sequence: its steps write nothing and give
        zeros until a rebind succeeds."""
        _call(torch.ops.kvsparse.rebind_steps, self._engine.handle, self.plan, list(sequence_ids), list(bounds or []))
        self.sequence_ids = list(sequence_ids)

    def graph_counts(self) -> tuple[int, int]:
        """Layer graphs recorded and replayed by calls outside a graph (0, 0 for eager steps)."""
        recorded, replayed = torch.ops.kvsparse.step_graph_counts(self._engine.handle, self.plan)
        return int(recorded), int(replayed)

    def commit(self) -> list[int]:
        """Makes the rows the steps wrote the store's (waits for the current stream); returns each
        sequence's length. OutOfRange if a step's position was refused since the last commit."""
        return list(_call(torch.ops.kvsparse.commit_steps, self._engine.handle, self.plan))

    @property
    def device_bytes(self) -> int:
        """GPU memory this plan holds beside the engine's sequences (its per-layer tables and
        buffers and the scratch its layers share); 0 for eager steps."""
        return int(torch.ops.kvsparse.step_device_bytes(self._engine.handle, self.plan))

    def stats(self) -> torch.Tensor:
        """The last step's statistics, [layers, 4, B * H] int32: in the first B * Hkv entries of
        block 0 the rows each (sequence, kv head) read, of block 3 those of them found in the GPU's
        row cache (methods that select rows over compressed keys or signatures). A captured plan's
        are on the device (copied without a synchronisation); an eager plan's in host memory
        (empty before its first step)."""
        return _call(torch.ops.kvsparse.step_stats, self._engine.handle, self.plan)

    def close(self) -> None:
        if self._plan is not None and self._engine._handle is not None:
            torch.ops.kvsparse.release_steps(self._engine.handle, self._plan)
        self._plan = None


@dataclasses.dataclass(frozen=True)
class SaleParams:
    """SALE's block geometry (kernels/sale.h): query blocks of ``block_q`` tokens, key blocks of
    ``block_k``, the sink (first ``sink_tokens``) and local (last ``local_tokens`` up to each
    query block) regions computed exactly. The paper's values are the defaults."""

    block_q: int = 64
    block_k: int = 32
    sink_tokens: int = 32
    local_tokens: int = 256


def sale_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tau: float | list[float],
    *,
    scale: float | None = None,
    params: SaleParams = SaleParams(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of one prompt through SALE's block-sparse prefill: ``q`` ``[H, n, d]``,
    ``k`` and ``v`` ``[Hkv, n, d]`` (or each with a leading batch dimension of 1), ``tau`` one
    threshold for every query head or one per head (0: dense). Returns the output shaped as
    ``q`` and, per query head, the share of the causal blocks skipped.

    CPU tensors run the reference (kernels/sale.h, exact arithmetic, for tests and calibration);
    CUDA tensors SALE's kernels (kernels/cuda/sale.h: bf16 or fp16, head_dim 64 or 128, block_q 64
    and block_k 32; other shapes raise ``Unimplemented``) on the current stream, without a
    synchronisation (the shares skipped stay on the device)."""
    load_library()
    heads = q.shape[-3]
    taus = [float(tau)] * heads if isinstance(tau, (int, float)) else [float(t) for t in tau]
    if scale is None:
        scale = q.shape[-1] ** -0.5
    out, blocks = _call(
        torch.ops.kvsparse.sale_prefill, q, k, v, taus, float(scale), params.block_q, params.block_k,
        params.sink_tokens, params.local_tokens,
    )
    skipped = 1.0 - blocks[:, 1].double() / blocks[:, 0].clamp(min=1).double()
    return out.reshape(q.shape), skipped
