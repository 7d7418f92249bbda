"""G7 before tokenizing: a prompt text too long to fit the context is refused without being
tokenized (``input_processor.max_prompt_chars``), and the bound never refuses a text that fits.

The oracle for the second part is the real tokenizers (SmolLM2's byte-level BPE, like Llama 3's,
and a SentencePiece tokenizer with byte fallback): on texts built to need few tokens per
character (the vocabulary's longest tokens repeated, whitespace runs, combining marks, Hangul
jamo, emoji, mixed scripts), every tokenization has at least the bound's minimum of tokens."""

from __future__ import annotations

import random
import time

import pytest

from refengine.engine.input_processor import NORMALIZER_SHRINK, max_prompt_chars
from refengine.types import GenerationRequest, InvalidRequestError, StoppingParams
from tests.unit.test_engine import assert_idle, make_engine, tiny  # noqa: F401 - tiny is a fixture
from tests.unit.tokenizer_fixture import byte_fallback_tokenizer, smollm2_tokenizer

TOKENIZERS = {"smollm2 byte-level BPE": smollm2_tokenizer, "sentencepiece byte fallback": byte_fallback_tokenizer}


class CountingTokenizer:
    """The engine's tokenizer, counting the texts it was asked to encode."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner, self.encoded = inner, 0

    def encode(self, text: str, **options):  # noqa: ANN003, ANN201
        self.encoded += 1
        return self.inner.encode(text, **options)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)


def test_a_text_past_the_bound_is_refused_untokenized_and_loses_nothing(tiny) -> None:  # noqa: F811
    engine = make_engine(tiny)
    processor = engine.input_processor
    processor.tokenizer = counting = CountingTokenizer(processor.tokenizer)
    limit = processor.max_prompt_chars
    assert limit == engine.info.max_model_len * max(map(len, counting.get_vocab())) * NORMALIZER_SHRINK
    started = time.perf_counter()
    with pytest.raises(InvalidRequestError, match=f"the prompt has {limit + 1} characters.*at most {limit}"):
        engine.add_request(GenerationRequest("huge", prompt="a" * (limit + 1), stopping=StoppingParams(max_tokens=1)))
    assert counting.encoded == 0 and time.perf_counter() - started < 1.0
    assert not engine.has_unfinished_requests
    assert_idle(engine)
    # At the bound the text is tokenized, and the usual context check speaks (G7).
    with pytest.raises(InvalidRequestError, match="context limit"):
        engine.add_request(GenerationRequest("at-bound", prompt="a" * limit, stopping=StoppingParams(max_tokens=1)))
    assert counting.encoded == 1
    assert_idle(engine)


def _dense_texts(tokenizer, rng: random.Random) -> list[str]:  # noqa: ANN001
    """Texts that spell many characters per token."""
    longest = sorted(tokenizer.get_vocab(), key=len, reverse=True)[:50]
    spelled = [tokenizer.convert_tokens_to_string([token]) for token in longest]
    samples = [
        "".join(rng.choice(spelled) for _ in range(200)),
        " " * 5000,
        "\n" * 3000 + "\t" * 3000,
        "e\u0301" * 2000 + "a\u0300\u0323" * 1000,  # combining marks (NFC composes them)
        "\u1100\u1161\u11a8" * 2000,  # Hangul jamo (NFC/NFKC compose three into one syllable)
        "\U0001f600" * 1000 + "\uff21" * 1000,  # emoji; full-width letters (NFKC narrows them)
    ]
    alphabet = "abcdefghij ,.\n\u00e9\u4e16\u0301\u1100\u1161\uff21\U0001f600"
    samples += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3000))) for _ in range(30)]
    return samples


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_the_bound_never_refuses_a_text_that_fits(name: str) -> None:
    tokenizer = TOKENIZERS[name]()
    longest = max(map(len, tokenizer.get_vocab()))
    for text in _dense_texts(tokenizer, random.Random(7)):
        num_tokens = len(tokenizer.encode(text, add_special_tokens=False))
        # max_prompt_chars(tokenizer, n) < len(text) must imply num_tokens >= n: the tightest n.
        fewest_tokens_claimed = len(text) // (longest * NORMALIZER_SHRINK)
        assert num_tokens >= fewest_tokens_claimed, (name, text[:40], num_tokens, len(text))
        assert max_prompt_chars(tokenizer, num_tokens + 1) >= len(text), (name, text[:40])
