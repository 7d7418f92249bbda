"""A time budget per token for a guide's matching, so one request's grammar cannot stall the step.

The matchers run on the step thread: every row of the batch waits while one of them computes its
mask. Some specs compile at once and then grow costly token by token (xgrammar on the 30-byte
regex ``((a{0,30}){0,30}){0,30}a{60}``: 2 ms at the 4th token, 0.6 s at the 20th, 6 s at the
33rd). A matcher whose mask and acceptance for one token together take longer than
``max_token_seconds`` (``--guided-max-token-seconds``) goes no further: its next acceptance is
refused with an error naming the budget, and the engine fails that request alone, as for any
grammar limit (INVALID_ARGUMENT, not retryable: the spec is what costs too much).
"""

from __future__ import annotations

import time

import torch

from refengine.sampling.guided.base import CompiledGuide, GuideMatcher


class BudgetedMatcher(GuideMatcher):
    """``matcher`` with its per-token matching time bounded by ``max_token_seconds``."""

    def __init__(self, matcher: GuideMatcher, max_token_seconds: float) -> None:
        self._matcher = matcher
        self._max_token_seconds = max_token_seconds
        self._token_seconds = 0.0  # this token's matching so far: its mask, then its acceptance
        self._over = ""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        start = time.perf_counter()
        self._matcher.fill_bitmask(bitmask, row)
        self._spent(time.perf_counter() - start)

    def accept_token(self, token_id: int) -> bool:
        if self._over:
            return False
        start = time.perf_counter()
        accepted = self._matcher.accept_token(token_id)
        self._spent(time.perf_counter() - start)
        self._token_seconds = 0.0
        return accepted and not self._over

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def error(self) -> str:
        return self._over or self._matcher.error()

    def _spent(self, seconds: float) -> None:
        self._token_seconds += seconds
        if self._token_seconds > self._max_token_seconds and not self._over:
            self._over = (f"matching one token took {self._token_seconds:.3g} s, over the "
                          f"{self._max_token_seconds:g} s budget (--guided-max-token-seconds): simplify the spec")


class BudgetedGuide(CompiledGuide):
    """``compiled``, whose matchers keep to ``max_token_seconds`` a token."""

    def __init__(self, compiled: CompiledGuide, max_token_seconds: float) -> None:
        self._compiled = compiled
        self._max_token_seconds = max_token_seconds

    def new_matcher(self) -> GuideMatcher:
        return BudgetedMatcher(self._compiled.new_matcher(), self._max_token_seconds)

    @property
    def memory_bytes(self) -> int:
        return self._compiled.memory_bytes
