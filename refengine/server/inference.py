"""``Inference.Generate``: one server-streaming RPC per request.

Phases (RULES X1):

1. before acceptance: metadata (M1–M3), lifecycle, edge validation (G1–G4, G8, D4, D7,
   K5, K6), then ``Engine.add_request`` (G5–G7, G2 duplicates, admission). Any refusal is a
   non-OK status with zero events;
2. accepted: engine outputs flow through an :class:`OutputBridge` and a
   :class:`ResponseBuilder` to the client until the terminal event (the last
   ``GenerationFinished`` or one ``EngineError``), then status OK.

Whatever ends the RPC early — client cancel or disconnect (A5), a broken write, a stalled
consumer, the drain deadline — the ``finally`` block aborts the engine request if it is
still running, so its KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from refengine.engine.interface import EngineClient
from refengine.protocol import oe
from refengine.server.convert import StreamSettings, stream_settings, to_engine_request
from refengine.server.errors import OUTRUN_CONSUMER, STALLED_CONSUMER, Rejection, abort_call, rejection_from_engine
from refengine.server.metadata import read_inference_metadata
from refengine.server.options import MIB
from refengine.server.responses import ResponseBuilder
from refengine.server.state import ServerState
from refengine.server.stream_bridge import OutputBridge
from refengine.server.validation import ServerFacts, prompt_positions_limit, validate_generate
from refengine.server.write_watch import WriteWatch
from refengine.types import GenerationRequest, RequestError

logger = logging.getLogger(__name__)
#: How long a request without a deadline, reusing a cancelled stream's id, waits for the engine to
#: retire it (the rest of the step in flight; longer than any step of a working engine).
RETIRE_WAIT_SECONDS = 300.0


#: Prompts up to this many characters (or token ids) are added on the event loop: tokenizing
#: them takes about a millisecond. A 2 MB prompt took seconds, and every stream of the server
#: stalled meanwhile.
INLINE_PROMPT_LENGTH = 1024


def _cheap_to_add(params: GenerationRequest) -> bool:
    """Whether ``add_request`` is quick enough for the event loop: no grammar, no media, a short prompt."""
    prompt_length = len(params.prompt) if params.prompt is not None else len(params.prompt_token_ids or ())
    return (params.guided is None and not params.media and not params.media_handles
            and prompt_length <= INLINE_PROMPT_LENGTH)


class InferenceServicer(oe.InferenceServicer):
    def __init__(self, state: ServerState) -> None:
        self.state = state
        options = state.options
        self.server_stream = StreamSettings(options.stream_buffer, options.stall_timeout_seconds)

    def _facts(self) -> ServerFacts:
        engine = self.state.engine
        return ServerFacts(
            role=self.state.options.role,
            caps=self.state.caps,
            max_send_message_bytes=self.state.options.max_send_message_bytes,
            transfer_backends=engine.info.kv_transfer_backends if engine is not None else (),
            max_media_items=self.state.engine_config.media.max_items,
        )

    async def _accept(self, request: oe.GenerateRequest, context: grpc.aio.ServicerContext) -> OutputBridge:
        """Everything before acceptance. Returns the bridge of the accepted request or
        raises ``Rejection`` (nothing was allocated)."""
        meta = read_inference_metadata(context.invocation_metadata())
        engine = self.state.engine_for_generate()
        facts = self._facts()
        validate_generate(request, meta, facts)
        settings = stream_settings(request.extra, self.server_stream)
        params = to_engine_request(request, meta, prompt_positions_limit(request, facts))
        bridge = OutputBridge(asyncio.get_running_loop(), request.request_id, settings.stream_buffer,
                              settings.stall_timeout_seconds, self._on_stall, engine.abort_kv_session,
                              buffer_bytes=self.state.options.stream_buffer_bytes)
        try:
            aborted_while_waiting = await self._wait_retired(params.request_id, context.time_remaining())
            if _cheap_to_add(params):
                engine.add_request(params, bridge.sink)
            else:
                await self._add_on_worker(engine, params, bridge)
        except RequestError as exc:
            raise rejection_from_engine(exc) from None
        if aborted_while_waiting:
            engine.abort(params.request_id)
        return bridge

    async def _wait_retired(self, request_id: str, time_remaining: float | None) -> bool:
        """G2: an id is reusable once its stream ended. A stream the client cancelled ended at
        once, but the engine retires its id after the step in flight, which can take seconds (a
        long prefill on CPU): a request reusing the id waits for that, within its own deadline
        (after it, ALREADY_EXISTS as for any active id). A fixed 5 s bound refused it. Returns
        whether an Abort of the id came meanwhile: it was meant for this request, which the caller
        aborts once accepted (found by review: it answered ABORTED, and the new request ran in full).
        A reuse sent before the server has seen the client's cancel of the old stream still meets
        an active id (ALREADY_EXISTS): the order the two reach the server decides."""
        ended = self.state.retiring.get(request_id)
        if ended is None:
            return False
        with self.state.reuse_wait(request_id) as reuse:
            wait = RETIRE_WAIT_SECONDS if time_remaining is None else min(time_remaining, RETIRE_WAIT_SECONDS)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ended.engine_done.wait(), wait)
        return reuse.aborted

    async def _add_on_worker(self, engine: EngineClient, params: GenerationRequest, bridge: OutputBridge) -> None:
        """``add_request`` on a worker thread, so the event loop keeps serving every other stream
        while it tokenizes a long prompt, decodes media or compiles a grammar (the tokenizer and
        the grammar engines release the GIL). A client that goes away meanwhile leaves nothing
        behind: its request is aborted as soon as it is accepted. Its stream ended at once, so
        its id is retiring from then on (G2)."""
        adding = self.state.slow_work.run(engine.add_request, params, bridge.sink)  # never queues KvPull reads
        try:
            await asyncio.shield(adding)
        except asyncio.CancelledError:
            self._retire(bridge)
            adding.add_done_callback(lambda f: self._abandoned(f, engine, bridge))
            raise

    @staticmethod
    def _abandoned(adding: asyncio.Future, engine: EngineClient, bridge: OutputBridge) -> None:
        """The add of a request whose client left is done: abort an accepted one (the engine's
        final output then retires its id); a refused one never held the id."""
        if adding.exception() is None:
            bridge.abandon()
            engine.abort(bridge.request_id)
        else:
            bridge.id_released()

    def _on_stall(self, bridge: OutputBridge) -> None:
        if bridge.fail(OUTRUN_CONSUMER if bridge.outrun else STALLED_CONSUMER):
            if bridge.outrun:
                logger.warning("request %s: the client reads slower than the engine produces; aborting it with "
                               "over %d MiB waiting for it", bridge.request_id, bridge.overflow_bytes // MIB)
            else:
                logger.warning("request %s: client stopped reading for %.1f s; aborting it",
                               bridge.request_id, bridge.stall_timeout)
            self.state.engine.abort(bridge.request_id)

    async def Generate(self, request: oe.GenerateRequest, context: grpc.aio.ServicerContext) -> None:  # noqa: N802
        with self.state.held_for_drain():  # a drain starting now waits for this request too (X3)
            try:
                bridge = await self._accept(request, context)
            except Rejection as rejection:
                await abort_call(context, rejection.code, rejection.message)
                return
            except Exception as exc:  # a bug, not the client's fault: say so, keep serving
                logger.exception("request %s: refused by an internal error", request.request_id)
                await abort_call(context, grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
                return
        builder = ResponseBuilder(request.request_id, max(request.sampling.num_sequences, 1),
                                  self.state.options.max_send_message_bytes, self.state.session_ref)
        self.state.add_stream(bridge)  # cut off at once when accepted after the drain deadline
        writes = WriteWatch(context, bridge, asyncio.current_task())
        try:
            while not builder.terminal_sent:
                out = await bridge.next()
                oversized = builder.oversized
                events = builder.events(out)
                if out.prefill is not None and not any(event.HasField("prefill_ready") for event in events):
                    # its PrefillReady gave way to an EngineError (an event too large): never sent (K7)
                    self.state.engine.abort_kv_session(out.prefill.session_id)
                for event in events:
                    await writes.send(event)
                if oversized is None and builder.oversized is not None:  # its final output ends the stream
                    self.state.engine.abort(request.request_id)
        finally:
            writes.close()
            self.state.streams.discard(bridge)
            # K7: the client left before its terminal event was built: a PrefillReady still to come
            # is never sent, so its session is released. One whose write had begun may have reached
            # the client (a cancel right after reading it is common): that one keeps its lease.
            if not builder.terminal_sent:
                bridge.abandon()
            bridge.close()
            if not bridge.engine_finished:  # cancelled, disconnected, failed: free the KV (A5)
                self.state.engine.abort(request.request_id)
                self._retire(bridge)

    def _retire(self, bridge: OutputBridge) -> None:
        """Remember ``bridge`` under its id until the engine confirms the abort (G2)."""
        retiring = self.state.retiring
        retiring[bridge.request_id] = bridge

        def forget() -> None:
            if retiring.get(bridge.request_id) is bridge:
                del retiring[bridge.request_id]

        bridge.on_engine_done = forget
