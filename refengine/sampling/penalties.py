"""Repetition, frequency and presence penalties, batched over the rows of a logits tensor.

Two families, applied in this order (the order the sampler documents):

1. Repetition penalty (HF / vLLM / CTRL style), over the tokens of the prompt *and* the
   output so far, each token at most once: a positive logit is divided by the penalty,
   a negative one multiplied. ``repetition_penalty`` 1.0 is off.
2. Frequency and presence penalties (OpenAI style), over the *output* tokens only:
   ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``. 0.0 is off.

Invariants:
- Only rows that use a penalty are touched; a row without penalties is returned bit for bit
  unchanged, and a call where no row uses one returns the input tensor itself.
- Every operation is elementwise within a row (no reduction across rows or within a row), so
  a row's result does not depend on which other rows are in the batch (RULES G17, G18).
- The input tensor is never modified in place.
- A penalized logit stays within ``LOGIT_LIMIT`` (or -inf where it was -inf: a grammar-masked
  token stays masked). Any finite penalty and any positive repetition penalty is valid (RULES
  G5), and the extreme ones (a repetition penalty of 1e-300, a presence penalty of -1e39)
  overflow float32: such a logit saturates instead of becoming inf, whose softmax would be NaN
  (a NaN logprob, or a sampled id outside the vocabulary). The limit leaves room for the
  sampler's smallest temperature, so the step needs no second pass after tempering. Values
  that do not reach it are computed exactly as before (bit-identical to Hugging Face's processors).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import torch

from refengine.types import SamplingParams

_FLOAT32_MAX = torch.finfo(torch.float32).max
_FLOAT32_TINY = torch.finfo(torch.float32).tiny  # the smallest positive normal float32
#: The largest magnitude of a penalized logit: still finite in float32 once divided by the
#: sampler's smallest temperature (``sampler.MIN_TEMPERATURE``, 1e-6).
LOGIT_LIMIT = _FLOAT32_MAX * 1e-7  # a margin of 10 over float32 rounding


def unique_token_counts(
    token_lists: Sequence[Sequence[int]], rows: Sequence[int], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse token counts: ``(row, token, count)`` for every distinct token of each list, where
    list ``j`` belongs to logits row ``rows[j]``. One ``torch.unique`` over ``row * V + token``
    keys, so the cost is O(history), not O(rows x V)."""
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.long)
    row_ids = torch.repeat_interleave(torch.tensor(list(rows), dtype=torch.long), lengths)
    tokens = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.long)
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise ValueError(f"token id out of range [0, {vocab_size}) in penalty history")
    keys, counts = torch.unique(row_ids * vocab_size + tokens, return_counts=True)
    return (keys // vocab_size).to(device), (keys % vocab_size).to(device), counts.to(device)


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Penalized copy of ``logits`` ``[n, V]`` (float32); row ``i`` uses ``params[i]`` and its
    token history. Returns ``logits`` itself when no row has a penalty.

    Only the logits of tokens in a row's history are read and written (gather, compute,
    scatter), so the cost is O(history length), independent of V; each distinct token is
    penalized once, however often it occurs.
    """
    n, vocab_size = logits.shape
    if not (len(params) == len(prompt_token_ids) == len(output_token_ids) == n):
        raise ValueError("apply_penalties: one params/prompt/output entry per logits row")
    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    freq_rows = [i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
    if not rep_rows and not freq_rows:
        return logits
    device = logits.device
    logits = logits.clone()

    if rep_rows:
        histories = [list(prompt_token_ids[i]) + list(output_token_ids[i]) for i in rep_rows]
        row, token, _ = unique_token_counts(histories, rep_rows, vocab_size, device)
        # Held in float32's positive range: 1e-300 would round to 0, and 0 / 0 is NaN.
        penalty = torch.tensor([p.repetition_penalty for p in params], device=device)[row]
        penalty = penalty.clamp(_FLOAT32_TINY, _FLOAT32_MAX)
        seen = logits[row, token]
        logits[row, token] = _saturate(torch.where(seen < 0, seen * penalty, seen / penalty), seen)

    if freq_rows:
        outputs = [output_token_ids[i] for i in freq_rows]
        row, token, count = unique_token_counts(outputs, freq_rows, vocab_size, device)
        # Held finite, so freq * count + presence is never inf - inf (NaN).
        # In float64, then held finite: clamping each term first could cancel two opposite
        # penalties (1e39 * 1 - 1.5e39 became 3.4e38 - 3.4e38 = 0), and float32's inf - inf is NaN.
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float64, device=device)[row]
        presence = torch.tensor([p.presence_penalty for p in params], dtype=torch.float64, device=device)[row]
        seen = logits[row, token]
        delta = (freq * count + presence).clamp(-_FLOAT32_MAX, _FLOAT32_MAX).to(logits.dtype)
        logits[row, token] = _saturate(seen - delta, seen)  # count > 0 for every listed token

    return logits


def _saturate(penalized: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """``penalized`` held within ``LOGIT_LIMIT``, except where ``seen`` was not finite, which it
    stays: -inf (-inf - (-inf) would be NaN, and a masked token must stay masked), and the
    model's +inf or NaN, which the sampler must see to fail the row (a penalty hid them)."""
    return torch.where(torch.isfinite(seen), penalized.clamp(-LOGIT_LIMIT, LOGIT_LIMIT), seen)
