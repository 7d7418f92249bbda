"""Multi-LoRA deltas for a mixed batch: ``y[t] += B[s] @ (A[s] @ x[t])`` for each token
``t`` whose adapter sits in slot ``s`` (tokens of the base model, slot -1, get nothing).

The slot weights are stacked per projection: ``lora_a [num_slots, rank, in]`` and
``lora_b [num_slots, out, rank]``, the adapter's scale already folded into ``lora_b`` and
unused rank rows zero, so one layout serves adapters of any rank up to ``rank``.

``LoraBatch`` is made once per step from the per-token slots: the step's adapter tokens,
sorted by slot (stably, so each segment keeps token order), cut into one segment per slot.
Every projection of the step reuses it. ``apply_lora`` is the torch reference: per
segment, one shrink and one expand matmul on a contiguous slice of the sorted rows, then
one ``index_add_`` back into ``y``. The Triton kernels (``lora_triton.py``) compute the same
shrink/expand over the same segments on CUDA (punica / S-LoRA's SGMV).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoraBatch:
    """The step's adapter tokens grouped by slot. Invariants: ``token_indices`` lists every
    token with a slot ≥ 0 exactly once, sorted by slot, token order kept within a slot;
    segment ``i`` is rows ``seg_starts[i] : seg_starts[i] + seg_lens[i]`` of that order and
    uses slot ``seg_slots[i]``; segments are in ascending slot order and none is empty."""

    token_indices: torch.Tensor  # [num_lora_tokens] int64: rows of x, grouped by slot
    seg_starts: tuple[int, ...]
    seg_lens: tuple[int, ...]
    seg_slots: tuple[int, ...]
    # The same three as int32 tensors on the step's device, for kernels (Triton's launch grid).
    seg_tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    max_seg_len: int

    @classmethod
    def build(cls, token_slots: torch.Tensor) -> LoraBatch | None:
        """From ``[num_tokens]`` slots (-1: base model). None when no token has an adapter."""
        on_adapter = token_slots >= 0
        if not bool(on_adapter.any()):
            return None
        rows = torch.nonzero(on_adapter).flatten()
        order = torch.sort(token_slots[rows], stable=True)
        slots, counts = torch.unique_consecutive(order.values, return_counts=True)
        seg_lens = tuple(int(c) for c in counts.tolist())
        seg_starts = tuple(int(s) for s in (torch.cumsum(counts, 0) - counts).tolist())
        seg_slots = tuple(int(s) for s in slots.tolist())
        device = token_slots.device
        tensors = tuple(torch.tensor(v, dtype=torch.int32, device=device) for v in (seg_starts, seg_lens, seg_slots))
        return cls(rows[order.indices], seg_starts, seg_lens, seg_slots, tensors, max(seg_lens))  # type: ignore[arg-type]


def apply_lora(y: torch.Tensor, x: torch.Tensor, batch: LoraBatch, lora_a: torch.Tensor, lora_b: torch.Tensor,
               active_slots: frozenset[int] | None = None) -> None:
    """``y += delta`` in place (torch reference). ``x [T, in]``, ``y [T, out]``.
    ``active_slots``: the slots whose adapter has weights for this projection (others are
    skipped: their delta is zero); None = all."""
    xs = x.index_select(0, batch.token_indices)
    deltas = torch.empty(xs.shape[0], y.shape[1], dtype=y.dtype, device=y.device)
    computed = []
    for start, length, slot in zip(batch.seg_starts, batch.seg_lens, batch.seg_slots, strict=True):
        if active_slots is not None and slot not in active_slots:
            continue
        shrunk = torch.mm(xs[start:start + length], lora_a[slot].t())
        torch.mm(shrunk, lora_b[slot].t(), out=deltas[start:start + length])
        computed.append((start, length))
    if len(computed) == len(batch.seg_starts):
        y.index_add_(0, batch.token_indices, deltas)
    else:
        for start, length in computed:
            y.index_add_(0, batch.token_indices[start:start + length], deltas[start:start + length])
