"""Generate's acceptance runs on the server's slow-work threads (``server/workers.py``), not on
asyncio's default executor (``min(32, cpus + 4)`` threads), so requests waiting in ``add_request``
(a grammar compile queued behind ``--guided-compile-threads``, a slow media URL) never hold up
the quick calls that share the default executor: here a decode server's KvPull of this prefill
server. Found by review: with the default executor's threads all adding, a 1-block KvPull waited
for the adds to end.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from types import SimpleNamespace

from refengine.protocol.kvpull.v1 import kv_pull_pb2 as pb
from refengine.server.inference import InferenceServicer
from refengine.server.kv_pull_service import KvPullServicer
from refengine.server.stream_bridge import OutputBridge
from refengine.server.workers import SlowWork
from refengine.types import GenerationRequest


class Ctx:
    async def send_initial_metadata(self, md):  # noqa: ANN001
        pass

    async def abort(self, code, message):  # noqa: ANN001
        raise RuntimeError(code, message)


def test_a_kv_pull_read_does_not_wait_for_generate_acceptance_workers() -> None:
    gate = threading.Event()
    engine = SimpleNamespace(
        info=SimpleNamespace(role="prefill"),
        add_request=lambda params, sink: gate.wait(30),  # a grammar compile waiting for a compile thread
        kv_layout=lambda: "L", kv_session_content=lambda sid: "c", kv_session_blocks=lambda sid: 1,
        block_nbytes=lambda: 16,
        read_kv_session=lambda sid, first, n: b"\0" * 16 * n)
    kv_transfer = SimpleNamespace(chunk_bytes=1 << 20)
    state = SimpleNamespace(engine=engine, engine_for_control=lambda: engine,
                            engine_config=SimpleNamespace(kv_transfer=kv_transfer),
                            options=SimpleNamespace(max_send_message_bytes=64 << 20))
    workers = min(32, (os.cpu_count() or 1) + 4)

    async def main() -> float:
        loop = asyncio.get_running_loop()
        servicer = SimpleNamespace(state=SimpleNamespace(slow_work=SlowWork()))
        adds = [asyncio.ensure_future(InferenceServicer._add_on_worker(
            servicer, engine, GenerationRequest(f"g{i}", prompt_token_ids=[1]),
            OutputBridge(loop, f"g{i}", 8, 5.0, lambda b: None))) for i in range(workers)]
        await asyncio.sleep(0.2)
        loop.call_later(3.0, gate.set)  # the compiles end after 3 s
        started = time.monotonic()
        async for _ in KvPullServicer(state).Pull(
                pb.PullRequest(session_id="s", first_block_index=0, num_blocks=1, kv_layout="L"), Ctx()):
            pass
        elapsed = time.monotonic() - started
        await asyncio.gather(*adds)
        return elapsed

    elapsed = asyncio.run(main())
    assert elapsed < 1.0, f"the KvPull chunk read waited {elapsed:.2f} s for Generate's acceptance workers"
