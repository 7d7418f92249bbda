"""``generate_epd`` releases its handles at the end as a best effort (found by review): a release
that fails (the encoder gone after the consumer pulled the rows) must neither turn a complete
stream into an error nor replace the error the stream itself ended with. The handle's lease
frees it anyway (ENC7)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from refengine.encoder_client import generate_epd
from refengine.protocol import oe
from refengine.protocol.v1alpha1 import media_pb2 as media


class Unavailable(grpc.RpcError):
    def __init__(self, what: str) -> None:
        super().__init__(what)

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE


class GoneEncoder:
    """Encodes one handle; its Release fails: the encoder stopped after the pull."""

    def __init__(self) -> None:
        self.released: list[list[str]] = []

    def encode(self, items: Any, timeout: Any = None, cache_salt: str = "") -> list[media.EmbeddingHandle]:
        return [media.EmbeddingHandle(handle_id="h0")]

    def release(self, handle_ids: list[str]) -> int:
        self.released.append(list(handle_ids))
        raise Unavailable("encoder gone")


class Consumer:
    def __init__(self, fail: BaseException | None = None) -> None:
        self.fail = fail

    def generate(self, request: oe.GenerateRequest, **kwargs: Any) -> Iterator[oe.GenerateResponse]:
        yield oe.GenerateResponse(request_id=request.request_id, token=oe.TokenOutput(text="a"))
        if self.fail is not None:
            raise self.fail
        yield oe.GenerateResponse(request_id=request.request_id, finished=oe.GenerationFinished())


def _request() -> oe.GenerateRequest:
    request = oe.GenerateRequest(request_id="r", prompt="<image>")
    request.media.add()
    return request


def test_a_failed_release_does_not_fail_a_complete_stream() -> None:
    encoder = GoneEncoder()
    events = list(generate_epd(encoder, Consumer(), None, _request()))  # type: ignore[arg-type]
    assert [e.WhichOneof("event") for e in events] == ["token", "finished"]
    assert encoder.released == [["h0"]]


def test_a_failed_release_keeps_the_streams_own_error() -> None:
    class Refused(Unavailable):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.INVALID_ARGUMENT

    with pytest.raises(Refused):
        list(generate_epd(GoneEncoder(), Consumer(fail=Refused("bad")), None, _request()))  # type: ignore[arg-type]
