"""An accepted stream whose next event cannot fit one gRPC message (found by review): the size
estimate validation makes before acceptance (``server/validation.py``, ~40 bytes a candidate)
cannot know the candidates' token texts, and some are 80 bytes; gRPC then ended the stream with
a bare RESOURCE_EXHAUSTED and no event, which breaks X1. Now the oversized event is not written:
the stream ends with one ``EngineError(INVALID_ARGUMENT)`` carrying the usage, then OK, and the
request's KV is freed. Duplicate candidate ids, which let a request list 200,000 of them past
the estimate, are refused before acceptance."""

from __future__ import annotations

import grpc
import pytest
from tokenizers import Tokenizer

from refengine.client import OpenEngineClient
from refengine.model import resolve_model
from refengine.protocol import oe
from refengine.server.validation import CANDIDATE_BYTES, TOKEN_INFO_BYTES
from tests.integration.conftest import MODEL, collect, wait_idle

SEND_LIMIT = 16 << 20  # the shared server's --max-send-message-mib


@pytest.fixture(scope="module")
def client(server_address: str):  # noqa: ANN201
    with OpenEngineClient(server_address, max_message_bytes=256 << 20) as c:
        yield c


def _longest_tokens(count: int) -> list[int]:
    """The ids of the ``count`` tokens with the longest text (80 bytes and down)."""
    tokenizer = Tokenizer.from_file(str(resolve_model(MODEL).path / "tokenizer.json"))
    sizes = sorted(((len(tokenizer.decode([i]).encode()), i) for i in range(tokenizer.get_vocab_size())), reverse=True)
    return [i for _, i in sizes[:count]]


def test_a_prompt_output_too_large_for_a_message_ends_with_an_engine_error(client: OpenEngineClient) -> None:
    ids = _longest_tokens(300)
    positions = SEND_LIMIT // (TOKEN_INFO_BYTES + CANDIDATE_BYTES * len(ids))  # what validation lets through
    request = oe.GenerateRequest(request_id="prompt-too-large", token_ids=oe.TokenIds(ids=[504] * positions))
    request.stopping.max_tokens = 1
    request.response.return_prompt_logprobs = True
    request.response.prompt_candidates.token_ids.ids.extend(ids)
    stream = collect(client, request)
    assert stream.code == grpc.StatusCode.OK, (stream.code, stream.details)
    kinds = [event.WhichOneof("event") for event in stream.events]
    assert kinds == ["error"], kinds  # the PromptOutput was never written; nothing after the error (X1)
    error = stream.events[-1]
    assert error.error.code == oe.ERROR_CODE_INVALID_ARGUMENT and not error.error.retryable
    assert "--max-send-message-mib" in error.error.message
    assert error.usage.prompt_tokens == positions  # G16: the terminal event carries the usage
    wait_idle(client)


def test_candidate_ids_listed_twice_are_refused_before_acceptance(client: OpenEngineClient) -> None:
    request = oe.GenerateRequest(request_id="twice", prompt="Hi")
    request.stopping.max_tokens = 1
    request.response.return_output_logprobs = True
    request.response.output_candidates.token_ids.ids.extend([46778] * 200_000)
    stream = collect(client, request)
    assert stream.code == grpc.StatusCode.INVALID_ARGUMENT and not stream.events
    assert "output_candidates.token_ids lists a token id more than once" in stream.details
