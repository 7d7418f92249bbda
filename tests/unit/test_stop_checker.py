"""StopChecker (G13-G15) and process_token, with Python's ``str.find`` as the stop-string oracle.

Matching rule under test: the stop string completed first reading left to right
wins; among those completing at the same character, the longest.
"""

from __future__ import annotations

import random
import time

import pytest
from transformers import PreTrainedTokenizerBase

from refengine.engine.detokenizer import IncrementalDetokenizer, decode
from refengine.engine.stop_checker import StopChecker, process_token
from refengine.engine.token_hold_back import TokenHoldBack
from refengine.types import FinishInfo, FinishReason, StoppingParams, TokenInfo
from tests.unit.tokenizer_fixture import byte_fallback_tokenizer, smollm2_tokenizer

EOS = 2


def checker(max_tokens: int = 100, eos: tuple[int, ...] = (EOS,), **stopping) -> StopChecker:
    return StopChecker(StoppingParams(**stopping), eos, max_tokens)


# ---------------------------------------------------------------- tokens: EOS, stop ids, length


def test_eos_stops_and_names_the_eos_token() -> None:
    stop = checker()
    assert stop.check_token(5, 1) is None
    assert stop.check_token(EOS, 2) == FinishInfo(FinishReason.STOP, eos_token_id=EOS)
    assert stop.should_drop_stop_token


def test_stop_token_id_names_the_stop_token_also_when_it_is_eos() -> None:
    stop = checker(stop_token_ids=(7, EOS))
    assert stop.check_token(7, 1) == FinishInfo(FinishReason.STOP, stop_token_id=7)
    assert checker(stop_token_ids=(EOS,)).check_token(EOS, 1) == FinishInfo(FinishReason.STOP, stop_token_id=EOS)


def test_several_eos_ids() -> None:
    stop = checker(eos=(2, 9))
    assert stop.check_token(9, 1) == FinishInfo(FinishReason.STOP, eos_token_id=9)


def test_ignore_eos_never_stops_at_eos_but_stop_ids_still_work() -> None:
    stop = checker(ignore_eos=True, stop_token_ids=(7,))
    assert all(stop.check_token(EOS, n) is None for n in range(1, 50))
    assert stop.check_token(7, 50) == FinishInfo(FinishReason.STOP, stop_token_id=7)
    assert checker(ignore_eos=True, stop_token_ids=(EOS,)).check_token(EOS, 1).stop_token_id == EOS


@pytest.mark.parametrize("min_tokens", [0, 1, 3])
def test_min_tokens_suppresses_eos_and_stop_ids(min_tokens: int) -> None:
    stop = checker(min_tokens=min_tokens, stop_token_ids=(7,))
    for n in range(1, min_tokens + 1):  # the n-th token; min_tokens tokens are produced first
        assert stop.check_token(EOS, n) is None
        assert stop.check_token(7, n) is None
    assert stop.check_token(EOS, min_tokens + 1) == FinishInfo(FinishReason.STOP, eos_token_id=EOS)
    assert stop.check_token(7, min_tokens + 1) == FinishInfo(FinishReason.STOP, stop_token_id=7)


def test_suppressed_token_ids_for_the_sampler() -> None:
    stop = checker(min_tokens=2, stop_token_ids=(7,))
    assert stop.suppressed_token_ids(0) == stop.suppressed_token_ids(1) == {7, EOS}
    assert stop.suppressed_token_ids(2) == frozenset()
    assert checker(min_tokens=2, ignore_eos=True).suppressed_token_ids(0) == frozenset()


def test_max_tokens_gives_length_and_stop_wins_on_the_same_token() -> None:
    stop = checker(max_tokens=3)
    assert stop.check_token(5, 2) is None
    assert stop.check_token(5, 3) == FinishInfo(FinishReason.LENGTH)
    assert checker(max_tokens=3).check_token(EOS, 3) == FinishInfo(FinishReason.STOP, eos_token_id=EOS)
    # min_tokens == max_tokens: the last token may not stop as EOS, it ends by length
    assert checker(max_tokens=3, min_tokens=3).check_token(EOS, 3) == FinishInfo(FinishReason.LENGTH)


def test_include_stop_in_output_keeps_the_stop_token() -> None:
    stop = checker(include_stop_in_output=True, stop_token_ids=(7,))
    assert stop.check_token(7, 1) is not None and not stop.should_drop_stop_token
    stop = checker(stop_token_ids=(7,))
    assert stop.check_token(5, 1) is None and not stop.should_drop_stop_token
    assert stop.check_token(7, 2) is not None and stop.should_drop_stop_token


# ---------------------------------------------------------------- stop strings


def expected_match(text: str, stops: list[str]) -> tuple[int, str] | None:
    """(end, stop) of the first stop string to complete in ``text``, ties -> longest."""
    found = [(text.find(s) + len(s), -len(s), s) for s in stops if s and text.find(s) >= 0]
    return (min(found)[0], min(found)[2]) if found else None


def longest_partial(text: str, prefixes: set[str]) -> int:
    """Length of the longest suffix of ``text`` that is a prefix of a stop string."""
    return max((k for k in range(1, len(text) + 1) if text[-k:] in prefixes), default=0)


def random_split(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, len(text))))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def feed_all(stop: StopChecker, deltas: list[str], stops: list[str], include: bool, text: str):
    """Feed deltas, checking at every point that exactly the right text was emitted."""
    expected = expected_match(text, stops)
    final = text if expected is None else text[: expected[0] - (0 if include else len(expected[1]))]
    prefixes = {s[:k] for s in stops for k in range(1, len(s) + 1)}
    emitted, consumed = "", ""
    for delta in deltas:
        consumed += delta
        out, finish = stop.feed_text(delta)
        emitted += out
        assert final.startswith(emitted), "emitted past the match, or something else"
        if finish is not None:
            assert expected is not None and finish == FinishInfo(FinishReason.STOP, stop_text=expected[1])
            assert emitted == final and len(consumed) >= expected[0]
            assert stop.feed_text("more text") == ("", None) and stop.finish_text() == ""
            return emitted, finish
        assert expected is None or len(consumed) < expected[0]
        # Held back: exactly the longest suffix that could still start a stop string.
        assert emitted == consumed[: len(consumed) - longest_partial(consumed[-50:], prefixes)]
    assert expected is None
    emitted += stop.finish_text()
    assert emitted == text
    return emitted, None


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_random_texts_random_deltas(seed: int, include: bool) -> None:
    rng = random.Random(seed)
    alphabet = "ab c\né世😀"
    for _ in range(600):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 4))]
        if text and rng.random() < 0.5:  # make sure matches happen, also inside one another
            a = rng.randrange(len(text))
            stops.append(text[a : a + rng.randint(1, 6)])
        stop = checker(stop_strings=tuple(stops), include_stop_in_output=include)
        feed_all(stop, random_split(rng, text), stops, include, text)


@pytest.mark.parametrize(
    ("stops", "text", "emitted", "stop_text"),
    [
        (["abcd", "bc"], "abcdef", "a", "bc"),  # "bc" completes first
        (["ab", "abc"], "abcdef", "", "ab"),  # "ab" completes first
        (["bc", "abc"], "xabcd", "x", "abc"),  # same end: the longest
        (["cd", "abcd", "bcd"], "abcde", "", "abcd"),
        (["世界", "界"], "你好世界！", "你好", "世界"),
        (["😀x"], "a😀😀xb", "a😀", "😀x"),
        (["aab"], "aaab", "a", "aab"),  # the partial match restarts correctly
    ],
)
def test_overlapping_stop_strings(stops: list[str], text: str, emitted: str, stop_text: str) -> None:
    for include in (False, True):
        for deltas in ([text], list(text)):
            stop = checker(stop_strings=tuple(stops), include_stop_in_output=include)
            out, finish = feed_all(stop, deltas, stops, include, text)
            assert out == emitted + (stop_text if include else "")
            assert finish == FinishInfo(FinishReason.STOP, stop_text=stop_text)


def test_empty_and_duplicate_stop_strings_are_ignored() -> None:
    stop = checker(stop_strings=("", "x", "x"))
    assert stop.feed_text("ab") == ("ab", None)
    assert stop.feed_text("cxd") == ("c", FinishInfo(FinishReason.STOP, stop_text="x"))


def test_no_stop_strings_passes_text_through() -> None:
    stop = checker()
    assert stop.feed_text("abc") == ("abc", None) and stop.finish_text() == ""


def test_thousands_of_stop_strings() -> None:
    rng = random.Random(7)
    alphabet = "abcdefghij klmnopé世"
    stops = list({"".join(rng.choice(alphabet) for _ in range(rng.randint(4, 12))) for _ in range(5000)})
    for trial in range(20):
        text = "".join(rng.choice(alphabet) for _ in range(2000))
        if trial % 2:
            at = rng.randrange(len(text))
            text = text[:at] + rng.choice(stops) + text[at:]
        for include in (False, True):
            stop = checker(stop_strings=tuple(stops), include_stop_in_output=include)
            feed_all(stop, random_split(rng, text)[:3000], stops, include, text)
    # Per character cost does not depend on the number of stop strings.
    text = "".join(rng.choice("qrstuvwxyz") for _ in range(20000))  # never matches
    timings = []
    for stop_strings in (tuple(stops[:4]), tuple(stops)):
        stop = checker(stop_strings=stop_strings)
        start = time.perf_counter()
        for i in range(0, len(text), 4):
            stop.feed_text(text[i : i + 4])
        timings.append(time.perf_counter() - start)
    assert timings[1] < 5 * timings[0] + 0.05


# ---------------------------------------------------------------- process_token with a real tokenizer


def generate(stopping: StoppingParams, out: list[int], max_tokens: int | None = None, prompt=(1,)):
    """Drive process_token like the engine: returns (kept tokens, text, finish)."""
    tok = smollm2_tokenizer()
    stop = StopChecker(stopping, (tok.eos_token_id,), max_tokens or len(out))
    detok = IncrementalDetokenizer(tok, list(prompt))
    kept, text = [], ""
    for n, token_id in enumerate(out, start=1):
        step = process_token(stop, detok, token_id, n)
        kept += [token_id] if step.keep_token else []
        text += step.text
        if step.finish is not None:
            return kept, text, step.finish
    raise AssertionError("the output never finished")


def sent(stopping: StoppingParams, out: list[int], tok: PreTrainedTokenizerBase | None = None,
         ) -> tuple[list[int], str, FinishInfo]:
    """Drive process_token and TokenHoldBack as the engine's output processor does: returns
    (the token ids sent, the text sent, finish)."""
    tok = tok or smollm2_tokenizer()
    stop = StopChecker(stopping, (tok.eos_token_id,), len(out))
    detok = IncrementalDetokenizer(tok, [1])
    held = TokenHoldBack(stopping.include_stop_in_output)
    tokens, text = [], ""
    for n, token_id in enumerate(out, start=1):
        step = process_token(stop, detok, token_id, n)
        held.add(TokenInfo(token_id, "") if step.keep_token else None, step.num_detokenized_chars, step.text_pending,
                 step.num_chars_before, step.token_ends)
        tokens += [t.token_id for t in held.release(len(step.text), step.finish)]
        text += step.text
        if step.finish is not None:
            return tokens, text, step.finish
    raise AssertionError("the output never finished")


@pytest.mark.parametrize("include", [False, True])
def test_byte_pieces_of_an_excluded_stop_string_are_not_sent(include: bool) -> None:
    """G14: a multi-byte stop string's first byte-piece tokens add no text on their own; they
    are held with the token that completes the character, so an excluded stop string keeps
    them out of the tokens too (they went out before: the tokens decoded to '😀\ufffd')."""
    tok = smollm2_tokenizer()
    out = tok.encode("😀😃 日本語", add_special_tokens=False)
    assert len(out) > 4, "the emoji are byte pieces in SmolLM2's vocabulary"
    tokens, text, finish = sent(StoppingParams(stop_strings=("😃",), include_stop_in_output=include), out)
    assert finish == FinishInfo(FinishReason.STOP, stop_text="😃")
    assert text == ("😀😃" if include else "😀") and decode(tok, tokens) == text


@pytest.mark.parametrize(("pieces", "stop", "kept", "text"), [
    (["<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "▁the"], "the", 4, "😀 "),
    (["<0xC3>", "<0xA9>", "▁the"], "the", 2, "é "),
    (["<0x67>", "a", "<0x6D>", "<0x6D>", "a"], "m", 2, "ga"),  # the run's own text holds the stop string
    (["a", "<0xC3>", "<0xA9>"], "é", 1, "a"),  # the run's text comes with the last token's flush
])
def test_a_byte_fallback_run_ends_where_its_own_text_ends(pieces: list[str], stop: str, kept: int, text: str) -> None:
    """G11/G14 with SentencePiece byte fallback: a run of byte tokens is decoded only with the
    next whole token. When that token's text holds an excluded stop string, the run's tokens,
    whose text comes before it and is sent, are sent too (they were dropped: text '😀 ' with no
    tokens); a run whose own text reaches into the stop string is still dropped."""
    tok = byte_fallback_tokenizer()
    out = tok.convert_tokens_to_ids(pieces)
    tokens, sent_text, finish = sent(StoppingParams(stop_strings=(stop,)), out, tok)
    assert finish == FinishInfo(FinishReason.STOP, stop_text=stop)
    assert (tokens, sent_text) == (out[:kept], text)


def test_eos_excluded_or_included() -> None:
    tok = smollm2_tokenizer()
    body = tok.encode("Hello 😀 world", add_special_tokens=False)
    out = [*body, tok.eos_token_id, 5, 6]
    kept, text, finish = generate(StoppingParams(), out)
    assert (kept, text) == (body, "Hello 😀 world")
    assert finish == FinishInfo(FinishReason.STOP, eos_token_id=tok.eos_token_id)
    kept, text, finish = generate(StoppingParams(include_stop_in_output=True), out)
    assert (kept, text) == (out[: len(body) + 1], "Hello 😀 world<|im_end|>")
    _, text, finish = generate(StoppingParams(ignore_eos=True), out)
    assert text == decode(tok, out) and finish == FinishInfo(FinishReason.LENGTH)


def test_stop_string_across_tokens_and_multibyte_pieces() -> None:
    tok = smollm2_tokenizer()
    out = tok.encode("Say 😀👍 then stop here", add_special_tokens=False)
    for include, expected in ((False, "Say "), (True, "Say 😀👍")):
        kept, text, finish = generate(StoppingParams(stop_strings=("😀👍",), include_stop_in_output=include), out)
        assert (text, finish) == (expected, FinishInfo(FinishReason.STOP, stop_text="😀👍"))
        assert decode(tok, kept).startswith("Say 😀👍")  # tokens up to the completing one are kept


def test_length_releases_held_text_and_incomplete_bytes() -> None:
    tok = smollm2_tokenizer()
    out = tok.encode("one two thr 😀", add_special_tokens=False)[:-1]  # ends mid-emoji
    kept, text, finish = generate(StoppingParams(stop_strings=("three",)), out)
    assert text == decode(tok, out) and text.endswith("thr \ufffd")
    assert finish == FinishInfo(FinishReason.LENGTH) and kept == out


@pytest.mark.parametrize("include", [False, True])
def test_random_smollm2_streams_with_stop_strings(include: bool) -> None:
    tok = smollm2_tokenizer()
    rng = random.Random(11)
    pieces = tok.encode("Hi 世界 😀🎉 café, déjà; naïve fox. 한국어", add_special_tokens=False)
    for _ in range(150):
        out = [rng.choice(pieces) if rng.random() < 0.8 else rng.randrange(len(tok)) for _ in range(30)]
        full = decode(tok, out)
        clean = [s for s in (full[a : a + rng.randint(1, 5)] for a in range(len(full))) if "\ufffd" not in s]
        stops = rng.sample(clean, min(3, len(clean))) + ["never-there"]
        stopping = StoppingParams(stop_strings=tuple(stops), include_stop_in_output=include, ignore_eos=True)
        kept, text, finish = generate(stopping, out)
        tokens_sent, text_sent, _ = sent(stopping, out)
        assert text_sent == text
        match = expected_match(full, stops)
        if match is None:
            assert (text, finish, kept) == (full, FinishInfo(FinishReason.LENGTH), out)
            assert tokens_sent == out
        else:
            end, stop_text = match
            assert text == full[: end if include else end - len(stop_text)]
            assert finish == FinishInfo(FinishReason.STOP, stop_text=stop_text)
            assert len(decode(tok, kept)) >= end  # the token completing the match is the last kept
            # G14: the tokens sent never reach into an excluded stop string (nor, with it
            # included, stop short of it); a byte piece alone would decode to U+FFFD here.
            sent_text = decode(tok, tokens_sent)
            assert text.startswith(sent_text) if not include else sent_text.startswith(text), (sent_text, text)


def test_per_token_cost() -> None:
    """add_token + feed_text per token on SmolLM2 text (printed with -s)."""
    tok = smollm2_tokenizer()
    out = tok.encode(("The quick brown fox jumps over the lazy dog. 世界 😀 café. " * 200), add_special_tokens=False)
    rng = random.Random(3)
    many = tuple("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(8)) for _ in range(5000))
    for name, stops in (("none", ()), ("4 stops", ("<|user|>", "\n\n", "###", "END")), ("5000 stops", many)):
        stop = StopChecker(StoppingParams(stop_strings=stops), (EOS,), len(out) + 1)
        detok = IncrementalDetokenizer(tok, [1])
        start = time.perf_counter()
        for token_id in out:
            stop.feed_text(detok.add_token(token_id))
        per_token = (time.perf_counter() - start) / len(out) * 1e6
        print(f"{name}: {per_token:.1f} us/token over {len(out)} tokens")
        assert per_token < 500


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_ends_the_output_only_after_min_tokens(include: bool) -> None:
    """G15 names EOS and stop tokens; stop strings follow them (as vLLM and SGLang do): " b"
    completed by the 2nd token of min_tokens 3 is passed over, the one the 5th token completes
    stops the output, and a stop string begun inside min_tokens may complete after it."""
    tok = smollm2_tokenizer()
    out = tok.encode(" a b c b d e", add_special_tokens=False)
    assert len(out) == 6
    stopping = StoppingParams(stop_strings=(" b",), min_tokens=3, include_stop_in_output=include)
    tokens, text, finish = sent(stopping, out, tok)
    assert finish.stop_text == " b" and text == (" a b c b" if include else " a b c")
    assert decode(tok, tokens) == text
    spanning = StoppingParams(stop_strings=(" c b",), min_tokens=3, include_stop_in_output=include)
    _, text, finish = sent(spanning, out, tok)  # " c" is token 3 (inside min_tokens), " b" token 4
    assert finish.stop_text == " c b" and text == (" a b c b" if include else " a b")
    _, text, finish = sent(StoppingParams(stop_strings=(" b",), min_tokens=0), out, tok)
    assert text == " a" and finish.stop_text == " b"  # the control: without min_tokens the first " b"
