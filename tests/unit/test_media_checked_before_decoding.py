"""Bounds on image work before and during ``MediaInputs.prepare``.

G7 before any image work: a prompt too long once its placeholders are expanded, or holding an id
past the vocabulary, is refused before any media item is fetched, decoded or encoded
(``check_expanded``). Found by review: both were refused only after every image was decoded and
encoded (on llava-1.5, up to 8 URL fetches of up to 10 s each first)."""

from __future__ import annotations

import threading
import time

import pytest

from refengine.config import MediaConfig
from refengine.engine import media
from refengine.multimodal import sources
from refengine.types import InvalidRequestError, MediaInput
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


def test_fetched_bodies_are_bounded_while_no_decode_slot_is_free(llava: TinyLlava,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests with media URLs hold their fetched bodies until encoded: at most ``MEDIA_FETCHES``
    requests do at once (found by review: 6 requests of 8 URLs held 48 bodies, up to 20 MiB each,
    while both decode slots were busy)."""
    engine_media = make_engine(llava).media
    engine_media.config = MediaConfig(url_allow_hosts=("img.test",))
    held: list[int] = []
    body = tiny_llava.png(1, (56, 56))
    monkeypatch.setattr(sources, "fetch_url", lambda url, config: held.append(len(body)) or bytes(body))
    for _ in range(media.MEDIA_DECODES):  # every decode slot is busy (large images, say)
        engine_media.decoding.acquire()
    items = [MediaInput("image", url=f"http://img.test/{i}.png") for i in range(8)]
    threads = [threading.Thread(target=engine_media.prepare, args=(prompt_with(8), items), daemon=True)
               for _ in range(media.MEDIA_FETCHES + 2)]
    for thread in threads:
        thread.start()
    bound = media.MEDIA_FETCHES * len(items)
    deadline = time.monotonic() + 10
    while len(held) < bound and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # time for the two requests beyond the bound to fetch, were they allowed to
    fetched = len(held)
    for _ in range(media.MEDIA_DECODES):
        engine_media.decoding.release()
    for thread in threads:
        thread.join(30)
    assert fetched == bound, f"{fetched} URL bodies held while no decode slot was free (bound {bound})"
    assert len(held) == len(threads) * len(items)  # then every request went on
