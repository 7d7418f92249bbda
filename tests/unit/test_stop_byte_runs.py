"""Byte-fallback tokens (``<0xNN>``, SentencePiece tokenizers of the Llama-2/Mistral kind) and stop
handling, found by review (2026-12-06): a stop string completed inside a run of byte tokens
stops the output at once (before: at the next non-byte token, up to max_tokens later), and a
prompt ending in a byte token (``"\\n"`` is ``<0x0A>``) keeps the first output token's leading
space. Oracle: the tokenizer's own ``decode`` of the tokens."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from refengine.engine.detokenizer import IncrementalDetokenizer, decode
from refengine.types import StoppingParams
from tests.unit.test_stop_checker import sent
from tests.unit.tokenizer_fixture import byte_fallback_tokenizer

TOKENIZER = byte_fallback_tokenizer()


def _byte_ids(text: str) -> list[int]:
    return [TOKENIZER.convert_tokens_to_ids(f"<0x{b:02X}>") for b in text.encode()]


class Sampled(list):
    """The tokens a model would sample, counting how many were taken before the output ended."""

    taken = 0

    def __iter__(self) -> Iterator[int]:
        for token_id in super().__iter__():
            self.taken += 1
            yield token_id


@pytest.mark.parametrize(("before", "include"), [("", False), ("", True), ("界", True)])
def test_a_stop_string_completed_by_byte_tokens_stops_at_once(before: str, include: bool) -> None:
    """(Excluding a stop string preceded by other characters of the same byte run drops the run's
    tokens with it, though its text stays: the run's tokens share one text offset.)"""
    after = _byte_ids("界😀" * 10) + TOKENIZER.encode(" the", add_special_tokens=False)
    generated = Sampled(_byte_ids(before + "😀") + after)
    stopping = StoppingParams(stop_strings=("😀",), include_stop_in_output=include)
    tokens, text, _ = sent(stopping, generated, TOKENIZER)
    assert generated.taken == len(_byte_ids(before + "😀"))  # the byte completing the stop string ends it
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


def test_byte_runs_are_decoded_early_only_for_stop_strings_and_whole_characters(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The early check decodes the held run (found by review: on every byte token, also without
    stop strings, quadratic in the run's length): without stop strings never; with them once per
    completed character, not per byte."""
    from refengine.engine import detokenizer as detokenizer_module
    from refengine.engine.stop_checker import StopChecker, process_token

    byte_ids = _byte_ids("界😀" * 20)  # 40 characters in 140 bytes
    real = detokenizer_module.decode
    decoded: list[int] = []
    for stop_strings, most in (((), 0), (("never",), 40)):
        stopping = StoppingParams(max_tokens=1000, stop_strings=stop_strings)
        stop = StopChecker(stopping, [2], stopping.max_tokens)
        detokenizer = IncrementalDetokenizer(TOKENIZER, TOKENIZER.encode("the cat", add_special_tokens=False))
        decoded.clear()
        monkeypatch.setattr(detokenizer_module, "decode", lambda tok, ids: decoded.append(len(ids)) or real(tok, ids))
        for count, token_id in enumerate(byte_ids, 1):
            process_token(stop, detokenizer, token_id, count)
        monkeypatch.setattr(detokenizer_module, "decode", real)
        assert len(decoded) == most, (stop_strings, len(decoded))
