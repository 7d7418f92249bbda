"""The server under test, seen only through the generated OpenEngine stubs.

:class:`Target` holds one gRPC channel, the two stubs, what discovery said
(``ServerInfo``, ``ModelInfo``) and a few helpers every check shares: send a
Generate and collect the whole stream (:meth:`Target.generate`), build a small
bounded request (:meth:`Target.request`), wait until the server is idle again
(:meth:`Target.wait_idle`). Every RPC has a deadline, and every enum value the
server sends through these helpers is recorded (:attr:`Target.enums`, for X4).
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import grpc

from refengine.conformance.enums import EnumLog
from refengine.conformance.evidence import ExchangeLog
from refengine.conformance.options import Options
from refengine.conformance.registry import CheckFailed, not_claimed
from refengine.conformance.stream_ledger import StreamLedger
from refengine.conformance.streams import Background, StreamResult
from refengine.conformance.target_load import LoadWaits
from refengine.protocol import oe
from refengine.protocol.reachability import not_ready_reason

Metadata = Sequence[tuple[str, str]]

#: No message-size limit of the client's own (the server's limits are what the checks test);
#: a subchannel of its own (see Target.__init__).
CHANNEL_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1),
                   ("grpc.use_local_subchannel_pool", 1)]


#: How long past its stream's deadline a background Generate may take to end (on_event callbacks,
#: the stream's last RPCs): with the default --timeout, the 120 s a join waited before.
BACKGROUND_JOIN_MARGIN_S = 60.0


class ConnectError(Exception):
    """The server cannot be tested: it does not answer, or its discovery (GetServerInfo,
    GetModelInfo: D1) fails, or it is not the kind of server the selected checks test (run_report's
    ``core_run``): then no check runs; or it stopped answering during a run (the checks after it
    do not run). The command line reports it and exits 2."""


class Target(LoadWaits):
    """One OpenEngine server, reached at ``address`` (``host:port``)."""

    def __init__(self, address: str, options: Options | None = None, control_address: str = "") -> None:
        """``control_address``: where this server's Control listens, when apart from ``address``."""
        self.address = address
        self.options = options or Options()
        # A subchannel of its own: in a process that talked to an earlier server on the same port
        # (a test harness, a tool running the suite repeatedly), a shared one may still be in its
        # reconnect backoff, and connect() would time out waiting for it.
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.control_channel = grpc.insecure_channel(control_address, options=CHANNEL_OPTIONS) \
            if control_address else self.channel
        self._peers: list[Target] = []  # other servers of this run (connect_peer), closed with this one
        self.inference = oe.InferenceStub(self.channel)
        self.control = oe.ControlStub(self.control_channel)
        self._ids = itertools.count()
        self._run = uuid.uuid4().hex[:6]
        self.cache: dict[str, Any] = {}  # results shared between checks (reference runs)
        self.server_info: Any = None
        self.model_info: Any = None
        self.idle_used_kv_blocks: int | None = None
        # GetLoad's answer at connect: the RPC is optional (only the load profile needs it), so the
        # checks that merely wait for idle or for a batch go on without it (see wait_idle, wait_busy).
        self.load_code = grpc.StatusCode.OK
        self.enums = EnumLog()  # X4: every enum value received, whichever check caused it
        self.engine_errors: list[Any] = []  # X3: every EngineError event received (append is thread-safe)
        self.rule = ""  # the rule of the check running now (set by the runner): streams are judged by it
        self.check = ""  # that check's name (set by the runner)
        self.ledger = StreamLedger()  # structural problems of every stream the checks read
        self.exchanges = ExchangeLog()  # the latest RPCs of the running check: a failure's evidence

    # -- lifecycle -------------------------------------------------------------
    def connect(self) -> Target:
        """Wait for the channel, then run discovery (GetServerInfo, GetModelInfo); raises
        :class:`ConnectError` saying why the server cannot be tested. GetLoad is optional (the
        ``load`` profile is claimed only when it answers): when it does, an idle server's used
        KV blocks become the idle value of :meth:`wait_idle`."""
        apart = () if self.control_channel is self.channel else ((self.control_channel, "the --control address"),)
        for channel, address in ((self.channel, self.address), *apart):
            if reason := not_ready_reason(channel, self.options.rpc_timeout_s):
                raise ConnectError(f"cannot connect to {address} within {self.options.rpc_timeout_s:g} s: {reason}")
        self.server_info = self._discover("GetServerInfo", oe.GetServerInfoRequest())
        self._check_inference()
        served = self.server_info.supported_models
        model = self.options.model or (served[0] if served else "")
        if not model:
            raise ConnectError(f"{self.address}: GetServerInfo lists no supported model; name one with --model")
        self.model_info = self._discover("GetModelInfo", oe.GetModelInfoRequest(model=model))
        code, load = self.unary_code("GetLoad", oe.GetLoadRequest())
        self.load_code = code
        if code == grpc.StatusCode.OK and load.running_requests == 0 and load.queued_requests == 0 \
                and load.HasField("used_kv_blocks"):
            self.idle_used_kv_blocks = load.used_kv_blocks
        return self

    def _discover(self, method: str, request: Any) -> Any:
        try:
            return self.unary(method, request)
        except grpc.RpcError as err:
            split = " (is Control served on another port? name it with --control)" if method == "GetServerInfo" \
                and err.code() == grpc.StatusCode.UNIMPLEMENTED and self.control_channel is self.channel else ""
            raise ConnectError(f"{self.address}: discovery failed: {method}({str(request).strip() or '{}'}) "
                               f"answered {err.code().name}: {err.details()}{split}") from None

    def _check_inference(self) -> None:
        """Inference is served at the target's address: an empty Generate (refused, nothing run) is not
        UNIMPLEMENTED. Found by review: a Control-only port ran the whole suite, 63 checks failing on
        UNIMPLEMENTED and some refusal checks passing on it."""
        try:
            for _ in self.inference.Generate(oe.GenerateRequest(), timeout=self.options.rpc_timeout_s):
                pass
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise ConnectError(f"{self.address} does not serve openengine.v1.Inference (Generate is "
                                   "UNIMPLEMENTED): point --target at the Inference port and --control at "
                                   "Control's") from None

    def connect_peer(self, address: str, role: str) -> Target:
        """Another server of the same run (``role``: the option naming it, e.g. ``--encoder``),
        with these options, closed with this one even when connecting fails: a channel left open
        keeps reconnecting to a server that may be long gone. A server that cannot be tested
        fails the check that needs it, naming the option and the address."""
        peer = Target(address, self.options)
        peer.ledger = self.ledger  # its streams are the run's: the run-wide checks (G9-G16) judge them too
        self._peers.append(peer)
        try:
            return peer.connect()
        except ConnectError as err:
            raise CheckFailed(f"{role}: {err}") from None

    @contextmanager
    def fixed_window_inference(self) -> Iterator[Any]:
        """An Inference stub on a channel of its own (closed after the block) whose HTTP/2
        flow-control window never grows (no BDP probing): a client that stops reading blocks
        the server's writes after the same few bytes, whatever streams ran before. On the
        shared channel, earlier big streams may have grown the window to megabytes, more than
        a slow server produces within a reader's stall (X1)."""
        channel = grpc.insecure_channel(self.address, options=[*CHANNEL_OPTIONS, ("grpc.http2.bdp_probe", 0)])
        try:
            yield oe.InferenceStub(channel)
        finally:
            channel.close()

    def close(self) -> None:
        for peer in self._peers:
            peer.close()
        self.channel.close()
        if self.control_channel is not self.channel:
            self.control_channel.close()

    def __enter__(self) -> Target:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- discovery shortcuts -----------------------------------------------------
    @property
    def model(self) -> str:
        return self.model_info.served_model_name or self.options.model

    @property
    def caps(self) -> Any:
        return self.model_info.generation

    @property
    def max_num_sequences(self) -> int | None:
        return self.caps.max_num_sequences if self.caps.HasField("max_num_sequences") else None

    def need_sequences(self, n: int) -> None:
        """Skip unless num_sequences = n is advertised."""
        if self.max_num_sequences is None:
            not_claimed("max_num_sequences is not advertised")
        if self.max_num_sequences < n:
            not_claimed(f"needs num_sequences={n}, max_num_sequences is {self.max_num_sequences}")

    def supports_text(self) -> bool:
        return not (self.model_info.HasField("supports_text_input") and not self.model_info.supports_text_input)

    @property
    def max_context_length(self) -> int | None:
        return self.model_info.max_context_length if self.model_info.HasField("max_context_length") else None

    # -- building requests -------------------------------------------------------
    def new_id(self, tag: str = "r") -> str:
        return f"oeconf-{self._run}-{tag}-{next(self._ids)}"

    def request(self, tag: str = "r", prompt: str | None = None, token_ids: Sequence[int] | None = None,
                max_tokens: int | None = 8, temperature: float | None = 0.0, **stopping: Any) -> Any:
        """A small bounded request: greedy, ``max_tokens`` 8, default prompt, this model."""
        req = oe.GenerateRequest(request_id=self.new_id(tag), model=self.model)
        if token_ids is not None:
            req.token_ids.ids.extend(token_ids)
        elif self.supports_text():
            req.prompt = prompt if prompt is not None else self.options.prompt
        else:
            req.token_ids.ids.extend(self.known_token_ids()[:8])
        if temperature is not None:
            req.sampling.temperature = temperature
        if max_tokens is not None:
            req.stopping.max_tokens = max_tokens
        for key, value in stopping.items():
            setattr(req.stopping, key, value)
        return req

    def long_request(self, tag: str = "long", cap: int = 400, **kw: Any) -> Any:
        """A request that runs long enough to be aborted or cancelled mid-stream:
        ignore_eos and up to ``cap`` tokens (fewer when the context is small)."""
        ctx = self.max_context_length
        max_tokens = min(cap, max(16, ctx - 160)) if ctx else cap
        return self.request(tag, max_tokens=max_tokens, ignore_eos=True, **kw)

    def known_token_ids(self) -> list[int]:
        """Token ids known to be in the vocabulary (seen in a greedy output)."""
        if "known_ids" not in self.cache:
            if self.supports_text():
                res = self.generate(self.request("vocab", max_tokens=16, ignore_eos=True))
                ids = res.tokens()
            else:  # no way to learn the vocabulary; small ids exist in every tokenizer
                ids = list(range(100, 132))
            if not ids:
                raise CheckFailed(f"a greedy request produced no tokens: {res.describe()}")
            self.cache["known_ids"] = ids
        return list(self.cache["known_ids"])

    # -- calling -------------------------------------------------------------------
    def generate(self, req: Any, metadata: Metadata | None = None, timeout: float | None = None,
                 on_event: Callable[[StreamResult, Any, Any], bool] | None = None) -> StreamResult:
        """Run one Generate to its end and collect every event and the final status.

        ``on_event(result, event, call)`` runs after each event; returning True cancels
        the call (the status is then CANCELLED, as the client sees it)."""
        result = StreamResult(request_id=req.request_id, rule=self.rule, started=time.perf_counter(),
                              check=self.check, ledger=self.ledger)
        call = self.inference.Generate(req, metadata=metadata, timeout=timeout or self.options.stream_timeout_s)
        try:
            for event in call:
                self.observe(event)
                result.events.append(event)
                result.times.append(time.perf_counter())
                if on_event is not None and on_event(result, event, call):
                    call.cancel()
                    break
        except grpc.RpcError as err:
            result.code, result.details = err.code(), err.details() or ""
        else:
            result.code = call.code() or grpc.StatusCode.OK
            result.details = call.details() or ""
        self.exchanges.record("Generate", req, result)
        return result

    def generate_async(self, req: Any, metadata: Metadata | None = None, timeout: float | None = None,
                       on_event: Callable[[StreamResult, Any, Any], bool] | None = None) -> Background:
        """Run :meth:`generate` on a thread; ``.join()`` returns the StreamResult, waiting for the
        stream's own deadline and a margin (a fixed 120 s once cut off streams a longer --timeout
        allowed: found by review)."""
        deadline = timeout or self.options.stream_timeout_s
        return Background(lambda: self.generate(req, metadata, timeout, on_event),
                          join_timeout=deadline + BACKGROUND_JOIN_MARGIN_S)

    def observe(self, event: Any) -> None:
        """Record what a received Generate event says for the run-wide checks (X3, X4);
        :meth:`generate` does it for every event, a check reading a call itself calls it."""
        self.enums.observe(event)
        if event.WhichOneof("event") == "error":
            self.engine_errors.append(event.error)

    def unary(self, method: str, request: Any, metadata: Metadata | None = None) -> Any:
        """Call a Control RPC by name with the run's deadline."""
        try:
            response = getattr(self.control, method)(request, metadata=metadata, timeout=self.options.rpc_timeout_s)
        except grpc.RpcError as err:
            self.exchanges.record(method, request, err.code(), err.details() or "")
            raise
        self.exchanges.record(method, request, response)
        self.enums.observe(response)
        return response

    def unary_code(self, method: str, request: Any, metadata: Metadata | None = None) -> tuple[grpc.StatusCode, Any]:
        """Like :meth:`unary`, returning (status code, response or None) instead of raising."""
        try:
            return grpc.StatusCode.OK, self.unary(method, request, metadata)
        except grpc.RpcError as err:
            return err.code(), None

    def load(self, per_rank: bool = False) -> Any:
        return self.unary("GetLoad", oe.GetLoadRequest(include_per_rank=per_rank))

    def abort(self, request_id: str) -> grpc.StatusCode:
        code, _ = self.unary_code("Abort", oe.AbortRequest(request_id=request_id))
        return code

    def aborter(self, request_id: str, after_events: int = 1) -> Callable[[StreamResult, Any, Any], bool]:
        """An ``on_event`` callback that calls Abort(request_id) once, after ``after_events``
        events, and keeps reading the stream."""
        def on_event(res: StreamResult, event: Any, call: Any) -> bool:
            if len(res.events) == after_events:
                self.abort(request_id)
            return False

        return on_event

    def start_stream(self, req: Any) -> tuple[Background, bool]:
        """Start ``req`` on a thread and wait until the server has certainly accepted it: its
        first event arrived or, for a server that holds an output's events until it ends (G11
        allows one TokenOutput per output), GetLoad counts more requests running or queued than
        before the call. Returns the call and whether acceptance was seen while it ran."""
        before = self.load() if self.has_load else None
        accepted = threading.Event()

        def on_event(res: StreamResult, event: Any, call: Any) -> bool:
            accepted.set()
            return False

        call = self.generate_async(req, on_event=on_event)
        deadline = time.monotonic() + self.options.stream_timeout_s
        while not call.done() and time.monotonic() < deadline:
            if accepted.wait(0.05):
                return call, True
            if before is not None:
                load = self.load()
                if load.running_requests + load.queued_requests > before.running_requests + before.queued_requests:
                    return call, True
        return call, accepted.is_set()

    def generate_aborted(self, req: Any) -> StreamResult:
        """Run ``req`` and Abort it once accepted (:meth:`start_stream`); its whole stream."""
        call, _ = self.start_stream(req)
        self.abort(req.request_id)
        return call.join()

    def canceller(self, after_events: int = 1) -> Callable[[StreamResult, Any, Any], bool]:
        """An ``on_event`` callback that cancels the call (client disconnect) after ``after_events``."""
        return lambda res, event, call: len(res.events) >= after_events
