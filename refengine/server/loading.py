"""Loading the role's engine on a worker thread, so the listeners answer (STARTING) meanwhile."""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import Callable

from refengine.config import EngineConfig
from refengine.engine.interface import EngineClient
from refengine.server.kv_pull_client import GrpcKvTransfer


def load_engine(config: EngineConfig):  # noqa: ANN201 - an Engine or an EncoderEngine (EngineClient)
    """The role's engine, with the gRPC transfer backends (KV, and embedding handles)."""
    from refengine.engine.encoder import EncoderEngine
    from refengine.engine.engine import Engine

    if config.role == "encoder":
        return EncoderEngine.from_config(config, [GrpcKvTransfer(config.kv_transfer.pull_timeout_seconds)])
    backends = [] if config.role == "aggregated" else [GrpcKvTransfer(config.kv_transfer.pull_timeout_seconds)]
    return Engine.from_config(config, transfer_backends=backends,
                              embedding_backends=[GrpcKvTransfer(config.encoder.pull_timeout_seconds)])


def load_in_thread(config: EngineConfig,
                   check: Callable[[EngineClient], None]) -> tuple[asyncio.Future, threading.Thread]:
    """Load the engine on a daemon thread (a signal during loading must not wait for it), then
    ``check`` it against the server's options (what it raises fails the load like a bad model).

    Once loaded, everything alive (the model's modules, the tokenizer, the libraries) moves to
    the collector's permanent generation (``gc.freeze``): those objects live as long as the
    process, and a full collection no longer walks them. Requests that make many small objects
    (``all`` candidates: ~50k a token) triggered full collections that spent most of their time
    there; measured, an ``all``-candidates token took 305 ms with them, 225 ms without.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def load() -> None:
        try:
            engine = load_engine(config)
            check(engine)
            gc.collect()
            gc.freeze()
        except BaseException as exc:  # noqa: BLE001 - reported to the loop, logged there
            error = exc
            loop.call_soon_threadsafe(lambda: future.done() or future.set_exception(error))
        else:
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(engine))

    thread = threading.Thread(target=load, name="refengine-load", daemon=True)
    thread.start()
    return future, thread
