"""Multi-LoRA deltas for a mixed batch: ``y[t] += B[s] @ (A[s] @ x[t])`` for each token
``t`` whose adapter sits in slot ``s`` (tokens of the base model, slot -1, get nothing).

The slot weights are stacked per projection: ``lora_a [num_slots, rank, in]`` and
``lora_b [num_slots, out, rank]``, the adapter's scale already folded into ``lora_b`` and
unused rank rows zero, so one layout serves adapters of any rank up to ``rank``.

``LoraBatch`` is made once per step from the per-token slots: the step's adapter tokens,
sorted by slot (stably, so each segment keeps token order), cut into one segment per slot.
Every projection of the step reuses it. ``apply_lora_parts`` is the torch reference, two ways:
when segments are about equally long (decode steps) every segment is padded to the longest
and one batched shrink and one batched expand (``bmm``) cover all of them; otherwise (a
long prefill chunk beside a few decodes) each segment gets its own shrink and expand matmul
on a contiguous slice of the sorted rows. Either way one ``index_add_`` adds the deltas
back into ``y``. Per-step Python work is per segment, never per token. The Triton kernels
(``lora_triton.py``) compute the same shrink/expand over the same segments on CUDA
(punica / S-LoRA's SGMV).
"""

from __future__ import annotations

import functools
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
    # When every segment's tokens are consecutive rows of x (the engine orders a step's
    # sequences by adapter), the first row of each segment: slices replace the gather and
    # the scatter. None otherwise.
    seg_rows: tuple[int, ...] | None = None
    # ``(first, end)`` when ``seg_slots`` is ``first, first + 1, … end - 1``, else None.
    slot_range: tuple[int, int] | None = None

    @property
    def stacked(self) -> bool:
        """Consecutive, equally long segments back to back: x's rows view as ``[segments, len, in]``."""
        rows, length = self.seg_rows, self.max_seg_len
        return rows is not None and all(n == length for n in self.seg_lens) \
            and rows == tuple(range(rows[0], rows[0] + length * len(rows), length))

    @property
    def num_tokens(self) -> int:
        return int(self.token_indices.numel())

    @functools.cached_property
    def token_slots(self) -> torch.Tensor:
        """``[num_lora_tokens]`` int32: the slot of each token of ``token_indices`` (native kernel)."""
        return torch.repeat_interleave(torch.tensor(self.seg_slots, dtype=torch.int32),
                                       torch.tensor(self.seg_lens)).to(self.token_indices.device)

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
        steps = token_indices[1:] - token_indices[:-1]
        steps[starts[1:] - 1] = 1  # a segment may start anywhere after the one before
        seg_rows = tuple(int(r) for r in token_indices[starts].tolist()) if bool((steps == 1).all()) else None
        consecutive = seg_slots == tuple(range(seg_slots[0], seg_slots[0] + len(seg_slots)))
        return cls(token_indices, seg_starts, seg_lens, seg_slots, tensors, max_len,  # type: ignore[arg-type]
                   padded_rows, positions, seg_rows, (seg_slots[0], seg_slots[-1] + 1) if consecutive else None)


def _slot_weights(weights: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
    """``weights[seg_slots]``: a view when the slots are consecutive, else a copy."""
    if batch.slot_range is not None:
        return weights[batch.slot_range[0]:batch.slot_range[1]]
    return weights[batch.seg_tensors[2].long()]


def apply_lora_parts(y: torch.Tensor, x: torch.Tensor, batch: LoraBatch, lora_a: torch.Tensor,
                     lora_b_parts: tuple[torch.Tensor, ...], active_slots: frozenset[int] | None = None) -> None:
    """``y += delta`` for a fused projection of modules ``p`` (q, k, v): ``lora_a [slots, P *
    rank, in]`` stacks their A matrices along the rank axis (module p: rows ``p * rank …``),
    ``lora_b_parts[p] [slots, out_p, rank]``, and module p's delta lands in ``y``'s columns
    after the modules before it. One gather of ``x``, one shrink for all modules, one expand
    per module, one scatter. Segments on slots outside ``active_slots`` are skipped (the
    batched path is taken only when none is)."""
    segments = [i for i, slot in enumerate(batch.seg_slots) if active_slots is None or slot in active_slots]
    if not segments:
        return
    rank = lora_b_parts[0].shape[2]
    offsets = [0]
    for lora_b in lora_b_parts:
        offsets.append(offsets[-1] + lora_b.shape[1])
    if batch.seg_rows is not None:  # measured faster than padding, whatever the segments' lengths
        _apply_in_place(y, x, batch, lora_a, lora_b_parts, segments, rank, offsets)
        return
    if batch.batched and len(segments) == len(batch.seg_slots):
        count, length = len(batch.seg_slots), batch.max_seg_len
        xs = x.index_select(0, batch.padded_rows).view(count, length, -1)
        shrunk = torch.bmm(xs, _slot_weights(lora_a, batch).transpose(1, 2))
        deltas = torch.empty(count, length, offsets[-1], dtype=y.dtype, device=y.device)
        for p, lora_b in enumerate(lora_b_parts):
            torch.bmm(shrunk[..., p * rank:(p + 1) * rank], _slot_weights(lora_b, batch).transpose(1, 2),
                      out=deltas[..., offsets[p]:offsets[p + 1]])
        y.index_add_(0, batch.token_indices, deltas.view(-1, offsets[-1]).index_select(0, batch.padded_positions))
        return
    xs = x.index_select(0, batch.token_indices)
    deltas = torch.zeros(xs.shape[0], offsets[-1], dtype=y.dtype, device=y.device)
    for i in segments:
        start, end, slot = batch.seg_starts[i], batch.seg_starts[i] + batch.seg_lens[i], batch.seg_slots[i]
        shrunk = torch.mm(xs[start:end], lora_a[slot].t())
        for p, lora_b in enumerate(lora_b_parts):
            deltas[start:end, offsets[p]:offsets[p + 1]] = torch.mm(shrunk[:, p * rank:(p + 1) * rank],
                                                                    lora_b[slot].t())
    y.index_add_(0, batch.token_indices, deltas)


def _apply_in_place(y: torch.Tensor, x: torch.Tensor, batch: LoraBatch, lora_a: torch.Tensor,
                    lora_b_parts: tuple[torch.Tensor, ...], segments: list[int], rank: int, offsets: list[int]) -> None:
    """Segments on consecutive rows: slices of ``x`` and ``y``, no gather or scatter."""
    assert batch.seg_rows is not None
    if batch.stacked and len(segments) == len(batch.seg_slots):
        first, length, count = batch.seg_rows[0], batch.max_seg_len, len(batch.seg_slots)
        xs = x[first:first + length * count].view(count, length, -1)
        shrunk = torch.bmm(xs, _slot_weights(lora_a, batch).transpose(1, 2))
        ys = y[first:first + length * count]
        for p, lora_b in enumerate(lora_b_parts):
            columns = ys[:, offsets[p]:offsets[p + 1]].unflatten(0, (count, length))
            columns.baddbmm_(shrunk[..., p * rank:(p + 1) * rank], _slot_weights(lora_b, batch).transpose(1, 2))
        return
    for i in segments:
        row, length, slot = batch.seg_rows[i], batch.seg_lens[i], batch.seg_slots[i]
        shrunk = torch.mm(x[row:row + length], lora_a[slot].t())
        for p, lora_b in enumerate(lora_b_parts):
            y[row:row + length, offsets[p]:offsets[p + 1]].addmm_(shrunk[:, p * rank:(p + 1) * rank], lora_b[slot].t())
