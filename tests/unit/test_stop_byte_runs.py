"""Byte-fallback tokens (``<0xNN>``, SentencePiece tokenizers of the Llama-2/Mistral kind) and stop
handling, found by review (2026-12-06): a stop string completed inside a run of byte tokens
stops the output at once (before: at the next non-byte token, up to max_tokens later), and a
prompt ending in a byte token (``"\\n"`` is ``<0x0A>``) keeps the first output token's leading
space. Oracle: the tokenizer's own ``decode`` of the tokens."""

from __future__ import annotations

import pytest

from refengine.engine.detokenizer import IncrementalDetokenizer, decode
from refengine.engine.stop_checker import StopChecker, TokenHoldBack, process_token
from refengine.types import StoppingParams, TokenInfo
from tests.unit.tokenizer_fixture import byte_fallback_tokenizer

TOKENIZER = byte_fallback_tokenizer()


def _byte_ids(text: str) -> list[int]:
    return [TOKENIZER.convert_tokens_to_ids(f"<0x{b:02X}>") for b in text.encode()]


def _run(generated: list[int], stopping: StoppingParams, prompt: list[int]) -> tuple[str, list[int], int]:
    """The output's text, its tokens and how many were sampled until it finished."""
    stop, detokenizer = StopChecker(stopping, [2], stopping.max_tokens), IncrementalDetokenizer(TOKENIZER, prompt)
    hold = TokenHoldBack(stopping.include_stop_in_output)
    text, tokens = "", []
    for count, token_id in enumerate(generated, 1):
        step = process_token(stop, detokenizer, token_id, count)
        if step.keep_token:
            hold.add(TokenInfo(token_id, ""), step.num_detokenized_chars, step.text_pending, step.num_chars_before)
        tokens += [info.token_id for info in hold.release(len(step.text), step.finish)]
        text += step.text
        if step.finish is not None:
            return text, tokens, count
    raise AssertionError("the output never finished")


@pytest.mark.parametrize(("before", "include"), [("", False), ("", True), ("界", True)])
def test_a_stop_string_completed_by_byte_tokens_stops_at_once(before: str, include: bool) -> None:
    """(Excluding a stop string preceded by other characters of the same byte run drops the run's
    tokens with it, though its text stays: the run's tokens share one text offset.)"""
    prompt = TOKENIZER.encode("the cat", add_special_tokens=False)
    generated = _byte_ids(before + "😀") + _byte_ids("界😀" * 10) + TOKENIZER.encode(" the", add_special_tokens=False)
    stopping = StoppingParams(max_tokens=200, stop_strings=("😀",), include_stop_in_output=include)
    text, tokens, sampled = _run(generated, stopping, prompt)
    assert sampled == len(_byte_ids(before + "😀"))  # the byte completing the stop string ends it
    assert text == before + ("😀" if include else "")
    assert decode(TOKENIZER, tokens) == text


@pytest.mark.parametrize("ending", ["\n", " 😀", "界"])
def test_the_first_output_token_keeps_its_space_after_a_byte_token_prompt(ending: str) -> None:
    prompt = TOKENIZER.encode("the cat" + ending, add_special_tokens=False)
    assert TOKENIZER.convert_ids_to_tokens(prompt[-1]).startswith("<0x")
    output = TOKENIZER.encode("the end", add_special_tokens=False)  # its first token is '▁the'
    detokenizer = IncrementalDetokenizer(TOKENIZER, prompt)
    text = "".join(detokenizer.add_token(token_id) for token_id in output) + detokenizer.flush()
    assert text == decode(TOKENIZER, prompt + output)[len(decode(TOKENIZER, prompt)):] == " the end"
