"""``LoraLinear``: a projection plus the deltas of the adapters resident in its slots.

Each slot holds one adapter's ``(A, B)`` for each module fused into this projection
(q, k, v; gate, up), zero-padded to ``max_lora_rank``, ``B`` pre-scaled. A step's
``ForwardContext.lora`` (a ``LoraBatch``) says which rows use which slot; rows of the base
model (and slots whose adapter does not target a module) get no delta, and a step with no
adapter token costs nothing beyond the base projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refengine.kernels.forward_context import ForwardContext
from refengine.kernels.linear import Linear
from refengine.kernels.lora import apply_lora

#: The model's fused projections, and the PEFT modules (``<letter>_proj``) each fuses, in
#: the order of its output rows.
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q", "k", "v"), "o_proj": ("o",), "gate_up_proj": ("gate", "up"), "down_proj": ("down",)}


@dataclass(frozen=True)
class LoraPair:
    """One adapter's delta for one module: ``y += x @ lora_a.T @ lora_b.T``."""

    lora_a: torch.Tensor  # [rank, in]
    lora_b: torch.Tensor  # [out, rank], the adapter's scale folded in


@dataclass(frozen=True)
class ProjectionDeltas:
    """One adapter's deltas for one fused projection: per fused module, in output order, its
    pair or None (the adapter does not target that module)."""

    parts: tuple[LoraPair | None, ...]


class LoraLinear:
    """Slot buffers per fused module (``part_sizes``: the modules' output sizes, in order):
    ``lora_a[p] [num_slots, max_rank, in]`` and ``lora_b[p] [num_slots, out_p, max_rank]``,
    so each module's delta lands in its own columns of the fused output and nothing is stored
    for the zeros between modules."""

    def __init__(self, base: Linear, part_sizes: tuple[int, ...], num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: str) -> None:
        assert sum(part_sizes) == base.out_features, (part_sizes, base.out_features)
        self.base = base
        self.max_rank = max_rank
        self.part_sizes = part_sizes
        self.lora_a = [torch.zeros(num_slots, max_rank, base.in_features, dtype=dtype, device=device)
                       for _ in part_sizes]
        self.lora_b = [torch.zeros(num_slots, out, max_rank, dtype=dtype, device=device) for out in part_sizes]
        self.active_slots: list[frozenset[int]] = [frozenset() for _ in part_sizes]  # per part
        self._offsets = [sum(part_sizes[:p]) for p in range(len(part_sizes))]
        self._apply = apply_lora
        if torch.device(device).type == "cuda":
            from refengine.kernels.lora_triton import apply_lora_triton, triton_available
            if triton_available():
                self._apply = apply_lora_triton

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def set_slot(self, slot: int, deltas: ProjectionDeltas | None) -> None:
        """Put an adapter's deltas in ``slot`` (None: the adapter does not target this projection)."""
        parts = deltas.parts if deltas is not None else (None,) * len(self.part_sizes)
        if len(parts) != len(self.part_sizes):
            raise ValueError(f"LoRA deltas for {len(parts)} modules on a projection fusing {len(self.part_sizes)}")
        for p, pair in enumerate(parts):
            self.lora_a[p][slot].zero_()
            self.lora_b[p][slot].zero_()
            self.active_slots[p] = self.active_slots[p] - {slot}
            if pair is None:
                continue
            rank = pair.lora_a.shape[0]
            if rank > self.max_rank or pair.lora_a.shape[1] != self.in_features \
                    or pair.lora_b.shape != (self.part_sizes[p], rank):
                raise ValueError(f"LoRA delta A {tuple(pair.lora_a.shape)} / B {tuple(pair.lora_b.shape)} does not fit "
                                 f"a rank-{self.max_rank} slot of a {self.in_features}->{self.part_sizes[p]} module")
            self.lora_a[p][slot, :rank].copy_(pair.lora_a)
            self.lora_b[p][slot, :, :rank].copy_(pair.lora_b)
            self.active_slots[p] = self.active_slots[p] | {slot}

    def __call__(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        y = self.base(x)
        batch = None if ctx is None else ctx.lora
        if batch is None:
            return y
        for p, active in enumerate(self.active_slots):
            if active:
                columns = y[:, self._offsets[p]:self._offsets[p] + self.part_sizes[p]]
                self._apply(columns, x, batch, self.lora_a[p], self.lora_b[p], active)
        return y
