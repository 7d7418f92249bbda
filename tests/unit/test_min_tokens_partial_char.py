"""min_tokens protects a stop string completed by one of the first min_tokens tokens (README), also when
that token's text ends in part of a character (byte-level BPE: SmolLM2 'Ġâĸ' is ' ' + 2 bytes of '▭').
Found by a fuzz against the tokenizer's own decode: its space was counted as the next token's."""

from __future__ import annotations

from refengine.types import FinishInfo, FinishReason, StoppingParams
from tests.unit.test_stop_checker import generate
from tests.unit.tokenizer_fixture import smollm2_tokenizer


def test_a_min_tokens_token_ending_in_a_partial_character_keeps_its_whole_characters() -> None:
    tok = smollm2_tokenizer()
    a, b, space_partial, tail = tok.convert_tokens_to_ids(["a", "Ġb", "Ġâĸ", "Ń"])  # ' \xe2\x96', '\xad'
    stopping = StoppingParams(stop_strings=(" ",), min_tokens=2, include_stop_in_output=True)
    # token 2 makes the space in both: it must not stop the output
    assert generate(stopping, [a, b, a, a], max_tokens=4) == ([a, b, a, a], "a baa", FinishInfo(FinishReason.LENGTH))
    assert generate(stopping, [a, space_partial, tail, a], max_tokens=4) == (
        [a, space_partial, tail, a], "a ▭a", FinishInfo(FinishReason.LENGTH))
