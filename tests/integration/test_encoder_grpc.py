"""Draft profile ``encoder`` (docs/profiles/encoder.md, ENC1–ENC15) between real processes on
loopback: an encoder server (``--role encoder``, offering NIXL when it imports, and gRPC), an
aggregated, a prefill and a decode server, all on the tiny LLaVA checkpoint
(``tests/tiny_llava.py``). The oracle is the aggregated server given the images themselves:
E → aggregated and E → P → D must stream the same tokens and logprobs, over each transfer
backend (the client keeps only that backend's transfer in the handles it forwards).
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf import json_format

from refengine.client import OpenEngineClient, generate_disaggregated
from refengine.encoder_client import MediaClient, generate_epd, over_backend, supports_profile, with_handles
from refengine.kv.transfer.nixl_backend import nixl_available
from refengine.protocol import oe
from refengine.protocol.v1alpha1 import media_pb2 as media
from tests import tiny_llava
from tests.integration.conftest import ServerProcess, Stream, start_server, wait_ready
from tests.tiny_llava import TinyLlava, png, prompt_with

pytestmark = pytest.mark.timeout(900)
COMMON = ("--max-model-len", "512", "--num-kv-blocks", "96", "--max-num-seqs", "8", "--num-threads", "1")
IMAGES = [png(11, (56, 56)), png(12, (80, 64)), png(13, (64, 64)), png(14, (60, 72))]
BACKENDS = ["grpc", "nixl"]


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> TinyLlava:
    return tiny_llava.build_tiny_llava(tmp_path_factory.mktemp("tiny-llava-epd"))


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, llava: TinyLlava) -> Iterator[dict[str, ServerProcess]]:
    tmp = tmp_path_factory.mktemp("epd")
    model = ("--model", str(llava.directory), *COMMON)
    encoder_backend = ("--kv-transfer-backend", "nixl") if nixl_available()[0] else ()
    procs = {
        # short grace periods: a drain waits for handles and sessions left unpulled (teardowns end soon)
        "encoder": start_server(tmp / "encoder.log", *model, "--role", "encoder", *encoder_backend,
                                "--shutdown-grace-seconds", "2",
                                "--encoder-cache-entries", "2", wait_ready=False),
        "aggregated": start_server(tmp / "aggregated.log", *model, wait_ready=False),
        "prefill": start_server(tmp / "prefill.log", *model, "--role", "prefill", "--shutdown-grace-seconds", "2",
                                wait_ready=False),
        "decode": start_server(tmp / "decode.log", *model, "--role", "decode", wait_ready=False),
    }
    try:
        for proc in procs.values():
            wait_ready(proc)
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


@pytest.fixture(scope="module")
def clients(servers: dict[str, ServerProcess]) -> Iterator[dict[str, OpenEngineClient]]:
    made = {name: OpenEngineClient(proc.address) for name, proc in servers.items()}
    yield made
    for client in made.values():
        client.close()


@pytest.fixture(scope="module")
def encoder(clients: dict[str, OpenEngineClient]) -> MediaClient:
    return MediaClient(clients["encoder"])


def image_item(data: bytes) -> oe.MediaItem:
    return oe.MediaItem(modality=oe.MODALITY_IMAGE, raw_bytes=data, mime_type="image/png")


def request(rid: str, images: list[bytes], seed: int = 0, temperature: float = 0.0,
            max_tokens: int = 8) -> oe.GenerateRequest:
    req = oe.GenerateRequest(request_id=rid)
    req.token_ids.ids.extend(prompt_with(len(images), seed))
    req.sampling.temperature = temperature
    if temperature:
        req.sampling.seed = 500 + seed
    req.stopping.max_tokens = max_tokens
    req.stopping.ignore_eos = True
    req.response.return_output_logprobs = True
    req.media.extend(image_item(data) for data in images)
    return req


def collect(events: Iterator[oe.GenerateResponse]) -> Stream:
    stream = Stream()
    try:
        stream.events = list(events)
    except grpc.RpcError as err:
        stream.code, stream.details = err.code(), err.details()
    return stream


def logprobs(stream: Stream) -> list[float]:
    return [t.logprob for out in stream.of("token") for t in out.tokens]


def media_load(client: OpenEngineClient) -> dict[str, float]:
    attributes = json_format.MessageToDict(client.load().attributes)
    return {k.removeprefix("refengine.v1alpha1."): v for k, v in attributes.items() if k.startswith("refengine.v1")}


def wait_encoder_idle(client: OpenEngineClient, timeout: float = 15.0) -> dict[str, float]:
    """Until no handle is held; then held + cached + free rows = all rows (ENC15)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = media_load(client)
        if stats["held_handles"] == 0 and stats["held_rows"] == 0:
            assert stats["cached_rows"] + stats["free_rows"] == stats["total_rows"], stats
            return stats
        assert time.monotonic() < deadline, f"encoder not idle: {stats}"
        time.sleep(0.05)


def wait_idle(client: OpenEngineClient, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        load = client.load()
        if load.used_kv_blocks == 0 and load.active_kv_sessions == 0 and load.running_requests == 0 \
                and load.queued_requests == 0:
            return
        assert time.monotonic() < deadline, f"not idle: {load}"
        time.sleep(0.05)


def check_all_idle(clients: dict[str, OpenEngineClient]) -> None:
    wait_encoder_idle(clients["encoder"])
    for name in ("aggregated", "prefill", "decode"):
        wait_idle(clients[name])


def test_discovery_roles_and_refusals(clients: dict[str, OpenEngineClient]) -> None:
    """ENC1, ENC2: the profile is listed with each side; the encoder reports no release role,
    refuses Generate before acceptance, and its probe encodes an image."""
    assert supports_profile(clients["encoder"], "encoder")
    for name in ("aggregated", "prefill", "decode"):
        assert supports_profile(clients[name], "consumer") and not supports_profile(clients[name], "encoder")
    info = clients["encoder"].server_info()
    assert info.engine_role == oe.ENGINE_ROLE_UNSPECIFIED
    stream = collect(clients["encoder"].generate(request("enc-generate", [])))
    assert stream.code == grpc.StatusCode.FAILED_PRECONDITION and "role mismatch" in stream.details
    assert stream.events == []
    health = clients["encoder"].health(include_inference_probe=True)
    assert health.state == oe.HEALTH_STATE_READY, health
    assert "image encoded" in [c for c in health.checks if c.name == "inference_probe"][0].message
    with pytest.raises(grpc.RpcError) as err:  # a consumer serves no Media
        MediaClient(clients["aggregated"]).encode([image_item(IMAGES[0])])
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("backend", BACKENDS)
def test_epd_and_e_aggregated_equal_aggregated(clients, encoder: MediaClient, backend: str) -> None:
    """ENC8–ENC12: 1 and 4 images, greedy and seeded: E → aggregated and E → P → D stream the
    tokens and logprobs the aggregated server streams for the images themselves."""
    if backend == "nixl" and not nixl_available()[0]:
        pytest.skip(f"nixl: {nixl_available()[1]}")
    for k, (count, temperature) in enumerate([(1, 0.0), (4, 0.0), (1, 0.8), (4, 0.8)]):
        req = request(f"{backend}-{k}", IMAGES[:count], seed=k, temperature=temperature)
        want = collect(clients["aggregated"].generate(req, timeout=120))
        assert want.code == grpc.StatusCode.OK and len(want.tokens()) == 8, want.details
        for route in ("aggregated", "pd"):
            handles = over_backend(encoder.encode(list(req.media)), backend)
            assert all(h.transfers[0].backend == backend for h in handles)
            consumer_req = with_handles(req, handles)
            consumer_req.request_id = f"{req.request_id}-{route}"
            events = (clients["aggregated"].generate(consumer_req, timeout=120) if route == "aggregated" else
                      generate_disaggregated(clients["prefill"], clients["decode"], consumer_req, timeout=120))
            got = collect(events)
            assert got.code == grpc.StatusCode.OK, got.details
            assert got.tokens() == want.tokens(), (route, count, temperature)
            assert logprobs(got) == pytest.approx(logprobs(want), abs=1e-4)
    check_all_idle(clients)  # every handle was released by the consumer that pulled it


def test_generate_epd_helper_and_cli(clients, encoder: MediaClient, servers, tmp_path) -> None:
    """The client's orchestration and ``refengine generate --encoder … --prefill … --decode …``."""
    import subprocess
    import sys

    req = request("helper", IMAGES[1:3], max_tokens=6)
    want = collect(clients["aggregated"].generate(req, timeout=120)).tokens()
    got = collect(generate_epd(encoder, clients["prefill"], clients["decode"], req, timeout=120))
    assert got.code == grpc.StatusCode.OK and got.tokens() == want
    image = tmp_path / "image.png"
    image.write_bytes(IMAGES[0])
    text = "a river <image> under the old stone"  # the marker is the placeholder token in text
    assert tiny_llava.IMAGE_TOKEN in tiny_llava.TOKENIZER.encode(text, add_special_tokens=False)
    outputs = []
    for hops in (["--remote", servers["aggregated"].address],
                 ["--encoder", servers["encoder"].address, "--prefill", servers["prefill"].address,
                  "--decode", servers["decode"].address]):
        result = subprocess.run([sys.executable, "-m", "refengine.cli", "generate", text, "--image", str(image),
                                 "--max-tokens", "6", *hops], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        outputs.append(result.stdout)
    assert outputs[0] == outputs[1]
    check_all_idle(clients)


def test_encoder_cache_release_renew_and_expiry(clients, encoder: MediaClient) -> None:
    """ENC4–ENC7, ENC15: the same image again hits the encoder cache (same mm_hash, cached);
    Release is idempotent; RenewLease extends a live handle and is NOT_FOUND for a gone one;
    a short lease frees the handle by itself."""
    before = media_load(clients["encoder"])
    first, = encoder.encode([image_item(IMAGES[3])])
    again, = encoder.encode([image_item(IMAGES[3])])
    assert again.cached and again.mm_hash == first.mm_hash and again.handle_id != first.handle_id
    assert first.mm_hash_algorithm == "refengine-rgb8-sha256" and list(first.shape) == [tiny_llava.NUM_IMAGE_TOKENS, 64]
    assert media_load(clients["encoder"])["cache_hits"] == before["cache_hits"] + 1
    assert media_load(clients["encoder"])["held_handles"] == 2
    assert encoder.release([first.handle_id, again.handle_id]) == 2
    assert encoder.release([first.handle_id, "no-such-handle"]) == 0  # idempotent
    wait_encoder_idle(clients["encoder"])
    short, = encoder.encode([image_item(IMAGES[2])], lease_seconds=0.6)
    assert encoder.renew(short.handle_id, 1.5) > short.lease_expires_unix_nanos
    time.sleep(0.9)
    assert media_load(clients["encoder"])["held_handles"] == 1  # renewed past its first lease
    wait_encoder_idle(clients["encoder"], timeout=5)
    with pytest.raises(grpc.RpcError) as err:
        encoder.renew(short.handle_id, 10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(grpc.RpcError) as err:
            encoder.encode([image_item(IMAGES[2])], lease_seconds=bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:  # bad media: exactly the multimodal refusals
        encoder.encode([oe.MediaItem(modality=oe.MODALITY_IMAGE, raw_bytes=b"not an image")])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "image" in err.value.details()
    wait_encoder_idle(clients["encoder"])


def tampered(handle: media.EmbeddingHandle, **fields: object) -> media.EmbeddingHandle:
    copy = media.EmbeddingHandle()
    copy.CopyFrom(handle)
    for name, value in fields.items():
        if name == "shape":
            del copy.shape[:]
            copy.shape.extend(value)  # type: ignore[arg-type]
        else:
            setattr(copy, name, value)
    return copy


def test_incompatible_handles_are_refused_before_acceptance(clients, encoder: MediaClient) -> None:
    """ENC11, ENC12: a wrong fingerprint, shape, dtype, algorithm or transfer, handles and items
    together, a wrongly typed extra value: INVALID_ARGUMENT, no events; nothing held after."""
    req = request("bad", IMAGES[:1], max_tokens=2)
    handle, = encoder.encode(list(req.media))
    cases = {
        "fingerprint": tampered(handle, fingerprint="0" * 64),
        "shape": tampered(handle, shape=[tiny_llava.NUM_IMAGE_TOKENS + 1, 64],
                          num_tokens=tiny_llava.NUM_IMAGE_TOKENS + 1),
        "dtype": tampered(handle, dtype="bfloat16"),
        "algorithm": tampered(handle, mm_hash_algorithm="md5"),
        "no transfer": over_backend([handle], "tcp")[0],
    }
    for name, bad in cases.items():
        for target in ("aggregated", "prefill"):
            stream = collect(clients[target].generate(with_handles(req, [bad])))
            assert stream.code == grpc.StatusCode.INVALID_ARGUMENT, (name, target, stream.details)
            assert stream.events == [], name
    both = with_handles(req, [handle])
    both.media.extend(req.media)
    stream = collect(clients["aggregated"].generate(both))
    assert stream.code == grpc.StatusCode.INVALID_ARGUMENT and "not both" in stream.details
    wrong_type = oe.GenerateRequest()
    wrong_type.CopyFrom(req)
    del wrong_type.media[:]
    wrong_type.extra.update({"refengine.v1alpha1.media_handles": "a handle"})
    assert collect(clients["aggregated"].generate(wrong_type)).code == grpc.StatusCode.INVALID_ARGUMENT
    assert encoder.release([handle.handle_id]) == 1
    check_all_idle(clients)


def test_gone_handle_fails_after_acceptance(clients, encoder: MediaClient) -> None:
    """ENC13: a handle released (or expired) before its consumer pulls it: the stream is accepted
    and ends with one EngineError KV_TRANSFER_FAILED, not retryable; nothing leaks."""
    req = request("gone", IMAGES[:2], max_tokens=4)
    handles = encoder.encode(list(req.media))
    encoder.release([handles[1].handle_id])
    for target in ("aggregated", "prefill"):
        stream = collect(clients[target].generate(with_handles(req, handles), timeout=60))
        assert stream.code == grpc.StatusCode.OK, stream.details
        errors = stream.of("error")
        assert len(errors) == 1 and stream.events[-1].WhichOneof("event") == "error"
        assert errors[0].code == oe.ERROR_CODE_KV_TRANSFER_FAILED and not errors[0].retryable
        assert "embedding handle" in errors[0].message
    encoder.release([handles[0].handle_id])  # the first one was pulled by one consumer at most
    check_all_idle(clients)


def test_a_handle_naming_another_item_fails_and_poisons_nothing(clients, encoder: MediaClient) -> None:
    """ENC8, ENC13: a handle for image 1 whose mm_hash is changed to image 0's would put image 1's
    rows into the consumer's prefix cache under image 0's identity. The encoder says what the
    session holds; the consumer refuses the rows (KV_TRANSFER_FAILED, not retryable), and image 0
    sent inline afterwards still gives its own output."""
    fresh = [png(21, (56, 56)), png(22, (56, 56))]  # never seen by the consumer (no cached rows or KV)
    real, = encoder.encode(list(request("x", fresh[:1]).media))
    other, = encoder.encode(list(request("y", fresh[1:]).media))
    # Over gRPC: a NIXL pull's failed pin would keep the rows until the pin ends (the pin's own
    # check is in tests/unit/test_kv_pull_client.py), and this test ends with everything idle.
    forged, = over_backend([tampered(other, mm_hash=real.mm_hash)], "grpc")
    try:
        stream = collect(clients["aggregated"].generate(with_handles(request("poison", fresh[:1], max_tokens=4),
                                                                     [forged]), timeout=60))
        errors = stream.of("error")
        assert len(errors) == 1 and errors[0].code == oe.ERROR_CODE_KV_TRANSFER_FAILED and not errors[0].retryable
        assert "another item" in errors[0].message, errors[0].message
    finally:
        encoder.release([real.handle_id, other.handle_id])
    inline = collect(clients["aggregated"].generate(request("poison-after", fresh[:1], max_tokens=4)))
    uncached = request("poison-check", fresh[:1], max_tokens=4)
    uncached.kv.bypass_prefix_cache = True
    assert inline.tokens() == collect(clients["aggregated"].generate(uncached)).tokens()
    check_all_idle(clients)


def test_random_workload_with_cancellations_leaks_nothing(clients, encoder: MediaClient) -> None:
    """ENC13, ENC15: 24 concurrent E → aggregated and E → P → D requests, a third cancelled at a
    random point (before, while or after the pull); afterwards every server is idle."""
    rng = random.Random(7)
    jobs = [(i, rng.randrange(1, 4), rng.random() < 0.34, rng.random() < 0.5) for i in range(24)]

    def one(job: tuple[int, int, bool, bool]) -> None:
        i, count, cancel, pd = job
        req = request(f"load-{i}", [IMAGES[(i + j) % 4] for j in range(count)], seed=i, max_tokens=12)
        try:
            handles = encoder.encode(list(req.media))
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            return
        consumer_req = with_handles(req, handles)
        events = (generate_disaggregated(clients["prefill"], clients["decode"], consumer_req, timeout=120) if pd
                  else clients["aggregated"].generate(consumer_req, timeout=120))
        try:
            for n, _ in enumerate(events):
                if cancel and n >= rng.randrange(0, 3):
                    events.close()
                    break
        except grpc.RpcError:
            pass
        finally:
            if cancel:
                encoder.release([h.handle_id for h in handles])  # a client that gave up releases

    threads = [threading.Thread(target=one, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    check_all_idle(clients)


def test_killed_encoder_fails_the_consumer_after_acceptance(tmp_path, llava: TinyLlava, clients) -> None:
    """ENC13: the encoder is SIGKILLed after Encode: the consumer accepts the request (handles are
    checked, not fetched, before acceptance) and ends it with KV_TRANSFER_FAILED, not retryable
    (the handle died with the process); the consumer is idle afterwards."""
    doomed = start_server(tmp_path / "doomed.log", "--model", str(llava.directory), *COMMON, "--role", "encoder")
    try:
        with OpenEngineClient(doomed.address) as client:
            handles = MediaClient(client).encode([image_item(IMAGES[0])])
    finally:
        doomed.signal(signal.SIGKILL)
        doomed.proc.wait(timeout=30)
    req = with_handles(request("orphan", IMAGES[:1], max_tokens=4), handles)
    stream = collect(clients["aggregated"].generate(req, timeout=60))
    assert stream.code == grpc.StatusCode.OK, stream.details
    error, = stream.of("error")
    assert error.code == oe.ERROR_CODE_KV_TRANSFER_FAILED and not error.retryable
    wait_idle(clients["aggregated"])


#: Every Encode takes 3 s longer, as a large image on a busy CPU does.
SLOW_ENCODE = """
import time
from refengine.engine import encoder
_encode = encoder.EncoderEngine.encode
def slow_encode(self, *args, **kwargs):
    time.sleep(3.0)
    return _encode(self, *args, **kwargs)
encoder.EncoderEngine.encode = slow_encode
"""


def test_an_encode_under_way_gets_the_drain_grace_period(tmp_path, llava: TinyLlava) -> None:
    """ENC3, X3: SIGTERM during an Encode: it finishes within the grace period and returns its
    handles; the drain waits for them to be consumed (here released), then the server exits 0.
    Found by review: the drain waited only for Generate, so the listeners' stop cancelled the
    Encode 0.5 s after the signal (UNAVAILABLE "Cancelling all calls"), and dropped every handle
    at once (a consumer's pull under way then failed for good)."""
    server = start_server(tmp_path / "encoder.log", "--model", str(llava.directory), *COMMON, "--role", "encoder",
                          "--shutdown-grace-seconds", "20", patch=SLOW_ENCODE)
    outcome: list[object] = []
    try:
        with OpenEngineClient(server.address) as client:
            def encode() -> None:
                try:
                    outcome.append(MediaClient(client).encode([image_item(IMAGES[0])]))
                except grpc.RpcError as exc:
                    outcome.append(exc)

            thread = threading.Thread(target=encode)
            thread.start()
            time.sleep(1.0)  # the Encode is on the server, encoding
            server.signal(signal.SIGTERM)
            thread.join(60)
            assert outcome and not isinstance(outcome[0], grpc.RpcError), outcome[:1]
            assert len(outcome[0]) == 1, outcome[0]
            time.sleep(1.0)
            assert server.proc.poll() is None, "the drain dropped a handle not yet consumed"
            assert MediaClient(client).release([outcome[0][0].handle_id]) == 1
            released = time.monotonic()
            code = server.proc.wait(60)
    finally:
        server.stop()
    assert code == 0, server.log_tail()
    assert time.monotonic() - released < 10, "the drain waited on after the last handle was released"
