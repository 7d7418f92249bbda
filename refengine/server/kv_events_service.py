"""``Control.SubscribeKvEvents`` and ``Control.GetKvEventSources`` (RULES E1–E6).

Choices where the contract is silent (ref):
- one data-parallel rank, 0: any other rank, or a rank named twice, is INVALID_ARGUMENT;
- ``include_snapshot`` together with ``start_sequence_number`` is INVALID_ARGUMENT (a
  snapshot starts a view afresh, a replay continues one);
- a snapshot is one batch numbered like the last live batch it includes (0 before any):
  the live batches after it continue from the next number (``refengine.types.KvEventBatch``);
- terminal errors (then status OK, E5): a replay point no longer retained →
  ``EngineError(INVALID_ARGUMENT)``; a subscriber that leaves more than
  ``--kv-events-subscriber-buffer`` batches unread → ``EngineError(OVERLOADED, retryable)``;
  a client that stops reading for ``--stall-timeout-seconds`` is disconnected with status
  RESOURCE_EXHAUSTED (X1: its receive window is full, so no event could reach it);
- ``GetKvEventSources`` lists compatibility sources only: the ZMQ publisher of
  ``--kv-events-zmq`` (one per rank), or none when it is not configured; the native stream
  is this RPC service itself.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Protocol

import grpc

from refengine.engine.interface import EngineClient
from refengine.engine.kv_events import KV_EVENTS_DISABLED, KvEventSubscription
from refengine.protocol import oe
from refengine.server.errors import Rejection, abort_call, disconnect, invalid, rejection_from_engine
from refengine.server.kv_events_wire import batch_response, storage_medium
from refengine.server.metadata import DATA_PARALLEL_RANKS
from refengine.server.options import ServerOptions, is_wildcard_host
from refengine.server.state import ServerState
from refengine.types import RequestError

logger = logging.getLogger(__name__)


class ZmqSource(Protocol):
    def describe(self, advertise_host: str) -> dict: ...

    def close(self) -> None: ...


def check_ranks(ranks: list[int]) -> list[int]:
    """E6: known ranks, each once; empty = all."""
    if len(set(ranks)) != len(ranks):
        raise invalid(f"data_parallel_ranks names a rank twice: {ranks}")
    unknown = sorted(set(ranks) - set(DATA_PARALLEL_RANKS))
    if unknown:
        raise invalid(f"data_parallel_ranks {unknown} do not exist; this server has ranks {list(DATA_PARALLEL_RANKS)}")
    return list(ranks) or list(DATA_PARALLEL_RANKS)


def kv_event_sources(state: ServerState, request: oe.GetKvEventSourcesRequest) -> oe.GetKvEventSourcesResponse:
    state.engine_for_control()
    if not state.engine_config.kv_events.enabled:
        raise Rejection(grpc.StatusCode.FAILED_PRECONDITION, KV_EVENTS_DISABLED)
    ranks = check_ranks(list(request.data_parallel_ranks))
    described = state.kv_event_source
    if described is None:
        return oe.GetKvEventSourcesResponse()
    return oe.GetKvEventSourcesResponse(sources=[
        oe.KvEventSource(
            transport=described["transport"],
            endpoint_addr=oe.KvEndpoint(host=described["host"], port=described["port"], protocol="tcp"),
            topic=described["topic"], replay_endpoint=described["replay_endpoint"], data_parallel_rank=rank,
            encoding=described["encoding"], schema_version=1, buffer_steps=described["buffer_steps"],
            hwm=described["hwm"], max_queue_size=described["max_queue_size"],
        ) for rank in ranks])


async def subscribe(state: ServerState, request: oe.SubscribeKvEventsRequest,
                    context: grpc.aio.ServicerContext) -> None:
    try:
        engine = state.engine_for_control()
        check_ranks(list(request.data_parallel_ranks))
    except Rejection as rejection:
        await abort_call(context, rejection.code, rejection.message)
        return
    loop = asyncio.get_running_loop()
    ready = asyncio.Event()

    def on_ready() -> None:  # the step thread: never blocks
        loop.call_soon_threadsafe(ready.set)

    # The engine subscribes between steps, so this waits for the current step to end; a client
    # that leaves meanwhile must not leave its subscription registered (fed until it overflows).
    subscribing = asyncio.ensure_future(asyncio.to_thread(
        engine.subscribe_kv_events, on_ready, request.include_snapshot, request.start_sequence_number))
    try:
        sub = await asyncio.shield(subscribing)
    except asyncio.CancelledError:
        subscribing.add_done_callback(_close_abandoned)
        raise
    except RequestError as exc:  # the engine's refusal codes: --no-kv-events is FAILED_PRECONDITION (ref)
        rejection = rejection_from_engine(exc)
        await abort_call(context, rejection.code, rejection.message)
        return
    live = _Live(ready)
    state.kv_subscribers.add(live)
    if state.drain_deadline_passed:  # the drain ended the others already (found by review: one made
        live.drain()  # after that pass stayed open, and the drain's flush waited its whole bound for it)
    try:
        await _stream(sub, live, context, storage_medium(engine.info.device), state.options.stall_timeout_seconds)
    finally:
        state.kv_subscribers.discard(live)
        sub.close()


def _close_abandoned(subscribing: asyncio.Future) -> None:
    """The subscription of a client that left before it was made: closed once it exists."""
    if not subscribing.cancelled() and subscribing.exception() is None:
        subscribing.result().close()


class _Live:
    """One subscription's wake-up, and whether the server's drain ended it."""

    def __init__(self, ready: asyncio.Event) -> None:
        self.ready = ready
        self.drained = False

    def drain(self) -> None:
        self.drained = True
        self.ready.set()


DRAINED = ("the server is draining: it is shutting down; resubscribe (with include_snapshot) to another "
           "instance or after its restart")


async def _stream(sub: KvEventSubscription, live: _Live, context: grpc.aio.ServicerContext,
                  medium: int, write_timeout: float) -> None:
    # Headers first, on their own: they are not flow-controlled, and a first write that
    # carried them could not be ended by a status if it stalled (see _write_or_disconnect).
    await context.send_initial_metadata(())
    ready = live.ready
    ready.set()  # a snapshot or replay may already be queued
    while True:
        await ready.wait()
        ready.clear()
        batches, failure = sub.take()
        responses = [batch_response(batch, medium) for batch in batches]
        if failure is not None:
            code = oe.ERROR_CODE_OVERLOADED if "too slow" in failure else oe.ERROR_CODE_INVALID_ARGUMENT
            error = oe.EngineError(code=code, message=failure, retryable=code == oe.ERROR_CODE_OVERLOADED)
            responses.append(oe.SubscribeKvEventsResponse(error=error))
        elif live.drained:  # X3, E5: one terminal, retryable error, then OK, as a drained Generate gets
            failure = DRAINED
            error = oe.EngineError(code=oe.ERROR_CODE_CANCELLED, message=DRAINED, retryable=True)
            responses.append(oe.SubscribeKvEventsResponse(error=error))
        for response in responses:
            await _write_or_disconnect(context, response, write_timeout)
        if failure is not None:
            return


async def _write_or_disconnect(context: grpc.aio.ServicerContext, response: oe.SubscribeKvEventsResponse,
                               write_timeout: float) -> None:
    """One write; a client that takes none of it for ``write_timeout`` is disconnected.

    Such a client has filled its HTTP/2 receive window, so no further event can reach it:
    the stream ends with status RESOURCE_EXHAUSTED (``errors.disconnect``), which the client sees
    right after the responses already in flight; the handler ends at once (it waited behind the
    stuck write before, keeping the subscriber counted, which a drain's flush waits on)."""
    write = asyncio.ensure_future(context.write(response))
    done, _ = await asyncio.wait({write}, timeout=write_timeout)
    if done:
        write.result()
        return
    logger.warning("KV event subscriber stopped reading for %.1f s; disconnecting it", write_timeout)
    disconnect(context, write, f"KV event subscriber read nothing for {write_timeout:.1f} s (--stall-timeout-seconds); "
               "disconnected: subscribe again, with start_sequence_number to resume")


def advertised_host(options: ServerOptions) -> str:
    """E6: a host clients can connect to, never a bind wildcard."""
    if options.advertise_host:
        return options.advertise_host
    return socket.gethostname() if is_wildcard_host(options.host) else options.host


def start_compatibility_source(state: ServerState, engine: EngineClient) -> ZmqSource | None:
    """The ``--kv-events-zmq`` publisher (vLLM's wire format), or None when not configured."""
    o = state.options
    if not o.kv_events_zmq:
        return None
    from refengine.server.kv_events_zmq import ZmqKvEventPublisher  # pyzmq only when asked for

    publisher = ZmqKvEventPublisher(engine, o.kv_events_zmq, o.kv_events_zmq_replay, topic=o.kv_events_zmq_topic,
                                    medium="GPU" if engine.info.device.startswith("cuda") else "CPU")
    publisher.start()
    state.kv_event_source = publisher.describe(advertised_host(o))
    logger.info("KV events also published on %s (vLLM ZMQ format)", o.kv_events_zmq)
    return publisher


async def reset_prefix_cache(state: ServerState) -> None:
    """The admin path (SIGUSR1; a secured admin service comes later): forget every cached
    prefix, publish one AllBlocksCleared. Blocks in use stay."""
    if state.engine is None:
        logger.info("prefix-cache reset asked for while the model is loading: ignored")
        return
    freed = await asyncio.to_thread(state.engine.reset_prefix_cache)
    logger.info("prefix cache reset: %d cached blocks freed", freed)
