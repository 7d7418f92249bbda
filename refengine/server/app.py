"""``refengine serve``: an OpenEngine v0.1.0 server over grpc.aio.

Startup: the listeners open first (Health = STARTING, grpc.health.v1 NOT_SERVING), the
model loads on a daemon worker thread, then ``Engine.start()`` runs the step loop on its
own thread and the state turns READY. The event loop never waits on model compute.

SIGUSR1 resets the prefix cache (cached blocks are freed, blocks in use stay, one
``AllBlocksCleared`` KV event): the admin path until a secured admin service exists.

Shutdown on SIGTERM/SIGINT (a second signal skips the grace period and the flush):
1. draining: new Generate → UNAVAILABLE; Health answers NOT_READY with a check naming the
   drain (the release has no DRAINING state), grpc.health.v1 NOT_SERVING; the other Control
   RPCs keep answering;
2. running streams, requests still being accepted, Encode calls and LoRA loads or unloads get
   ``--shutdown-grace-seconds`` to finish, and a prefill server's KV sessions (an encoder's
   handles) to be pulled (the KV pull service keeps answering);
3. the rest end with one ``EngineError(CANCELLED, retryable=true)`` naming the drain (also one
   accepted after the deadline), and their engine requests are aborted (KV freed); the flush waits
   for the engine to confirm the aborts and for those events to be written;
4. the listeners stop, the engine thread stops, the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading

import grpc
from grpc_reflection.v1alpha import reflection

from refengine.args_config import engine_config_from_args
from refengine.config import EngineConfig
from refengine.engine.interface import EngineClient
from refengine.protocol.addresses import listening_line
from refengine.protocol.kvpull.v1 import kv_pull_pb2 as kv_pull
from refengine.protocol.kvpull.v1 import kv_pull_pb2_grpc as kv_pull_grpc
from refengine.protocol.v1alpha1 import media_pb2, media_pb2_grpc
from refengine.runtime import apply_process_settings
from refengine.server import kv_events_service
from refengine.server.args import options_from_args
from refengine.server.control import ControlServicer
from refengine.server.health import GrpcHealth
from refengine.server.inference import InferenceServicer
from refengine.server.kv_events_service import advertised_host
from refengine.server.kv_pull_service import KvPullServicer, blocks_per_chunk
from refengine.server.loading import load_in_thread
from refengine.server.media_service import MediaServicer
from refengine.server.options import ServerOptions, host_port
from refengine.server.state import Lifecycle, ServerState
from refengine.server.stream_bridge import ABORT_CONFIRM_SECONDS
from refengine.server.wire import add_servicer
from refengine.types import KvEndpointSpec

KV_PULL_SERVICE = kv_pull.DESCRIPTOR.services_by_name["KvPull"].full_name
INFERENCE_SERVICE, CONTROL_SERVICE = "openengine.v1.Inference", "openengine.v1.Control"
MEDIA_SERVICE = media_pb2.DESCRIPTOR.services_by_name["Media"].full_name

logger = logging.getLogger("refengine.server")

# After the grace period: a cut-off stream holds its terminal event until the engine confirms
# the abort (its usage is then final), which waits for the step under way: up to
# ABORT_CONFIRM_SECONDS. Then the event is written. The drain ends as soon as nothing is left.
FLUSH_SECONDS = ABORT_CONFIRM_SECONDS + 1.0


def serve_from_args(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        options = options_from_args(args)
        engine_config = engine_config_from_args(args)
        for root in engine_config.lora.roots:  # every load under it would be refused (found by review)
            if not os.path.isdir(root):
                raise ValueError(f"--lora-root {root}: not a directory")
        if options.kv_events_zmq and (not engine_config.kv_events.enabled or engine_config.role == "encoder"):
            raise ValueError("--kv-events-zmq needs KV events: drop --no-kv-events (an encoder server has none)")
        if options.kv_events_zmq:
            from refengine.server.kv_events_zmq_wire import check_endpoints  # pyzmq only when asked for

            check_endpoints(options)
    except ValueError as exc:
        print(f"refengine serve: {exc}", file=sys.stderr)
        return 2
    apply_process_settings(engine_config)  # imports torch only when --num-threads is given
    server = Server(options, engine_config)
    try:
        code = asyncio.run(server.run())
    except ListenError as exc:
        print(f"refengine serve: {exc}", file=sys.stderr)
        return 2
    if server.loader is not None and server.loader.is_alive():
        # Stopped while loading: interpreter finalization would tear down a thread that is
        # inside native code (torch, safetensors) and abort; leave without finalizing.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


class ListenError(Exception):
    """A listener could not bind its address (exit 2, like a bad flag)."""


class Server:
    """One process: listeners, state, engine, signals."""

    def __init__(self, options: ServerOptions, engine_config: EngineConfig) -> None:
        self.options = options
        self.state = ServerState(options, engine_config)
        self.health = GrpcHealth()
        self.listeners: list[grpc.aio.Server] = []
        self._stop = asyncio.Event()
        self._signals = 0
        self.kv_source: kv_events_service.ZmqSource | None = None
        self._tasks: set[asyncio.Task] = set()
        self.loader: threading.Thread | None = None

    def _build_listeners(self) -> list[str]:
        """Bind every listener; the ``listening_line`` of each, to print once they all serve."""
        o = self.options
        inference, control = InferenceServicer(self.state), ControlServicer(self.state)
        shared = o.control_port is None
        main = grpc.aio.server(options=o.grpc_options())
        add_servicer(inference, "Inference", main)
        kv_pull_grpc.add_KvPullServicer_to_server(KvPullServicer(self.state), main)
        media_pb2_grpc.add_MediaServicer_to_server(MediaServicer(self.state), main)
        main_services = (INFERENCE_SERVICE, *((CONTROL_SERVICE,) if shared else ()))
        # Each listener lists (reflection) and reports (grpc.health.v1) only what it serves.
        plan = [(main, o.host, o.port, main_services, (KV_PULL_SERVICE, MEDIA_SERVICE))]
        if shared:
            add_servicer(control, "Control", main)
        else:
            side = grpc.aio.server(options=o.grpc_options())
            add_servicer(control, "Control", side)
            plan.append((side, o.control_host or o.host, o.control_port, (CONTROL_SERVICE,), ()))
        announced: list[str] = []
        for server, host, port, services, others in plan:
            self.health.register(server, services)
            reflection.enable_server_reflection((*services, *others, "grpc.health.v1.Health", reflection.SERVICE_NAME),
                                                server)
            try:
                bound = server.add_insecure_port(host_port(host, port))
            except RuntimeError:  # gRPC's bind failure: the operator's mistake, said without a traceback
                flag = "--port" if server is main else "--control-port"
                raise ListenError(f"{flag} {port}: cannot listen on {host_port(host, port)} (in use, or not an "
                                  "address of this machine)") from None
            announced.append(listening_line(host_port(host, bound), [name.rsplit(".", 1)[-1] for name in services]))
            self.listeners.append(server)
            if server is main:  # K4, ENC9: sessions and embedding handles are pulled from the Inference port
                self.state.kv_endpoints = (KvEndpointSpec(advertised_host(o), bound, "grpc"),)
        return announced

    def _background(self, coro) -> None:  # noqa: ANN001 - a coroutine
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)  # keep a reference until done (asyncio holds tasks weakly)
        task.add_done_callback(self._tasks.discard)

    def _on_signal(self) -> None:
        self._signals += 1
        action = "draining" if self._signals == 1 else "stopping now"
        logger.info("%s signal received: %s", "first" if self._signals == 1 else "another", action)
        self._stop.set()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        # Signals first: a supervisor that reads the listening lines may signal at once; before,
        # a SIGTERM just after them killed the process (no drain, exit -15) and a SIGINT raised
        # inside gRPC's start (found by review).
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)
        loop.add_signal_handler(signal.SIGUSR1, lambda: self._background(kv_events_service.reset_prefix_cache(
            self.state)))
        self.state.on_change(lambda lifecycle: self._background(self.health.follow(lifecycle)))
        announced = self._build_listeners()
        await self.health.follow(Lifecycle.STARTING)
        for server in self.listeners:
            await server.start()
        for line in announced:  # once every listener serves: a supervisor reads ports that answer
            print(line, flush=True)
        code = await self._load_and_serve()
        await self._shutdown()
        return code

    async def _load_and_serve(self) -> int:
        loading, self.loader = load_in_thread(self.state.engine_config, self._check_loaded)
        stopping = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait([loading, stopping], return_when=asyncio.FIRST_COMPLETED)
        if not loading.done():
            logger.info("stopped while the model was loading")
            return 0
        if loading.exception() is not None:
            stopping.cancel()
            exc = loading.exception()
            logger.error("the model failed to load: %s: %s", type(exc).__name__, exc)
            self.state.set_load_failed(f"{type(exc).__name__}: {exc}")
            return 1
        engine = loading.result()
        engine.start()
        try:
            self.kv_source = kv_events_service.start_compatibility_source(self.state, engine)
        except Exception as exc:  # zmq.ZMQError: the port was taken after the check before loading
            stopping.cancel()
            logger.error("--kv-events-zmq %s: %s: %s", self.options.kv_events_zmq, type(exc).__name__, exc)
            self.state.set_load_failed(f"--kv-events-zmq: {type(exc).__name__}: {exc}")
            await asyncio.to_thread(engine.shutdown)
            return 2
        loop = asyncio.get_running_loop()
        engine.on_stopped(lambda reason: loop.call_soon_threadsafe(self._engine_stopped, reason))
        self.state.set_ready(engine)
        logger.info("ready: %s (%d KV blocks)", engine.info.served_model_name, engine.info.total_kv_blocks)
        await stopping
        await self._drain()
        return 0

    def _engine_stopped(self, reason: str) -> None:
        logger.error("%s: the server is NOT_READY and refuses new requests until restarted", reason)
        self.state.set_engine_stopped(reason)

    def _check_loaded(self, engine: EngineClient) -> None:
        if engine.info.supports_multimodal or engine.info.role == "encoder":
            if problem := self.options.media_item_problem(self.state.engine_config.media.max_bytes):
                logger.warning("%s", problem)
        if engine.info.role in ("prefill", "encoder"):  # its KV sessions are pulled in chunks of whole blocks
            blocks_per_chunk(self.state.engine_config.kv_transfer.chunk_bytes, self.options.max_send_message_bytes,
                             engine.block_nbytes())

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        self.state.set_draining()
        deadline = loop.time() + self.options.shutdown_grace_seconds
        # A request still inside acceptance counts as running: it becomes a stream (or is refused).
        while self._draining_work() and loop.time() < deadline and self._signals < 2:
            await asyncio.sleep(0.05)
        cut_off = self.state.cut_off_streams()  # also those accepted from now on
        released = self.state.engine.release_all_kv_sessions()  # K7: a drained prefill server keeps none
        if released:
            logger.info("drain: released %d KV sessions no decode server had pulled", released)
        if cut_off:
            logger.info("grace period over: cancelled %d streams (retryable)", cut_off)
        for subscriber in list(self.state.kv_subscribers):  # they would never end on their own
            subscriber.drain()
        # Let the engine apply the aborts (frees their KV) and the terminal events be written,
        # before the listeners' stop cancels every call still open.
        flush_deadline = loop.time() + FLUSH_SECONDS
        while not self.state.flushed() and loop.time() < flush_deadline and self._signals < 2:
            await asyncio.sleep(0.02)

    def _draining_work(self) -> bool:
        """What the grace period waits for: streams, acceptances, Encode and LoRA calls, and a prefill
        server's KV sessions (an encoder's handles) not yet pulled. One dropped at once would fail
        its consumer's request for good (KV_SESSION_NOT_FOUND, not retryable) while its pull could
        still run, on every rolling restart (found by review); a pull, a release or the lease ends it."""
        if self.state.streams or self.state.accepting:
            return True
        engine = self.state.engine
        if self.state.engine_error is not None:  # a stopped engine expires no lease any more
            return False
        if engine.info.role == "prefill":
            return engine.stats().active_kv_sessions > 0
        if engine.info.role == "encoder":
            media = engine.stats().media
            return media is not None and media.held_handles > 0
        return False

    async def _shutdown(self) -> None:
        self.state.set_draining()
        await asyncio.gather(*(server.stop(0.5) for server in self.listeners))
        if self.kv_source is not None:
            self.kv_source.close()
        if self.state.engine is not None:
            await asyncio.to_thread(self.state.engine.shutdown)
            stats = self.state.engine.stats()
            # Read by the drain tests: after a drain every KV block is free or cached.
            logger.info("KV pool at exit: %d used, %d cached, %d total blocks",
                        stats.used_kv_blocks, stats.cached_kv_blocks, stats.total_kv_blocks)
        self.state.slow_work.shutdown()
        logger.info("stopped")
