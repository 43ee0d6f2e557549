"""kvsparse's decode inside vLLM's full CUDA graphs (the CUDA backend, kvsparse.vllm.cuda_backend).

vLLM 0.24.0's V2 model runner captures one graph per batch size for steps where every request
has one token (FULL decode graphs, declared by the backend's ``UNIFORM_SINGLE_TOKEN_DECODE``)
and replays it without calling attention's forward: whatever kvsparse does inside must be
recorded once, at vLLM's start, before any request exists, and read everything that changes
from tensors rewritten in place between replays. A ``SlotPlan`` is that: one captured plan
(``DecodeSteps``) over ``slots`` batch slots (vLLM's ``max_num_seqs``), slot i serving row i of
vLLM's batch, with its own input, output and positions tensors. At start every slot holds a
placeholder sequence of one token (bound at that token: nothing reserved past it) and every
position is -1 (idle: nothing written, zeros). Before each step (the KV connector's bind, the
last host hook before the replay) the worker binds each slot to the request decoding in that row
(``bind``: a ``rebind`` of the plan when the rows changed, one synchronisation, so a steady batch
costs none) and writes the step's positions; after it, every position goes back to -1, so a
replay vLLM runs without a step (its warm-up, a dummy batch) writes nothing. The rows of a step
that mixes prompts and decodes run outside vLLM's graphs (piecewise), through the same plan and
tensors: the decode rows gathered into their slots, the prompt rows idle.

One method is captured: the deployment's (KVSPARSE_VLLM_METHOD). A request asking for another
fails alone with the reason (KVSPARSE_VLLM_FULL_GRAPHS=0 serves per-request methods outside
vLLM's graphs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvsparse.errors import KvSparseError
from kvsparse.methods import ModelShape, parse_method, placement_for
from kvsparse.tensors import torch_dtype

PLACEHOLDER = "kvsparse-idle-{}"  # slot i's placeholder sequence

# The most of the GPU's memory the plan's scores region (slots x query heads x max_model_len
# floats, its largest buffer, sized for every slot at the longest length) may take; a deployment
# over it (many slots at a long max_model_len) decodes between vLLM's piecewise graphs instead
# (SlotPlan.too_large says why).
MAX_SCORES_SHARE = 1 / 16


@dataclass
class SlotPlan:
    """A captured plan over vLLM's batch slots (the module text)."""

    text: str  # the method's text
    shape: ModelShape
    steps: Any  # kvsparse.torch.ops.DecodeSteps
    placeholders: list[str]
    ids: list[str]  # the sequence bound to each slot
    q: torch.Tensor  # [slots, H, d]
    k: torch.Tensor  # [slots, Hkv, d]
    v: torch.Tensor
    out: torch.Tensor  # [slots, H, d]
    positions: torch.Tensor  # [slots] int64: each slot's position this step, -1 idle
    rebinds: int = 0

    @property
    def slots(self) -> int:
        return len(self.placeholders)

    @staticmethod
    def too_large(shape: ModelShape, slots: int, max_tokens: int, gpu_bytes: int) -> str | None:
        """Why a plan of `slots` slots would hold too much of a GPU of `gpu_bytes`
        (MAX_SCORES_SHARE), or None."""
        scores = 4 * slots * shape.num_q_heads * max_tokens
        if scores <= gpu_bytes * MAX_SCORES_SHARE:
            return None
        return (f"its scores region ({slots} slots x {shape.num_q_heads} heads x {max_tokens} tokens, "
                f"{scores / 2**30:.1f} GiB) is over 1/{round(1 / MAX_SCORES_SHARE)} of the GPU's memory: "
                "lower vLLM's max_num_seqs or max_model_len")

    @classmethod
    def create(cls, engine: Any, text: str, shape: ModelShape, slots: int, *, max_tokens: int, seed: int,
               scale: float, device: torch.device) -> "SlotPlan":
        """The plan over `slots` placeholders (created here: one token of zeros in every layer),
        and its tensors. Outside any CUDA graph capture (it synchronises). On an error the
        placeholders are dropped again."""
        method = parse_method(text)
        dtype = torch_dtype(shape.dtype)
        zeros = torch.zeros(1, shape.num_kv_heads, shape.head_dim, dtype=dtype, device=device)
        placeholders: list[str] = []
        try:
            for sid in (PLACEHOLDER.format(i) for i in range(slots)):
                engine.create_sequence(sid, shape, placement_for(method))
                placeholders.append(sid)
                for layer in range(shape.num_layers):
                    engine.append(sid, layer, zeros, zeros)
            steps = engine.plan_steps(placeholders, method, max_tokens=max_tokens, seed=seed, scale=scale,
                                      dtype=shape.dtype, bounds=[1] * slots)
        except Exception:
            for sid in placeholders:
                engine.drop_sequence(sid)
            raise
        h, hkv, d = shape.num_q_heads, shape.num_kv_heads, shape.head_dim
        return cls(
            text, shape, steps, placeholders, list(placeholders),
            torch.zeros(slots, h, d, dtype=dtype, device=device),
            torch.zeros(slots, hkv, d, dtype=dtype, device=device),
            torch.zeros(slots, hkv, d, dtype=dtype, device=device),
            torch.zeros(slots, h, d, dtype=dtype, device=device),
            torch.full((slots,), -1, dtype=torch.long, device=device),
        )

    def bind(self, want: list[str | None]) -> Exception | None:
        """Binds slot i to sequence want[i] (None: its placeholder) where the binding changed:
        commits what the steps wrote, then moves the plan (a synchronisation). Returns the
        commit's error, if any (a step refused since the last commit: the sequences then bound
        are no longer whole); raises the move's (then the plan holds no sequence: every slot
        idle until a bind succeeds)."""
        ids = [w or self.placeholders[i] for i, w in enumerate(want)]
        ids += self.placeholders[len(ids):]
        if ids == self.ids:
            return None
        error: Exception | None = None
        try:
            self.steps.commit()
        except KvSparseError as e:
            error = e
        self.ids = [""] * self.slots  # none, until the move succeeds
        self.steps.rebind(ids, [1 if sid == p else 0 for sid, p in zip(ids, self.placeholders)])
        self.ids = ids
        self.rebinds += 1
        return error

    def stage(self, positions: list[int]) -> None:
        """The step's positions (one per slot, -1 idle) into the plan's tensor, on the current
        stream without a synchronisation."""
        staged = torch.tensor(positions + [-1] * (self.slots - len(positions)), dtype=torch.long).pin_memory()
        self.positions.copy_(staged, non_blocking=True)

    def idle(self) -> None:
        """Every slot idle (after a step: a replay without a step writes nothing)."""
        self.positions.fill_(-1)

    def decode_rows(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    out: torch.Tensor, n: int) -> None:
        """One layer of the slots for a batch whose first n rows are slots 0 .. n - 1 (vLLM's
        uniform decode batch, or its capture): the rows in, the plan's step, the outputs back."""
        s = self.shape
        self.q[:n].copy_(query[:n].view(n, s.num_q_heads, s.head_dim))
        self.k[:n].copy_(key[:n].view(n, s.num_kv_heads, s.head_dim))
        self.v[:n].copy_(value[:n].view(n, s.num_kv_heads, s.head_dim))
        self.steps.decode(layer, self.q, self.k, self.v, self.positions, out=self.out)
        out[:n].copy_(self.out[:n].view(out[:n].shape))

    def decode_gathered(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        out: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """One layer of the slots for a batch that mixes prompt and decode rows: decode row
        `slots[i]`'s token is `tokens[i]` (device int64 tensors); the other slots are idle."""
        s = self.shape
        self.q.index_copy_(0, slots, query.index_select(0, tokens).view(-1, s.num_q_heads, s.head_dim))
        self.k.index_copy_(0, slots, key.index_select(0, tokens).view(-1, s.num_kv_heads, s.head_dim))
        self.v.index_copy_(0, slots, value.index_select(0, tokens).view(-1, s.num_kv_heads, s.head_dim))
        self.steps.decode(layer, self.q, self.k, self.v, self.positions, out=self.out)
        out.index_copy_(0, tokens, self.out.index_select(0, slots).to(out.dtype))

    def close(self, engine: Any) -> None:
        """Ends the plan (its written rows the store's) and drops the placeholders."""
        try:
            self.steps.commit()
        finally:
            self.steps.close()
            for sid in self.placeholders:
                engine.drop_sequence(sid)
