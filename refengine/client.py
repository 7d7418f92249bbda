"""A small typed client for any OpenEngine v0.1.0 server, over the generated stubs.

    with OpenEngineClient("127.0.0.1:50051") as client:
        client.wait_until_ready()
        for event in client.generate(prompt="Hello", max_tokens=16, temperature=0.0):
            ...

Synchronous (one ``grpc`` channel). ``generate`` yields raw ``GenerateResponse`` events;
:func:`stream_text` yields just the text of output 0 and raises :class:`GenerationError`
when the stream ends with an ``EngineError``.

Disaggregated prefill/decode: :func:`generate_disaggregated` is the two-hop flow a framework
performs: the request on a prefill server (its one event is ``PrefillReady``), then the same
request with ``kv.session`` set to the returned session on a decode server, whose events
it yields.

Chat: OpenEngine v0.1.0 has no chat API; templates are applied by the caller.
``stream_text(chat=formatter)`` calls ``formatter(model, prompt)`` before sending;
``refengine.model.chat.chat_prompt`` is one (what ``refengine generate --remote --chat`` applies):
it renders the model's chat template *locally*, which works only when this machine can resolve
the served model by name (a manifest such as the embedded ``smollm2-135m-instruct``).
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections.abc import Callable, Iterator, Sequence

import grpc
from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

from refengine.protocol import oe
from refengine.protocol.addresses import check_address

Metadata = Sequence[tuple[str, str]]
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20  # receives ``all``-candidate outputs of large vocabularies
#: The longest deadline the tools accept (~116 days): gRPC turns a deadline into a time_t, and one
#: of inf or 1e12 s overflows it (an error) or expires at once (every call DEADLINE_EXCEEDED).
MAX_DEADLINE_SECONDS = 1e7


def address_arg(text: str) -> str:
    """:func:`check_address` as an argparse type (a bad value exits 2, naming the flag)."""
    try:
        return check_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def enum_name(enum: EnumTypeWrapper, value: int) -> str:
    """``value``'s name in ``enum``; a proto3 enum is open, so a newer server may send a value
    this release does not name (X4): ``ErrorCode(17)`` then, never a ValueError."""
    try:
        return enum.Name(value)
    except ValueError:
        return f"{enum.DESCRIPTOR.name}({value})"


def error_code_name(code: int) -> str:
    return enum_name(oe.ErrorCode, code)


class GenerationError(RuntimeError):
    """An accepted request ended with an ``EngineError``."""

    def __init__(self, error: oe.EngineError) -> None:
        super().__init__(f"{error_code_name(error.code)}: {error.message}")
        self.error = error


class OpenEngineClient:
    def __init__(self, address: str, *, timeout: float | None = 30.0,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, metadata: Metadata = (),
                 channel_options: Sequence[tuple[str, object]] = ()) -> None:
        """``timeout``: deadline of unary RPCs (``generate`` takes its own). ``channel_options``:
        extra gRPC channel arguments (e.g. ``("grpc.use_local_subchannel_pool", 1)`` for a
        connection of its own)."""
        if timeout is not None and not 0 < timeout <= MAX_DEADLINE_SECONDS:  # also refuses nan
            # inf or nan made every call fail at once with DEADLINE_EXCEEDED (found by review)
            raise ValueError(f"timeout must be in (0, {MAX_DEADLINE_SECONDS:g}] seconds or None, got {timeout!r}")
        self.address = address
        self.timeout = timeout
        self.metadata = tuple(metadata)
        self.channel = grpc.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            *channel_options,
        ])
        self.inference = oe.InferenceStub(self.channel)
        self.control = oe.ControlStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> OpenEngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _md(self, metadata: Metadata | None) -> tuple[tuple[str, str], ...]:
        return self.metadata + tuple(metadata or ())

    # -- Inference ---------------------------------------------------------------
    def generate(
        self,
        request: oe.GenerateRequest | None = None,
        *,
        prompt: str | None = None,
        token_ids: Sequence[int] | None = None,
        model: str = "",
        request_id: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        seed: int | None = None,
        num_sequences: int | None = None,
        stop: Sequence[str] = (),
        metadata: Metadata | None = None,
        timeout: float | None = None,
    ) -> Iterator[oe.GenerateResponse]:
        """Stream one request's events. Either pass a full ``request`` or the common
        fields. Cancelling: close the returned iterator (``.close()``, or iterate it inside
        ``contextlib.closing``); breaking out of a ``for`` loop cancels only once the iterator
        is garbage-collected. A ``request`` with any of the fields too is a ``TypeError`` (they
        would be ignored), raised when iteration starts: this is a generator."""
        fields = {"prompt": prompt, "token_ids": token_ids, "model": model or None, "request_id": request_id,
                  "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
                  "num_sequences": num_sequences, "stop": stop or None}
        if request is not None and (given := [name for name, value in fields.items() if value is not None]):
            raise TypeError(f"pass a request or its fields, not both (given: {', '.join(given)})")
        if request is None:
            request = oe.GenerateRequest(request_id=request_id or f"client-{uuid.uuid4().hex}", model=model)
            if prompt is not None:
                request.prompt = prompt
            if token_ids is not None:
                request.token_ids.ids.extend(token_ids)
            if max_tokens is not None:
                request.stopping.max_tokens = max_tokens
            if temperature is not None:
                request.sampling.temperature = temperature
            if seed is not None:
                request.sampling.seed = seed
            if num_sequences is not None:
                request.sampling.num_sequences = num_sequences
            for text in stop:
                request.stopping.conditions.add(stop_text=text)
        call = self.inference.Generate(request, metadata=self._md(metadata), timeout=timeout)
        try:
            yield from call
        finally:
            call.cancel()  # no-op when the stream already ended

    # -- Control -----------------------------------------------------------------
    def server_info(self) -> oe.ServerInfo:
        return self.control.GetServerInfo(oe.GetServerInfoRequest(), timeout=self.timeout,
                                          metadata=self.metadata)

    def default_model(self) -> str:
        """The server's first supported model; ``ValueError`` when it lists none."""
        models = self.server_info().supported_models
        if not models:
            raise ValueError(f"{self.address} lists no supported_models: name the model")
        return models[0]

    def model_info(self, model: str = "") -> oe.ModelInfo:
        """``model`` empty = the server's first supported model."""
        model = model or self.default_model()
        return self.control.GetModelInfo(oe.GetModelInfoRequest(model=model), timeout=self.timeout,
                                         metadata=self.metadata)

    def load(self, include_per_rank: bool = False) -> oe.LoadInfo:
        request = oe.GetLoadRequest(include_per_rank=include_per_rank)
        return self.control.GetLoad(request, timeout=self.timeout, metadata=self.metadata)

    def health(self, include_inference_probe: bool = False, model: str = "",
               role: int = oe.ENGINE_ROLE_UNSPECIFIED) -> oe.HealthResponse:
        request = oe.HealthRequest(include_inference_probe=include_inference_probe, model=model, role=role)
        return self.control.Health(request, timeout=self.timeout, metadata=self.metadata)

    def abort(self, request_id: str | None = None, *, all_requests: bool = False,
              kv_session: oe.KvSessionRef | None = None, timeout: float | None = None) -> oe.AbortResponse:
        """Set exactly one target (the server rejects none or several with INVALID_ARGUMENT).
        ``timeout``: this call's deadline (None: the client's)."""
        request = oe.AbortRequest()
        if request_id is not None:
            request.request_id = request_id
        if all_requests:
            request.all_requests.SetInParent()
        if kv_session is not None:
            request.kv_session.CopyFrom(kv_session)
        return self.control.Abort(request, timeout=self.timeout if timeout is None else timeout,
                                  metadata=self.metadata)

    def wait_until_ready(self, timeout: float = 300.0, poll: float = 0.2) -> oe.HealthResponse:
        """Poll ``Health`` until READY; raises ``TimeoutError`` (with the last state) otherwise."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while (left := deadline - time.monotonic()) > 0:
            try:  # each call within what is left: a hanging server must not stretch the wait
                health = self.control.Health(oe.HealthRequest(), timeout=min(5.0, left), metadata=self.metadata)
                if health.state == oe.HEALTH_STATE_READY:
                    return health
                last = enum_name(oe.HealthState, health.state)
            except grpc.RpcError as exc:
                last = f"{exc.code().name}: {exc.details()}"
            time.sleep(max(0.0, min(poll, deadline - time.monotonic())))
        raise TimeoutError(f"{self.address} not READY after {timeout:g} s (last: {last})")


#: (served model name, user message) -> the prompt text; e.g. ``refengine.model.chat.chat_prompt``.
ChatFormatter = Callable[[str, str], str]


def stream_text(address: str, prompt: str, model: str = "", max_tokens: int = 128, temperature: float = 0.0,
                chat: ChatFormatter | None = None) -> Iterator[str]:
    """Text deltas of output 0 of one request: the shortest way to stream from any server. OpenEngine
    v0.1.0 has no chat API: with ``chat``, the caller's formatter applies the model's template here."""
    with OpenEngineClient(address) as client:
        if chat is not None:
            prompt = chat(model or client.default_model(), prompt)
        events = client.generate(prompt=prompt, model=model, max_tokens=max_tokens, temperature=temperature)
        for event in events:
            kind = event.WhichOneof("event")
            if kind == "token" and event.token.output_index == 0 and event.token.text:
                yield event.token.text
            elif kind == "error":
                raise GenerationError(event.error)
            elif kind == "finished" and event.finished.reason == oe.FINISH_REASON_CANCELLED:
                # an abort (Abort RPC, drain) cut the text short: not a quiet end (found by review)
                raise GenerationError(oe.EngineError(code=oe.ERROR_CODE_CANCELLED, message=event.finished.message))
            elif kind == "prefill_ready":  # a prefill server: release the session it would hold for a decode
                release_kv_session(client, event.prefill_ready.kv_session)
                raise GenerationError(oe.EngineError(code=oe.ERROR_CODE_ROLE_MISMATCH, message=(
                    f"{address} is a prefill server: it generates no text (use generate_disaggregated)")))


class PrefillFailed(RuntimeError):
    """The prefill hop ended without a ``PrefillReady`` (``event``: what it ended with)."""

    def __init__(self, message: str, event: oe.GenerateResponse | None = None) -> None:
        super().__init__(message)
        self.event = event


def prefill(client: OpenEngineClient, request: oe.GenerateRequest, timeout: float | None = None,
            metadata: Metadata | None = None,
            prompt_events: list[oe.GenerateResponse] | None = None) -> oe.GenerateResponse:
    """Run ``request`` on a prefill server; returns its terminal ``PrefillReady`` event. The
    events before it (the ``PromptOutput``, when prompt logprobs were asked for) are appended
    to ``prompt_events`` when it is given, else dropped."""
    for event in client.generate(request, timeout=timeout, metadata=metadata):
        kind = event.WhichOneof("event")
        if kind == "prefill_ready":
            return event
        if kind == "error":
            raise PrefillFailed(f"prefill failed: {error_code_name(event.error.code)}: {event.error.message}",
                                event)
        if kind == "finished" and event.finished.reason == oe.FINISH_REASON_CANCELLED:
            # An abort (Abort RPC, a drain, a fault) ends a prefill as any stream (A4): no session.
            raise PrefillFailed(f"the prefill was cancelled: {event.finished.message or 'no reason given'}", event)
        if kind in ("token", "finished"):
            raise PrefillFailed(f"not a prefill server: it sent a {kind} event (K4)", event)
        if prompt_events is not None:
            prompt_events.append(event)
    raise PrefillFailed("the prefill stream ended without PrefillReady")


def decode_request_for(request: oe.GenerateRequest, ready: oe.GenerateResponse) -> oe.GenerateRequest:
    """The decode hop's request: ``request`` with the session forwarded unchanged (K9). Prompt
    logprobs were the prefill's to compute (a decode server never has the prompt's logits and
    refuses them, D4), so their options are cleared here."""
    decode_request = oe.GenerateRequest()
    decode_request.CopyFrom(request)
    decode_request.kv.session.CopyFrom(ready.prefill_ready.kv_session)
    for field in ("return_prompt_logprobs", "prompt_candidates", "prompt_logprob_start"):
        decode_request.response.ClearField(field)
    return decode_request


def generate_disaggregated(prefill_client: OpenEngineClient, decode_client: OpenEngineClient,
                           request: oe.GenerateRequest, timeout: float | None = None,
                           metadata: Metadata | None = None) -> Iterator[oe.GenerateResponse]:
    """Prefill on one server, decode on another; yields the request's events as one server
    would: the prefill's ``PromptOutput`` (when prompt logprobs were asked for), then the decode
    server's events. The decode request targets the session's rank (M3). ``timeout`` is each
    hop's deadline (and the release's below), not the whole call's.

    Unless the decode stream ends with a ``Finished`` that is not CANCELLED, the session is
    aborted on the prefill server (best effort, within ``timeout``), so a refused, failed,
    cancelled or abandoned decode leaves no KV held until the lease (found by review: a decode
    cancelled while queued, before its pull, left the session held ~30 s). Cancel by closing the
    returned iterator from the thread that iterates it (a generator refuses ``close`` from another
    thread while it runs), or by closing the clients."""
    prompt_events: list[oe.GenerateResponse] = []
    ready = prefill(prefill_client, request, timeout, metadata, prompt_events)
    decoded = False
    try:
        yield from prompt_events  # inside: a caller stopping here (Ctrl-C) releases the session too
        for event in decode_client.generate(decode_request_for(request, ready), timeout=timeout, metadata=metadata):
            decoded = event.WhichOneof("event") == "finished" and event.finished.reason != oe.FINISH_REASON_CANCELLED
            yield event
    finally:
        if not decoded:
            release_kv_session(prefill_client, ready.prefill_ready.kv_session, timeout)


def release_kv_session(client: OpenEngineClient, session: oe.KvSessionRef, timeout: float | None = None) -> None:
    """Best effort: abort a prefill server's session no decode consumed (the two-hop flow here, and
    ``refengine generate`` given a prefill server). NOT_FOUND (already pulled or expired) is
    fine, and so is a client the caller closed first (its ValueError: the iterator's close must
    not raise, found by review)."""
    try:
        client.abort(kv_session=session, timeout=timeout)
    except (grpc.RpcError, ValueError):
        pass
