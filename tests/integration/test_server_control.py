"""Control RPCs on the shared server (RULES D1–D7, H1–H4, A1–A4, R5, X2), plus the
standard gRPC services next to them: grpc.health.v1 and server reflection.

Lifecycle states that need their own server (STARTING, DRAINING, split listeners) are in
``test_server_shutdown.py``.
"""

from __future__ import annotations

import threading
import time
import uuid

import grpc
import pytest
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from refengine.client import OpenEngineClient
from refengine.protocol import oe
from refengine.server.health import SEVERITY
from tests.integration.conftest import Stream, check_stream, collect, greedy_request, wait_idle

MODEL = "smollm2-135m-instruct"
TRACE = (("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"), ("tracestate", "a=1"))


def _code(call, *args, **kwargs) -> grpc.StatusCode:  # noqa: ANN001, ANN003
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    assert info.value.details()
    return info.value.code()


def test_server_info(client: OpenEngineClient) -> None:
    info = client.control.GetServerInfo(oe.GetServerInfoRequest(), metadata=TRACE, timeout=10)  # M5
    assert info.engine_name == "refengine" and info.engine_version
    assert info.engine_role == oe.ENGINE_ROLE_AGGREGATED  # D7
    assert info.instance_id and list(info.supported_models) == [MODEL]
    assert (info.schema_revision, info.minimum_client_revision) == (1, 1)  # D1
    assert info.schema_release == "768a93c7b44e40f28c692ad0b471a8f2"  # D1: the BSR commit of v0.1.0, not the tag
    p = info.parallelism
    assert (p.tensor_parallel_size, p.pipeline_parallel_size, p.data_parallel_size) == (1, 1, 1)
    assert p.HasField("data_parallel_rank") and p.data_parallel_rank == 0  # D2: present zero
    assert p.decode_context_parallel_size >= 1  # D5
    c = info.capacity  # D6
    assert (c.kv_block_size, c.total_kv_blocks, c.max_running_requests) == (16, 128, 16)
    assert c.max_batched_tokens > 0 and c.HasField("max_loras") and c.max_loras == 0
    assert info.kv_connector.HasField("enabled") and not info.kv_connector.enabled
    extra = json_format.MessageToDict(info.extra)
    assert (extra["device"], extra["dtype"], extra["kv_cache_dtype"]) == ("cpu", "float32", "float32")


def test_model_info(client: OpenEngineClient) -> None:
    info = client.model_info(MODEL)
    assert info.served_model_name == MODEL and info.max_context_length == 2048
    assert info.supports_text_input and info.supports_token_ids_input
    assert info.HasField("supports_lora") and not info.supports_lora
    g = info.generation
    assert g.prompt_logprobs.supported and g.output_logprobs.supported and g.output_logprobs.max_top_n == 20
    assert g.guided_decoding.HasField("supported") and g.guided_decoding.supported  # D4: all six modes
    assert sorted(oe.GuidedDecodingMode.Name(m) for m in g.guided_decoding.modes) == sorted(
        f"GUIDED_DECODING_MODE_{m.upper()}" for m in
        ("json_schema", "regex", "ebnf_grammar", "structural_tag", "choice", "json_object"))
    extra = json_format.MessageToDict(info.extra)
    backends = extra["refengine.guided_backends"]
    assert sorted(backends) == ["llguidance", "xgrammar"] and all(len(m) == 6 for m in backends.values())
    assert extra["refengine.guided_default_backend"] == "xgrammar"
    assert g.max_num_sequences == 16 and g.supports_priority and g.supports_cache_salt
    assert _code(client.model_info, "no-such-model") == grpc.StatusCode.NOT_FOUND  # D3
    empty = client.control.GetModelInfo
    assert _code(empty, oe.GetModelInfoRequest(model="")) == grpc.StatusCode.INVALID_ARGUMENT  # D3 (ref)


def test_load_per_rank(client: OpenEngineClient) -> None:
    idle = wait_idle(client)
    assert idle.instance_id and idle.HasField("timestamp_unix_nanos")
    assert idle.HasField("running_requests") and idle.used_kv_blocks <= idle.total_kv_blocks == 128  # H4
    assert not idle.ranks
    ranked = client.load(include_per_rank=True)
    assert len(ranked.ranks) == 1 and ranked.ranks[0].HasField("data_parallel_rank")
    assert ranked.ranks[0].data_parallel_rank == 0 and ranked.ranks[0].total_kv_blocks == 128


def test_health_ready_with_probes(client: OpenEngineClient) -> None:
    health = client.health()
    assert health.state == oe.HEALTH_STATE_READY
    assert {c.name for c in health.checks} >= {"grpc", "model", "scheduler"}
    results: list[oe.HealthResponse] = []

    def probe() -> None:
        results.append(client.health(include_inference_probe=True, model=MODEL))

    threads = [threading.Thread(target=probe) for _ in range(4)]  # H2: concurrent probes
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4
    for result in results:
        probe_check = [c for c in result.checks if c.name == "inference_probe"]
        assert len(probe_check) == 1 and probe_check[0].state == oe.HEALTH_STATE_READY, probe_check
        assert result.state == max((c.state for c in result.checks), key=SEVERITY.index)  # H1
    wait_idle(client)


def test_health_role_and_model_mismatch(client: OpenEngineClient) -> None:
    health = client.health(role=oe.ENGINE_ROLE_PREFILL)
    assert health.state == oe.HEALTH_STATE_NOT_READY  # H1: worst check wins
    assert [c.state for c in health.checks if c.name == "role"] == [oe.HEALTH_STATE_NOT_READY]
    assert _code(client.health, True, "no-such-model") == grpc.StatusCode.NOT_FOUND


def _started(client: OpenEngineClient, request_id: str, num_sequences: int = 1):  # noqa: ANN202
    request = greedy_request(request_id, "Write a long story about a cat.", max_tokens=400, ignore_eos=True)
    request.sampling.num_sequences = num_sequences
    if num_sequences > 1:
        request.sampling.temperature = 0.7
    events = client.generate(request, timeout=120)
    first = next(events)
    assert first.WhichOneof("event") == "token"
    return request, [first], events


def test_abort_request(client: OpenEngineClient) -> None:
    assert _code(client.abort) == grpc.StatusCode.INVALID_ARGUMENT  # A1: no target
    assert _code(client.abort, "never-seen") == grpc.StatusCode.NOT_FOUND  # A2
    request, seen, events = _started(client, "abort-me", num_sequences=2)
    assert client.abort("abort-me").status == oe.ABORT_STATUS_ABORTED
    seen.extend(events)
    stream = Stream(events=seen)
    check_stream(stream, request)  # A4: one GenerationFinished(CANCELLED) per output, then OK
    assert {stream.finished(i).reason for i in range(2)} == {oe.FINISH_REASON_CANCELLED}
    assert client.abort("abort-me").status == oe.ABORT_STATUS_ALREADY_FINISHED  # A2
    wait_idle(client)


def test_an_abort_during_the_last_step_answers_as_the_stream_ends(client: OpenEngineClient) -> None:
    """A2/A4: an abort sent as the request computes its last token: ABORTED only when the stream
    then ends CANCELLED, else ALREADY_FINISHED (it answered ABORTED for streams that ended LENGTH
    with every token, 20 times in 20, found by review)."""
    for trial in range(4):
        request = greedy_request(f"last-step-{trial}", "Count to ten.", max_tokens=4, ignore_eos=True)
        events = client.generate(request, timeout=60)
        seen = [next(events) for _ in range(3)]  # three token events: the last step is under way
        status = client.abort(request.request_id).status
        stream = Stream(events=[*seen, *events])
        check_stream(stream, request)
        reason = stream.finished(0).reason
        assert (status, reason) in ((oe.ABORT_STATUS_ABORTED, oe.FINISH_REASON_CANCELLED),
                                    (oe.ABORT_STATUS_ALREADY_FINISHED, oe.FINISH_REASON_LENGTH)), (status, reason)
    wait_idle(client)


def test_abort_all_requests(client: OpenEngineClient) -> None:
    wait_idle(client)
    idle = client.abort(all_requests=True)
    assert idle.status == oe.ABORT_STATUS_ALREADY_FINISHED  # A3: nothing ran
    started = [_started(client, f"all-{i}") for i in range(2)]
    assert client.abort(all_requests=True).status == oe.ABORT_STATUS_ABORTED
    for request, seen, events in started:
        stream = Stream(events=[*seen, *events])
        check_stream(stream, request)
        assert stream.finished(0).reason == oe.FINISH_REASON_CANCELLED
    wait_idle(client)  # A4: KV freed
    session = oe.KvSessionRef(session_id="nope")
    assert _code(client.abort, kv_session=session) == grpc.StatusCode.NOT_FOUND
    assert _code(client.abort, kv_session=oe.KvSessionRef()) == grpc.StatusCode.INVALID_ARGUMENT  # no id: malformed


@pytest.mark.parametrize("all_requests", [False, True], ids=["by-id", "all"])
def test_an_abort_while_a_reused_id_waits_ends_the_new_request(client: OpenEngineClient, all_requests: bool) -> None:
    """A2/A4 with G2: the client cancels during a long cold prefill and sends the id again, which
    waits for the engine to retire its namesake; an Abort meanwhile (by id, or of all requests) is
    meant for the new request: it answers ABORTED and the new stream ends CANCELLED (found by
    review: the new request ran all its tokens)."""
    wait_idle(client)
    request_id = f"abort-reuse-{all_requests}"
    first = oe.GenerateRequest(request_id=request_id, token_ids=oe.TokenIds(ids=[(7 * i) % 4000 + 100
                                                                                for i in range(1200)]))
    first.kv.cache_salt = uuid.uuid4().hex  # a cold prefill: a step long enough to abort within
    first.stopping.max_tokens = 4
    call = client.inference.Generate(first, timeout=120)
    time.sleep(0.3)
    call.cancel()
    time.sleep(0.05)  # the server saw the cancel; the engine is still inside the prefill step
    second = greedy_request(request_id, "Count from one to one hundred.", max_tokens=60, ignore_eos=True)
    events = client.inference.Generate(second, timeout=120)  # waits for the namesake to retire (G2)
    time.sleep(0.1)
    answer = client.abort(all_requests=True) if all_requests else client.abort(request_id)
    assert answer.status == oe.ABORT_STATUS_ABORTED, answer
    stream = Stream(events=list(events))
    check_stream(stream, second)
    assert stream.finished(0).reason == oe.FINISH_REASON_CANCELLED  # A4: the abort reached the live stream
    wait_idle(client)


@pytest.mark.parametrize("rpc,request_,code", [
    ("LoadLora", oe.LoadLoraRequest(adapter=oe.LoraAdapter(lora_id=1, lora_name="a", source_path="/tmp")),
     grpc.StatusCode.FAILED_PRECONDITION),  # R5
    ("LoadLora", oe.LoadLoraRequest(), grpc.StatusCode.FAILED_PRECONDITION),  # R5 whatever the request holds
    ("LoadLora", oe.LoadLoraRequest(adapter=oe.LoraAdapter(lora_id=0)), grpc.StatusCode.FAILED_PRECONDITION),
    ("UnloadLora", oe.UnloadLoraRequest(lora_name="a"), grpc.StatusCode.FAILED_PRECONDITION),
    ("UnloadLora", oe.UnloadLoraRequest(), grpc.StatusCode.FAILED_PRECONDITION),
    ("ListLoras", oe.ListLorasRequest(), grpc.StatusCode.FAILED_PRECONDITION),
])
def test_unoffered_rpcs(client: OpenEngineClient, rpc: str, request_: object, code: grpc.StatusCode) -> None:
    assert _code(getattr(client.control, rpc), request_) == code


def test_kv_event_sources_none_configured(client: OpenEngineClient) -> None:
    """E6 (ref): without --kv-events-zmq there is no compatibility source to list."""
    assert list(client.control.GetKvEventSources(oe.GetKvEventSourcesRequest(), timeout=10).sources) == []
    for ranks in ([1], [0, 0]):
        assert _code(client.control.GetKvEventSources,
                     oe.GetKvEventSourcesRequest(data_parallel_ranks=ranks)) == grpc.StatusCode.INVALID_ARGUMENT


def test_subscribe_kv_events_snapshot_then_live(client: OpenEngineClient) -> None:
    """E1, E2: the snapshot batch, then the live batches of a request, numbered without a gap."""
    stream = client.control.SubscribeKvEvents(oe.SubscribeKvEventsRequest(include_snapshot=True), timeout=60)
    first = next(stream)
    assert first.WhichOneof("event") == "batch"
    check_stream(collect(client, greedy_request("kv-events-1", "Tell me about Paris, the capital. " * 3,
                                                max_tokens=4)), greedy_request("kv-events-1", "x", max_tokens=4))
    numbers, stored = [first.batch.sequence_number], 0
    while stored == 0:
        batch = next(stream).batch
        numbers.append(batch.sequence_number)
        stored += sum(e.WhichOneof("event") == "block_stored" for e in batch.events)
    stream.cancel()
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    assert stored > 0


def test_grpc_health_v1(server_address: str) -> None:
    with grpc.insecure_channel(server_address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "openengine.v1.Inference", "openengine.v1.Control"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_the_services(server_address: str) -> None:
    with grpc.insecure_channel(server_address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {"openengine.v1.Inference", "openengine.v1.Control", "grpc.health.v1.Health"} <= services
        generate = database.FindFileContainingSymbol("openengine.v1.Inference")
        assert generate.package == "openengine.v1"


def test_generate_still_works_after_control_traffic(client: OpenEngineClient) -> None:
    request = greedy_request("after-control", "Hello", max_tokens=2)
    check_stream(collect(client, request), request)
