"""A ``uuid`` given to two different images in one request names the first, on every path: the
aggregated engine encodes one identity once a request, from its first item, as an encoder does
and as the prefix cache keys it (found by review: the aggregated path encoded each image, so the
same request gave other tokens through an encoder, and the two caches held other rows for it)."""

from __future__ import annotations

from refengine.types import MediaInput
from tests import tiny_llava
from tests.unit.test_encoder_engine import IMAGES, TinyLlava, consumer, llava, make_encoder, reachable, request, tokens  # noqa: F401


def test_one_uuid_for_two_images_gives_the_same_tokens_aggregated_and_through_an_encoder(llava: TinyLlava) -> None:  # noqa: F811
    two = (MediaInput("image", raw_bytes=IMAGES[0], uuid="X"), MediaInput("image", raw_bytes=IMAGES[1], uuid="X"))
    first_twice = (MediaInput("image", raw_bytes=IMAGES[0]), MediaInput("image", raw_bytes=IMAGES[0]))
    oracle = tiny_llava.make_engine(llava.directory)
    encoder = make_encoder(llava.directory)
    engine = consumer(llava.directory, encoder)
    try:
        (want,) = oracle.run_until_done([request("raw", 2, media=two)])
        (same,) = tiny_llava.make_engine(llava.directory).run_until_done([request("first", 2, media=first_twice)])
        (got,) = engine.run_until_done([request("handles", 2, media_handles=reachable(encoder.encode(two)))])
        assert want.error is None and got.error is None
        assert tokens(want) == tokens(same), "the uuid names its first image"
        assert tokens(got) == tokens(want)
    finally:
        engine.shutdown()
        encoder.shutdown()
