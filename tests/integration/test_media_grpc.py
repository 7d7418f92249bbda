"""Images through a real ``refengine serve --model <tiny LLaVA dir>`` on loopback (D9, G19).

The checkpoint is ``tests/tiny_llava.py``'s (saved with its image processor and tokenizer);
the oracle is the in-process ``Engine`` on the same directory, so every token the server
streams for a request with images must equal the engine's for the same request. Malformed
media is refused with INVALID_ARGUMENT before any event. The text-only side (the shared
server refusing media) is covered by ``test_server_generate.py`` ("media") and by the
conformance suite's G19 checks against the text-only conformance server. At the end the
conformance suite's media checks run against this server with the placeholder known and
must PASS, not skip.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from refengine.client import OpenEngineClient
from refengine.conformance import Options, Status, Target, all_checks, run_check
from refengine.engine.engine import Engine
from refengine.protocol import oe
from refengine.types import GenerationRequest, MediaInput, SamplingParams, StoppingParams
from tests import tiny_llava
from tests.conformance.fault_proxy import Fault, FaultProxy
from tests.integration.conftest import ServerProcess, check_stream, collect, running_server
from tests.support_matrix import observe
from tests.tiny_llava import IMAGE_TOKEN, NUM_IMAGE_TOKENS, TinyLlava, png, prompt_with

IMAGES = [png(1, (56, 56)), png(2, (80, 64))]
SERVER_ARGS = ("--max-model-len", "512", "--num-kv-blocks", "64", "--max-num-seqs", "4")


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> TinyLlava:
    return tiny_llava.build_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, llava: TinyLlava) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("llava-server") / "server.log"
    with running_server(log, "--model", str(llava.directory), *SERVER_ARGS) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[OpenEngineClient]:
    with OpenEngineClient(server.address) as c:
        yield c


@pytest.fixture(scope="module")
def engine(llava: TinyLlava) -> Engine:
    return tiny_llava.make_engine(llava.directory)


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def media_request(rid: str, ids: list[int] | None, images: list[bytes], source: str = "raw_bytes",
                  max_tokens: int = 8, prompt: str | None = None) -> oe.GenerateRequest:
    """Greedy, ``max_tokens`` with ignore_eos; one image item per entry of ``images``, all through ``source``."""
    request = oe.GenerateRequest(request_id=rid)
    if ids is not None:
        request.token_ids.ids.extend(ids)
    else:
        request.prompt = prompt or ""
    request.sampling.temperature = 0.0
    request.stopping.max_tokens = max_tokens
    request.stopping.ignore_eos = True
    for data in images:
        item = request.media.add(modality=oe.MODALITY_IMAGE)
        if source == "data_uri":
            item.data_uri = data_uri(data)
        else:
            item.raw_bytes, item.mime_type = data, "image/png"
    return request


def in_process(engine: Engine, rid: str, ids: list[int] | None, images: list[bytes], max_tokens: int = 8,
               prompt: str | None = None) -> tuple[list[int], int]:
    """The in-process engine's tokens and prompt_tokens for the same request."""
    request = GenerationRequest(rid, prompt=prompt, prompt_token_ids=ids, sampling=SamplingParams(temperature=0.0),
                                stopping=StoppingParams(max_tokens=max_tokens, ignore_eos=True),
                                media=tuple(MediaInput("image", raw_bytes=b) for b in images))
    (completion,) = engine.run_until_done([request])
    return list(completion.outputs[0].token_ids), completion.usage.prompt_tokens


def test_model_info_advertises_multimodal(client: OpenEngineClient) -> None:
    info = client.model_info()
    assert info.HasField("supports_multimodal") and info.supports_multimodal is True
    assert info.supports_token_ids_input


@pytest.mark.parametrize(("num_images", "source"), [(1, "raw_bytes"), (1, "data_uri"), (2, "raw_bytes"),
                                                    (2, "data_uri")])
def test_images_give_the_in_process_engines_tokens(client: OpenEngineClient, engine: Engine, num_images: int,
                                                   source: str) -> None:
    ids, images = prompt_with(num_images, seed=num_images), IMAGES[:num_images]
    request = media_request(f"img-{num_images}-{source}", ids, images, source)
    stream = collect(client, request)
    check_stream(stream, request)
    expected, prompt_tokens = in_process(engine, "oracle", ids, images)
    assert stream.tokens() == expected
    assert stream.finished().reason == oe.FINISH_REASON_LENGTH
    usage = stream.events[-1].usage
    assert usage.prompt_tokens == prompt_tokens == len(ids) + num_images * (NUM_IMAGE_TOKENS - 1)


def test_image_order_is_kept(client: OpenEngineClient, engine: Engine) -> None:
    """G19: items fill the placeholders in order; swapping the two images changes the output."""
    ids = prompt_with(2, seed=2)
    request = media_request("swapped", ids, IMAGES[::-1])
    swapped = collect(client, request)
    check_stream(swapped, request)
    assert swapped.tokens() == in_process(engine, "swapped", ids, IMAGES[::-1])[0]
    assert swapped.tokens() != in_process(engine, "in-order", ids, IMAGES)[0]


def test_concurrent_image_requests_match_solo_runs(client: OpenEngineClient, engine: Engine) -> None:
    """Media is decoded and encoded on the callers' threads while the step thread runs: four
    requests at once (one or two images each) give the in-process engine's solo tokens."""
    cases = [(prompt_with(1 + i % 2, seed=30 + i), [IMAGES[i % 2], IMAGES[(i + 1) % 2]][:1 + i % 2]) for i in range(4)]
    requests = [media_request(f"conc-{i}", ids, images, max_tokens=6) for i, (ids, images) in enumerate(cases)]
    with ThreadPoolExecutor(len(requests)) as pool:
        streams = list(pool.map(lambda r: collect(client, r), requests))
    for request, stream, (ids, images) in zip(requests, streams, cases, strict=True):
        check_stream(stream, request)
        assert stream.tokens() == in_process(engine, request.request_id, ids, images, max_tokens=6)[0]


@pytest.mark.parametrize("kind", ["token_ids", "text"])
def test_a_text_only_request_on_the_multimodal_server(client: OpenEngineClient, engine: Engine, kind: str) -> None:
    ids, prompt = (prompt_with(0, seed=5), None) if kind == "token_ids" else (None, "the cat in the box")
    request = media_request(f"text-{kind}", ids, [], prompt=prompt)
    stream = collect(client, request)
    check_stream(stream, request)
    expected, prompt_tokens = in_process(engine, "text", ids, [], prompt=prompt)
    assert stream.tokens() == expected
    assert stream.events[-1].usage.prompt_tokens == prompt_tokens


def _item(**fields: object) -> Callable[[oe.GenerateRequest], None]:
    return lambda r: r.media.add(**fields)


def _images(*images: bytes) -> Callable[[oe.GenerateRequest], None]:
    def add(r: oe.GenerateRequest) -> None:
        for data in images:
            r.media.add(modality=oe.MODALITY_IMAGE, raw_bytes=data)

    return add


#: (name, the prompt's token ids, how the media is added, a word the refusal must contain)
MALFORMED = [
    ("two placeholders, one image", prompt_with(2), _images(IMAGES[0]), "placeholder"),
    ("one placeholder, two images", prompt_with(1), _images(*IMAGES), "placeholder"),
    ("no placeholder, one image", prompt_with(0), _images(IMAGES[0]), "placeholder"),
    ("one placeholder, no image", prompt_with(1), _images(), "placeholder"),
    ("an expanded placeholder, no image", [5, 6, *[IMAGE_TOKEN] * NUM_IMAGE_TOKENS, 7], _images(), "placeholder"),
    ("three adjacent placeholders, one image", [5, 6, *[IMAGE_TOKEN] * 3, 7], _images(IMAGES[0]),
     "3 image placeholder"),
    ("a placeholder neither 1 nor num_image_tokens per image", [5, 6, *[IMAGE_TOKEN] * (NUM_IMAGE_TOKENS + 3), 7],
     _images(IMAGES[0]), f"{NUM_IMAGE_TOKENS + 3} tokens long"),
    ("garbage bytes", prompt_with(1), _images(b"not an image at all"), "not an image"),
    ("truncated PNG", prompt_with(1), _images(IMAGES[0][:60]), "truncated"),
    ("empty bytes", prompt_with(1), _item(modality=oe.MODALITY_IMAGE, raw_bytes=b""), "no bytes"),
    ("data URI not base64", prompt_with(1), _item(modality=oe.MODALITY_IMAGE, data_uri="data:image/png;base64,@@@@"),
     "base64"),
    ("video modality", prompt_with(1), _item(modality=oe.MODALITY_VIDEO, raw_bytes=b"\x00\x00\x00\x18ftypisom"),
     "video"),
    ("unspecified modality", prompt_with(1), _item(raw_bytes=IMAGES[0]), "modality"),
    ("an item with no source", prompt_with(1), _item(modality=oe.MODALITY_IMAGE, mime_type="image/png"), "source"),
    ("a url while URL fetching is off", prompt_with(1),
     _item(modality=oe.MODALITY_IMAGE, url="https://example.com/cat.png"), "disabled"),
]


@pytest.mark.parametrize(("name", "ids", "add_media", "word"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_media_is_refused_before_any_event(client: OpenEngineClient, name: str, ids: list[int],
                                                     add_media: Callable[[oe.GenerateRequest], None],
                                                     word: str) -> None:
    request = media_request(f"bad-{name}", ids, [])
    add_media(request)
    before = client.load()
    stream = collect(client, request)
    assert stream.code == grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {stream.code} {stream.details}"
    assert not stream.events, f"{name}: refused after {len(stream.events)} event(s)"
    assert word in stream.details, f"{name}: {stream.details!r} does not say {word!r}"
    after = client.load()
    assert after.running_requests == after.queued_requests == 0
    assert after.used_kv_blocks == before.used_kv_blocks, "a refused request allocated KV blocks"


MEDIA_CHECKS = ["D9:multimodal_image_accepted", "G19:media_placeholder_mismatch_refused",
                "G19:media_malformed_image_refused", "D9:multimodal_validated", "G19:media_source_required",
                "D9:multimodal_image_used", "E4:media_in_block_hash"]


@pytest.fixture(scope="module")
def target(server: ServerProcess) -> Iterator[Target]:
    with Target(server.address, Options(media_placeholder_token_id=IMAGE_TOKEN)) as t:
        yield t


@pytest.mark.parametrize("name", MEDIA_CHECKS)
def test_conformance_media_checks_pass(target: Target, name: str) -> None:
    """The suite's media checks against this server, given its placeholder: PASS, not SKIP."""
    (chk,) = [c for c in all_checks() if c.name == name]
    result = run_check(chk, target)
    observe("multimodal", result)
    assert result.status is Status.PASS, f"{chk.name}: {result.status.value} {result.message}"


def test_conformance_media_checks_skip_without_the_placeholder(server: ServerProcess) -> None:
    checks = [c for c in all_checks() if c.name in MEDIA_CHECKS[:3]]
    assert len(checks) == 3
    with Target(server.address) as t:
        results = [run_check(c, t) for c in checks]
    for result in results:
        assert result.status is Status.SKIP and "--media-placeholder-token-id" in result.message, result


def _one_image_for_all(request: oe.GenerateRequest, context: grpc.ServicerContext, forward: Callable) -> Iterator:
    """The fault: every image becomes the same one, as a server that accepts images and ignores them."""
    for item in request.media:
        item.raw_bytes, item.mime_type = png(7, (64, 64)), "image/png"
    return forward(request)


@pytest.mark.parametrize(("name", "says"), [("D9:multimodal_image_used", "not used"),
                                            ("E4:media_in_block_hash", "the image is not in the block hash")])
def test_the_image_checks_fail_a_server_that_ignores_images(server: ServerProcess, name: str, says: str) -> None:
    """The negative controls of D9:multimodal_image_used and E4:media_in_block_hash: the same server
    behind a proxy that sends one fixed image in place of every image fails them (and passes them
    directly: the test above). To E4 it is a server whose block hash leaves the image out."""
    (chk,) = [c for c in all_checks() if c.name == name]
    proxy = FaultProxy(server.address, Fault({"Inference/Generate": _one_image_for_all}))
    try:
        with Target(proxy.address, Options(media_placeholder_token_id=IMAGE_TOKEN)) as t:
            result = run_check(chk, t)
    finally:
        proxy.close()
    assert result.status is Status.FAIL and says in result.message, result
