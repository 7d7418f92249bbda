"""Byte-fallback tokens (``<0xNN>``, SentencePiece tokenizers of the Llama-2/Mistral kind) and stop
handling, found by review (2026-12-06): a stop string completed inside a run of byte tokens
stops the output at once (before: at the next non-byte token, up to max_tokens later), and a
prompt ending in a byte token (``"\\n"`` is ``<0x0A>``) keeps the first output token's leading
space. Oracle: the tokenizer's own ``decode`` of the tokens."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator

import pytest

from refengine.engine.detokenizer import IncrementalDetokenizer, decode
from refengine.types import StoppingParams
from tests.unit.test_stop_checker import sent
from tests.unit.tokenizer_fixture import byte_fallback_tokenizer, smollm2_tokenizer

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


@pytest.mark.parametrize(("before", "include"), [("", False), ("", True), ("界", True), ("界", False)])
def test_a_stop_string_completed_by_byte_tokens_stops_at_once(before: str, include: bool) -> None:
    """Excluded, the stop string's bytes are dropped and those of the characters before it in the
    same run are sent (they were dropped too until a review: the run's tokens shared one offset)."""
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


def _held_runs() -> dict[str, tuple[object, list[int], int]]:
    """2,000 tokens that each leave text held back before this fix (and the token whose step
    first sends text): byte-fallback bytes of emoji; on SmolLM2 (byte-level BPE), literal U+FFFD
    tokens (EF BF BD) and a stray continuation byte 80 (GPT-2's character "Ģ"), which read as
    U+FFFD just like a piece of a character, and 'ĠðŁĺ' (a space, then 3 bytes of "😀"), each
    of which leaves a piece of a character that the next one makes U+FFFD."""
    smollm2 = smollm2_tokenizer()
    return {
        "byte-fallback emoji": (TOKENIZER, _byte_ids("😀" * 500), 2000),
        "SmolLM2 literal U+FFFD": (smollm2, smollm2.encode("\ufffd" * 2000, add_special_tokens=False), 1),
        "SmolLM2 stray byte 80": (smollm2, [smollm2.convert_tokens_to_ids("Ģ")] * 2000, 1),
        "SmolLM2 pieces": (smollm2, [smollm2.convert_tokens_to_ids("ĠðŁĺ")] * 2000, 2000),
    }


@pytest.mark.parametrize("case", ["byte-fallback emoji", "SmolLM2 literal U+FFFD", "SmolLM2 stray byte 80",
                                  "SmolLM2 pieces"])
@pytest.mark.parametrize("stop_strings", [(), ("never",)])
def test_a_long_held_run_costs_linear_decoding(monkeypatch: pytest.MonkeyPatch, case: str,
                                               stop_strings: tuple[str, ...]) -> None:
    """Found by review: held text was decoded again for every token (to judge it, and to peek at
    it for stop strings), and each token of a run released at once again to place it: O(n²) on
    the step thread (8,000 tokens: 5-17 s). Now at most 3 decodes per token, of a few ids each:
    the tokens decoded in all stay within 16 per output token (it was over 1,000; and with the
    held pieces, each token was placed by a decode at the end), and the stop
    checker reads each held character about once, not the whole held text per token."""
    from refengine.engine import detokenizer as detokenizer_module
    from refengine.engine.stop_checker import StopChecker, process_token

    tokenizer, out, first_text_at = _held_runs()[case]
    assert len(out) == 2000 and decode(tokenizer, out).count("\ufffd") == (0 if tokenizer is TOKENIZER else 2000)
    real, decoded = detokenizer_module.decode, []
    monkeypatch.setattr(detokenizer_module, "decode", lambda tok, ids: decoded.append(len(ids)) or real(tok, ids))
    stopping = StoppingParams(max_tokens=len(out), stop_strings=stop_strings)  # an excluded stop: tokens placed
    stop = StopChecker(stopping, [tokenizer.eos_token_id], len(out))
    steps: list[str] = []
    if stop_strings:
        automaton = stop._automaton
        real_step = automaton.step
        monkeypatch.setattr(automaton, "step", lambda state, ch: steps.append(ch) or real_step(state, ch))
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("the cat", add_special_tokens=False))
    text, first_text = "", None
    for count, token_id in enumerate(out, 1):
        step = process_token(stop, detokenizer, token_id, count)
        text += step.text
        first_text = first_text or (step.text and count)
    assert step.finish is not None and text == decode(tokenizer, out)
    assert first_text == first_text_at
    assert len(decoded) <= 3 * len(out) and sum(decoded) <= 16 * len(out), (len(decoded), sum(decoded))
    assert len(steps) <= 3 * len(text), len(steps)


_LONG_RUNS = ["SmolLM2 pieces", "byte-fallback emoji", "byte-fallback invalid bytes"]  # held to their end


def _long_run(case: str, num_tokens: int, min_tokens: int) -> tuple[object, object, list[int]]:
    """``case`` to ``num_tokens`` tokens: the stop checker (a stop string that never matches), the
    detokenizer and the tokens, for ``process_token``."""
    from refengine.engine.stop_checker import StopChecker

    tokenizer, unit = TOKENIZER, _byte_ids("😀")
    if case == "SmolLM2 pieces":
        tokenizer = smollm2_tokenizer()
        unit = [tokenizer.convert_tokens_to_ids("ĠðŁĺ")]  # a space, then 3 of the 4 bytes of 😀
    elif case == "byte-fallback invalid bytes":
        unit = unit[1:2]  # a continuation byte alone: U+FFFD each
    stopping = StoppingParams(stop_strings=("never",), min_tokens=min_tokens)
    stop = StopChecker(stopping, [tokenizer.eos_token_id], num_tokens + 1)
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("the cat", add_special_tokens=False))
    return stop, detokenizer, (unit * num_tokens)[:num_tokens]


def _bytes_allocated_per_token(case: str, num_tokens: int, min_tokens: int) -> float:
    """Streamed through ``process_token``, per token: the memory its step allocated at its peak above
    what was live before it (tracemalloc counts each allocation: a copy of the held text is one as
    long as that text)."""
    from refengine.engine.stop_checker import process_token

    stop, detokenizer, out = _long_run(case, num_tokens, min_tokens)
    total = 0
    tracemalloc.start()
    try:
        for count, token_id in enumerate(out, 1):
            live = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            step = process_token(stop, detokenizer, token_id, count)
            total += tracemalloc.get_traced_memory()[1] - live
    finally:
        tracemalloc.stop()
    assert step.text_pending  # the whole run is held: its text never came
    return total / num_tokens


@pytest.mark.parametrize("case", _LONG_RUNS)
@pytest.mark.parametrize("min_tokens", [0, 4])
def test_a_long_held_run_copies_its_text_linearly(case: str, min_tokens: int) -> None:
    """Found by review: the held text was joined again for every token (the stop-string check read
    it whole, and with min_tokens so did the check of which characters the first tokens made), a
    copy as long as the run per token, O(n²) on the step thread (8,000 pieces: 0.34 s; 0.8 s with
    min_tokens). Counted in bytes allocated, not timed: per token, as many at 4,000 tokens as at
    1,000 (it was 2 to 3.6 times as many)."""
    short, long = (_bytes_allocated_per_token(case, n, min_tokens) for n in (1000, 4000))
    assert long <= 1.25 * short + 64, (short, long)


@pytest.mark.parametrize("case", _LONG_RUNS)
def test_the_first_tokens_characters_in_a_long_held_run_are_placed_once_final(monkeypatch: pytest.MonkeyPatch,
                                                                             case: str) -> None:
    """With min_tokens, which characters of a held run the first tokens made was worked out again for
    every token, in a pass over their bytes: O(min_tokens) a token (229 µs at min_tokens 128 for 4,000
    pieces). The held text only grows, so once it has all the characters they may reach, the answer is
    kept: a pass per token only until then (here 1 to 97 passes in 4,000 tokens; it was up to 3,936)."""
    from refengine.engine import detokenizer as detokenizer_module
    from refengine.engine.stop_checker import process_token

    passes = []
    for name in ("stream_ends", "run_ends"):
        real = getattr(detokenizer_module, name)
        monkeypatch.setattr(detokenizer_module, name, lambda *args, real=real: passes.append(1) or real(*args))
    stop, detokenizer, out = _long_run(case, 4000, min_tokens=64)
    for count, token_id in enumerate(out, 1):
        assert not process_token(stop, detokenizer, token_id, count).text
    assert 0 < len(passes) <= 400, len(passes)


@pytest.mark.parametrize("stop_string", [" ", "Hi "])
def test_a_stop_string_before_a_byte_level_piece_stops_at_once(stop_string: str) -> None:
    """SmolLM2's 'ĠðŁĺ' is a space, then 3 of the 4 bytes of "😀": the space is whole, so a stop
    string it completes ends the output with that token, not once the emoji is (the whole
    characters of held byte-level pieces are checked as they come)."""
    tokenizer = smollm2_tokenizer()
    generated = Sampled(tokenizer.encode("Hi 😀 there", add_special_tokens=False))  # Hi ĠðŁĺ Ģ Ġthere
    tokens, text, finish = sent(StoppingParams(stop_strings=(stop_string,)), generated, tokenizer)
    assert finish.stop_text == stop_string and generated.taken == 2
    assert text == "Hi" if stop_string == " " else text == ""
    assert decode(tokenizer, tokens) == text


def test_an_excluded_stop_string_keeps_the_tokens_logprobs_and_count_of_the_text_it_keeps() -> None:
    """Found by review (a fuzz against ``decode``: 124 of 36,500 cases): with "界😀" in one byte
    run and stop "😀" excluded, the text " a 界" was sent with the tokens of " a" only, so
    decode(tokens) != text, the logprobs of 界's bytes were missing and completion_tokens was 2."""
    from refengine.engine.admission import make_outputs
    from refengine.engine.output_processor import OutputProcessor
    from refengine.engine.request import Request
    from refengine.sampling.sampler import SampledToken
    from refengine.types import GenerationRequest, LogprobParams

    prompt = TOKENIZER.encode("the cat", add_special_tokens=False)
    generated = TOKENIZER.encode("a 界😀 the", add_special_tokens=False)  # ▁a ▁ <E7><95><8C> <F0>..<80> ▁the
    params = GenerationRequest("r", prompt_token_ids=prompt, logprobs=LogprobParams(output_logprobs=True),
                               stopping=StoppingParams(max_tokens=20, stop_strings=("😀",)))
    request = Request(params, prompt, max_tokens=20)
    request.outputs = make_outputs(request, TOKENIZER, (TOKENIZER.eos_token_id,), "fp")
    out, processor = request.outputs[0], OutputProcessor(TOKENIZER)
    text, tokens = "", []
    for i, token_id in enumerate(generated):
        delta = processor.append_token(request, out, SampledToken(token_id, -0.1 * (i + 1), 1, ()))
        text, tokens = text + delta.text, tokens + list(delta.tokens)
        if delta.finish:
            break
    assert delta.finish is not None and delta.finish.stop_text == "😀"
    assert text == " a 界"
    assert decode(TOKENIZER, [t.token_id for t in tokens]) == "a 界"
    assert [t.logprob for t in tokens] == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5])
    assert out.num_emitted_tokens == 5


def test_an_excluded_stop_string_after_an_invalid_byte_run_keeps_its_replacement_character() -> None:
    """Byte-level BPE (SmolLM2): a truncated emoji (F0 9F 8E) reads "\ufffd" once "🎉" follows;
    with stop "🎉" excluded that character is sent, so its tokens are too (they were not)."""
    tokenizer = smollm2_tokenizer()
    truncated = [10813, 232]  # 'ðŁ' 'İ': F0 9F 8E
    assert decode(tokenizer, truncated) == "\ufffd"
    out = truncated + tokenizer.encode("🎉 ok", add_special_tokens=False)
    tokens, text, finish = sent(StoppingParams(stop_strings=("🎉",)), out, tokenizer)
    assert finish.stop_text == "🎉" and text == "\ufffd"
    assert decode(tokenizer, tokens) == text


def test_a_dropped_stop_token_places_the_run_its_step_released() -> None:
    """A dropped stop token or EOS whose step flushes held tokens hands their ends over too
    (``token`` None): an excluded stop string found in that text keeps the tokens before it."""
    from refengine.engine.token_hold_back import TokenHoldBack
    from refengine.types import FinishInfo, FinishReason, TokenInfo

    held = TokenHoldBack(include_stop_in_output=False)
    first, second = TokenInfo(1, ""), TokenInfo(2, "")
    held.add(first, 0, True, 0)
    held.add(second, 0, True, 0)
    held.add(None, 3, False, 3, token_ends=(1, 3))  # the run reads "ab!" : "a" first, "b!" second
    stop = FinishInfo(FinishReason.STOP, stop_text="b!")
    assert held.release(1, stop) == (first,)


def test_a_replacement_character_stop_string_waits_for_a_character_split_across_tokens() -> None:
    """Found by review: byte-level BPE splits "😀" in two pieces; after the first the held text
    reads "\ufffd", which the early check took as final, so stop "\ufffd" ended 2,686 of 3,000
    valid outputs at their first such character."""
    tokenizer = smollm2_tokenizer()
    out = tokenizer.encode("Hi 😀 there, bye now", add_special_tokens=False)
    assert "\ufffd" not in decode(tokenizer, out)
    out.append(tokenizer.eos_token_id)
    tokens, text, finish = sent(StoppingParams(stop_strings=("\ufffd",)), out, tokenizer)
    assert finish.stop_text is None and text == "Hi 😀 there, bye now"
    assert decode(tokenizer, tokens) == text


@pytest.mark.parametrize("include", [False, True])
def test_min_tokens_protects_the_text_of_its_tokens_that_a_byte_run_releases_later(include: bool) -> None:
    """Found by review: "\\n" is the byte token <0x0A>; as the first token, with min_tokens 1 and stop
    "\\n", its text came with token 2, past min_tokens, and the output stopped there, empty. A stop
    string completed by one of the first min_tokens tokens never ends the output, whichever token
    releases its text; one completed by a later token of the same run does."""
    words = TOKENIZER.encode("the end", add_special_tokens=False)
    stopping = StoppingParams(stop_strings=("\n",), min_tokens=1, include_stop_in_output=include)
    _, text, finish = sent(stopping, _byte_ids("\n") + words, TOKENIZER)
    assert finish.stop_text is None and text == decode(TOKENIZER, _byte_ids("\n") + words)
    later = _byte_ids("\n\n") + words  # the 2nd "\n" is token 2: past min_tokens, in the same run
    tokens, text, finish = sent(stopping, later, TOKENIZER)
    assert finish.stop_text == "\n" and text == ("\n\n" if include else "\n")
    assert decode(TOKENIZER, tokens) == text
    accent = _byte_ids("é") + words  # é is completed by token 2 of 2 bytes
    for min_tokens, stops in ((2, False), (1, True)):
        _, _, finish = sent(StoppingParams(stop_strings=("é",), min_tokens=min_tokens), accent, TOKENIZER)
        assert (finish.stop_text == "é") is stops, (min_tokens, finish)


@pytest.mark.parametrize("min_tokens", [1, 2, 3])
def test_min_tokens_protects_each_byte_of_a_whole_character_that_a_later_byte_turns_invalid(min_tokens: int) -> None:
    """Found by review: the run 'é' + E4 B8 4D reads as one U+FFFD per byte once 4D makes it invalid.
    The first min_tokens tokens' characters are their bytes' U+FFFDs, as for a run cut short; the
    bytes of 'é' (complete before) had none but the first, so with min_tokens 2 the stop string
    '\\ufffd\\ufffd' ended on the second byte's U+FFFD (text '\\ufffd\\ufffd', expected three)."""
    out = _byte_ids("é") + [TOKENIZER.convert_tokens_to_ids(f"<0x{b:02X}>") for b in (0xE4, 0xB8, 0x4D)]
    out += TOKENIZER.encode("the end", add_special_tokens=False)
    assert decode(TOKENIZER, out).startswith("\ufffd" * 5)
    stopping = StoppingParams(stop_strings=("\ufffd\ufffd",), min_tokens=min_tokens, include_stop_in_output=True)
    _, text, finish = sent(stopping, out, TOKENIZER)
    assert finish.stop_text == "\ufffd\ufffd" and text == "\ufffd" * (min_tokens + 1)
