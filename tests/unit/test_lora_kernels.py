"""``apply_lora_parts`` (both of its paths) and ``LoraLinear`` against a per-token loop in plain
Python: ``y[t] += B[s] @ (A[s] @ x[t])`` for each token ``t`` on slot ``s``."""

from __future__ import annotations

import pytest
import torch

from refengine.kernels.linear import Linear
from refengine.kernels.lora import LoraBatch, apply_lora_parts
from refengine.kernels.lora_linear import LoraLinear, LoraPair, ProjectionDeltas

pytestmark = pytest.mark.threads(2)  # the work split between threads (tests/conftest.py)

IN, OUT, RANK, SLOTS = 24, 40, 6, 5


def naive(y: torch.Tensor, x: torch.Tensor, slots: list[int], a: torch.Tensor, b: torch.Tensor,
          active: frozenset[int] | None = None) -> torch.Tensor:
    out = y.clone()
    for t, slot in enumerate(slots):
        if slot >= 0 and (active is None or slot in active):
            out[t] += b[slot] @ (a[slot] @ x[t])
    return out


def weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SLOTS, RANK, IN, generator=g), torch.randn(SLOTS, OUT, RANK, generator=g)


CASES = {  # per-token slots; whether the batched (bmm) path is taken; whether rows are sliced in place
    "decode-balanced": ([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, -1, 2], True, False),
    "non-consecutive-slots": ([4, 1, 4, 1, -1, 1, 4], True, False),
    "prefill-beside-decodes": ([2] * 20 + [0, 3, -1], False, True),
    "one-adapter": ([3, 3, -1, 3], False, False),
    "grouped-decode": ([-1, 0, 0, 1, 1, 3, 3], True, True),  # the engine's order: by adapter
    "grouped-ragged": ([-1, -1, 4, 4, 4, 1, 2, 2], True, True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_apply_lora_matches_the_per_token_loop(case: str) -> None:
    slots, batched, in_place = CASES[case]
    a, b = weights()
    x = torch.randn(len(slots), IN, generator=torch.Generator().manual_seed(1))
    y = torch.randn(len(slots), OUT, generator=torch.Generator().manual_seed(2))
    batch = LoraBatch.build(torch.tensor(slots))
    assert batch is not None and batch.batched == batched and (batch.seg_rows is not None) == in_place
    expected = naive(y, x, slots, a, b)
    apply_lora_parts(y, x, batch, a, (b,))
    assert torch.allclose(y, expected, atol=1e-4)


def test_active_slots_skip_the_others_and_padding_maps_back() -> None:
    slots = [0, 1, 2, 0, 1, 2, -1]
    a, b = weights(3)
    x, y = torch.randn(len(slots), IN), torch.randn(len(slots), OUT)
    batch = LoraBatch.build(torch.tensor(slots))
    assert batch is not None
    # every token's padded position holds that token's own row
    assert torch.equal(batch.padded_rows[batch.padded_positions], batch.token_indices)
    expected = naive(y, x, slots, a, b, frozenset({2}))
    apply_lora_parts(y, x, batch, a, (b,), frozenset({2}))
    assert torch.allclose(y, expected, atol=1e-4)
    assert LoraBatch.build(torch.tensor([-1, -1])) is None


def test_lora_linear_puts_each_module_in_its_own_columns() -> None:
    """A fused projection of modules 16 + 8 + 16 wide: the middle one untargeted."""
    g = torch.Generator().manual_seed(4)
    sizes = (16, 8, 16)
    base = Linear(torch.randn(sum(sizes), IN, generator=g), prepack=False)
    layer = LoraLinear(base, sizes, num_slots=2, max_rank=RANK, dtype=torch.float32, device="cpu")
    first = LoraPair(torch.randn(4, IN, generator=g), torch.randn(16, 4, generator=g))
    last = LoraPair(torch.randn(RANK, IN, generator=g), torch.randn(16, RANK, generator=g))
    layer.set_slot(1, ProjectionDeltas((first, None, last)))
    x = torch.randn(3, IN, generator=g)

    class Ctx:
        lora = LoraBatch.build(torch.tensor([1, -1, 1]))

    y = layer(x, Ctx())  # type: ignore[arg-type]
    expected = base(x)
    for t in (0, 2):
        expected[t, :16] += first.lora_b @ (first.lora_a @ x[t])
        expected[t, 24:] += last.lora_b @ (last.lora_a @ x[t])
    assert torch.allclose(y, expected, atol=1e-4)
    layer.set_slot(1, None)
    assert torch.allclose(layer(x, Ctx()), base(x))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="does not fit"):
        layer.set_slot(0, ProjectionDeltas((LoraPair(torch.zeros(RANK + 1, IN), torch.zeros(16, RANK + 1)), None,
                                            None)))


def test_fused_modules_on_the_batched_path() -> None:
    """Two slots, three modules, balanced decode-like rows: one shrink, three expands."""
    g = torch.Generator().manual_seed(5)
    sizes = (16, 8, 16)
    base = Linear(torch.randn(sum(sizes), IN, generator=g), prepack=False)
    layer = LoraLinear(base, sizes, num_slots=2, max_rank=RANK, dtype=torch.float32, device="cpu")
    pairs = {slot: tuple(LoraPair(torch.randn(r, IN, generator=g), torch.randn(out, r, generator=g))
                         for r, out in zip((RANK, 3, 5), sizes, strict=True)) for slot in (0, 1)}
    for slot, parts in pairs.items():
        layer.set_slot(slot, ProjectionDeltas(parts))
    slots = [0, 1, 1, 0, -1, 0, 1]
    x = torch.randn(len(slots), IN, generator=g)

    class Ctx:
        lora = LoraBatch.build(torch.tensor(slots))

    assert Ctx.lora is not None and Ctx.lora.batched
    expected = base(x)
    for t, slot in enumerate(slots):
        if slot >= 0:
            expected[t] += torch.cat([p.lora_b @ (p.lora_a @ x[t]) for p in pairs[slot]])
    assert torch.allclose(layer(x, Ctx()), expected, atol=1e-4)  # type: ignore[arg-type]
