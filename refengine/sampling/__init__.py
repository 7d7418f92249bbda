"""Batched sampling: penalties, truncation, seeded draws, logprobs and candidates."""

from refengine.sampling.logprobs import (
    CandidateTuple,
    LogprobInfo,
    batch_logprob_info,
    prompt_logprobs,
)
from refengine.sampling.penalties import apply_penalties
from refengine.sampling.sampler import SampledToken, Sampler, SamplingRow

__all__ = [
    "CandidateTuple",
    "LogprobInfo",
    "SampledToken",
    "Sampler",
    "SamplingRow",
    "apply_penalties",
    "batch_logprob_info",
    "prompt_logprobs",
]
