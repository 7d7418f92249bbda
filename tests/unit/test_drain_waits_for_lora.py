"""A drain's grace period waits for a ``LoadLora`` or ``UnloadLora`` under way, as for a running
stream (X3, app.py's shutdown steps): its reply, not the listeners' cancel 0.5 s after the grace
period, ends it.

Before, the grace period looked only at streams, acceptances and Encode calls: an idle server that
got SIGTERM while an adapter's files were being read ended its drain at once, and the load was
cancelled with the listeners, its client told CANCELLED for a load that may have completed.

The load is held by the fake engine's ``load_lora`` (a real one reads files in well under a second,
too short to race deterministically); the servicer, the state and ``Server._drain`` are the real ones.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from types import SimpleNamespace

import pytest

from refengine.config import EngineConfig
from refengine.protocol import oe
from refengine.server.app import Server
from refengine.server.control import ControlServicer
from refengine.server.options import ServerOptions
from refengine.types import LoraAdapterSpec

GRACE_SECONDS = 20.0  # far longer than the test: the drain must end when the load does, not at the deadline
HELD_SECONDS = 0.5  # how long the drain is watched while the load is held


class Ctx:
    async def abort(self, code, message):  # noqa: ANN001
        raise AssertionError(f"the RPC failed: {code} {message}")

    def time_remaining(self) -> None:
        return None


class HeldLoraEngine:
    """What ``Server._drain`` and the LoRA RPCs ask of an idle aggregated engine; load and unload
    block until ``release`` is set."""

    def __init__(self) -> None:
        self.info = SimpleNamespace(role="aggregated", max_loras=1)
        self.started = threading.Event()
        self.release = threading.Event()
        self.has_unfinished_requests = False

    def _held(self) -> None:
        self.started.set()
        assert self.release.wait(30), "the test never released the load"

    def load_lora(self, spec: LoraAdapterSpec) -> tuple[LoraAdapterSpec, bool]:
        self._held()
        return spec, False

    def unload_lora(self, name: str) -> LoraAdapterSpec:
        self._held()
        return LoraAdapterSpec(1, name, "/adapters/a")

    def release_all_kv_sessions(self) -> int:
        return 0

    def stats(self) -> SimpleNamespace:
        return SimpleNamespace(used_kv_blocks=0, withheld_kv_blocks=0)


def _load(servicer: ControlServicer) -> Awaitable[oe.LoadLoraResponse]:
    adapter = oe.LoraAdapter(lora_id=1, lora_name="a", source_path="/adapters/a")
    return servicer.LoadLora(oe.LoadLoraRequest(adapter=adapter), Ctx())


def _unload(servicer: ControlServicer) -> Awaitable[oe.UnloadLoraResponse]:
    return servicer.UnloadLora(oe.UnloadLoraRequest(lora_name="a"), Ctx())


@pytest.mark.parametrize("call", [_load, _unload], ids=["LoadLora", "UnloadLora"])
def test_the_drain_waits_for_a_lora_call_under_way(call: Callable[[ControlServicer], Awaitable]) -> None:
    server = Server(ServerOptions(shutdown_grace_seconds=GRACE_SECONDS), EngineConfig())
    engine = HeldLoraEngine()
    server.state.engine = engine

    async def main() -> tuple[bool, bool, object]:
        rpc = asyncio.ensure_future(call(ControlServicer(server.state)))
        assert await asyncio.to_thread(engine.started.wait, 10), "the call never reached the engine"
        drain = asyncio.ensure_future(server._drain())
        await asyncio.sleep(HELD_SECONDS)
        ended_while_held = drain.done()
        engine.release.set()
        reply = await asyncio.wait_for(rpc, 10)
        await asyncio.wait_for(drain, 10)  # well before GRACE_SECONDS: it ends with the call
        return ended_while_held, server.state.accepting == 0, reply

    ended_while_held, nothing_left, reply = asyncio.run(main())
    assert not ended_while_held, "the grace period ended while the LoRA call was under way"
    assert nothing_left
    assert reply.adapter.lora_name == "a"
