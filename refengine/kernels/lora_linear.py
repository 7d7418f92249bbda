"""``LoraLinear``: a projection plus the deltas of the adapters resident in its slots.

Each slot holds one adapter's ``(A, B)`` for this projection, zero-padded to the slot
rank (``max_lora_rank`` times the number of projections fused into this one), ``B``
pre-scaled. A step's ``ForwardContext.lora`` (a ``LoraBatch``) says which rows use which
slot; rows of the base model (and slots whose adapter does not target this projection)
get no delta, and a step with no adapter token costs nothing beyond the base projection.
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
class ProjectionDeltas:
    """One adapter's delta for one fused projection: ``y += x @ lora_a.T @ lora_b.T``."""

    lora_a: torch.Tensor  # [rank, in]
    lora_b: torch.Tensor  # [out, rank], the adapter's scale folded in


class LoraLinear:
    def __init__(self, base: Linear, num_slots: int, max_rank: int, dtype: torch.dtype, device: str) -> None:
        self.base = base
        self.lora_a = torch.zeros(num_slots, max_rank, base.in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(num_slots, base.out_features, max_rank, dtype=dtype, device=device)
        self.active_slots: frozenset[int] = frozenset()  # slots whose adapter targets this projection
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
        """Put an adapter's delta in ``slot`` (None: its adapter does not target this projection)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if deltas is None:
            self.active_slots = self.active_slots - {slot}
            return
        rank = deltas.lora_a.shape[0]
        if rank > self.lora_a.shape[1] or deltas.lora_b.shape[0] != self.out_features \
                or deltas.lora_a.shape[1] != self.in_features:
            raise ValueError(f"LoRA delta A {tuple(deltas.lora_a.shape)} / B {tuple(deltas.lora_b.shape)} does not "
                             f"fit a slot of rank {self.lora_a.shape[1]} on a {self.in_features}->"
                             f"{self.out_features} projection")
        self.lora_a[slot, :rank].copy_(deltas.lora_a)
        self.lora_b[slot, :, :rank].copy_(deltas.lora_b)
        self.active_slots = self.active_slots | {slot}

    def __call__(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        y = self.base(x)
        batch = None if ctx is None else ctx.lora
        if batch is not None and self.active_slots:
            self._apply(y, x, batch, self.lora_a, self.lora_b, self.active_slots)
        return y
