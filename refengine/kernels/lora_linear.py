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
from refengine.kernels.lora import apply_lora_parts
from refengine.kernels.lora_native import apply_lora_native, fits, native_lora_available

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
    """Slot buffers for the modules fused into one projection (``part_sizes``: their output
    sizes, in order): ``lora_a [num_slots, P * max_rank, in]``, module p's A in rows
    ``p * max_rank …`` (they share the input), and ``lora_b[p] [num_slots, out_p, max_rank]``,
    so each module's delta lands in its own columns and nothing is stored for the zeros
    between modules. Invariant: a slot not in ``active_slots`` holds zeros only."""

    def __init__(self, base: Linear, part_sizes: tuple[int, ...], num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: str, native: bool = True) -> None:
        """``native``: ``KernelConfig.native_cpu_kernels`` (float32 on CPU takes ``lora_native``)."""
        assert sum(part_sizes) == base.out_features, (part_sizes, base.out_features)
        self.base = base
        self.max_rank = max_rank
        self.part_sizes = part_sizes
        # Stored transposed (``[slots, in, rank]``, ``[slots, rank, out]``) and used through
        # transposed views: the matmuls then read both operands contiguously.
        self.lora_a = torch.zeros(num_slots, base.in_features, len(part_sizes) * max_rank, dtype=dtype,
                                  device=device).transpose(1, 2)
        self.lora_b = tuple(torch.zeros(num_slots, max_rank, out, dtype=dtype, device=device).transpose(1, 2)
                            for out in part_sizes)
        self.active_slots: frozenset[int] = frozenset()  # slots whose adapter targets any of the modules
        self._active = torch.zeros(num_slots, dtype=torch.uint8)  # the same, per slot, for the native kernel
        self._native = native and native_lora_available(native) and fits(
            torch.empty(1, base.out_features, dtype=dtype, device=device),
            torch.empty(1, base.in_features, dtype=dtype, device=device), self.lora_a, self.lora_b)
        self._offsets = [sum(part_sizes[:p]) for p in range(len(part_sizes))]
        self._triton = None
        if torch.device(device).type == "cuda":
            from refengine.kernels.lora_triton import apply_lora_triton, triton_available
            self._triton = apply_lora_triton if triton_available() else None

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
            if pair is not None and (pair.lora_a.shape[0] > self.max_rank or pair.lora_a.shape[1] != self.in_features
                                     or pair.lora_b.shape != (self.part_sizes[p], pair.lora_a.shape[0])):
                raise ValueError(f"LoRA delta A {tuple(pair.lora_a.shape)} / B {tuple(pair.lora_b.shape)} does not fit "
                                 f"a rank-{self.max_rank} slot of a {self.in_features}->{self.part_sizes[p]} module")
        self.lora_a[slot].zero_()
        for p, pair in enumerate(parts):
            self.lora_b[p][slot].zero_()
            if pair is not None:
                rank, first = pair.lora_a.shape[0], p * self.max_rank
                self.lora_a[slot, first:first + rank].copy_(pair.lora_a)
                self.lora_b[p][slot, :, :rank].copy_(pair.lora_b)
        targeted = any(pair is not None for pair in parts)
        self.active_slots = self.active_slots | {slot} if targeted else self.active_slots - {slot}
        self._active[slot] = int(targeted)

    def __call__(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        y = self.base(x)
        batch = None if ctx is None else ctx.lora
        if batch is None or not self.active_slots:
            return y
        # Every step, however long: the kernel computes each token alone, so a token's delta does
        # not depend on the step's shape (G18). The torch matmuls round by it; for steps over 256
        # tokens they were 0-24 % faster per projection (with the base GEMM), and broke G18.
        if self._native and x.stride(1) == 1:
            apply_lora_native(y, x, batch, self.lora_a, self.lora_b, self._active)
            return y
        if self._triton is None:
            apply_lora_parts(y, x, batch, self.lora_a, self.lora_b, self.active_slots)
            return y
        for p, out in enumerate(self.part_sizes):  # CUDA: the Triton kernels, one module at a time
            first = p * self.max_rank
            self._triton(y[:, self._offsets[p]:self._offsets[p] + out], x, batch,
                         self.lora_a[:, first:first + self.max_rank], self.lora_b[p], self.active_slots)
        return y
