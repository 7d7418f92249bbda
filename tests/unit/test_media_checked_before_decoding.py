"""G7 before any image work: a prompt too long once its placeholders are expanded, or holding an
id past the vocabulary, is refused before any media item is fetched, decoded or encoded
(``MediaInputs.prepare``'s ``check_expanded``). Found by review: both were refused only after every
image was decoded and encoded (on llava-1.5, up to 8 URL fetches of up to 10 s each first)."""

from __future__ import annotations

import pytest

from refengine.engine import media
from refengine.types import InvalidRequestError
from tests import tiny_llava
from tests.tiny_llava import VOCAB, TinyLlava, prompt_with
from tests.unit.test_media_engine import make_engine, request


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> TinyLlava:
    return tiny_llava.build_tiny_llava(tmp_path_factory.mktemp("llava"))


def count_decodes(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    decoded: list[bytes] = []
    real = media.image_of
    monkeypatch.setattr(media, "image_of", lambda item, data, config: decoded.append(data) or real(item, data, config))
    return decoded


def test_a_prompt_too_long_once_expanded_is_refused_before_decoding(llava: TinyLlava,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    decoded = count_decodes(monkeypatch)
    engine = make_engine(llava)
    images = [tiny_llava.png(i, (56, 56)) for i in range(8)]
    ids = prompt_with(8) + [5] * 440  # fits the context before expansion, not after
    with pytest.raises(InvalidRequestError, match="context limit"):
        engine.add_request(request("long", ids, images))
    assert not decoded, f"{len(decoded)} images decoded before the refusal"


def test_an_id_past_the_vocabulary_is_refused_before_decoding(llava: TinyLlava,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    decoded = count_decodes(monkeypatch)
    engine = make_engine(llava)
    with pytest.raises(InvalidRequestError, match="not in the vocabulary"):
        engine.add_request(request("oov", prompt_with(1) + [VOCAB + 7], [tiny_llava.png(1, (56, 56))]))
    assert not decoded, f"{len(decoded)} images decoded before the refusal"
