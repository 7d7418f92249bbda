"""A disaggregated toy pair (K4-K10): a PREFILL server that answers one ``PrefillReady`` with a
``KvSessionRef``, and a DECODE server that continues from it.

Both share an in-process :class:`SessionStore`: the prefill server holds each session's
prompt (and its KV blocks, counted in its GetLoad) until Abort(kv_session) or a decode pulls
it; the decode server takes the session and runs the toy engine on the held prompt, so its
greedy output equals an aggregated toy's. ``Faults`` break the K rules on purpose.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import replace
from typing import Any

import grpc
from google.protobuf import json_format

from refengine.protocol import oe
from tests.conformance.fake_server import Control, Inference, start
from tests.conformance.toy_engine import ToyEngine
from tests.conformance.toy_faults import Faults
from tests.conformance.toy_model import distribution, token_info
from tests.conformance.toy_requests import BLOCK, INVALID, VOCAB, Refused, parse_metadata, validate

BACKEND = "toy"
#: Opaque transfer details, as a real connector sends them (K9: JSON types kept; a 64-bit id as a string).
ATTRIBUTES = {"block_table_id": "18446744073709551557", "remote_rank": 0, "pinned": True}


class SessionStore:
    """Held sessions: id -> the prompt's token ids; ``leaked`` blocks stay counted (K7's fault)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sessions: dict[str, list[int]] = {}
        self.leaked = 0
        self._ids = itertools.count(1)

    def hold(self, prompt: list[int]) -> str:
        with self.lock:
            session_id = f"toy-session-{next(self._ids)}"
            self.sessions[session_id] = prompt
            return session_id

    def take(self, session_id: str, leak: bool = False) -> list[int] | None:
        """Remove a session (pulled by a decode, or aborted); None when it is not held."""
        with self.lock:
            prompt = self.sessions.pop(session_id, None)
            if prompt is not None and leak:
                self.leaked += -(-len(prompt) // BLOCK)
            return prompt

    def used_blocks(self) -> int:
        with self.lock:
            return self.leaked + sum(-(-len(p) // BLOCK) for p in self.sessions.values())


class PrefillInference(Inference):
    def __init__(self, engine: ToyEngine, store: SessionStore) -> None:
        super().__init__(engine)
        self.store = store
        self.port = 0  # set once the server has one: sessions name it as their endpoint

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        f = self.engine.faults
        if request.kv.HasField("session") and not f.prefill_accepts_session:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "kv.session on a PREFILL engine")
        try:
            prompt = validate(request, f)
        except Refused as err:
            context.abort(err.code, str(err))
        if f.prefill_leaks_tokens:
            first = max(range(VOCAB), key=distribution(prompt, prompt, 0.0, set()).__getitem__)
            yield oe.GenerateResponse(request_id=request.request_id, token=oe.TokenOutput(
                output_index=0, tokens=[token_info(first, None, None, f)], text=chr(first)))
        session = oe.KvSessionRef(session_id=self.store.hold(prompt), transfer_backend=BACKEND,
                                  endpoints=[oe.KvEndpoint(host="127.0.0.1", port=self.port, protocol="grpc")])
        json_format.ParseDict(ATTRIBUTES, session.attributes_struct)
        if self.engine.faults.identifier_as_number:
            session.attributes_struct["block_table_id"] = 18446744073709551557  # 2^64 - 59: inexact as a double
        request_id = "" if f.prefill_without_request_id else request.request_id
        yield oe.GenerateResponse(request_id=request_id, prefill_ready=oe.PrefillReady(kv_session=session),
                                  usage=oe.Usage(prompt_tokens=len(prompt), completion_tokens=0,
                                                 total_tokens=len(prompt), cached_prompt_tokens=0))


def connector(role: int, port: int) -> Any:
    """K11: the pair's connector, the same at every call (the prefill server's sessions are pulled from it)."""
    prefill = role == oe.ENGINE_ROLE_PREFILL
    return oe.KvConnectorInfo(
        enabled=True, transfer_backend=BACKEND, supported_protocols=[BACKEND],
        local_endpoints=[oe.KvEndpoint(host="127.0.0.1", port=port, protocol=BACKEND)] if prefill else [],
        supports_remote_prefill=prefill, supports_decode_pull=not prefill, supports_abort_cleanup=True,
        schema_version=1)


class PrefillControl(Control):
    role = oe.ENGINE_ROLE_PREFILL

    def __init__(self, engine: ToyEngine, store: SessionStore) -> None:
        super().__init__(engine)
        self.store = store
        self.port = 0  # set once the server listens

    def connector(self) -> Any:
        return connector(self.role, self.port)

    def GetLoad(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        load = super().GetLoad(request, context)
        load.used_kv_blocks += self.store.used_blocks()
        load.active_kv_sessions = len(self.store.sessions)
        return load

    def Health(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        """H2's fault (Faults.probe_holds_session): a probe leaves its session held."""
        if request.include_inference_probe and self.engine.faults.probe_holds_session:
            self.store.hold([1, 2, 3])
        return super().Health(request, context)

    def abort_session(self, session: Any, context: grpc.ServicerContext) -> Any:
        """K7: Abort(kv_session) releases a held session (Faults.session_abort_leaks_blocks: not its KV)."""
        if self.store.take(session.session_id, leak=self.engine.faults.session_abort_leaks_blocks) is None:
            context.abort(grpc.StatusCode.NOT_FOUND, "unknown session")
        return oe.AbortResponse(status=oe.ABORT_STATUS_ABORTED)


class DecodeInference(Inference):
    def __init__(self, engine: ToyEngine, store: SessionStore) -> None:
        super().__init__(engine)
        self.store = store

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        f = self.engine.faults
        session = request.kv.session
        if not request.kv.HasField("session"):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "a DECODE engine needs kv.session")
        endpoints_ok = bool(session.endpoints) and all(0 < e.port < 65536 for e in session.endpoints)
        if not session.session_id or not (endpoints_ok or f.decode_accepts_any_endpoints) or \
                (session.transfer_backend != BACKEND and not f.decode_accepts_bad_backend):
            context.abort(INVALID, f"malformed kv.session: {session}")
        self.check_rank(session, context)
        prompt = self.store.take(session.session_id)
        if prompt is None:
            if f.gone_session_refused:  # not a fault: found missing while validating, before acceptance
                context.abort(grpc.StatusCode.NOT_FOUND, "unknown session")
            if f.gone_session_crashes:
                context.abort(grpc.StatusCode.INTERNAL, "KeyError: session")
            yield oe.GenerateResponse(request_id=request.request_id, error=oe.EngineError(
                code=oe.ERROR_CODE_KV_SESSION_NOT_FOUND, message=f"session {session.session_id} is gone",
                retryable=f.gone_session_retryable))
            return
        decode = oe.GenerateRequest()
        decode.CopyFrom(request)
        decode.kv.ClearField("session")
        decode.ClearField("input")
        decode.token_ids.ids.extend(prompt[1:] if f.decode_differs else prompt)
        for event in super().Generate(decode, context):
            finish = event.WhichOneof("event") == "finished"
            if f.decode_double_finish and finish:  # a copy first, without the final response's usage
                yield oe.GenerateResponse(request_id=event.request_id, finished=event.finished)
            if f.decode_omits_finish and finish:  # its usage still rides on the final response (G16 kept)
                yield oe.GenerateResponse(request_id=event.request_id, usage=event.usage,
                                          token=oe.TokenOutput(output_index=event.finished.output_index))
            else:
                yield event
        if f.decode_leaks_on_finish:
            self.engine.leaked_blocks += 2


    def check_rank(self, session: Any, context: grpc.ServicerContext) -> None:
        """M3: the session's dp_rank is authoritative; a target-dp-rank header contradicting it is
        refused before acceptance, the session kept (Faults.decode_rank_conflict_ignored: not)."""
        try:
            header = parse_metadata(context.invocation_metadata(), self.engine.faults).get("openengine-target-dp-rank")
        except Refused as err:
            context.abort(err.code, str(err))
        ignored = self.engine.faults.decode_rank_conflict_ignored
        if header is not None and int(header) != session.dp_rank and not ignored:
            context.abort(INVALID, f"target-dp-rank {header} contradicts kv.session.dp_rank {session.dp_rank}")


class DecodeControl(Control):
    role = oe.ENGINE_ROLE_DECODE

    def connector(self) -> Any:
        return connector(self.role, 0)


def serve_pair(faults: Faults) -> tuple[list[grpc.Server], str, str, list[ToyEngine]]:
    """A PREFILL and a DECODE toy sharing one session store: (servers, prefill, decode, engines)."""
    store = SessionStore()
    # A decode stream without its GenerationFinished is K9's finding (decode_omits_finish), not G12's.
    prefill_engine, decode_engine = ToyEngine(faults), ToyEngine(replace(faults, omit_finish=False))
    prefill, prefill_control = PrefillInference(prefill_engine, store), PrefillControl(prefill_engine, store)
    pre_server, pre_address = start(prefill_engine, prefill, prefill_control)
    prefill.port = prefill_control.port = int(pre_address.rsplit(":", 1)[1])
    dec_server, dec_address = start(decode_engine, DecodeInference(decode_engine, store), DecodeControl(decode_engine))
    return [pre_server, dec_server], pre_address, dec_address, [prefill_engine, decode_engine]
