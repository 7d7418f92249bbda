"""Logprobs, ranks and candidates against an oracle built by plain sorting in Python."""

from __future__ import annotations

import math

import pytest
import torch

from refengine.sampling.logprobs import (
    PROMPT_CHUNK_POSITIONS,
    batch_logprob_info,
    prompt_logprobs,
)
from refengine.types import CandidateSpec
from tests.unit.sampling_helpers import token_logprob_info


def _oracle(lp: list[float]) -> list[tuple[int, float, int]]:
    """Every token ordered by (-logprob, id) with rank = 1 + #strictly greater, by brute force."""
    order = sorted(range(len(lp)), key=lambda t: (-lp[t], t))
    return [(t, lp[t], 1 + sum(v > lp[t] for v in lp)) for t in order]


def _row(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.log_softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 2, -1)


def test_logprob_and_rank_match_log_softmax() -> None:
    logits = torch.randn(200, generator=torch.Generator().manual_seed(1))
    lp = torch.log_softmax(logits, -1)
    oracle = {t: r for t, _, r in _oracle(lp.tolist())}
    for token in (0, 17, int(lp.argmax()), int(lp.argmin())):
        logprob, rank, cands = token_logprob_info(lp, token, True, None)
        assert logprob == lp[token].item() and rank == oracle[token] and cands == ()
    assert token_logprob_info(lp, int(lp.argmax()), True, None)[1] == 1
    assert token_logprob_info(lp, int(lp.argmin()), True, None)[1] == 200


def test_nothing_reported_unless_asked() -> None:
    assert token_logprob_info(_row(10), 3, False, None) == (None, None, ())


@pytest.mark.parametrize("n", [1, 5, 20, 64])
def test_top_n_candidates_ordered_by_rank(n: int) -> None:
    lp = _row(500, seed=n)
    _, _, cands = token_logprob_info(lp, 0, False, CandidateSpec("top_n", top_n=n))
    assert cands == tuple(_oracle(lp.tolist())[:n])


def test_top_n_ties_choose_lower_ids_and_share_rank() -> None:
    values = [-1.0, -3.0, -2.0, -2.0, -5.0, -2.0, -2.0, -9.0]
    lp = torch.tensor(values)
    _, _, cands = token_logprob_info(lp, 4, True, CandidateSpec("top_n", top_n=3))
    assert cands == ((0, -1.0, 1), (2, -2.0, 2), (3, -2.0, 2))
    assert token_logprob_info(lp, 5, True, None)[1] == 2  # tied tokens share a rank
    assert token_logprob_info(lp, 1, True, None)[1] == 6  # 1 + the five above it


def test_top_n_ties_beyond_the_topk_prefix() -> None:
    lp = torch.full((3000,), -8.0)
    lp[2999] = -1.0
    _, _, cands = token_logprob_info(lp, 0, False, CandidateSpec("top_n", top_n=4))
    assert cands == ((2999, -1.0, 1), (0, -8.0, 2), (1, -8.0, 2), (2, -8.0, 2))


def test_batch_rows_with_different_requests_match_the_oracle() -> None:
    vocab = 64
    lp = torch.log_softmax(torch.randn(6, vocab, generator=torch.Generator().manual_seed(7)), -1)
    lp[2, [9, 40]] = lp[2].max().item() + 0.5  # tie for first place, fully inside the topk prefix
    lp = torch.log_softmax(lp, -1)
    specs = [
        CandidateSpec("top_n", top_n=1),
        CandidateSpec("top_n", top_n=7),
        CandidateSpec("top_n", top_n=2),
        None,
        CandidateSpec("all"),
        CandidateSpec("token_ids", token_ids=(3, 2, 1)),
    ]
    tokens, wants = [5, 0, 40, 63, 1, 2], [True, False, True, True, False, True]
    got = batch_logprob_info(lp, tokens, wants, specs)
    for r in range(6):
        oracle = _oracle(lp[r].tolist())
        by_id = {t: (t, v, k) for t, v, k in oracle}
        logprob, rank, cands = got[r]
        if wants[r]:
            assert (logprob, rank) == (by_id[tokens[r]][1], by_id[tokens[r]][2])
        else:
            assert (logprob, rank) == (None, None)
        spec = specs[r]
        if spec is None:
            expected: tuple = ()
        elif spec.mode == "top_n":
            expected = tuple(oracle[: spec.top_n])
        elif spec.mode == "all":
            expected = tuple(oracle)
        else:
            expected = tuple(by_id[t] for t in spec.token_ids)
        assert cands == expected, r
    assert got[2][2][0][0] == 9 and got[2][2][1][0] == 40 and got[2][1] == 1


def test_top_n_larger_than_vocab_gives_the_vocab() -> None:
    lp = _row(6)
    _, _, cands = token_logprob_info(lp, 0, False, CandidateSpec("top_n", top_n=50))
    assert cands == tuple(_oracle(lp.tolist()))


def test_token_ids_candidates_are_exactly_those_ids_in_order() -> None:
    lp = _row(300, seed=2)
    oracle = {t: (t, v, r) for t, v, r in _oracle(lp.tolist())}
    ids = (299, 0, 42, 42, 7)
    _, _, cands = token_logprob_info(lp, 0, False, CandidateSpec("token_ids", token_ids=ids))
    assert cands == tuple(oracle[t] for t in ids)
    many = tuple(range(299, 99, -1))  # > 64 ids: ranks by sort + searchsorted
    _, _, cands = token_logprob_info(lp, 0, False, CandidateSpec("token_ids", token_ids=many))
    assert cands == tuple(oracle[t] for t in many)
    with pytest.raises(ValueError):
        token_logprob_info(lp, 0, False, CandidateSpec("token_ids", token_ids=(300,)))


def test_all_candidates_are_the_full_vocabulary() -> None:
    lp = _row(257, seed=3)
    lp[[4, 9, 100]] = lp[50].item()  # ties
    lp[7] = float("-inf")  # a masked token
    _, _, cands = token_logprob_info(lp, 0, False, CandidateSpec("all"))
    assert len(cands) == 257 and cands == tuple(_oracle(lp.tolist()))
    assert cands[-1] == (7, float("-inf"), 257)


def test_masked_token_rank_counts_finite_tokens_above() -> None:
    lp = torch.log_softmax(torch.tensor([1.0, float("-inf"), 0.0, float("-inf")]), -1)
    logprob, rank, _ = token_logprob_info(lp, 3, True, None)
    assert logprob == float("-inf") and rank == 3


def test_prompt_logprobs_batched_equals_per_position() -> None:
    positions, vocab = PROMPT_CHUNK_POSITIONS + 37, 120  # spans two chunks
    logits = torch.randn(positions, vocab, generator=torch.Generator().manual_seed(4)) * 3
    targets = torch.randint(0, vocab, (positions,), generator=torch.Generator().manual_seed(5)).tolist()
    spec = CandidateSpec("top_n", top_n=3)
    batched = prompt_logprobs(logits, targets, True, spec)
    direct = torch.log_softmax(logits, -1)
    assert len(batched) == positions
    for j in (0, 1, PROMPT_CHUNK_POSITIONS - 1, PROMPT_CHUNK_POSITIONS, positions - 1):
        row = direct[j].tolist()
        oracle = _oracle(row)
        logprob, rank, cands = batched[j]
        assert logprob == pytest.approx(row[targets[j]], abs=1e-6)
        assert rank == next(r for t, _, r in oracle if t == targets[j])
        assert [c[0] for c in cands] == [t for t, _, _ in oracle[:3]]
        assert all(math.isfinite(c[1]) for c in cands)
    for j in range(positions):
        assert batched[j] == token_logprob_info(direct[j], targets[j], True, spec)


def test_prompt_logprobs_without_a_request_and_with_bad_lengths() -> None:
    logits = torch.zeros(3, 5)
    assert prompt_logprobs(logits, [1, 2, 3], False, None) == [(None, None, ())] * 3
    with pytest.raises(ValueError):
        prompt_logprobs(logits, [1, 2], True, None)
