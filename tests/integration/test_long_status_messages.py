"""A refusal echoing a client's long value keeps its status code (G3, R4, G8, X1): status
messages are cut to ``errors.MAX_STATUS_MESSAGE_BYTES``. Found by review: the message travels as
the ``grpc-message`` trailer, and past a client's metadata limit (8 KiB soft, 16 KiB hard by
default) the client dropped the call as RESOURCE_EXHAUSTED, so a 20,000-character model name never
read NOT_FOUND."""

from __future__ import annotations

import grpc
import pytest

from refengine.protocol import oe
from refengine.server.errors import MAX_STATUS_MESSAGE_BYTES, bounded_message


def _request(**fields: str) -> oe.GenerateRequest:
    request = oe.GenerateRequest(request_id="echo", prompt="Hi", **fields)
    request.stopping.max_tokens = 1
    return request


def _guided(kind: str, spec: str) -> oe.GenerateRequest:
    request = _request()
    setattr(request.guided, kind, spec)
    return request


@pytest.mark.parametrize(("request_", "code"), [
    (_request(model="m" * 20000), grpc.StatusCode.NOT_FOUND),  # G3
    (_request(model="\u00e9" * 20000), grpc.StatusCode.NOT_FOUND),  # percent-encoded: 6 bytes a character
    (_request(lora_name="m" * 20000), grpc.StatusCode.NOT_FOUND),  # R4
    (_guided("ebnf_grammar", "root ::= " + "x" * 60000), grpc.StatusCode.INVALID_ARGUMENT),
    (_guided("json_schema", '{"type":"' + "x" * 60000 + '"}'), grpc.StatusCode.INVALID_ARGUMENT),
], ids=["model", "non-ascii-model", "lora_name", "ebnf_grammar", "json_schema"])
def test_a_long_echoed_value_keeps_the_status(server_address: str, request_: oe.GenerateRequest,
                                              code: grpc.StatusCode) -> None:
    with grpc.insecure_channel(server_address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(oe.InferenceStub(channel).Generate(request_, timeout=30))
    assert info.value.code() == code, info.value.details()
    assert "characters in all" in info.value.details()


def test_the_cut_keeps_whole_characters_and_says_how_long_it_was() -> None:
    message = "\U0001f600" * 1000
    cut = bounded_message(message)
    suffix = "... (1000 characters in all)"
    assert cut == "\U0001f600" * ((MAX_STATUS_MESSAGE_BYTES - len(suffix)) // 4) + suffix
    assert len(cut.encode()) <= MAX_STATUS_MESSAGE_BYTES, "the suffix counts too (found by review: 1,054 bytes)"
    assert bounded_message("short") == "short"
