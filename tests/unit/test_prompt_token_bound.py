"""G7 in bounded memory: a prompt longer than the context in characters is counted in pieces
(``input_processor.count_exceeds``) and refused once it surely has too many tokens, without being
tokenized whole. Found by review: 600,000 emoji (under the character bound) are 1.8 million
tokens, and tokenizing them whole to refuse them took 480 MiB and 2 s a request.

The oracle for "never refuses a prompt that fits" is the real tokenizers' count of the whole
text: with the limit set to that count, no cut of the text into pieces may claim more."""

from __future__ import annotations

import random

import pytest

from refengine.engine import input_processor
from refengine.engine.input_processor import count_exceeds
from refengine.types import GenerationRequest, InvalidRequestError, StoppingParams
from tests.unit.test_engine import assert_idle, make_engine, tiny  # noqa: F401 - tiny is a fixture
from tests.unit.test_prompt_chars_bound import TOKENIZERS, CountingTokenizer, _dense_texts


class LongestEncoded(CountingTokenizer):
    """Also records the longest text it was asked to encode."""

    longest = 0

    def encode(self, text: str, **options):  # noqa: ANN003, ANN201
        self.longest = max(self.longest, len(text))
        return super().encode(text, **options)


@pytest.mark.parametrize("piece_chars", [7, 64, 8192])
@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_pieces_never_claim_more_tokens_than_the_whole(name: str, piece_chars: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(input_processor, "COUNT_PIECE_CHARS", piece_chars)
    tokenizer = TOKENIZERS[name]()
    rng = random.Random(11)
    texts = _dense_texts(tokenizer, rng)
    texts += ["".join(rng.sample(texts, 6)) for _ in range(10)]  # scripts meeting at the cuts
    for text in texts:
        num_tokens = len(tokenizer.encode(text, add_special_tokens=False))
        assert not count_exceeds(tokenizer, text, num_tokens), (name, text[:40], num_tokens)
        if piece_chars > 2 * len(text) and num_tokens > 8:  # one piece: the count is exact
            assert count_exceeds(tokenizer, text + text, num_tokens + 8), "twice the text is counted past it"


def test_an_overlong_prompt_is_refused_without_tokenizing_it_whole(tiny, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.setattr(input_processor, "COUNT_PIECE_CHARS", 256)  # this tiny context's scale of 8192
    engine = make_engine(tiny)
    processor = engine.input_processor
    processor.tokenizer = counting = LongestEncoded(processor.tokenizer)
    prompt = "\U0001f600" * processor.max_prompt_chars  # far past the context in tokens, at the character bound
    with pytest.raises(InvalidRequestError, match=f"more than {engine.info.max_model_len} tokens"):
        engine.add_request(GenerationRequest("emoji", prompt=prompt, stopping=StoppingParams(max_tokens=1)))
    assert counting.longest <= input_processor.COUNT_PIECE_CHARS
    assert_idle(engine)
    fits = " the" * (engine.info.max_model_len // 2)  # longer in characters than in tokens
    assert len(fits) > engine.info.max_model_len > len(counting.encode(fits, add_special_tokens=False)) + 1
    (done,) = engine.run_until_done([GenerationRequest("fits", prompt=fits, stopping=StoppingParams(max_tokens=1))])
    assert done.error is None and done.usage.prompt_tokens == len(counting.encode(fits, add_special_tokens=False))


def test_a_fitting_prompt_within_one_piece_is_tokenized_once(tiny, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Longer than the context in characters but no longer than one piece: tokenizing it whole is
    bounded (at most 4 tokens a character), so it is not counted in pieces first, which would
    tokenize it twice."""
    engine = make_engine(tiny)
    monkeypatch.setattr(input_processor, "COUNT_PIECE_CHARS", 4 * engine.info.max_model_len)
    processor = engine.input_processor
    processor.tokenizer = counting = CountingTokenizer(processor.tokenizer)
    fits = " the" * (engine.info.max_model_len // 2)
    assert engine.info.max_model_len < len(fits) <= input_processor.COUNT_PIECE_CHARS
    (done,) = engine.run_until_done([GenerationRequest("fits", prompt=fits, stopping=StoppingParams(max_tokens=1))])
    assert done.error is None and counting.encoded == 1
