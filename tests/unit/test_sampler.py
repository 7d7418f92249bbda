"""The batched sampler against independent oracles.

Oracles: transformers' logits processors (repetition penalty, temperature, top-k, top-p,
min-p), a plain-Python counter for frequency/presence penalties, softmax frequencies under
a chi-square bound, and torch.log_softmax for reported logprobs.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from refengine.sampling import Sampler, SamplingRow, apply_penalties
from refengine.types import CandidateSpec, SamplingParams
from tests.unit.sampling_helpers import truncation_mask

# chi-square critical values at p = 0.001 (from tables), by degrees of freedom
CHI2_CRIT_001 = {3: 16.27, 4: 18.47, 5: 20.52, 7: 24.32, 9: 27.88}


def _row(params: SamplingParams, gen: torch.Generator | None = None, **kw) -> SamplingRow:
    kw.setdefault("prompt_token_ids", ())
    kw.setdefault("output_token_ids", ())
    return SamplingRow(params=params, generator=gen, **kw)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _logits(n: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=_gen(seed)) * scale


def _hf_kept(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """HF's warper chain (temperature, top-k, top-p, min-p) -> bool mask of kept tokens."""
    scores = TemperatureLogitsWarper(float(p.temperature))(None, logits.clone())
    if p.top_k > 0:
        scores = TopKLogitsWarper(p.top_k)(None, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(None, scores)
    if p.min_p > 0.0:
        scores = MinPLogitsWarper(p.min_p)(None, scores)
    return torch.isfinite(scores)


def _chi_square(counts: Counter, probs: list[float], draws: int) -> float:
    return sum((counts.get(i, 0) - draws * p) ** 2 / (draws * p) for i, p in enumerate(probs))


# -- penalties ----------------------------------------------------------------------------


def test_repetition_penalty_matches_hf() -> None:
    vocab = 50
    logits = _logits(4, vocab)
    histories = [([1, 2, 3, 3], [4, 1]), ([], [7, 7, 7]), ([10, 11], []), ([5], [6])]
    penalties = [1.3, 0.7, 2.0, 1.0]
    params = [SamplingParams(repetition_penalty=r) for r in penalties]
    ours = apply_penalties(logits, params, [h[0] for h in histories], [h[1] for h in histories])
    for i, (prompt, output) in enumerate(histories):
        ids = torch.tensor([prompt + output or [vocab]])  # an empty history: one out-of-range id
        hf = logits[i : i + 1].clone()
        if ids[0, 0] < vocab:
            hf = RepetitionPenaltyLogitsProcessor(penalties[i])(ids, hf)
        assert torch.equal(ours[i], hf[0]), i


def test_frequency_presence_penalties_match_counter_oracle() -> None:
    vocab = 40
    logits = _logits(3, vocab, seed=1)
    prompts = [[1, 2, 3], [9, 9], [0]]
    outputs = [[3, 3, 5, 7, 3], [], [8, 0, 8]]
    params = [
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(frequency_penalty=1.0, presence_penalty=1.0),
        SamplingParams(frequency_penalty=-0.3, presence_penalty=0.0, repetition_penalty=1.5),
    ]
    ours = apply_penalties(logits, params, prompts, outputs)
    for i, p in enumerate(params):
        expected = logits[i].tolist()
        seen = set(prompts[i]) | set(outputs[i])  # repetition: prompt + output, once per token
        for t in seen:
            if p.repetition_penalty != 1.0:
                v = expected[t]
                expected[t] = v * p.repetition_penalty if v < 0 else v / p.repetition_penalty
        for t, c in Counter(outputs[i]).items():  # frequency/presence: output only
            expected[t] -= p.frequency_penalty * c + p.presence_penalty
        torch.testing.assert_close(ours[i], torch.tensor(expected), rtol=1e-6, atol=1e-6)


EXTREME_PENALTIES = [  # valid by G5 (finite; repetition > 0), and each overflows float32
    SamplingParams(temperature=0.0, repetition_penalty=1e-300),
    SamplingParams(temperature=1.0, seed=2, repetition_penalty=1e-300),
    SamplingParams(temperature=0.0, repetition_penalty=1e300),
    SamplingParams(temperature=0.0, presence_penalty=-1e39),
    SamplingParams(temperature=1.0, seed=1, presence_penalty=-1e39),
    SamplingParams(temperature=1.0, seed=3, frequency_penalty=1e300, presence_penalty=-1e300),
    SamplingParams(temperature=0.7, seed=4, frequency_penalty=-1e308, repetition_penalty=1e-45),
    SamplingParams(temperature=1e-9, seed=5, presence_penalty=-1e39),  # below the sampler's smallest temperature
]


@pytest.mark.parametrize("params", EXTREME_PENALTIES, ids=range(len(EXTREME_PENALTIES)))
def test_extreme_penalties_stay_finite_and_masked_tokens_stay_masked(params: SamplingParams) -> None:
    """Penalties whose float32 arithmetic overflows saturate (penalties.LOGIT_LIMIT): the
    token is in the vocabulary, its logprob and its candidates' are not NaN, and a token the
    grammar mask removed is never chosen, though it is in the history (a masked -inf penalized
    by -inf would be NaN). The review reproduced NaN logprobs and an id equal to V before."""
    vocab = 64
    logits = _logits(1, vocab, seed=5)
    history = [0, 1, 2, 3, 3, 9]
    penalized = apply_penalties(logits, [params], [[4, 5]], [history])
    assert not penalized.isnan().any() and not penalized.isinf().any()
    mask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)  # every token allowed...
    mask[0, 0] &= ~(1 << 3)  # ...but token 3
    row = _row(params, _gen(params.seed or 0), prompt_token_ids=[4, 5], output_token_ids=history,
               want_logprob=True, candidates=CandidateSpec(mode="top_n", top_n=4))
    (token,) = Sampler(vocab)(logits, [row], token_bitmask=mask, masked_rows=[0])
    assert 0 <= token.token_id < vocab and token.token_id != 3
    assert token.logprob is not None and math.isfinite(token.logprob) and token.rank is not None
    assert not any(math.isnan(lp) for _, lp, _ in token.candidates)


def test_no_penalty_returns_input_and_never_mutates() -> None:
    logits = _logits(2, 30)
    before = logits.clone()
    assert apply_penalties(logits, [SamplingParams()] * 2, [[1, 2]] * 2, [[3]] * 2) is logits
    apply_penalties(logits, [SamplingParams(repetition_penalty=2.0)] * 2, [[1, 2]] * 2, [[3]] * 2)
    Sampler(30)(logits, [_row(SamplingParams(presence_penalty=1.0), output_token_ids=[3])] * 2)
    assert torch.equal(logits, before)


# -- truncation vs HF warpers -------------------------------------------------------------

TRUNCATION_CASES = [
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.5, top_k=40, top_p=0.9),
    SamplingParams(temperature=0.9, top_k=100, top_p=0.95, min_p=0.02),
    SamplingParams(temperature=2.0, top_p=0.99),  # flat: top-p cut beyond the first prefix
    SamplingParams(temperature=1.0, top_k=3000),
    SamplingParams(temperature=1.0, top_k=-1, top_p=0.5),
]


@pytest.mark.parametrize("params", TRUNCATION_CASES, ids=str)
def test_truncation_kept_set_matches_hf(params: SamplingParams) -> None:
    vocab = 4096
    logits = _logits(6, vocab, seed=2)
    tempered = logits / params.temperature
    assert torch.equal(tempered, TemperatureLogitsWarper(float(params.temperature))(None, logits.clone()))
    probs = torch.softmax(tempered, -1)
    keep = truncation_mask(tempered, probs, [params] * 6)
    assert keep is not None
    for i in range(6):
        assert torch.equal(keep[i], _hf_kept(logits[i : i + 1], params)[0]), i


def test_truncation_rows_with_different_params_in_one_batch() -> None:
    vocab = 4096
    logits = _logits(len(TRUNCATION_CASES), vocab, seed=3)
    tempered = torch.stack([logits[i] / p.temperature for i, p in enumerate(TRUNCATION_CASES)])
    keep = truncation_mask(tempered, torch.softmax(tempered, -1), TRUNCATION_CASES)
    assert keep is not None
    for i, p in enumerate(TRUNCATION_CASES):
        assert torch.equal(keep[i], _hf_kept(logits[i : i + 1], p)[0]), p


def test_top_k_ties_running_past_the_prefix_then_top_p_match_hf() -> None:
    vocab = 2000
    logits = _logits(2, vocab, seed=6, scale=0.1) - 5.0
    logits[:, :2] = torch.tensor([4.0, 3.0])
    logits[:, 100:700] = 0.0  # 600 tokens tied at the k-th value, beyond the first prefix
    params = SamplingParams(top_k=3, top_p=0.999)
    keep = truncation_mask(logits, torch.softmax(logits, -1), [params] * 2)
    assert keep is not None and torch.equal(keep, _hf_kept(logits, params))
    # top-p cutting inside the tie: HF keeps an arbitrary part of it (sort order), we keep all of
    # it (ties with the last kept token are kept), so ours = HF's set + the rest of the tie.
    params = SamplingParams(top_k=3, top_p=0.5)
    keep = truncation_mask(logits, torch.softmax(logits, -1), [params] * 2)
    hf = _hf_kept(logits, params)
    assert keep is not None and bool((keep | ~hf).all())
    tie_value = logits[hf].min()
    assert torch.equal(keep, hf | (logits == tie_value))


def test_sampled_tokens_stay_in_hf_kept_set() -> None:
    vocab = 200
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.7, min_p=0.05)
    logits = _logits(1, vocab, seed=4).expand(2000, vocab)
    tokens = [s.token_id for s in Sampler(vocab, seed=1)(logits, [_row(params)] * 2000)]
    kept = set(torch.nonzero(_hf_kept(logits[:1], params)[0])[:, 0].tolist())
    assert set(tokens) == kept  # never outside, and every kept token appears in 2000 draws


def test_tiny_top_p_keeps_exactly_the_top_token() -> None:
    vocab = 1000
    logits = _logits(8, vocab, seed=5)
    params = SamplingParams(temperature=1.0, top_p=1e-9)
    keep = truncation_mask(logits, torch.softmax(logits, -1), [params] * 8)
    assert keep is not None and keep.sum(-1).tolist() == [1] * 8
    out = Sampler(vocab)(logits, [_row(params)] * 8)
    assert [s.token_id for s in out] == logits.argmax(-1).tolist()


def test_top_k_ties_at_the_cut_are_kept() -> None:
    logits = torch.tensor([[5.0, 3.0, 3.0, 3.0, 1.0]])
    keep = truncation_mask(logits, torch.softmax(logits, -1), [SamplingParams(top_k=2)])
    assert keep is not None and keep[0].tolist() == [True, True, True, True, False]


# -- distribution -------------------------------------------------------------------------


def test_shared_generator_frequencies_follow_softmax() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    temperature, draws = 0.7, 20000
    probs = torch.softmax(logits / temperature, -1).tolist()
    rows = [_row(SamplingParams(temperature=temperature))] * draws
    out = Sampler(8, seed=123)(logits.expand(draws, 8), rows)
    assert _chi_square(Counter(s.token_id for s in out), probs, draws) < CHI2_CRIT_001[7]


def test_seeded_generator_frequencies_follow_truncated_softmax() -> None:
    logits = torch.tensor([[1.0, 0.8, 0.6, 0.3, 0.0, -0.2, -2.0, -3.0]])
    params = SamplingParams(temperature=1.2, top_k=5, seed=7)
    expected = torch.softmax(TopKLogitsWarper(5)(None, logits / 1.2), -1)[0].tolist()
    gen, sampler, counts, steps = _gen(7), Sampler(8), Counter(), 4000
    for _ in range(steps):
        counts[sampler(logits, [_row(params, gen)])[0].token_id] += 1
    assert counts[6] == counts[7] == 0
    assert _chi_square(counts, expected[:5], steps) < CHI2_CRIT_001[4]


# -- reproducibility ----------------------------------------------------------------------

SEEDED = [
    SamplingParams(temperature=0.8, top_p=0.9, seed=11),
    SamplingParams(temperature=1.0, top_k=50, seed=12),
    SamplingParams(temperature=0.7, min_p=0.05, repetition_penalty=1.2, seed=13),
    SamplingParams(temperature=1.5, top_p=0.99, frequency_penalty=0.5, seed=14),  # flat: deep top-p
]


def _run_seeded(positions: list[int], batch: int, steps: int, vocab: int) -> dict[int, list[int]]:
    """Generate ``steps`` tokens for each SEEDED row placed at ``positions`` in a batch of
    ``batch`` rows; the other rows are greedy, shared-generator or differently seeded."""
    sampler = Sampler(vocab, seed=99)
    gens = [_gen(p.seed) for p in SEEDED]  # type: ignore[arg-type]
    outputs: list[list[int]] = [[] for _ in SEEDED]
    fillers = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=2000),  # forces a larger top-k prefix
        SamplingParams(temperature=0.9, top_p=0.5),
    ]
    for step in range(steps):
        logits = _logits(batch, vocab, seed=1000 + step)
        rows = []
        for j in range(batch):
            rows.append(_row(fillers[j % 3], _gen(j) if j % 5 == 0 else None))
        for k, pos in enumerate(positions):
            logits[pos] = _logits(1, vocab, seed=500 + 10 * step + k)[0]
            rows[pos] = _row(SEEDED[k], gens[k], prompt_token_ids=[1, 2, 3], output_token_ids=outputs[k])
        for k, tok in enumerate(sampler(logits, rows)):
            if k in positions:
                outputs[positions.index(k)].append(tok.token_id)
    return dict(enumerate(outputs))


def test_seeded_rows_identical_alone_and_anywhere_in_a_batch() -> None:
    vocab, steps = 8192, 6
    alone = {}
    for k, params in enumerate(SEEDED):  # each seeded row alone in a batch of one
        sampler, gen, out = Sampler(vocab, seed=5), _gen(params.seed), []  # type: ignore[arg-type]
        for step in range(steps):
            logits = _logits(1, vocab, seed=500 + 10 * step + k)
            row = _row(params, gen, prompt_token_ids=[1, 2, 3], output_token_ids=out)
            out.append(sampler(logits, [row])[0].token_id)
        alone[k] = out
    in_batch_a = _run_seeded([3, 17, 30, 8], 32, steps, vocab)
    in_batch_b = _run_seeded([31, 0, 12, 25], 32, steps, vocab)
    assert in_batch_a == in_batch_b == alone


def test_different_seeds_differ_and_same_seed_repeats() -> None:
    vocab = 1000
    logits = _logits(1, vocab, seed=8, scale=0.5)  # flat: many likely tokens

    def run(seed: int) -> list[int]:
        gen, sampler = _gen(seed), Sampler(vocab)
        return [sampler(logits, [_row(SamplingParams(seed=seed), gen)])[0].token_id for _ in range(20)]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_greedy_is_argmax_lowest_id_on_ties_and_batch_invariant() -> None:
    vocab = 49152
    logits = _logits(32, vocab, seed=9)
    logits[5, [7, 300, 40000]] = 100.0  # a three-way tie: lowest id wins
    greedy = SamplingParams(temperature=0.0)
    sampler = Sampler(vocab)
    batch = sampler(logits, [_row(greedy if i % 2 else SamplingParams(), _gen(i)) for i in range(32)])
    assert batch[5].token_id == 7
    for i in range(1, 32, 2):
        assert batch[i].token_id == int(logits[i].argmax())
        assert sampler(logits[i : i + 1], [_row(greedy)])[0].token_id == batch[i].token_id


def test_greedy_uses_penalized_logits() -> None:
    logits = torch.tensor([[4.0, 3.9, 1.0, -1.0]])
    p = SamplingParams(temperature=0.0, repetition_penalty=1.1)
    assert Sampler(4)(logits, [_row(p, output_token_ids=[0])])[0].token_id == 1
    p = SamplingParams(temperature=0.0, presence_penalty=0.2)
    assert Sampler(4)(logits, [_row(p, output_token_ids=[0])])[0].token_id == 1


def test_suppressed_tokens_are_never_sampled() -> None:
    vocab, draws = 16, 3000
    logits = torch.zeros(draws, vocab)
    logits[:, 3] = 8.0  # the likely token is suppressed
    rows = [_row(SamplingParams(temperature=1.0), suppressed_token_ids=(3, 9))] * draws
    tokens = {s.token_id for s in Sampler(vocab)(logits, rows)}
    assert 3 not in tokens and 9 not in tokens and len(tokens) == vocab - 2
    greedy = _row(SamplingParams(temperature=0.0), suppressed_token_ids=(3,), want_logprob=True)
    out = Sampler(vocab)(logits[:1], [greedy])[0]
    assert out.token_id == 0 and out.logprob is not None and math.isfinite(out.logprob)


def test_padded_vocab_columns_are_never_sampled() -> None:
    logits = torch.zeros(500, 12)
    logits[:, 10:] = 50.0  # padding columns of the LM head, beyond vocab_size=10
    out = Sampler(10)(logits, [_row(SamplingParams())] * 500)
    assert max(s.token_id for s in out) < 10
    with pytest.raises(ValueError):
        Sampler(10)(torch.zeros(2, 9), [_row(SamplingParams())] * 2)
    assert Sampler(10)(torch.zeros(0, 10), []) == []


# -- reported logprobs --------------------------------------------------------------------


def test_reported_logprobs_are_of_the_penalized_tempered_distribution() -> None:
    vocab = 300
    logits = _logits(3, vocab, seed=10)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3),  # greedy: T treated as 1
        SamplingParams(temperature=0.6, top_k=3, seed=1),  # truncation does not change logprobs
        SamplingParams(temperature=1.4, presence_penalty=0.7),
    ]
    history = [5, 6, 7]
    rows = [
        _row(
            p,
            _gen(i),
            output_token_ids=history,
            want_logprob=True,
            candidates=CandidateSpec("top_n", top_n=4),
        )
        for i, p in enumerate(params)
    ]
    out = Sampler(vocab)(logits, rows)
    for i, p in enumerate(params):
        penalized = apply_penalties(logits[i : i + 1], [p], [()], [history])[0]
        lp = torch.log_softmax(penalized / (p.temperature or 1.0), -1)
        s = out[i]
        assert s.logprob == pytest.approx(lp[s.token_id].item(), abs=1e-6)
        assert s.rank == 1 + int((lp > lp[s.token_id]).sum())
        order = sorted(range(vocab), key=lambda t: (-lp[t].item(), t))[:4]
        assert [c[0] for c in s.candidates] == order
        assert [c[2] for c in s.candidates] == [1, 2, 3, 4]
        assert all(c[1] == pytest.approx(lp[c[0]].item(), abs=1e-6) for c in s.candidates)
    assert out[0].rank == 1  # greedy picks the most likely token
    assert out[1].rank is not None and out[1].rank <= 3


def test_no_logprob_fields_unless_asked() -> None:
    out = Sampler(10)(_logits(2, 10), [_row(SamplingParams()), _row(SamplingParams(temperature=0.0))])
    assert all(s.logprob is None and s.rank is None and s.candidates == () for s in out)


def test_non_finite_logits_give_their_row_no_token_and_spare_the_batch() -> None:
    """A NaN, a +inf or an all -inf row gets ``vocab_size`` (no token) and reports nothing, greedy
    or sampled, with or without logprobs; the other rows of the same call keep the tokens and
    logprobs they get alone. Before: a greedy NaN row took token 0 with a NaN logprob, and a
    sampled NaN row with logprobs made the whole call raise."""
    vocab = 12
    logits = _logits(8, vocab, seed=5)
    logits[0, 3] = logits[1, 4] = float("nan")
    logits[2, 5] = float("inf")
    logits[3] = float("-inf")
    logits[4, 6] = float("nan")
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=0.9)
    top4 = CandidateSpec(mode="top_n", top_n=4)
    rows = [_row(greedy, want_logprob=True), _row(sampled, _gen(1), want_logprob=True, candidates=top4),
            _row(greedy, want_logprob=True), _row(greedy), _row(sampled, _gen(2)),
            _row(greedy, want_logprob=True, candidates=top4), _row(sampled, _gen(3), want_logprob=True),
            _row(greedy, want_logprob=True)]
    out = Sampler(vocab)(logits, rows)
    for bad in range(5):
        assert (out[bad].token_id, out[bad].logprob, out[bad].rank, out[bad].candidates) == (vocab, None, None, ())
    for good in range(5, 8):
        fresh = [_row(r.params, _gen(3) if good == 6 else None, want_logprob=r.want_logprob,
                      candidates=r.candidates) for r in rows[good:good + 1]]
        alone = Sampler(vocab)(logits[good:good + 1], fresh)[0]
        assert out[good] == alone
        tempered = logits[good] / (0.9 if good == 6 else 1.0)
        assert out[good].logprob == pytest.approx(torch.log_softmax(tempered, -1)[out[good].token_id].item(), abs=1e-6)


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf row"])
@pytest.mark.parametrize("truncation", [{"top_k": 3}, {"top_p": 0.5}, {"min_p": 0.1}, {}])
def test_a_non_finite_row_gets_no_token_under_truncation_or_next_to_a_min_p_row(bad: str, truncation: dict) -> None:
    """Found by review: truncation zeroed a NaN row's probabilities (NaN >= floor is false), so
    the draw fell back to token 0 with a NaN logprob; untruncated, such a row next to a min_p row
    got a NaN floor and the same. The row is judged on its logits now."""
    vocab = 12
    logits = _logits(2, vocab, seed=9)
    if bad == "-inf row":
        logits[0] = float("-inf")
    else:
        logits[0, 4] = float(bad)
    rows = [_row(SamplingParams(temperature=0.8, **truncation), _gen(1), want_logprob=True),
            _row(SamplingParams(temperature=0.8, min_p=0.1), _gen(2), want_logprob=True)]
    out = Sampler(vocab)(logits, rows)
    assert (out[0].token_id, out[0].logprob) == (vocab, None)
    alone = Sampler(vocab)(logits[1:], [_row(SamplingParams(temperature=0.8, min_p=0.1), _gen(2), want_logprob=True)])
    assert out[1] == alone[0]


@pytest.mark.parametrize("penalty", [{"repetition_penalty": 1.3}, {"presence_penalty": 0.5},
                                     {"frequency_penalty": 0.5}])
def test_a_penalty_does_not_hide_a_non_finite_logit(penalty: dict) -> None:
    """The model's +inf (or NaN) on a token the history holds stays what it is, so the row fails
    as it does without a penalty; it was clamped to the finite limit and drawn with logprob 0."""
    vocab = 12
    logits = _logits(1, vocab, seed=3)
    logits[0, 5] = float("inf")
    penalized = apply_penalties(logits, [SamplingParams(**penalty)], [[5]], [[5]])
    assert penalized[0, 5].item() == float("inf")
    assert Sampler(vocab)(penalized, [_row(SamplingParams(temperature=0.0))])[0].token_id == vocab


def test_opposite_frequency_and_presence_penalties_combine_before_they_saturate() -> None:
    """G5 accepts any finite penalty: 1e39 * 1 - 1.5e39 = -5e38 lifts the token to the limit.
    Each term was clamped to float32's range first, and they cancelled to 0."""
    logits = torch.zeros(1, 4)
    out = apply_penalties(logits, [SamplingParams(frequency_penalty=1e39, presence_penalty=-1.5e39)], [[]], [[1]])
    assert out[0, 1].item() > 1e31 and out[0, 0].item() == 0.0


def test_a_top_p_that_underflows_float32_keeps_the_most_likely_token() -> None:
    """G5 allows any 0 < top_p <= 1. top_p = 1e-300 is 0 in float32: no token was kept, the
    sampler gathered index -1 and the step's exception failed every request on the server.
    Oracle: transformers' TopPLogitsWarper keeps the single most likely token."""
    vocab, rows = 256, 64
    logits = _logits(rows, vocab, seed=11)
    for top_p in (1e-300, 5e-324, 1e-46):
        params = SamplingParams(temperature=1.0, top_p=top_p)
        tokens = [s.token_id for s in Sampler(vocab)(logits, [_row(params, _gen(i)) for i in range(rows)])]
        hf = TopPLogitsWarper(top_p=top_p)(torch.zeros(rows, 1, dtype=torch.long), logits.clone())
        assert tokens == hf.argmax(-1).tolist() == logits.argmax(-1).tolist()


def test_a_temperature_beyond_float32_stays_finite_beside_masked_tokens() -> None:
    """temperature = 1e300 is finite and >= 0 (G5), but inf in float32: a suppressed token's
    -inf / inf was NaN and the request failed as "logits not finite". It now samples
    (all but) uniformly among the allowed tokens, with finite logprobs."""
    vocab, draws = 8, 4000
    logits = _logits(draws, vocab, seed=12)
    row = _row(SamplingParams(temperature=1e300), suppressed_token_ids=(3,), want_logprob=True)
    out = Sampler(vocab)(logits, [row] * draws)
    counts = Counter(s.token_id for s in out)
    assert set(counts) == set(range(vocab)) - {3}
    expected = draws / (vocab - 1)
    assert sum((c - expected) ** 2 / expected for c in counts.values()) < CHI2_CRIT_001[7]  # 6 dof: looser bound
    assert all(math.isfinite(s.logprob) and s.logprob == pytest.approx(-math.log(vocab - 1), abs=1e-5) for s in out)


@pytest.mark.parametrize("width", [2048, 3000, 32000, 49152])
def test_the_blocked_greedy_argmax_equals_torch_max(width: int) -> None:
    """``row_max`` (greedy rows on CPU, in blocks: torch's indexed max is a scalar loop there)
    gives ``logits.max(-1)``'s ids: ties across blocks go to the lowest id, a short last block is
    searched, and rows that are not finite are found. The oracle is torch's own ``max``."""
    from refengine.sampling.sampler import row_max

    generator = torch.Generator().manual_seed(width)
    logits = torch.randn(48, width + 5, generator=generator)[:, :width]  # not contiguous, as a slice
    top = logits.max() + 1
    for row, columns in enumerate(torch.randint(0, width, (48, 3), generator=generator).tolist()):
        if row % 2:  # ties: the same maximum in up to three blocks
            logits[row, columns] = top
    logits[40, -1] = top + 1  # the maximum in the last, possibly short, block
    logits[41, :] = logits[41].to(torch.bfloat16).float()  # many exact ties
    logits[42, 5], logits[43, 7], logits[44, :] = float("nan"), float("inf"), float("-inf")
    expected_best, expected_ids = logits.max(-1)
    best, ids = row_max(logits)
    finite = torch.isfinite(expected_best)
    assert torch.equal(torch.isfinite(best), finite)
    assert torch.equal(best[finite], expected_best[finite]) and torch.equal(ids[finite], expected_ids[finite])
