"""One-row and mask views of the batched sampling functions, for tests that check them
against direct computations."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from refengine.sampling.logprobs import LogprobInfo, batch_logprob_info
from refengine.sampling.truncation import truncation_thresholds
from refengine.types import CandidateSpec, SamplingParams


def token_logprob_info(
    logprobs: torch.Tensor, token_id: int, want_logprob: bool, candidates: CandidateSpec | None
) -> LogprobInfo:
    """``(logprob, rank, candidates)`` of ``token_id`` in one row ``logprobs`` ``[V]``."""
    return batch_logprob_info(logprobs[None, :], [token_id], [want_logprob], [candidates])[0]


def truncation_mask(logits: torch.Tensor, probs: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor | None:
    """Bool ``[n, V]``: the tokens each row may sample after top-k, top-p and min-p, or
    ``None`` when no row truncates."""
    thresholds = truncation_thresholds(logits, probs, params)
    if thresholds is None:
        return None
    cut, floor = thresholds
    return (logits >= cut[:, None]) & (probs >= floor[:, None])
