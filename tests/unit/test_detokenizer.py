"""IncrementalDetokenizer and token_text against the tokenizer's own ``decode``.

Oracle: ``tokenizer.decode`` of the ids (SmolLM2, byte-level BPE: ``decode(out)``
exactly; the tiny SentencePiece tokenizer: the text the output adds after the
prompt, which keeps the first output token's leading space).
"""

from __future__ import annotations

import copy
import functools
import random

import pytest

from refengine.engine import token_texts as token_texts_module
from refengine.engine.detokenizer import IncrementalDetokenizer
from refengine.engine.output_processor import OutputProcessor
from refengine.engine.token_texts import REPLACEMENT_CHAR, decode, token_text, token_texts, tokenizer_info
from tests.unit.tokenizer_fixture import byte_fallback_tokenizer, smollm2_tokenizer

TEXTS = [
    "Hello, world! The quick brown fox.",
    "naïve café — déjà vu «quotes» ½ ∑ π≈3.14",
    "emoji 😀🎉👍🏽 and a family 👨‍👩‍👧 flag 🇫🇷",
    "中文测试，日本語のテキスト、한국어 텍스트",
    "mixed: 世界😀é  two  spaces\nnew line\ttab",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
]


def run(tokenizer, prompt: list[int], out: list[int]) -> tuple[list[str], str]:
    """Feed ``out`` token by token; return the add_token deltas and the flush tail."""
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.add_token(token_id) for token_id in out]
    return deltas, detok.flush()


def check_stream(tokenizer, prompt: list[int], out: list[int], expected_of, continued_of=None) -> None:
    """Invariants of one stream. ``expected_of(k)`` = oracle text for ``out[:k]``; byte-level BPE:
    ``continued_of(k)`` = oracle texts of ``out[:k]`` and a byte that could still complete a
    character (a delta may end in U+FFFD only where no byte can change it: a literal one)."""
    deltas, tail = run(tokenizer, prompt, out)
    final = expected_of(len(out))
    assert "".join(deltas) + tail == final
    emitted = ""
    for k, delta in enumerate(deltas, start=1):
        assert continued_of is not None or not delta.endswith(REPLACEMENT_CHAR), (prompt, out[:k], delta)
        emitted += delta
        # Never emits text that later changes: a prefix of both the text so far and the final text.
        assert expected_of(k).startswith(emitted), (prompt, out[:k], emitted)
        assert final.startswith(emitted)
        for continued in continued_of(k) if continued_of is not None and delta else ():
            assert continued.startswith(emitted), (prompt, out[:k], emitted, continued)
    if REPLACEMENT_CHAR not in final:
        assert all(REPLACEMENT_CHAR not in delta for delta in [*deltas, tail])


# ---------------------------------------------------------------- SmolLM2 (byte-level BPE)


@functools.cache
def smollm2_byte_pieces() -> list[int]:
    """Ids that are only part of a UTF-8 character (their own text shows U+FFFD)."""
    tok = smollm2_tokenizer()
    return [i for i in range(len(tok)) if REPLACEMENT_CHAR in decode(tok, [i])]


def smollm2_continued(out: list[int], k: int) -> list[str]:
    """``decode`` of ``out[:k]`` and one more byte that continues a character: each lead byte
    takes one of these as its second byte (E0: A0-BF, ED: 80-9F, F0: 90-BF, F4: 80-8F)."""
    tok = smollm2_tokenizer()
    return [decode(tok, [*out[:k], tok.convert_tokens_to_ids(BYTE_CHARS[byte])]) for byte in (0x80, 0x90, 0xA0)]


BYTE_CHARS = {0x80: "Ģ", 0x90: "Ĳ", 0xA0: "ł"}  # GPT-2's byte-to-unicode characters of these bytes


def smollm2_random_ids(rng: random.Random, n: int) -> list[int]:
    tok = smollm2_tokenizer()
    pieces = smollm2_byte_pieces()
    text_ids = [i for text in TEXTS for i in tok.encode(text, add_special_tokens=False)]
    ids = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.45:
            ids.append(rng.choice(pieces))
        elif kind < 0.75:
            ids.append(rng.choice(text_ids))
        elif kind < 0.8:
            ids.append(rng.choice(tok.all_special_ids))
        else:
            ids.append(rng.randrange(len(tok)))
    return ids


def test_smollm2_has_multibyte_pieces() -> None:
    assert len(smollm2_byte_pieces()) > 100  # the random streams really do split characters


@pytest.mark.parametrize("seed", range(8))
def test_smollm2_random_streams_match_decode(seed: int) -> None:
    tok = smollm2_tokenizer()
    rng = random.Random(seed)
    for _ in range(60):
        prompt = smollm2_random_ids(rng, rng.choice([0, 1, 2, 7, 20]))
        out = smollm2_random_ids(rng, rng.randint(1, 40))
        check_stream(tok, prompt, out, lambda k, out=out: decode(tok, out[:k]),
                     lambda k, out=out: smollm2_continued(out, k))


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_encoded_texts(text: str) -> None:
    tok = smollm2_tokenizer()
    chat = tok.apply_chat_template([{"role": "user", "content": "Say it."}], tokenize=False)
    prompt = tok.encode(chat + "<|im_start|>assistant\n", add_special_tokens=False)
    out = tok.encode(text, add_special_tokens=False)
    assert decode(tok, out) == text
    check_stream(tok, prompt, out, lambda k: decode(tok, out[:k]))


def test_smollm2_emoji_held_until_complete() -> None:
    tok = smollm2_tokenizer()
    out = tok.encode(" 😀!", add_special_tokens=False)
    assert len(out) >= 3  # the emoji is split over byte pieces
    deltas, tail = run(tok, tok.encode("Hi", add_special_tokens=False), out)
    assert deltas[0] == ""  # " \xf0\x9f..." is incomplete: held back
    assert "".join(deltas) + tail == " 😀!"
    assert "😀" in "".join(deltas)  # released by add_token once complete, not only by flush


def test_smollm2_incomplete_at_finish_flushes_replacement() -> None:
    tok = smollm2_tokenizer()
    out = tok.encode(" 😀", add_special_tokens=False)[:-1]  # cut the emoji short
    deltas, tail = run(tok, [], out)
    assert "".join(deltas) == ""
    assert tail == decode(tok, out) and tail.endswith(REPLACEMENT_CHAR)


def test_smollm2_token_bytes_read_as_decode() -> None:
    """The byte table the detokenizer judges completeness by: each vocabulary token's bytes, read
    as lossy UTF-8, are what ``decode`` makes of the token; added tokens are left out (``decode``
    writes them as they are)."""
    tok = smollm2_tokenizer()
    token_bytes = tokenizer_info(tok).token_bytes
    assert token_bytes is not None and tokenizer_info(byte_fallback_tokenizer()).token_bytes is None
    assert set(token_bytes) == set(range(len(tok))) - set(tok.get_added_vocab().values())
    for token_id, data in token_bytes.items():
        assert data.decode("utf-8", "replace") == decode(tok, [token_id]), token_id
    assert token_bytes[tok.encode("\ufffd", add_special_tokens=False)[0]] == b"\xef\xbf\xbd"


def test_smollm2_literal_replacement_characters_stream_at_once() -> None:
    """Found by review: a literal U+FFFD (EF BF BD) and a stray byte 80 read U+FFFD just like a
    piece of a character, so the text was held (and decoded again per token) until the output
    ended. Judged by their bytes, they are whole: each token's text comes with it; a piece
    still waits for the bytes that complete its character."""
    tok = smollm2_tokenizer()
    literal = tok.encode("\ufffd" * 40, add_special_tokens=False)
    stray = [tok.convert_tokens_to_ids(BYTE_CHARS[0x80])] * 40
    for out in (literal, stray):
        deltas, tail = run(tok, tok.encode("Hi", add_special_tokens=False), out)
        assert deltas == [REPLACEMENT_CHAR] * 40 and tail == ""
    emoji = tok.encode(" 😀!", add_special_tokens=False)
    deltas, tail = run(tok, [], literal[:1] + emoji)
    assert deltas[:2] == [REPLACEMENT_CHAR, ""] and "".join(deltas) + tail == decode(tok, literal[:1] + emoji)


def test_smollm2_surrogate_bytes_are_not_held() -> None:
    """ED A0-BF would start a surrogate: ``decode`` makes a U+FFFD of each byte at once, and the
    detokenizer sends them at once (found by the oracle fuzz: Python's incremental UTF-8 decoder
    waits on them, so a held window read one U+FFFD short of ``decode``)."""
    tok = smollm2_tokenizer()
    token_bytes = tokenizer_info(tok).token_bytes
    assert token_bytes is not None
    single = {data: token_id for token_id, data in token_bytes.items() if len(data) == 1}
    for second in range(0x80, 0xC0):
        out = [single[b"\xed"], single[bytes((second,))], single[b"\x80"]]
        deltas, tail = run(tok, tok.encode("Hi", add_special_tokens=False), out)
        assert "".join(deltas) + tail == decode(tok, out)
        assert deltas[:2] == (["", REPLACEMENT_CHAR * 2] if second >= 0xA0 else ["", ""]), second


def test_window_stays_short() -> None:
    tok = smollm2_tokenizer()
    out = tok.encode(" ".join(TEXTS) * 20, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [1, 2, 3])
    longest = 0
    for token_id in out:
        detok.add_token(token_id)
        longest = max(longest, len(detok._ids))
    assert longest <= 12  # decoding cost per token does not grow with the output


def test_smollm2_token_text_is_decode_of_one_id() -> None:
    tok = smollm2_tokenizer()
    for token_id in range(len(tok)):
        assert token_text(tok, token_id) == decode(tok, [token_id])
    assert token_text(tok, tok.eos_token_id) == "<|im_end|>"


# ------------------------------------------------- tiny SentencePiece tokenizer with byte fallback


def byte_ids(tok) -> list[int]:
    return [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)]


def sentencepiece_expected(tok, prompt: list[int], out: list[int]) -> str:
    """The text ``out`` adds after ``prompt``; decoded alone when the prompt does not
    end at a stable boundary (a byte token, or an incomplete character)."""
    prompt_text = decode(tok, prompt)
    if not prompt:
        return decode(tok, out)
    if prompt[-1] in byte_ids(tok) or prompt_text.endswith(REPLACEMENT_CHAR):
        a = tok.encode("a", add_special_tokens=False)
        return decode(tok, a + out)[1:]
    full = decode(tok, prompt + out)
    assert full.startswith(prompt_text)
    return full[len(prompt_text) :]


def sentencepiece_random_ids(rng: random.Random, n: int) -> list[int]:
    tok = byte_fallback_tokenizer()
    utf8 = [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "é世界😀".encode()]
    ids = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.3:  # a whole character as bytes, often cut short by the next pick
            start = rng.randrange(len(utf8))
            ids.extend(utf8[start : start + rng.randint(1, 4)])
        elif kind < 0.45:
            ids.append(rng.choice(byte_ids(tok)))
        else:
            ids.append(rng.randrange(len(tok)))
    return ids[:n]


@pytest.mark.parametrize("seed", range(8))
def test_byte_fallback_random_streams_match_decode(seed: int) -> None:
    tok = byte_fallback_tokenizer()
    rng = random.Random(1000 + seed)
    for _ in range(100):
        prompt = sentencepiece_random_ids(rng, rng.choice([0, 0, 1, 3, 9]))
        out = sentencepiece_random_ids(rng, rng.randint(1, 30))
        check_stream(tok, prompt, out, lambda k, p=prompt, o=out: sentencepiece_expected(tok, p, o[:k]))
        if not prompt:
            assert "".join(run(tok, prompt, out)[0]) + run(tok, prompt, out)[1] == decode(tok, out)


def readable_ends_oracle(tok, prompt: list[int], out: list[int]) -> tuple[int, ...]:
    """``token_ends`` by its definition, one ``decode`` per token: where each token's text ends,
    the longest decode of the tokens up to it that the text starts with."""
    prefix = decode(tok, prompt)
    whole = decode(tok, prompt + out)
    ends: list[int | None] = []
    for k in range(1, len(out) + 1):
        partial = decode(tok, prompt + out[:k])
        reads = k == len(out) or (partial.startswith(prefix) and whole.startswith(partial))
        ends.append(len(partial) - len(prefix) if reads else None)
    for i in range(len(ends) - 2, -1, -1):
        ends[i] = ends[i] if ends[i] is not None else ends[i + 1]
    return tuple(end for end in ends if end is not None)


@pytest.mark.parametrize("closed", [True, False])
def test_byte_run_token_ends_match_decode(closed: bool) -> None:
    """Where each token of a released byte-fallback run ends (read from the run's bytes in one
    pass, not decoded per token): valid, invalid and literal U+FFFD runs, closed by a token or by
    ``flush``."""
    tok = byte_fallback_tokenizer()
    prompt = tok.encode("the cat", add_special_tokens=False)
    utf8 = [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "é世\ufffd界😀".encode()]
    rng = random.Random(7)
    for _ in range(300):
        run_ids: list[int] = []
        size = rng.randint(2, 12)
        while len(run_ids) < size:
            start = rng.randrange(len(utf8))
            run_ids += utf8[start : start + rng.randint(1, 4)] if rng.random() < 0.8 else [rng.choice(byte_ids(tok))]
        out = run_ids + tok.encode("the", add_special_tokens=False) if closed else run_ids
        detok = IncrementalDetokenizer(tok, prompt)
        for token_id in out:
            detok.add_token(token_id)
        if not closed:
            detok.flush()
        assert detok.token_ends() == readable_ends_oracle(tok, prompt[-5:], out), out


@pytest.mark.parametrize("closed", [True, False])
def test_smollm2_held_pieces_token_ends_match_decode(closed: bool) -> None:
    """The same for byte-level BPE: tokens ending in a lead byte are held whatever follows; closed
    by a piece, text, a literal U+FFFD or an added token, or by ``flush``."""
    tok = smollm2_tokenizer()
    token_bytes = tokenizer_info(tok).token_bytes
    assert token_bytes is not None
    leads = [i for i, data in token_bytes.items() if data and 0xC2 <= data[-1] <= 0xF4]
    closing = [*smollm2_byte_pieces(), *tok.encode(" the\ufffd", add_special_tokens=False), tok.eos_token_id]
    prompt = tok.encode("the cat", add_special_tokens=False)
    rng = random.Random(8)
    for _ in range(300):
        out = [rng.choice(leads) for _ in range(rng.randint(1, 10))] + ([rng.choice(closing)] if closed else [])
        detok = IncrementalDetokenizer(tok, prompt)
        deltas = [detok.add_token(token_id) for token_id in out]
        if not closed or not "".join(deltas):
            detok.flush()
        assert detok.token_ends() == (readable_ends_oracle(tok, prompt[-5:], out) if len(out) > 1 else None), out


def test_byte_run_completed_then_broken_turns_to_replacements() -> None:
    # The ByteFallback decoder turns a whole run of byte tokens into U+FFFD when any
    # byte is invalid, so a complete "€" is not stable until a non-byte token follows.
    tok = byte_fallback_tokenizer()
    euro = [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "€".encode()]
    stray = tok.convert_tokens_to_ids("<0x80>")
    t = tok.convert_tokens_to_ids("t")
    deltas, tail = run(tok, [], [*euro, stray, t])
    assert "".join(deltas) + tail == decode(tok, [*euro, stray, t]) == "\ufffd" * 4 + "t"
    deltas, tail = run(tok, [], [*euro, t])
    assert deltas == ["", "", "", "€t"] and tail == ""


def test_prompt_context_keeps_leading_space() -> None:
    tok = byte_fallback_tokenizer()
    prompt = tok.encode("the", add_special_tokens=False)
    out = tok.encode("the in", add_special_tokens=False)  # ▁the ▁in
    assert decode(tok, out) == "the in"  # decoded alone, the first space is stripped
    deltas, tail = run(tok, prompt, out)
    assert deltas == [" the", " in"] and tail == ""
    assert "".join(run(tok, [], out)[0]) == "the in"  # no prompt: nothing to separate from


def test_byte_fallback_token_text() -> None:
    tok = byte_fallback_tokenizer()
    assert token_text(tok, tok.convert_tokens_to_ids("▁the")) == " the"  # leading space kept
    assert token_text(tok, tok.convert_tokens_to_ids("世")) == "世"
    assert token_text(tok, tok.convert_tokens_to_ids("<0xE4>")) == REPLACEMENT_CHAR
    assert token_text(tok, tok.eos_token_id) == "</s>"


def test_token_texts_of_many_ids_in_any_order_are_each_ids_text() -> None:
    """``all`` candidates: one call for the vocabulary, in rank order, some ids cached already
    and some not, repeats kept; each answer is what decoding that id says."""
    tok = byte_fallback_tokenizer()
    ids = [tok.convert_tokens_to_ids(t) for t in ("▁the", "<0xE4>", "世", "▁the")] + list(range(len(tok)))[::-1]
    texts = token_texts(tok, ids)
    assert texts[:4] == [" the", REPLACEMENT_CHAR, "世", " the"]
    assert texts[4:] == [token_text(tok, i) for i in reversed(range(len(tok)))]
    assert texts[-1] == decode(tok, [0])


def test_the_byte_table_is_built_when_the_engine_starts_not_at_the_first_request(monkeypatch) -> None:
    """Building SmolLM2's per-token bytes takes 0.2 s (more for a 128k vocabulary): the output
    processor builds it at start-up, so the first request's step does not pay it."""
    tokenizer = copy.deepcopy(smollm2_tokenizer())  # a tokenizer no test has used yet
    OutputProcessor(tokenizer)

    def built_again(*args: object) -> None:
        raise AssertionError("the byte table was built at the first request")

    monkeypatch.setattr(token_texts_module, "_token_bytes", built_again)
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hi", add_special_tokens=False))
    assert detokenizer.add_token(tokenizer.encode(" there", add_special_tokens=False)[0]) == " there"
