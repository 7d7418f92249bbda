"""A Pin (refengine.kvpull.v1) whose reader gave up before hearing of it ends at once on the
source: the reader will never confirm or unpin it, and its blocks would otherwise stay held for
the whole pin window (up to --kv-pull-timeout; found by review). A real gRPC server on loopback,
a real ``KvSessionStore``; the source's event loop is kept busy past the reader's deadline."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import grpc

from refengine.kv.transfer.sessions import KvSession, KvSessionStore
from refengine.protocol.kvpull.v1 import kv_pull_pb2 as pb
from refengine.protocol.kvpull.v1 import kv_pull_pb2_grpc as pb_grpc
from refengine.server.kv_pull_service import KvPullServicer

BUSY_SECONDS = 0.5  # how long the source's loop is held while the pin is made
READER_DEADLINE_SECONDS = 0.1


class _SourceEngine:
    """The EngineClient surface Pin uses, over a real session store; its loop is busy when pinning."""

    info = SimpleNamespace(role="prefill")

    def __init__(self, sessions: KvSessionStore) -> None:
        self.sessions = sessions

    def kv_session_content(self, session_id: str) -> str:
        return self.sessions.content(session_id)

    def pin_kv_session(self, session_id: str, seconds: float, expected_content: str = "") -> tuple[int, ...]:
        time.sleep(BUSY_SECONDS)  # the loop is busy (e.g. a long step's results) as the pin is made
        return self.sessions.pin(session_id, seconds)

    def unpin_kv_session(self, session_id: str) -> None:
        self.sessions.unpin(session_id)

    def kv_read_identity(self) -> str:
        return ""


async def _serve_and_pin(sessions: KvSessionStore, reader_timeout: float) -> grpc.StatusCode:
    engine = _SourceEngine(sessions)
    state = SimpleNamespace(engine=engine, engine_for_control=lambda: engine, engine_config=SimpleNamespace(
        kv_transfer=SimpleNamespace(pull_timeout_seconds=30.0)))
    server = grpc.aio.server()
    pb_grpc.add_KvPullServicer_to_server(KvPullServicer(state), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    codes: list[grpc.StatusCode] = []

    def reader() -> None:  # the decode side, on its own thread and channel
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                pb_grpc.KvPullStub(channel).Pin(pb.PinRequest(session_id="s", seconds=20.0), timeout=reader_timeout)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as err:
                codes.append(err.code())

    thread = threading.Thread(target=reader)
    thread.start()
    while thread.is_alive():
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)  # the handler's end
    await server.stop(0)
    return codes[0]


def _store() -> KvSessionStore:
    sessions = KvSessionStore()
    sessions.add(KvSession("s", "prompt 00", (3, 4), expires_at=time.monotonic() + 60.0))
    return sessions


def test_a_pin_the_reader_gave_up_on_ends_at_once() -> None:
    sessions = _store()
    assert asyncio.run(_serve_and_pin(sessions, READER_DEADLINE_SECONDS)) == grpc.StatusCode.DEADLINE_EXCEEDED
    sessions.release("s", "aborted")  # e.g. Abort(kv_session): nothing reads it, so it is freed at once
    assert [s.session_id for s in sessions.take_due()] == ["s"], "an orphaned pin holds the blocks"


def test_a_pin_the_reader_heard_of_holds_for_its_window() -> None:
    sessions = _store()
    assert asyncio.run(_serve_and_pin(sessions, 5.0)) == grpc.StatusCode.OK
    sessions.release("s", "aborted")
    assert sessions.take_due() == [] and sessions.seconds_until_due() > 10.0  # its READ may still run
