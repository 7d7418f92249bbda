"""One guide cannot stall the batch (``sampling/guided/budget.py``): a matcher whose work on one
token (mask, then acceptance) exceeds ``GuidedConfig.max_token_seconds`` fails its own request,
INVALID_ARGUMENT naming the budget; the other requests in the batch run on unharmed."""

from __future__ import annotations

import time

import torch

from refengine.config import GuidedConfig
from refengine.sampling.guided.base import GuideMatcher
from refengine.sampling.guided.budget import BudgetedMatcher
from refengine.types import GuidedSpec
from tests.unit.test_guided_engine import assert_idle, make_engine, prompt, request, tiny  # noqa: F401


class SlowMatcher(GuideMatcher):
    """Accepts everything; its masks take ``mask_seconds[i]`` for the i-th token."""

    def __init__(self, mask_seconds: list[float]) -> None:
        self.mask_seconds = mask_seconds
        self.accepted: list[int] = []

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        time.sleep(self.mask_seconds[len(self.accepted)])

    def accept_token(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return True

    def is_terminated(self) -> bool:
        return False


def test_the_token_over_the_budget_is_refused_with_the_reason() -> None:
    inner = SlowMatcher([0.0, 0.0, 0.06, 0.0])
    matcher = BudgetedMatcher(inner, max_token_seconds=0.03)
    mask = torch.zeros(1, 1, dtype=torch.int32)
    for token_id in (5, 6):
        matcher.fill_bitmask(mask, 0)
        assert matcher.accept_token(token_id) and matcher.error() == ""
    matcher.fill_bitmask(mask, 0)
    assert not matcher.accept_token(7)
    assert "over the 0.03 s budget (--guided-max-token-seconds)" in matcher.error()
    assert not matcher.accept_token(8) and inner.accepted == [5, 6]


def test_a_guide_that_grows_costly_fails_alone(tiny) -> None:  # noqa: F811
    """xgrammar on this 30-byte regex: each token's mask costs more than the last (2 ms at the
    4th, 0.6 s at the 20th, 6 s at the 33rd on the 2-core VM); the unguided request beside it
    waited through every one of those steps."""
    engine = make_engine(tiny, guided=GuidedConfig(max_token_seconds=0.02))
    costly = GuidedSpec("regex", "((a{0,30}){0,30}){0,30}a{60}", backend="xgrammar")
    guided, plain = engine.run_until_done([request("costly", costly, prompt(1, 5), max_tokens=48),
                                           request("plain", None, prompt(2, 5), max_tokens=48)])
    assert guided.error is not None and guided.error.code == "invalid_argument" and not guided.error.retryable
    assert "--guided-max-token-seconds" in guided.error.message
    assert 0 < len(guided.outputs[0].tokens) < 40, "it failed mid-way, at the token over the budget"
    assert plain.error is None and len(plain.outputs[0].tokens) == 48
    assert_idle(engine)
