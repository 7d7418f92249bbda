"""The KV pull service's request checks (refengine.kvpull.v1, proto/refengine/kvpull/v1/kv_pull.proto's
Errors), on a real gRPC server on loopback over a real ``KvSessionStore``:

- a Pull's whole block range is checked before any chunk is sent: a range past the session's end
  streamed the blocks inside it, then failed at its first chunk outside with a message about that
  chunk alone, and an empty range (num_blocks 0, anywhere) answered OK (found by a review probe);
- a Pin of NaN or <= 0 seconds is INVALID_ARGUMENT and pins nothing: NaN was granted as NaN (a
  reader's window check could never end) and a negative one answered OK with 0 ("not said", so the
  reader assumed the seconds it asked for) while nothing was pinned;
- while the model loads, every KvPull RPC answers UNAVAILABLE, as the Control RPCs do (it said
  FAILED_PRECONDITION, "not a prefill server").
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from refengine.config import EngineConfig
from refengine.kv.transfer.sessions import KvSession, KvSessionStore
from refengine.protocol.kvpull.v1 import kv_pull_pb2 as pb
from refengine.protocol.kvpull.v1 import kv_pull_pb2_grpc as pb_grpc
from refengine.server.kv_pull_service import KvPullServicer
from refengine.server.options import ServerOptions
from refengine.server.state import ServerState

BLOCK_BYTES = 64 * 1024  # one block a chunk (the chunk size below): a range past the end shows its chunks
SESSION_BLOCKS = 4
LAYOUT = "test-layout"


class _Prefill:
    """The EngineClient surface KvPull uses, over a real session store; reads return filler bytes."""

    info = SimpleNamespace(role="prefill")

    def __init__(self, sessions: KvSessionStore) -> None:
        self.sessions = sessions

    def kv_layout(self) -> str:
        return LAYOUT

    def block_nbytes(self) -> int:
        return BLOCK_BYTES

    def kv_session_content(self, session_id: str) -> str:
        return self.sessions.content(session_id)

    def kv_session_blocks(self, session_id: str) -> int:
        return self.sessions.num_blocks(session_id)

    def read_kv_session(self, session_id: str, first_block_index: int, num_blocks: int) -> bytes:
        self.sessions.begin_read(session_id)
        self.sessions.end_read(session_id)
        return bytes(BLOCK_BYTES * num_blocks)

    def pin_kv_session(self, session_id: str, seconds: float, expected_content: str = "") -> tuple[int, ...]:
        return self.sessions.pin(session_id, seconds)

    def unpin_kv_session(self, session_id: str) -> None:
        self.sessions.unpin(session_id)

    def kv_read_identity(self) -> str:
        return ""


def _prefill_state(sessions: KvSessionStore) -> SimpleNamespace:
    engine = _Prefill(sessions)
    return SimpleNamespace(engine=engine, engine_for_control=lambda: engine,
                           engine_config=SimpleNamespace(kv_transfer=SimpleNamespace(
                               chunk_bytes=BLOCK_BYTES, pull_timeout_seconds=30.0)),
                           options=SimpleNamespace(max_send_message_bytes=64 << 20))


def _store() -> KvSessionStore:
    sessions = KvSessionStore()
    sessions.add(KvSession("s", "prompt 00", tuple(range(10, 10 + SESSION_BLOCKS)), expires_at=time.monotonic() + 60))
    return sessions


def _on_server(state: Any, call: Callable[[pb_grpc.KvPullStub], Any]) -> Any:
    """``call(stub)`` on its own thread, against a grpc.aio server of ``KvPullServicer(state)``."""

    async def main() -> Any:
        server = grpc.aio.server()
        pb_grpc.add_KvPullServicer_to_server(KvPullServicer(state), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            def client() -> Any:
                with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                    return call(pb_grpc.KvPullStub(channel))
            return await asyncio.to_thread(client)
        finally:
            await server.stop(0)

    return asyncio.run(main())


def _pull(first: int, num: int) -> Callable[[pb_grpc.KvPullStub], tuple[list[int], grpc.StatusCode, str]]:
    def call(stub: pb_grpc.KvPullStub) -> tuple[list[int], grpc.StatusCode, str]:
        chunks: list[int] = []
        request = pb.PullRequest(session_id="s", first_block_index=first, num_blocks=num, kv_layout=LAYOUT)
        try:
            for chunk in stub.Pull(request, timeout=10):
                chunks.append(chunk.first_block_index)
        except grpc.RpcError as err:
            return chunks, err.code(), err.details()
        return chunks, grpc.StatusCode.OK, ""
    return call


@pytest.mark.parametrize(("first", "num"), [(3, 2), (0, 2**32 - 1), (2, 1000), (0, 0), (1000, 0), (4, 1)])
def test_a_pull_outside_the_session_is_refused_before_any_chunk(first: int, num: int) -> None:
    chunks, code, details = _on_server(_prefill_state(_store()), _pull(first, num))
    assert (chunks, code) == ([], grpc.StatusCode.INVALID_ARGUMENT), (chunks, code, details)
    assert f"blocks [{first}, {first + num}) requested; session 's' holds {SESSION_BLOCKS}" in details


def test_a_pull_inside_the_session_streams_every_block() -> None:
    assert _on_server(_prefill_state(_store()), _pull(1, 3)) == ([1, 2, 3], grpc.StatusCode.OK, "")


@pytest.mark.parametrize("seconds", [math.nan, 0.0, -0.0, -1.0, -math.inf])
def test_a_pin_of_no_time_is_refused_and_pins_nothing(seconds: float) -> None:
    sessions = _store()

    def pin(stub: pb_grpc.KvPullStub) -> grpc.StatusCode:
        try:
            stub.Pin(pb.PinRequest(session_id="s", seconds=seconds), timeout=10)
        except grpc.RpcError as err:
            assert "seconds must be > 0" in err.details(), err.details()
            return err.code()
        return grpc.StatusCode.OK

    assert _on_server(_prefill_state(sessions), pin) == grpc.StatusCode.INVALID_ARGUMENT
    sessions.release("s", "aborted")  # with no pin, an aborted session is freed at once
    assert [s.session_id for s in sessions.take_due()] == ["s"]


def test_every_kv_pull_rpc_answers_unavailable_while_the_model_loads() -> None:
    state = ServerState(ServerOptions(), EngineConfig())  # STARTING: no engine yet

    def calls(stub: pb_grpc.KvPullStub) -> list[tuple[grpc.StatusCode, str]]:
        outcomes = []
        for rpc in (lambda: list(stub.Pull(pb.PullRequest(session_id="s", num_blocks=1, kv_layout=LAYOUT),
                                           timeout=10)),
                    lambda: stub.Release(pb.SessionRequest(session_id="s"), timeout=10),
                    lambda: stub.Pin(pb.PinRequest(session_id="s", seconds=1.0), timeout=10)):
            with pytest.raises(grpc.RpcError) as info:
                rpc()
            outcomes.append((info.value.code(), info.value.details()))
        return outcomes

    for code, details in _on_server(state, calls):
        assert code == grpc.StatusCode.UNAVAILABLE and "still loading" in details, (code, details)
