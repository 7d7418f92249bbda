"""Oracle tests for gaps a mutation run of refengine/sampling/* found (2026-12-06): each fails on
a mutant the other tests let through. Oracles: transformers' logits processors, torch.log_softmax
and plain-Python rank counting (RULES L5: rank = 1 + #tokens strictly more likely)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
)

from refengine.sampling import Sampler, SamplingRow, apply_penalties, batch_logprob_info, prompt_logprobs
from refengine.sampling.truncation import truncation_thresholds
from refengine.types import CandidateSpec, SamplingParams
from tests.unit.test_sampler import _hf_kept as hf_kept


def _rank(row: list[float], t: int) -> int:
    return 1 + sum(1 for v in row if v > row[t])


# -- logprobs ------------------------------------------------------------------------------


def test_prompt_logprobs_without_candidates_report_logprob_and_rank() -> None:
    """The engine asks for prompt logprobs with ``prompt_candidates=None`` whenever a request sets
    only ``prompt_logprobs``; nothing checked those values (test_engine checks only the ids)."""
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0)) * 3
    targets = [3, 0, 10, 3, 7]
    out = prompt_logprobs(logits, targets, True, None)
    ref = torch.log_softmax(logits, -1)
    for j, (lp, rank, cands) in enumerate(out):
        assert lp == ref[j, targets[j]].item()
        assert rank == _rank(ref[j].tolist(), targets[j])
        assert cands == ()


def test_prompt_candidates_without_prompt_logprob() -> None:
    """``want_logprob=False`` with candidates still reports the candidates (and no logprob)."""
    logits = torch.randn(3, 9, generator=torch.Generator().manual_seed(1))
    out = prompt_logprobs(logits, [1, 2, 3], False, CandidateSpec("top_n", top_n=2))
    ref = torch.log_softmax(logits, -1)
    for j, (lp, rank, cands) in enumerate(out):
        assert lp is None and rank is None
        assert [c[0] for c in cands] == ref[j].topk(2).indices.tolist()


def test_empty_token_ids_selection_reports_no_candidates() -> None:
    """``CandidateTokenSelection.token_ids`` with no ids passes server validation and reaches
    the sampler as ``CandidateSpec('token_ids', ())``: it must report an empty tuple."""
    lp = torch.log_softmax(torch.randn(2, 8, generator=torch.Generator().manual_seed(2)), -1)
    specs = [CandidateSpec("token_ids", token_ids=()), CandidateSpec("token_ids", token_ids=(4,))]
    (_, _, c0), (_, _, c1) = batch_logprob_info(lp, [0, 1], [True, True], specs)
    assert c0 == ()
    assert c1 == ((4, lp[1, 4].item(), _rank(lp[1].tolist(), 4)),)


@pytest.mark.parametrize("zero", [0, -1])
def test_top_n_zero_or_negative_reports_no_candidates_next_to_other_rows(zero: int) -> None:
    lp = torch.log_softmax(torch.randn(3, 10, generator=torch.Generator().manual_seed(3)), -1)
    specs = [CandidateSpec("top_n", top_n=zero), CandidateSpec("top_n", top_n=2), CandidateSpec("top_n", top_n=zero)]
    out = batch_logprob_info(lp, [0, 0, 0], [False] * 3, specs)
    assert out[0][2] == () and out[2][2] == ()
    assert [c[0] for c in out[1][2]] == lp[1].topk(2).indices.tolist()
    # a batch where every row asks for none
    only_zero = batch_logprob_info(lp[:2], [0, 0], [False, False], [specs[0], specs[0]])
    assert [c for _, _, c in only_zero] == [(), ()]


# -- truncation against HF, randomized, ties and -inf included ---------------------------------


def _hf_kept(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row of test_sampler's HF warper chain."""
    return hf_kept(x[None], p)[0]


def test_top_k_then_top_p_near_one_keeps_the_whole_top_k_set_as_hf() -> None:
    """top_p just below 1 renormalized over the top-k set keeps all k tokens (HF)."""
    x = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    p = SamplingParams(top_k=5, top_p=0.999)
    probs = torch.softmax(x, -1)
    cut, floor = truncation_thresholds(x, probs, [p])
    ours = ((x >= cut[:, None]) & (probs >= floor[:, None]))[0]
    assert ours.tolist() == _hf_kept(x[0], p).tolist() == [True] * 5 + [False]


def test_truncation_matches_hf_on_random_rows_with_ties_and_masked_tokens() -> None:
    """Every token HF keeps is kept; every extra token is tied (same tempered logit) with one HF
    keeps (HF's sort breaks ties arbitrarily, the engine keeps the whole tie)."""
    rng = random.Random(0)
    for case in range(400):
        vocab = rng.choice([5, 17, 300, 2100])
        x = torch.randn(vocab, generator=torch.Generator().manual_seed(case)) * 3
        if rng.random() < 0.7:
            x = (x * 2).round() / 2
        for _ in range(rng.randrange(0, vocab // 4 + 1)):
            x[rng.randrange(vocab)] = float("-inf")
        x[rng.randrange(vocab)] = 1.0
        temperature = rng.choice([1e-6, 0.5, 1.0, 2.0])
        p = SamplingParams(temperature=temperature, top_k=rng.choice([0, -1, 1, 3, vocab - 1, vocab, vocab + 5]),
                           top_p=rng.choice([1.0, 0.999, 0.95, 0.5, 1e-9, 1e-300]),
                           min_p=rng.choice([0.0, 0.1, 1.0]))
        xt = x[None] / temperature
        probs = torch.softmax(xt, -1)
        th = truncation_thresholds(xt, probs, [p])
        ours = torch.isfinite(xt[0]) if th is None else ((xt >= th[0][:, None]) & (probs >= th[1][:, None]))[0]
        ours &= probs[0] > 0  # a zero-probability token is never drawn
        ref = _hf_kept(x, p)
        missing = [i for i in (ref & ~ours).nonzero()[:, 0].tolist() if probs[0, i] > 0]
        kept_values = set(xt[0][ref].tolist())
        extra = [i for i in (ours & ~ref).nonzero()[:, 0].tolist() if xt[0, i].item() not in kept_values]
        assert not missing and not extra, (case, vocab, p, missing[:5], extra[:5])


# -- penalties and the whole sampler against HF + the OpenAI/vLLM penalty definition ----------


def test_sampler_rows_match_hf_and_openai_penalties_on_random_batches() -> None:
    """Repetition penalty over prompt + output (HF processor, as vLLM), frequency/presence over
    the output (OpenAI: ``logit -= f * count + p * (count > 0)``), suppression, temperature;
    the sampled token is kept by HF's warpers (up to ties), greedy is the lowest argmax, the
    reported logprob/rank are those of that distribution."""
    rng = random.Random(1)
    for case in range(120):
        vocab = rng.choice([6, 50, 300])
        n = rng.randrange(1, 5)
        x = (torch.randn(n, vocab, generator=torch.Generator().manual_seed(case)) * 6).round() / 2
        rows, refs = [], []
        for b in range(n):
            for _ in range(rng.randrange(0, vocab // 3)):
                x[b, rng.randrange(vocab)] = float("-inf")
            x[b, rng.randrange(vocab)] = 5.0
            p = SamplingParams(temperature=rng.choice([0.0, 1e-7, 0.7, 1.0, 3.0]), top_k=rng.choice([0, 2, vocab + 1]),
                               top_p=rng.choice([1.0, 0.8, 1e-9]), min_p=rng.choice([0.0, 0.2, 1.0]),
                               repetition_penalty=rng.choice([1.0, 1.5, 0.8]),
                               frequency_penalty=rng.choice([0.0, 0.5]), presence_penalty=rng.choice([0.0, -0.5, 0.7]))
            prompt = [rng.randrange(vocab) for _ in range(rng.randrange(4))]
            out = [rng.randrange(vocab) for _ in range(rng.randrange(5))]
            suppressed = tuple(rng.randrange(vocab) for _ in range(rng.randrange(2)))
            rows.append(SamplingRow(params=p, prompt_token_ids=prompt, output_token_ids=out,
                                    generator=torch.Generator().manual_seed(rng.randrange(1 << 30)),
                                    suppressed_token_ids=suppressed, want_logprob=True))
            s = x[b:b + 1].clone()
            if p.repetition_penalty != 1.0 and prompt + out:
                s = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([prompt + out]), s)
            for t, c in Counter(out).items():
                s[0, t] -= p.frequency_penalty * c + p.presence_penalty
            for t in suppressed:
                s[0, t] = float("-inf")
            refs.append((s[0] / (1.0 if p.greedy else max(p.temperature, 1e-6)), p))
        tokens = Sampler(vocab)(x, rows)
        for b, (tok, (st, p)) in enumerate(zip(tokens, refs, strict=True)):
            where = (case, b, p)
            if p.greedy:
                assert tok.token_id == int((st == st.max()).nonzero()[0, 0]), where
            else:
                kept = _hf_kept(st, replace(p, temperature=1.0))  # st: already divided by the temperature
                assert st[tok.token_id].item() in set(st[kept].tolist()), where
            lp = torch.log_softmax(st, -1)
            assert tok.logprob == pytest.approx(lp[tok.token_id].item(), abs=1e-5), where
            assert tok.rank == _rank(lp.tolist(), tok.token_id), where


def test_penalties_match_hf_and_openai_on_masked_and_tied_logits() -> None:
    rng = random.Random(2)
    for case in range(300):
        vocab = rng.choice([7, 30, 200])
        x = (torch.randn(vocab, generator=torch.Generator().manual_seed(case)) * 6).round() / 2
        for _ in range(rng.randrange(0, vocab // 4)):
            x[rng.randrange(vocab)] = float("-inf")
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(8))]
        output = [rng.randrange(vocab) for _ in range(rng.randrange(8))]
        p = SamplingParams(repetition_penalty=rng.choice([1.0, 0.5, 1.3]),
                           frequency_penalty=rng.choice([0.0, 0.7, -0.4]),
                           presence_penalty=rng.choice([0.0, 1.1, -0.9]))
        ours = apply_penalties(x[None], [p], [prompt], [output])[0]
        ref = x[None].clone()
        if prompt + output and p.repetition_penalty != 1.0:
            ref = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([prompt + output]), ref)
        ref = ref[0]
        for t, c in Counter(output).items():
            ref[t] -= p.frequency_penalty * c + p.presence_penalty
        assert torch.equal(torch.isneginf(ours), torch.isneginf(ref)), case
        finite = torch.isfinite(ref)
        assert torch.allclose(ours[finite], ref[finite], rtol=1e-6, atol=1e-5), case


@pytest.mark.parametrize("bad", [-1, 8])
def test_out_of_range_ids_are_rejected_not_wrapped(bad: int) -> None:
    """A ``-1`` candidate id would index the last token (``row[-1]``), ``V`` would fail deep in
    torch: both are refused with ValueError."""
    lp = torch.log_softmax(torch.randn(1, 8, generator=torch.Generator().manual_seed(4)), -1)
    with pytest.raises(ValueError):
        batch_logprob_info(lp, [0], [False], [CandidateSpec("token_ids", token_ids=(1, bad))])
    with pytest.raises(ValueError):
        batch_logprob_info(lp, [bad], [True], [None])


# -- sampler constants and the shared generator ------------------------------------------------


def test_a_temperature_below_the_minimum_is_raised_to_1e_minus_6() -> None:
    """Module docstring: ``logits / clamp(T, 1e-6, ...)``; the reported logprob shows the T used."""
    logits = torch.tensor([[0.0, 1e-6, -1.0]])
    row = SamplingRow(SamplingParams(temperature=1e-9), (), (), torch.Generator().manual_seed(0), want_logprob=True)
    token = Sampler(3)(logits, [row])[0]
    expected = torch.log_softmax(logits / 1e-6, -1)[0]
    assert token.logprob == pytest.approx(expected[token.token_id].item(), abs=1e-6)


def test_unseeded_rows_draw_from_the_sampler_seed_not_the_global_rng() -> None:
    logits = torch.zeros(4, 1000)
    rows = [SamplingRow(SamplingParams(), (), (), None) for _ in range(4)]
    torch.manual_seed(1)
    first = [t.token_id for t in Sampler(1000, seed=7)(logits, rows)]
    torch.manual_seed(2)
    again = [t.token_id for t in Sampler(1000, seed=7)(logits, rows)]
    other = [t.token_id for t in Sampler(1000, seed=8)(logits, rows)]
    assert first == again
    assert first != other


def test_a_uniform_that_rounds_up_to_the_total_draws_the_last_kept_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """``u * total`` can round up to ``total`` (u = 1 - 2**-53); the sampler then falls back to
    the last token with p > 0 instead of returning ``vocab_size`` (no token: a failed request).
    Modelled by a uniform of exactly 1.0, with zero-probability tokens after the kept ones."""
    logits = torch.tensor([[0.0, 3.0, 2.9, -5.0, -6.0]])
    monkeypatch.setattr(Sampler, "_uniforms", lambda self, rows, device: torch.ones(len(rows), 1, dtype=torch.float64))
    row = SamplingRow(SamplingParams(top_k=2), (), (), None)
    assert Sampler(5)(logits, [row])[0].token_id == 2


def test_grammar_masking_leaves_the_callers_logits_untouched_and_the_grammar_wins_over_suppression() -> None:
    """``Sampler.__call__``: 'Never modifies logits'; ``_suppress``: a guided row whose grammar
    allows only suppressed tokens keeps them (the row must still get a token)."""
    from refengine.sampling.guided.bitmask import allocate_bitmask

    logits = torch.tensor([[5.0, 1.0, 2.0, 0.0], [5.0, 1.0, 2.0, 0.0]])
    before = logits.clone()
    bitmask = allocate_bitmask(2, 4)
    bitmask[:, 0] = 0b0110  # tokens 1 and 2 allowed
    rows = [SamplingRow(SamplingParams(temperature=0.0), (), (), None, suppressed_token_ids=(1, 2)),
            SamplingRow(SamplingParams(temperature=0.0), (), (), None, suppressed_token_ids=(2,))]
    tokens = Sampler(4)(logits, rows, bitmask, [0, 1])
    assert torch.equal(logits, before)
    assert [t.token_id for t in tokens] == [2, 1]
