"""Truncation thresholds (sampler step 4): top-k, then top-p renormalized over the top-k
set, then min-p, as one ``(cut, floor)`` pair per row so the sampler applies them in one pass.

Every reduction here is batch-invariant on CPU (RULES G17, G18): ``topk``, integer counts and
sequential ``cumsum``, never a float ``.sum()`` that may split a row across threads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from refengine.types import SamplingParams

TOP_P_PREFIX = 256  # top-p first looks for its cut among this many most likely tokens, then 8x more


def _top_k(params: SamplingParams, vocab_size: int) -> int:
    """Effective k: ``vocab_size`` when top-k is off (0, -1) or k >= V."""
    return params.top_k if 0 < params.top_k < vocab_size else vocab_size


def truncation_cutoffs(
    logits: torch.Tensor, probs: torch.Tensor, top_ks: Sequence[int], top_ps: Sequence[float]
) -> torch.Tensor:
    """Per row, the smallest logit kept by top-k then top-p: the row keeps ``logits >= cut``.

    ``logits`` ``[t, V]`` are tempered, ``probs = softmax(logits)``; ``top_ks[i]`` is the
    effective k (``V`` = off), ``top_ps[i]`` 1.0 = off. The cut is searched on the
    ``K`` most likely tokens (``topk``), ``K`` growing 8x for the rows whose top-p cut lies
    beyond the prefix, so a full-vocabulary sort happens only for very flat rows.
    """
    t, vocab_size = logits.shape
    device = logits.device
    cut = torch.full((t,), float("-inf"), device=device)
    pending = list(range(t))
    needed = [k for k in top_ks if k < vocab_size] + [TOP_P_PREFIX for p in top_ps if p < 1.0]
    size = min(vocab_size, max(needed))
    while pending:
        index = torch.tensor(pending, device=device)
        rows = logits if len(pending) == t else logits[index]
        values, ids = torch.topk(rows, size, dim=-1)
        ks = torch.tensor([min(top_ks[i], size) for i in pending], device=device)
        has_k = torch.tensor([top_ks[i] < vocab_size for i in pending], device=device)
        k_cut = torch.where(has_k, values.gather(1, (ks - 1)[:, None])[:, 0], float("-inf"))
        top_p = torch.tensor([top_ps[i] for i in pending], device=device)
        sorted_probs = probs[index[:, None], ids]
        cum = torch.cumsum(sorted_probs, -1)  # sequential on CPU: the same prefix sums whatever the size
        before = cum.roll(1, -1)  # mass strictly before each token
        before[:, 0] = 0.0
        # top-p is renormalized over the top-k set: its mass is the cumsum at the set's last
        # prefix entry, or (ties of the k-th value running past the prefix) a full-row cumsum.
        # Never a float .sum(): that may split a row across threads and round batch-dependently.
        n_in_k = (values >= k_cut[:, None]).sum(-1)
        mass = torch.where(has_k, cum.gather(1, (n_in_k - 1)[:, None])[:, 0], 1.0)
        spill = [
            j
            for j, (i, n) in enumerate(zip(pending, n_in_k.tolist(), strict=True))
            if top_ks[i] < vocab_size and top_ps[i] < 1.0 and n == size < vocab_size
        ]
        if spill:
            b = torch.tensor(spill, device=device)
            in_top_k = rows[b] >= k_cut[b, None]
            mass[b] = torch.where(in_top_k, probs[index[b]], 0.0).cumsum(-1)[:, -1]
        kept = (before < (top_p * mass)[:, None]) & (values >= k_cut[:, None])
        # Never fewer than one token: the first has 0 mass before it, but a top_p so small that
        # ``top_p * mass`` rounds to 0 in float32 (1e-300 does) would otherwise keep none.
        n_kept = kept.sum(-1).clamp_min(1)
        p_cut = values.gather(1, (n_kept - 1)[:, None])[:, 0]
        row_cut = torch.maximum(k_cut, torch.where(top_p < 1.0, p_cut, float("-inf")))
        # Exact once the cut is inside the prefix; with top-k on it always is (size >= k, and
        # a fully kept prefix then ends on the k-th value, whose ties the threshold keeps).
        done = (n_kept < size) | has_k | (top_p >= 1.0) | (size == vocab_size)
        cut[index[done]] = row_cut[done]
        pending = [i for i, d in zip(pending, done.tolist(), strict=True) if not d]
        size = min(vocab_size, size * 8)
    return cut


def truncation_thresholds(
    logits: torch.Tensor, probs: torch.Tensor, params: Sequence[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per-row ``(cut, floor)``: a row keeps the tokens with ``logits >= cut`` (top-k, top-p)
    and ``probs >= floor`` (min-p); ``None`` when no row truncates. ``logits`` ``[n, V]`` are
    tempered, ``probs = softmax(logits)``. Thresholds, not masks: applying them is one fused
    pass over the batch, with no per-subset copies."""
    n, vocab_size = logits.shape
    trunc = [i for i, p in enumerate(params) if _top_k(p, vocab_size) < vocab_size or p.top_p < 1.0]
    min_p = [p.min_p for p in params]
    if not trunc and not any(m > 0.0 for m in min_p):
        return None
    cut = torch.full((n,), float("-inf"), device=logits.device)
    if trunc:
        index = torch.tensor(trunc, device=logits.device)
        cut[index] = truncation_cutoffs(
            logits if len(trunc) == n else logits[index],
            probs if len(trunc) == n else probs[index],
            [_top_k(params[i], vocab_size) for i in trunc],
            [params[i].top_p for i in trunc],
        )
    # min-p: p < min_p * p_max is dropped. p_max is kept by top-k/top-p, so the ratio to it is
    # the same before or after renormalizing over their kept set.
    floor = torch.tensor(min_p, device=logits.device) * probs.amax(-1)
    return cut, floor
