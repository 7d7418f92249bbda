"""The native CPU multi-LoRA kernel (kernels/lora_native.py, cpu/lora_ops.c) against the torch
path (``apply_lora_parts``) on the slot buffers ``LoraLinear`` keeps."""

from __future__ import annotations

import pytest
import torch

from refengine.kernels.linear import Linear
from refengine.kernels.lora import LoraBatch, apply_lora_parts
from refengine.kernels.lora_linear import LoraLinear, LoraPair, ProjectionDeltas
from refengine.kernels.lora_native import apply_lora_native, native_lora_available

pytestmark = [pytest.mark.threads(2),  # the work split between threads (tests/conftest.py)
              pytest.mark.skipif(not native_lora_available(), reason="the native CPU LoRA kernel did not build")]


def projection(part_sizes: tuple[int, ...], rank: int, slots: int, targeted: dict[int, tuple[bool, ...]],
               seed: int) -> LoraLinear:
    gen = torch.Generator().manual_seed(seed)
    in_features = 40
    layer = LoraLinear(Linear(torch.randn(sum(part_sizes), in_features, generator=gen)), part_sizes, slots, rank,
                       torch.float32, "cpu")
    for slot, modules in targeted.items():
        ranks = [rank if slot % 2 else max(1, rank // 2) for _ in part_sizes]  # some adapters use less rank
        layer.set_slot(slot, ProjectionDeltas(tuple(
            LoraPair(torch.randn(r, in_features, generator=gen), torch.randn(out, r, generator=gen)) if on else None
            for on, out, r in zip(modules, part_sizes, ranks, strict=True))))
    return layer


@pytest.mark.parametrize("part_sizes", [(24,), (16, 8, 8), (20, 20)])
@pytest.mark.parametrize("rank", [8, 16])
@pytest.mark.parametrize("token_slots", [[0, 0, 1, 1, 2, 2, 3, 3], [3, -1, 0, 2, 0, -1, 3, 1, 1], [2], [-1, 1, -1]])
def test_native_equals_the_torch_path(part_sizes, rank, token_slots) -> None:
    targeted = {0: (True,) * len(part_sizes), 1: tuple(p % 2 == 0 for p in range(len(part_sizes))),
                2: (True,) * len(part_sizes)}  # slot 3: an adapter that does not target this projection
    layer = projection(part_sizes, rank, 4, targeted, seed=rank + len(part_sizes))
    batch = LoraBatch.build(torch.tensor(token_slots))
    x = torch.randn(len(token_slots), 40)
    expected = layer.base(x)
    apply_lora_parts(expected, x, batch, layer.lora_a, layer.lora_b, layer.active_slots)
    got = layer.base(x)
    apply_lora_native(got, x, batch, layer.lora_a, layer.lora_b, layer._active)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(layer(x, _Ctx(batch)), got)  # LoraLinear takes the native path for this step


def test_each_row_is_batch_invariant() -> None:
    layer = projection((16, 8, 8), 16, 4, {s: (True, True, True) for s in range(4)}, seed=1)
    x = torch.randn(12, 40)
    slots = torch.tensor([0, 1, 2, 3] * 3)
    whole = layer(x, _Ctx(LoraBatch.build(slots)))
    for row in range(12):
        alone = layer(x[row:row + 1], _Ctx(LoraBatch.build(slots[row:row + 1])))
        assert torch.equal(alone[0], whole[row])


class _Ctx:
    """The one field of ``ForwardContext`` a projection reads."""

    def __init__(self, lora: LoraBatch | None) -> None:
        self.lora = lora
