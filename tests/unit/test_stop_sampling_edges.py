"""Edges of stopping, penalties, truncation and byte-run detokenization that the other tests
left open: a mutation run (comparisons flipped, constants moved, statements deleted) found each
one's mutants surviving them. Oracles: ``tokenizer.decode``, HF's logits warpers, the rules."""

from __future__ import annotations

import math

import pytest
import torch

from refengine.engine.detokenizer import IncrementalDetokenizer, decode
from refengine.engine.stop_checker import StopChecker, process_token
from refengine.sampling import apply_penalties
from refengine.sampling.truncation import truncation_thresholds
from refengine.types import FinishInfo, FinishReason, SamplingParams, StoppingParams
from tests.unit.sampling_helpers import truncation_mask
from tests.unit.test_sampler import _hf_kept, _logits
from tests.unit.test_stop_byte_runs import TOKENIZER, _byte_ids
from tests.unit.test_stop_checker import generate, sent
from tests.unit.tokenizer_fixture import smollm2_tokenizer

# ---------------------------------------------------------------- stop_checker.process_token


@pytest.mark.parametrize("include", [False, True])
def test_held_stop_prefix_is_released_when_the_output_ends_by_length_or_eos(include: bool) -> None:
    """Step 4 of process_token: text held back as a possible stop-string start ("thr" of
    "three") is released when the output ends by LENGTH or EOS (kills deleting
    ``emitted += stop.finish_text()``). Oracle: tokenizer.decode."""
    tok = smollm2_tokenizer()
    out = tok.encode("one two thr", add_special_tokens=False)
    stopping = StoppingParams(stop_strings=("three",), include_stop_in_output=include)
    tokens, text, finish = sent(stopping, out, tok)
    assert finish == FinishInfo(FinishReason.LENGTH)
    assert text == decode(tok, out) == "one two thr" and tokens == out
    eos = tok.eos_token_id
    kept, text, finish = generate(stopping, [*out, eos], max_tokens=100)
    assert finish == FinishInfo(FinishReason.STOP, eos_token_id=eos)
    assert text == "one two thr" + (decode(tok, [eos]) if include else "")
    assert kept == ([*out, eos] if include else out)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("at_max_tokens", [False, True])
def test_forced_finish_is_a_stop_matched_by_its_token(include: bool, at_max_tokens: bool) -> None:
    """A completed grammar's stop token (``forced_finish``) ends the output as STOP even with
    ignore_eos and even when the same token reaches max_tokens (not LENGTH); the token is kept
    in tokens/text only with include_stop_in_output (G14). No test passed ``forced_finish``."""
    tok = smollm2_tokenizer()
    eos = tok.eos_token_id
    out = tok.encode("hello world", add_special_tokens=False)
    max_tokens = len(out) + (1 if at_max_tokens else 10)
    stop = StopChecker(StoppingParams(ignore_eos=True, include_stop_in_output=include), (eos,), max_tokens)
    detok = IncrementalDetokenizer(tok, [1])
    text = ""
    for n, token_id in enumerate(out, start=1):
        step = process_token(stop, detok, token_id, n)
        assert step.finish is None and step.keep_token
        text += step.text
    forced = FinishInfo(FinishReason.STOP, eos_token_id=eos)
    step = process_token(stop, detok, eos, len(out) + 1, forced)
    assert step.finish == forced
    assert step.keep_token is include
    assert text + step.text == "hello world" + (decode(tok, [eos]) if include else "")


@pytest.mark.parametrize("include", [False, True])
def test_min_tokens_protects_a_stop_string_inside_a_held_byte_run_that_ends_a_character(include: bool) -> None:
    """The early stop of a held byte run (``string_stop``) must protect the text of the first
    ``min_tokens`` tokens *of the held run* (``_protected(..., held=True)``): "\\n" is token 1
    (<0x0A>), then "é" (<0xC3><0xA9>) ends a character while the run is still held. With
    min_tokens 1 the "\\n" may never stop the output (G15 as applied to stop strings by the
    module docstring), so the output runs to LENGTH with the tokenizer's decode as its text.
    Kills ``held=True`` -> ``held=False`` (it stopped at token 3 with stop_text "\\n")."""
    out = _byte_ids("\né") + TOKENIZER.encode("the end", add_special_tokens=False)
    stopping = StoppingParams(stop_strings=("\n",), min_tokens=1, include_stop_in_output=include)
    tokens, text, finish = sent(stopping, out, TOKENIZER)
    assert finish == FinishInfo(FinishReason.LENGTH)
    assert text == decode(TOKENIZER, out) and tokens == out


# ---------------------------------------------------------------- penalties


@pytest.mark.parametrize("penalty", [1e-300, 1e-50])
def test_a_repetition_penalty_that_underflows_float32_keeps_a_zero_logit_zero(penalty: float) -> None:
    """A valid repetition penalty (G5: any positive value) that rounds to 0.0 in float32 must
    not turn a logit of exactly 0.0 into NaN (0 / 0). Oracle: 0 / p = 0 for every p > 0; the
    other penalized values keep their sign and stay finite. Kills deleting the
    ``penalty.clamp(_FLOAT32_TINY, _FLOAT32_MAX)`` line (the existing extreme-penalty test has
    no zero logit in its history)."""
    logits = torch.tensor([[0.0, 1.5, -2.0, 3.0]])
    out = apply_penalties(logits, [SamplingParams(repetition_penalty=penalty)], [[0]], [[1, 2]])
    assert torch.isfinite(out).all(), out
    assert out[0, 0].item() == 0.0 and out[0, 1] > 1.5 and -2.0 < out[0, 2].item() <= 0.0
    assert out[0, 3].item() == 3.0  # not in the history


@pytest.mark.parametrize("bad", [-1, 4])
def test_a_penalty_history_id_outside_the_vocabulary_is_rejected(bad: int) -> None:
    """unique_token_counts keys tokens as ``row * V + token``: an id of -1 in row 1 would
    silently penalize row 0's last token, and V row 0 would penalize row 1's first token. Either
    bound alone must raise (kills ``min < 0 or max >= V`` -> ``and``)."""
    logits = torch.zeros(2, 4)
    params = [SamplingParams(presence_penalty=1.0)] * 2
    with pytest.raises(ValueError):
        apply_penalties(logits, params, [[], []], [[0], [bad]])


# ---------------------------------------------------------------- truncation


def test_top_k_1_keeps_only_the_most_likely_token_as_hf() -> None:
    """top_k = 1 is a valid top-k (only 0 and -1 disable it); no existing case used it, so
    ``0 < top_k`` -> ``1 < top_k`` (top_k 1 treated as off) survived. Oracle: HF TopKLogitsWarper."""

    logits = _logits(4, 300, seed=7)
    params = SamplingParams(top_k=1)
    keep = truncation_mask(logits, torch.softmax(logits, -1), [params] * 4)
    assert keep is not None and torch.equal(keep, _hf_kept(logits, params))
    assert keep.sum(-1).tolist() == [1] * 4


def test_top_p_is_renormalized_over_a_top_k_tie_that_runs_past_the_prefix() -> None:
    """top-k 3 whose 3rd value is tied by 600 tokens (past the 256-token prefix), then top-p 0.5
    renormalized over all 602 tokens of the top-k set: 0.5 of that mass reaches past the first
    token, so the 2nd (logit 3.0) is kept, as HF's TopK then TopP warpers keep it. Kills
    deleting the ``mass[b] = ...`` full-row mass for spilled ties (the prefix's mass alone keeps
    only the first token). Ours may keep the rest of a tie HF cuts arbitrarily."""

    logits = _logits(2, 2000, seed=6, scale=0.1) - 5.0
    logits[:, :2] = torch.tensor([6.0, 3.0])
    logits[:, 100:700] = 0.0
    params = SamplingParams(top_k=3, top_p=0.5)
    keep = truncation_mask(logits, torch.softmax(logits, -1), [params] * 2)
    hf = _hf_kept(logits, params)
    assert bool(hf[:, 1].all())  # the oracle keeps the 2nd token
    assert keep is not None and torch.equal(keep, hf | (logits == logits[hf].min()))
    # top_p 0.4: the cut falls between the 2nd token and the tie (shares 0.394, 0.020, 600 x 0.001)
    params = SamplingParams(top_k=3, top_p=0.4)
    keep = truncation_mask(logits, torch.softmax(logits, -1), [params] * 2)
    hf = _hf_kept(logits, params)
    assert hf.sum(-1).tolist() == [2, 2] and keep is not None and torch.equal(keep, hf)


def test_top_p_stops_at_the_first_token_whose_mass_reaches_p_exactly() -> None:
    """Top-p keeps the smallest prefix whose mass *reaches* p (HF removes ascending cumsum <=
    1 - p; vLLM the same): probs [0.5, 0.25, 0.25] with top_p 0.5 keep token 0 alone.
    Exact binary fractions, so no rounding decides it. Kills ``before < top_p * mass`` ->
    ``<=`` (it kept all three)."""
    probs = torch.tensor([[0.5, 0.25, 0.25]])
    logits = torch.tensor([[math.log(0.5), math.log(0.25), math.log(0.25)]])
    cut, floor = truncation_thresholds(logits, probs, [SamplingParams(top_p=0.5)])
    keep = (logits >= cut[:, None]) & (probs >= floor[:, None])
    assert keep[0].tolist() == [True, False, False]


def test_no_truncation_when_every_row_has_it_off() -> None:
    """truncation_thresholds returns None when no row truncates (top_k 0/-1/>=V, top_p 1, min_p 0):
    the sampler then skips the pass. Kills ``m > 0.0`` -> ``>= 0.0``, and top_k 0/-1 must not
    count as a k."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(top_k=0), SamplingParams(top_k=-1), SamplingParams(top_k=50)]
    assert truncation_thresholds(logits, torch.softmax(logits, -1), params) is None


# ---------------------------------------------------------------- detokenizer._utf8_needed (byte-fallback runs)


@pytest.mark.parametrize("char", ["耀", "क", "！", "߿"])  # E8 80 80, E0 A4 95, EF BC 81, DF BF: boundary bytes
def test_a_valid_character_in_byte_tokens_never_matches_a_replacement_character_stop(char: str) -> None:
    """While a byte-fallback run is mid-character its held text reads as U+FFFD; ``ended_character``
    (``_utf8_needed``) must say "not ended" until the last byte, else the early stop of a held
    run matches stop "\\ufffd" in a valid character. Kills the UTF-8 range boundary mutants
    (0x80 <= b -> 0x80 < b, 0xE0 <= b -> 0xE0 < b, 0xF0 -> 0xEF). Oracle: tokenizer.decode."""
    out = _byte_ids(char) + TOKENIZER.encode("the end", add_special_tokens=False)
    tokens, text, finish = sent(StoppingParams(stop_strings=("\ufffd",)), out, TOKENIZER)
    assert finish == FinishInfo(FinishReason.LENGTH) and text == decode(TOKENIZER, out) and tokens == out

