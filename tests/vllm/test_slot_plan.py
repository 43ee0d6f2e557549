"""The plan over vLLM's batch slots (kvsparse.vllm.slot_plan) without a GPU: its size rule, its
placeholders, and its binding (the in-process engine's eager plan on the CPU; the captured plan
inside vLLM's full graphs is tested on a GPU, test_vllm_cuda.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

import kvsparse  # noqa: E402
from kvsparse.methods import ModelShape  # noqa: E402
from kvsparse.torch import ops  # noqa: E402
from kvsparse.vllm.slot_plan import MAX_SCORES_SHARE, PLACEHOLDER, SlotPlan  # noqa: E402

SHAPE = ModelShape(2, 8, 2, 64, "bf16")


def test_a_plan_too_large_for_the_gpu_is_refused_with_its_size() -> None:
    llama = ModelShape(32, 32, 8, 128, "bf16")
    h200 = 141 * 2**30
    assert SlotPlan.too_large(llama, 8, 131_072, h200) is None  # 0.125 GiB of scores
    why = SlotPlan.too_large(llama, 1024, 131_072, h200)  # 16 GiB
    assert why is not None and "1024 slots" in why and "max_num_seqs" in why
    assert 4 * 1024 * 32 * 131_072 > h200 * MAX_SCORES_SHARE


def test_placeholders_bind_and_go() -> None:
    """create makes one one-token placeholder a slot; bind moves the plan only where the binding
    changed; a plan the engine refuses leaves no placeholder behind."""
    with ops.InProcessEngine(store_capacity="256M", gpu="off") as e:
        e.create_sequence("r", SHAPE)
        for layer in range(SHAPE.num_layers):
            e.append("r", layer, torch.zeros(5, 2, 64, dtype=torch.bfloat16), torch.zeros(5, 2, 64, dtype=torch.bfloat16))
        slots = SlotPlan.create(e, "top_k:top_k_fraction=0.25", SHAPE, 2, max_tokens=64, seed=0, scale=0.0,
                                device=torch.device("cpu"))
        assert slots.ids == [PLACEHOLDER.format(0), PLACEHOLDER.format(1)]
        assert e.layer_lengths(PLACEHOLDER.format(1)) == [1, 1]
        assert slots.bind([None, None]) is None and slots.rebinds == 0
        assert slots.bind([None, "r"]) is None and slots.rebinds == 1
        assert slots.ids == [PLACEHOLDER.format(0), "r"] and slots.steps.sequence_ids == slots.ids
        slots.bind([None, "r"])
        assert slots.rebinds == 1
        slots.close(e)
        with pytest.raises(kvsparse.NotFound):
            e.layer_lengths(PLACEHOLDER.format(0))
        with pytest.raises(kvsparse.InvalidArgument):  # refused when planned, after the placeholders
            SlotPlan.create(e, "top_k:top_k_fraction=0.25", SHAPE, 2, max_tokens=0, seed=0, scale=0.0,
                            device=torch.device("cpu"))
        with pytest.raises(kvsparse.NotFound):
            e.layer_lengths(PLACEHOLDER.format(0))
