"""The gRPC edge's pure parts, without a server or a model: metadata (M1–M3), role checks
(D7, K5, K6), ``extra`` (G8), request mapping, response building (G10–G16, X1) and the
stream bridge's stall detection. Fast; catches what the loopback tests cannot provoke
(an engine that breaks an invariant, a decode-role server)."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
from google.protobuf import struct_pb2

from refengine.protocol import oe
from refengine.server.convert import StreamSettings, stream_settings, to_engine_request
from refengine.server.errors import Rejection
from refengine.server.kv_pull_client import PULL_PROTOCOLS
from refengine.server.metadata import RequestMetadata, read_inference_metadata
from refengine.server.responses import ResponseBuilder
from refengine.server.stream_bridge import OutputBridge
from refengine.server.validation import check_role
from refengine.types import (
    Candidate,
    EngineFault,
    FinishInfo,
    FinishReason,
    RequestOutput,
    SequenceDelta,
    TokenInfo,
    Usage,
)

USAGE = Usage(prompt_tokens=4, completion_tokens=2, cached_prompt_tokens=0)
LENGTH = FinishInfo(FinishReason.LENGTH)


@pytest.mark.parametrize("metadata,ok", [
    ((("openengine-priority", "-7"), ("openengine-target-dp-rank", "0"), ("x-other", "a")), True),
    ((("openengine-priority", "2147483648"),), False),  # int32 overflow
    ((("openengine-priority", " 1"),), False),
    ((("openengine-target-dp-rank", "+0"),), False),
    ((("openengine-routing-key", "a"), ("openengine-routing-key", "b")), False),
    ((("openengine-unknown", "x"),), True),  # unknown openengine-* keys are ignored
    ((("traceparent", "garbage"),), True),  # a malformed trace context is ignored, never an error
    # M2: more than Python's 4,300-digit int() limit (a ValueError, which was INTERNAL); leading
    # zeros are still a base-10 number, and a repeated -bin key is repeated.
    ((("openengine-priority", "1" * 5000),), False),
    ((("openengine-target-dp-rank", "9" * 11),), False),
    ((("openengine-priority", "-" + "0" * 5000 + "7"),), True),
    ((("openengine-target-dp-rank", "0" * 4400),), True),
    ((("openengine-foo-bin", b"a"), ("openengine-foo-bin", b"b")), False),
])
def test_metadata(metadata: tuple, ok: bool) -> None:
    if ok:
        meta = read_inference_metadata(metadata)
        assert meta.priority in (None, -7) and meta.target_dp_rank in (None, 0)
    else:
        with pytest.raises(Rejection) as info:
            read_inference_metadata(metadata)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def _with_session(**fields: object) -> oe.GenerateRequest:
    request = oe.GenerateRequest(request_id="r", prompt="x")
    request.kv.session.CopyFrom(oe.KvSessionRef(**fields))
    return request


@pytest.mark.parametrize("role,request_,meta,code", [
    ("decode", oe.GenerateRequest(request_id="r", prompt="x"), RequestMetadata(), "INVALID_ARGUMENT"),  # K5
    ("decode", _with_session(session_id="s", transfer_backend="nixl"), RequestMetadata(), "INVALID_ARGUMENT"),
    ("decode", _with_session(transfer_backend="nixl"), RequestMetadata(), "INVALID_ARGUMENT"),
    ("prefill", _with_session(session_id="s"), RequestMetadata(), "FAILED_PRECONDITION"),  # K6
    ("aggregated", _with_session(session_id="s", dp_rank=1), RequestMetadata(target_dp_rank=0),
     "INVALID_ARGUMENT"),  # M3
    ("prefill", oe.GenerateRequest(request_id="r", prompt="x"), RequestMetadata(), None),
])
def test_role_checks(role: str, request_: oe.GenerateRequest, meta: RequestMetadata, code: str | None) -> None:
    if code is None:
        check_role(request_, role, meta)
        return
    with pytest.raises(Rejection) as info:
        check_role(request_, role, meta)
    assert info.value.code.name == code and info.value.message


@pytest.mark.parametrize("rank", [0, 1, 7])
def test_a_session_naming_a_rank_this_server_lacks_is_refused(rank: int) -> None:
    """M3: ``kv.session.dp_rank`` is authoritative, so, like the target-dp-rank header, it must
    name a rank that exists (found by review: any rank was decoded on rank 0)."""
    request = _with_session(session_id="s", transfer_backend="kvpull", dp_rank=rank,
                            endpoints=[oe.KvEndpoint(host="127.0.0.1", port=5, protocol=PULL_PROTOCOLS[0])])
    if rank == 0:
        check_role(request, "decode", RequestMetadata(), backends=("kvpull",))
        return
    with pytest.raises(Rejection) as info:
        check_role(request, "decode", RequestMetadata(), backends=("kvpull",))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"kv.session.dp_rank is {rank}, but this server has data_parallel_size 1" in info.value.message


def test_extra_stream_settings() -> None:
    server = StreamSettings(stream_buffer=8, stall_timeout_seconds=5.0)
    extra = struct_pb2.Struct()
    extra.update({"refengine.stream_buffer": 2, "refengine.stall_timeout_seconds": 0.5, "other": "ignored"})
    assert stream_settings(extra, server) == StreamSettings(2, 0.5)
    assert stream_settings(struct_pb2.Struct(), server) == server  # G8: empty is always valid
    for bad in ({"refengine.stream_buffer": 9}, {"refengine.stream_buffer": 1.5},
                {"refengine.stall_timeout_seconds": True}, {"refengine.stall_timeout_seconds": 0},
                {"refengine.stream_buffer": float("inf")}, {"refengine.stream_buffer": float("nan")}):
        extra = struct_pb2.Struct()
        extra.update(bad)
        with pytest.raises(Rejection):
            stream_settings(extra, server)


def test_request_mapping_keeps_presence() -> None:
    request = oe.GenerateRequest(request_id="r", prompt="hi", kv=oe.KvOptions(cache_salt=""))
    request.sampling.top_k = 0
    request.stopping.conditions.add(stop_token_id=5)
    request.stopping.conditions.add(stop_text="END")
    request.response.output_candidates.top_n = 0
    params = to_engine_request(request, RequestMetadata(priority=3))
    assert params.sampling.num_sequences == 1 and params.sampling.temperature == 1.0 and params.sampling.seed is None
    assert params.stopping.stop_token_ids == (5,) and params.stopping.stop_strings == ("END",)
    assert params.stopping.max_tokens is None and params.logprobs.output_candidates is None  # top_n 0 (ref)
    assert params.kv.cache_salt is None and params.priority == 3


def test_response_builder_usage_and_terminal() -> None:
    builder = ResponseBuilder("r", 2, 1 << 20)
    first = builder.events(RequestOutput("r", deltas=(SequenceDelta(0, (TokenInfo(1, "a"),), "a", LENGTH),)))
    assert [e.WhichOneof("event") for e in first] == ["token", "finished"]
    assert not any(e.HasField("usage") for e in first)
    last = builder.events(RequestOutput("r", deltas=(SequenceDelta(1, (), "", LENGTH),), finished=True, usage=USAGE))
    assert [e.WhichOneof("event") for e in last] == ["finished"] and last[-1].usage.total_tokens == 6
    assert last[-1].finished.HasField("output_index") and last[-1].finished.output_index == 1  # G10
    with pytest.raises(RuntimeError):
        builder.events(RequestOutput("r"))


def test_response_builder_turns_broken_invariants_into_one_engine_error() -> None:
    builder = ResponseBuilder("r", 1, 1 << 20)
    builder.events(RequestOutput("r", deltas=(SequenceDelta(0, finish=LENGTH),)))
    events = builder.events(RequestOutput("r", deltas=(SequenceDelta(0, (TokenInfo(1, "a"),), "a"),)))
    assert events[-1].error.code == oe.ERROR_CODE_INTERNAL and builder.terminal_sent
    fault = ResponseBuilder("r", 1, 1 << 20).events(
        RequestOutput("r", finished=True, usage=USAGE, error=EngineFault("internal", "boom", retryable=False)))
    assert len(fault) == 1 and fault[0].error.message == "boom" and not fault[0].error.retryable
    assert fault[0].usage.prompt_tokens == 4  # G16: usage on the terminal EngineError


def test_large_token_output_is_split_by_tokens() -> None:
    candidates = tuple(Candidate(i, -1.0, i + 1, "tok") for i in range(2000))
    tokens = tuple(TokenInfo(i, "t", -0.5, 1, candidates) for i in range(3))
    builder = ResponseBuilder("r", 1, 64 << 10)
    events = builder.events(RequestOutput("r", deltas=(SequenceDelta(0, tokens, "ttt"),)))
    assert [len(e.token.tokens) for e in events] == [1, 1, 1]
    assert "".join(e.token.text for e in events) == "ttt" and events[-1].token.text == "ttt"


def test_an_event_that_cannot_fit_ends_the_stream_with_one_engine_error() -> None:
    """Mid-stream: the events before it go out, ``oversized`` asks for the abort, outputs that
    still come are dropped and the final one becomes the EngineError with its usage. In a final
    output: the EngineError at once, in place of the oversized event and those after it."""
    huge = (TokenInfo(7, "x", -0.5, 1, tuple(Candidate(i, -1.0, i + 1, "tok") for i in range(20_000))),)
    small = (TokenInfo(1, "a"),)
    builder = ResponseBuilder("r", 1, 64 << 10)
    first = builder.events(RequestOutput("r", deltas=(SequenceDelta(0, small, "a"),)))
    second = builder.events(RequestOutput("r", deltas=(SequenceDelta(0, small, "a"), SequenceDelta(0, huge, "x"))))
    assert [e.WhichOneof("event") for e in first + second] == ["token", "token"] and builder.oversized is not None
    assert builder.events(RequestOutput("r", deltas=(SequenceDelta(0, small, "b"),))) == []
    end = builder.events(RequestOutput("r", deltas=(SequenceDelta(0, finish=LENGTH),), finished=True, usage=USAGE))
    assert [e.WhichOneof("event") for e in end] == ["error"] and builder.terminal_sent
    assert end[0].error.code == oe.ERROR_CODE_INVALID_ARGUMENT and end[0].usage.total_tokens == 6
    assert "--max-send-message-mib" in end[0].error.message
    final = ResponseBuilder("r", 1, 64 << 10).events(RequestOutput(
        "r", deltas=(SequenceDelta(0, small, "a"), SequenceDelta(0, huge, "x", LENGTH)), finished=True, usage=USAGE))
    assert [e.WhichOneof("event") for e in final] == ["token", "error"] and final[-1].usage.prompt_tokens == 4


def test_bridge_detects_a_stalled_consumer_and_reports_the_engine_usage() -> None:
    async def scenario() -> tuple[list[str], RequestOutput]:
        loop = asyncio.get_running_loop()
        stalled: list[str] = []
        bridge = OutputBridge(loop, "r", capacity=1, stall_timeout=0.05, on_stall=lambda b: stalled.append("x"))
        engine_thread = threading.Thread(target=lambda: [bridge.sink(RequestOutput("r")) for _ in range(3)])
        engine_thread.start()
        engine_thread.join()
        await asyncio.sleep(0.2)  # nobody reads: the buffer is full, the clock runs out
        assert bridge.fail(EngineFault("overloaded", "stalled", retryable=True))
        bridge.sink(RequestOutput("r", finished=True, usage=USAGE))  # the engine confirms the abort
        terminal = await asyncio.wait_for(bridge.next(), 2)
        return stalled, terminal

    stalled, terminal = asyncio.run(scenario())
    assert stalled == ["x"]
    assert terminal.error is not None and terminal.error.code == "overloaded" and terminal.usage == USAGE


def test_bridge_never_overrides_a_finished_request() -> None:
    async def scenario() -> bool:
        bridge = OutputBridge(asyncio.get_running_loop(), "r", 4, 10.0, on_stall=lambda b: None)
        bridge.sink(RequestOutput("r", finished=True, usage=USAGE))
        await asyncio.sleep(0.01)
        refused = not bridge.fail(EngineFault("draining", "late", retryable=True))
        out = await bridge.next()
        return refused and out.finished and out.error is None

    assert asyncio.run(scenario())


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_session_whose_attributes_are_not_json_is_invalid_argument(value: float) -> None:
    """K5: a malformed session is INVALID_ARGUMENT before acceptance; a NaN or infinity in
    attributes_struct (no JSON value) raised ValueError, which was INTERNAL."""
    from refengine.server.convert import session_spec

    ref = oe.KvSessionRef(session_id="s", transfer_backend="grpc",
                          endpoints=[oe.KvEndpoint(host="prefill.local", port=5000, protocol="grpc")])
    ref.attributes_struct.update({"block_size": 16, "x": value})
    with pytest.raises(Rejection) as refused:
        session_spec(ref)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and "attributes_struct" in refused.value.message


def test_a_kv_event_subscription_whose_client_left_during_the_step_is_closed() -> None:
    """E1: the engine subscribes between steps; a client that cancels while the step runs must
    not leave its subscription registered (it was fed until its buffer overflowed)."""
    from types import SimpleNamespace

    from refengine.server.kv_events_service import subscribe

    step_ended = threading.Event()
    closed: list[str] = []

    class Subscription:
        def close(self) -> None:
            closed.append("closed")

    class Engine:
        def subscribe_kv_events(self, on_ready: object, include_snapshot: bool, start: int) -> Subscription:
            step_ended.wait(5)
            return Subscription()

    state = SimpleNamespace(engine_for_control=Engine, kv_subscribers=set())

    async def scenario() -> None:
        call = asyncio.ensure_future(subscribe(state, oe.SubscribeKvEventsRequest(), context=None))
        await asyncio.sleep(0.05)  # the handler waits for the step
        call.cancel()  # the client left
        with pytest.raises(asyncio.CancelledError):
            await call
        step_ended.set()
        for _ in range(100):
            if closed:
                return
            await asyncio.sleep(0.01)

    asyncio.run(scenario())
    assert closed == ["closed"] and not state.kv_subscribers


def test_unload_lora_waiting_for_a_load_does_not_block_the_event_loop() -> None:
    """R2: an unload waits for a load in progress (the registry runs one at a time, and a load
    reads the adapter's files); the event loop, serving every stream, must not wait with it."""
    from types import SimpleNamespace

    from refengine.server.control import ControlServicer
    from refengine.server.state import ServerState
    from refengine.types import LoraAdapterSpec

    class Engine:
        info = SimpleNamespace(max_loras=2)

        def unload_lora(self, name: str) -> LoraAdapterSpec:
            time.sleep(0.6)  # the registry's lifecycle lock, held by a load reading its files
            return LoraAdapterSpec(2, name, "/adapters/b")

    class State(SimpleNamespace):
        held_for_drain = ServerState.held_for_drain

    servicer = ControlServicer(State(engine_for_control=Engine, accepting=0))

    async def scenario() -> tuple[float, str]:
        gaps: list[float] = []

        async def heartbeat() -> None:  # stands for the streams the server is serving
            last = time.monotonic()
            for _ in range(12):
                await asyncio.sleep(0.05)
                gaps.append(time.monotonic() - last)
                last = time.monotonic()

        beat = asyncio.ensure_future(heartbeat())
        await asyncio.sleep(0.05)
        response = await servicer.UnloadLora(oe.UnloadLoraRequest(lora_name="b"), context=None)
        await beat
        return max(gaps), response.adapter.lora_name

    worst_gap, name = asyncio.run(scenario())
    assert name == "b"
    assert worst_gap < 0.3, f"the event loop stalled {worst_gap:.2f} s while UnloadLora waited"


def _tiny_engine(max_num_seqs: int):  # noqa: ANN202 - an Engine on a tiny random model
    from refengine.config import EngineConfig, SchedulerConfig
    from refengine.engine.engine import Engine
    from tests.tiny_models import hf_weights, make_tiny_hf_model, model_config_from_hf
    from tests.unit.tokenizer_fixture import byte_fallback_tokenizer

    tokenizer = byte_fallback_tokenizer()
    model = make_tiny_hf_model(vocab_size=len(tokenizer), max_position_embeddings=4096)
    config = EngineConfig(max_model_len=4096, max_sequences_per_request=1,
                          scheduler=SchedulerConfig(max_num_seqs=max_num_seqs))
    return Engine(config, model_config_from_hf(model), hf_weights(model), tokenizer, model_fingerprint="tiny")


def test_a_saturated_engine_probes_degraded_not_not_ready() -> None:
    """H3: every running slot busy (max_num_seqs 1), the probe waits for room past its timeout
    while the engine keeps stepping: DEGRADED, saturated. It said NOT_READY, which takes a busy
    but healthy replica out of service (found by review)."""
    from refengine.server.health import inference_probe
    from refengine.types import GenerationRequest, SamplingParams, StoppingParams

    engine = _tiny_engine(max_num_seqs=1)
    engine.start()
    try:
        busy = engine.add_request(GenerationRequest("busy", prompt_token_ids=[5, 6, 7],
                                                    sampling=SamplingParams(temperature=0.0),
                                                    stopping=StoppingParams(max_tokens=3000, ignore_eos=True)))
        deadline = time.monotonic() + 10
        while engine.stats().running_requests == 0:  # admitted first: a probe queued beside it would go ahead
            assert time.monotonic() < deadline
            time.sleep(0.005)
        check = asyncio.run(inference_probe(engine, timeout=0.3))
        assert check.state == oe.HEALTH_STATE_DEGRADED and "saturated" in check.message, check
        engine.abort("busy")
        busy.result(30)
    finally:
        engine.shutdown()


def test_abort_all_leaves_health_probes_alone() -> None:
    """A3: a probe in flight is not client work: Abort(all_requests) on an otherwise idle server
    aborts nothing (it answered ABORTED, "aborted 1 requests", and the probe was cancelled)."""
    from refengine.types import GenerationRequest, StoppingParams

    engine = _tiny_engine(max_num_seqs=4)  # not started: the requests stay active
    engine.add_request(GenerationRequest("refengine-health-probe-x", prompt_token_ids=[1], health_probe=True,
                                         stopping=StoppingParams(max_tokens=1)))
    assert engine.abort_all() == []
    engine.add_request(GenerationRequest("client", prompt_token_ids=[1], stopping=StoppingParams(max_tokens=1)))
    assert engine.abort_all() == ["client"]
    engine.shutdown()


def test_an_encoder_server_offers_no_kv_connector() -> None:
    """An encoder's embedding handles belong to its draft profile (ENC2): its ServerInfo said it
    pulled decode KV (supports_decode_pull true, found by review)."""
    from types import SimpleNamespace

    from refengine.server.control import ControlServicer

    servicer = ControlServicer(SimpleNamespace(kv_endpoints=()))
    for role in ("encoder", "aggregated"):
        assert not servicer.kv_connector(SimpleNamespace(role=role, kv_transfer_backends=("grpc",))).enabled
    decode = servicer.kv_connector(SimpleNamespace(role="decode", kv_transfer_backends=("grpc",)))
    assert decode.enabled and decode.supports_decode_pull
