"""G19 before conversion: a request with more media items (or embedding handles) than
``--media-max-items`` is refused by the edge from the repeated field's length, before any entry is
converted. Found by review: 8 million empty items fit the 32 MiB message limit and were turned into
Python objects on the event loop (2.7 s a million) before the engine's own count refused them."""

from __future__ import annotations

import time

import pytest

from refengine.protocol import oe
from refengine.server.errors import Rejection
from refengine.server.media_wire import EXTRA_MEDIA_HANDLES
from refengine.server.validation import check_media_count


def test_too_many_items_are_refused_by_their_count_alone() -> None:
    request = oe.GenerateRequest(request_id="x", prompt="hi")
    request.media.extend([oe.MediaItem(modality=oe.MODALITY_IMAGE)] * 1_000_000)
    started = time.perf_counter()
    with pytest.raises(Rejection, match="1000000 media items; at most 8"):
        check_media_count(request, 8)
    assert time.perf_counter() - started < 0.1


def test_too_many_handles_are_refused_by_their_count_alone() -> None:
    request = oe.GenerateRequest(request_id="x", prompt="hi")
    entries = request.extra.fields[EXTRA_MEDIA_HANDLES].list_value
    for _ in range(9):
        entries.values.add().struct_value.SetInParent()
    with pytest.raises(Rejection, match="9 extra.*entries; at most 8"):
        check_media_count(request, 8)


def test_up_to_the_limit_and_without_media_passes() -> None:
    request = oe.GenerateRequest(request_id="x", prompt="hi")
    check_media_count(request, 8)
    request.media.extend([oe.MediaItem(modality=oe.MODALITY_IMAGE)] * 8)
    request.extra.fields["other"].string_value = "v"
    check_media_count(request, 8)
