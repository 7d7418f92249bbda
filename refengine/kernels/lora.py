"""Multi-LoRA deltas for a mixed batch: ``y[t] += B[s] @ (A[s] @ x[t])`` for each token
``t`` whose adapter sits in slot ``s`` (tokens of the base model, slot -1, get nothing).

The slot weights are stacked per projection: ``lora_a [num_slots, rank, in]`` and
``lora_b [num_slots, out, rank]``, the adapter's scale already folded into ``lora_b`` and
unused rank rows zero, so one layout serves adapters of any rank up to ``rank``.

``LoraBatch`` is made once per step from the per-token slots: the step's adapter tokens,
sorted by slot (stably, so each segment keeps token order), cut into one segment per slot.
Every projection of the step reuses it. ``apply_lora`` is the torch reference, two ways:
when segments are about equally long (decode steps) every segment is padded to the longest
and one batched shrink and one batched expand (``bmm``) cover all of them; otherwise (a
long prefill chunk beside a few decodes) each segment gets its own shrink and expand matmul
on a contiguous slice of the sorted rows. Either way one ``index_add_`` adds the deltas
back into ``y``. Per-step Python work is per segment, never per token. The Triton kernels
(``lora_triton.py``) compute the same shrink/expand over the same segments on CUDA
(punica / S-LoRA's SGMV).
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
    # The padded layout of the batched path: ``padded_rows [num_segments * max_seg_len]``, rows
    # of x segment by segment, each segment padded to ``max_seg_len`` (with its own first row);
    # ``padded_positions [num_lora_tokens]``: where ``token_indices[i]``'s row is in it.
    padded_rows: torch.Tensor
    padded_positions: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.token_indices.numel())

    @property
    def batched(self) -> bool:
        """Whether padding every segment to the longest costs at most twice the real rows
        (decode steps): then two batched matmuls beat a pair of matmuls per segment."""
        return len(self.seg_lens) > 1 and len(self.seg_lens) * self.max_seg_len <= 2 * self.num_tokens

    @classmethod
    def build(cls, token_slots: torch.Tensor) -> LoraBatch | None:
        """From ``[num_tokens]`` slots (-1: base model). None when no token has an adapter."""
        on_adapter = token_slots >= 0
        if not bool(on_adapter.any()):
            return None
        rows = torch.nonzero(on_adapter).flatten()
        order = torch.sort(token_slots[rows], stable=True)
        token_indices = rows[order.indices]
        slots, counts = torch.unique_consecutive(order.values, return_counts=True)
        seg_lens = tuple(int(c) for c in counts.tolist())
        seg_starts = tuple(int(s) for s in (torch.cumsum(counts, 0) - counts).tolist())
        seg_slots = tuple(int(s) for s in slots.tolist())
        max_len, device = max(seg_lens), token_slots.device
        offsets = torch.arange(max_len, device=device)
        starts = torch.tensor(seg_starts, device=device)
        lens = torch.tensor(seg_lens, device=device)
        within = torch.where(offsets < lens[:, None], offsets, 0)  # padding repeats the segment's first row
        padded_rows = token_indices[(starts[:, None] + within).flatten()]
        segment_of = torch.repeat_interleave(torch.arange(len(seg_lens), device=device), lens)
        positions = segment_of * max_len + torch.arange(len(token_indices), device=device) - starts[segment_of]
        tensors = tuple(torch.tensor(v, dtype=torch.int32, device=device) for v in (seg_starts, seg_lens, seg_slots))
        return cls(token_indices, seg_starts, seg_lens, seg_slots, tensors, max_len,  # type: ignore[arg-type]
                   padded_rows, positions)


def _slot_weights(weights: torch.Tensor, seg_slots: tuple[int, ...]) -> torch.Tensor:
    """``weights[seg_slots]``: a view when the slots are consecutive, else a copy."""
    first = seg_slots[0]
    if seg_slots == tuple(range(first, first + len(seg_slots))):
        return weights[first:first + len(seg_slots)]
    return weights[torch.tensor(seg_slots, device=weights.device)]


def apply_lora(y: torch.Tensor, x: torch.Tensor, batch: LoraBatch, lora_a: torch.Tensor, lora_b: torch.Tensor,
               active_slots: frozenset[int] | None = None) -> None:
    """``y += delta`` in place (torch reference). ``x [T, in]``, ``y [T, out]`` (a column
    slice of a wider output is fine). ``active_slots``: the slots whose adapter has weights
    for this projection (others are skipped: their delta is zero); None = all."""
    segments = [i for i, slot in enumerate(batch.seg_slots) if active_slots is None or slot in active_slots]
    if not segments:
        return
    if batch.batched and len(segments) == len(batch.seg_slots):
        xs = x.index_select(0, batch.padded_rows).view(len(segments), batch.max_seg_len, -1)
        shrunk = torch.bmm(xs, _slot_weights(lora_a, batch.seg_slots).transpose(1, 2))
        deltas = torch.bmm(shrunk, _slot_weights(lora_b, batch.seg_slots).transpose(1, 2))
        y.index_add_(0, batch.token_indices, deltas.view(-1, y.shape[1]).index_select(0, batch.padded_positions))
        return
    xs = x.index_select(0, batch.token_indices)
    deltas = torch.empty(xs.shape[0], y.shape[1], dtype=y.dtype, device=y.device)
    for i in segments:
        start, end, slot = batch.seg_starts[i], batch.seg_starts[i] + batch.seg_lens[i], batch.seg_slots[i]
        torch.mm(torch.mm(xs[start:end], lora_a[slot].t()), lora_b[slot].t(), out=deltas[start:end])
    if len(segments) == len(batch.seg_slots):
        y.index_add_(0, batch.token_indices, deltas)
        return
    for i in segments:
        start, end = batch.seg_starts[i], batch.seg_starts[i] + batch.seg_lens[i]
        y.index_add_(0, batch.token_indices[start:end], deltas[start:end])
