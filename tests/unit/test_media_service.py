"""``refengine.v1alpha1.Media`` servicer (``server/media_service.py``) without a network: an
Encode whose RPC ends (client cancel, deadline) while the encoder is still working must not
leave handles nobody can name (ENC3 all or nothing, ENC15 held_handles back to 0)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from refengine.protocol import oe
from refengine.protocol.v1alpha1 import media_pb2 as media
from refengine.server.media_service import MediaServicer
from refengine.server.state import ServerState
from refengine.server.workers import SlowWork
from refengine.types import EmbeddingHandleSpec, MediaInput

WAIT = 5.0


def spec(handle_id: str) -> EmbeddingHandleSpec:
    return EmbeddingHandleSpec(handle_id, "ab" * 32, "refengine-rgb8-sha256", "image", (16, 64), "float32",
                               "refengine-embeddings/1:row-major:64:float32", "f" * 64, (), 0, False)


class SlowEncoder:
    """Encodes once ``finish`` is set; records what is released."""

    info = SimpleNamespace(role="encoder")

    def __init__(self) -> None:
        self.started, self.finish, self.released_all = threading.Event(), threading.Event(), threading.Event()
        self.released: list[str] = []

    def encode(self, items: list[MediaInput], lease: float | None, cache_salt: str = "") -> list[EmbeddingHandleSpec]:
        self.started.set()
        assert self.finish.wait(WAIT)
        return [spec(f"h{i}") for i in range(len(items))]

    def release_handles(self, handle_ids: list[str]) -> int:
        self.released += handle_ids
        self.released_all.set()
        return len(handle_ids)


class FakeState(SimpleNamespace):
    """The parts of ServerState an Encode uses; the drain's count is the real one."""

    held_for_drain = ServerState.held_for_drain


def servicer(engine: SlowEncoder) -> MediaServicer:
    state = FakeState(engine_for_generate=lambda: engine, engine_for_control=lambda: engine, caps=None,
                            kv_endpoints=(), slow_work=SlowWork(), accepting=0)
    return MediaServicer(state)  # type: ignore[arg-type]


def encode_request(count: int) -> media.EncodeRequest:
    return media.EncodeRequest(items=[oe.MediaItem(modality=oe.MODALITY_IMAGE, raw_bytes=b"png")] * count)


def test_an_encode_cancelled_mid_work_releases_the_handles_it_made() -> None:
    """ENC3/ENC15: the client of a cancelled Encode never learns the handle ids, so the server
    releases them as soon as the work ends; before, they held rows until their leases ended."""
    engine = SlowEncoder()

    async def scenario() -> None:
        rpc = asyncio.ensure_future(servicer(engine).Encode(encode_request(2), context=None))
        assert await asyncio.to_thread(engine.started.wait, WAIT)
        rpc.cancel()  # what grpc.aio does to the handler when the client cancels or its deadline passes
        await asyncio.gather(rpc, return_exceptions=True)
        assert rpc.cancelled()
        engine.finish.set()
        assert await asyncio.to_thread(engine.released_all.wait, WAIT)

    asyncio.run(scenario())
    assert sorted(engine.released) == ["h0", "h1"]


def test_an_encode_that_completes_releases_nothing() -> None:
    engine = SlowEncoder()
    engine.finish.set()
    reply = asyncio.run(servicer(engine).Encode(encode_request(2), context=None))
    assert [h.handle_id for h in reply.handles] == ["h0", "h1"] and engine.released == []


class Deadline:
    """What the servicer reads of a grpc.aio context: the time left, and abort (which raises)."""

    def __init__(self, seconds_left: float) -> None:
        self.seconds_left = seconds_left
        self.aborted: tuple | None = None

    def time_remaining(self) -> float:
        return self.seconds_left

    async def abort(self, code, message: str) -> None:  # noqa: ANN001
        self.aborted = (code, message)
        raise RuntimeError("aborted")


def test_an_encode_done_at_its_deadline_releases_its_handles_and_says_so() -> None:
    """Found by review: grpc.aio does not cancel a handler the moment its deadline passes, so an
    Encode that finished just after it returned normally; the reply was dropped and its handles
    were held, unnamed, until their leases ended."""
    engine = SlowEncoder()
    engine.finish.set()
    context = Deadline(seconds_left=0.01)
    try:
        asyncio.run(servicer(engine).Encode(encode_request(2), context=context))
    except RuntimeError:
        pass
    assert context.aborted is not None and context.aborted[0].name == "DEADLINE_EXCEEDED"
    assert sorted(engine.released) == ["h0", "h1"]


def test_an_encode_with_time_to_spare_keeps_its_handles() -> None:
    engine = SlowEncoder()
    engine.finish.set()
    reply = asyncio.run(servicer(engine).Encode(encode_request(2), context=Deadline(seconds_left=5.0)))
    assert [h.handle_id for h in reply.handles] == ["h0", "h1"] and engine.released == []


def test_a_drain_waits_for_an_encode_under_way() -> None:
    """X3: an Encode counts as work the drain waits for (``ServerState.accepting``) while it runs,
    also when cancelled. Found by review: the listeners' stop cut it off 0.5 s after SIGTERM."""
    engine = SlowEncoder()
    media_servicer = servicer(engine)
    counted: list[int] = []

    async def scenario() -> None:
        rpc = asyncio.ensure_future(media_servicer.Encode(encode_request(1), context=None))
        assert await asyncio.to_thread(engine.started.wait, WAIT)
        counted.append(media_servicer.state.accepting)
        engine.finish.set()
        await rpc
        counted.append(media_servicer.state.accepting)
        engine.started.clear()
        engine.finish.clear()
        cancelled = asyncio.ensure_future(media_servicer.Encode(encode_request(1), context=None))
        assert await asyncio.to_thread(engine.started.wait, WAIT)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        counted.append(media_servicer.state.accepting)
        engine.finish.set()

    asyncio.run(scenario())
    assert counted == [1, 0, 0]
