"""Four multimodal defects found by review, each test failing before its fix:

- the encoder-cache key of a salted image was ``identity + "\\0salt:" + salt``: an unsalted uuid
  ``"u\\0salt:a"`` named tenant ``a``'s entry for uuid ``"u"`` (its embeddings read by, or
  poisoned by, another client), on the aggregated engine and on the encoder role;
- an Encode whose images need more rows than the encoder's whole arena was OVERLOADED ("retry
  later", every retry the same), saying every row was held on an idle server;
- ``reset_prefix_cache`` (SIGUSR1) forgot the encoder role's cached images but not an
  aggregated engine's: the same uuid still gave the old image's output;
- a media item of the default ``--media-max-mib`` could not reach the server as a data URI:
  the 16 MiB receive limit refused it first with RESOURCE_EXHAUSTED (now 32 MiB, and a server
  whose limits contradict warns at start).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import refengine.engine.encoder as encoder_module
from refengine.config_features import MediaConfig
from refengine.model.embedding_io import EmbeddingArena
from refengine.server.options import MIB, ServerOptions
from refengine.types import GenerationRequest, InvalidRequestError, KvParams, MediaInput, SamplingParams, StoppingParams
from tests import tiny_llava
from tests.tiny_llava import TinyLlava, png, prompt_with
from tests.unit.test_encoder_engine import make_encoder

IMAGE_A, IMAGE_B = png(1, (56, 56)), png(2, (80, 64))
CRAFTED_UUID = "u\0salt:a"  # spelled as the old key of uuid "u" under salt "a"


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> TinyLlava:
    return tiny_llava.build_tiny_llava(tmp_path_factory.mktemp("tiny-llava-review"))


def _request(rid: str, image: bytes, uuid: str, salt: str | None) -> GenerationRequest:
    return GenerationRequest(rid, prompt_token_ids=prompt_with(1), sampling=SamplingParams(temperature=0.0),
                             stopping=StoppingParams(max_tokens=8, ignore_eos=True),
                             media=(MediaInput("image", raw_bytes=image, uuid=uuid),), kv=KvParams(cache_salt=salt))


def _tokens(engine, request: GenerationRequest) -> list[int]:  # noqa: ANN001
    return list(engine.run_until_done([request])[0].outputs[0].token_ids)


def test_an_unsalted_uuid_cannot_name_a_salted_entry_on_the_aggregated_engine(llava: TinyLlava) -> None:
    alone = _tokens(tiny_llava.make_engine(llava.directory), _request("x", IMAGE_B, CRAFTED_UUID, None))
    shared = tiny_llava.make_engine(llava.directory)
    victim = _tokens(shared, _request("victim", IMAGE_A, "u", "a"))
    assert victim != alone  # the two images give different outputs: a leak would show
    assert _tokens(shared, _request("attacker", IMAGE_B, CRAFTED_UUID, None)) == alone
    assert _tokens(shared, _request("victim-again", IMAGE_A, "u", "a")) == victim


def test_an_unsalted_uuid_cannot_name_a_salted_entry_on_the_encoder_role(llava: TinyLlava) -> None:
    encoder = make_encoder(Path(llava.directory))
    try:
        (victim,) = encoder.encode([MediaInput("image", raw_bytes=IMAGE_A, uuid="u")], cache_salt="a")
        (attacker,) = encoder.encode([MediaInput("image", raw_bytes=IMAGE_B, uuid=CRAFTED_UUID)], cache_salt="")
        assert not victim.cached and not attacker.cached
        encoder.release_handles([victim.handle_id, attacker.handle_id])
    finally:
        encoder.shutdown()


def test_an_encode_that_can_never_fit_is_invalid_not_retry_later(llava: TinyLlava,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    class SmallArena(EmbeddingArena):  # room for two of the tiny model's 16-row images, not three
        def __init__(self, num_rows: int, hidden_size: int, dtype) -> None:  # noqa: ANN001
            super().__init__(40, hidden_size, dtype)

    monkeypatch.setattr(encoder_module, "EmbeddingArena", SmallArena)
    encoder = make_encoder(Path(llava.directory))
    try:
        with pytest.raises(InvalidRequestError, match=r"3 distinct media items need 48 embedding rows; this "
                                                      r"encoder holds 40 in all \(--encoder-memory-mib\)"):
            encoder.encode([MediaInput("image", raw_bytes=png(i, (56, 56))) for i in range(3)])
        stats = encoder.media_stats()
        assert stats.held_rows == 0 and stats.held_handles == 0
        two = encoder.encode([MediaInput("image", raw_bytes=png(i, (56, 56))) for i in range(2)])  # fits
        encoder.release_handles([handle.handle_id for handle in two])
    finally:
        encoder.shutdown()


def test_reset_prefix_cache_forgets_encoded_images_on_the_aggregated_engine(llava: TinyLlava) -> None:
    engine = tiny_llava.make_engine(llava.directory)
    fresh = _tokens(tiny_llava.make_engine(llava.directory), _request("b", IMAGE_B, "u", None))
    _tokens(engine, _request("a", IMAGE_A, "u", None))
    assert len(engine.media.cache) == 1
    engine.reset_prefix_cache()
    assert len(engine.media.cache) == 0
    assert _tokens(engine, _request("b", IMAGE_B, "u", None)) == fresh  # not image A's rows under uuid "u"


def test_the_default_receive_limit_carries_a_default_media_item_as_a_data_uri() -> None:
    assert ServerOptions().media_item_problem(MediaConfig().max_bytes) is None
    problem = ServerOptions(max_receive_message_bytes=16 * MIB).media_item_problem(MediaConfig().max_bytes)
    assert problem is not None and "needs a 28 MiB request as a data URI, more than --max-receive-message-mib 16" \
        in problem and "raise it or lower --media-max-mib" in problem
    assert ServerOptions(max_receive_message_bytes=16 * MIB).media_item_problem(11 * MIB) is None
