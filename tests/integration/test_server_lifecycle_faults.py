"""Lifecycle edges found by review (2026-12-06): a health probe whose caller left, an engine that
stopped itself after a fault, and the usage of a stream the drain cut off. Real servers on
loopback; each test fails without its fix."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from refengine.client import OpenEngineClient
from refengine.protocol import oe
from tests.integration.conftest import start_server


def _long(client: OpenEngineClient, request_id: str) -> None:
    request = oe.GenerateRequest(request_id=request_id, prompt="Tell me a story.")
    request.stopping.max_tokens, request.stopping.ignore_eos = 400, True
    request.sampling.temperature = 0.0
    list(client.generate(request, timeout=120))


def test_a_probe_whose_caller_left_is_aborted_and_never_takes_a_client_slot(tmp_path: Path) -> None:
    """A Health caller with a short deadline (a load balancer's) leaves its probe waiting behind
    full running slots: the probe is aborted, GetLoad does not count it, and probes never use a
    client's --max-active-requests slot. Before: 2 abandoned probes queued, the 3rd client of 4
    refused with RESOURCE_EXHAUSTED."""
    server = start_server(tmp_path / "server.log", "--max-model-len", "512", "--num-kv-blocks", "64",
                          "--max-num-seqs", "2", "--max-active-requests", "4")
    try:
        with server.client() as client:
            threads = [threading.Thread(target=_long, args=(client, f"long-{i}")) for i in range(2)]
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + 30
            while client.load().running_requests < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            for _ in range(2):  # both running slots are busy: each probe waits, its caller leaves
                with pytest.raises(grpc.RpcError) as info:
                    client.control.Health(oe.HealthRequest(include_inference_probe=True), timeout=0.3)
                assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            deadline = time.monotonic() + 5  # the aborts land within a step or two; under load, later
            while (queued := client.load().queued_requests) and time.monotonic() < deadline:
                time.sleep(0.05)
            probe = client.health(include_inference_probe=False)
            outcome: list[object] = []

            def third() -> None:  # accepted, it waits for a running slot: seen queued, then the longs end
                try:
                    outcome.extend(client.generate(request_id="client-3", prompt="Hi", max_tokens=1, timeout=60))
                except grpc.RpcError as exc:
                    outcome.append(exc)

            waiting = threading.Thread(target=third)
            waiting.start()
            deadline = time.monotonic() + 10
            while not outcome and client.load().queued_requests < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            for i in range(2):
                client.abort(f"long-{i}")
            for thread in (*threads, waiting):
                thread.join(60)
        assert queued == 0, f"{queued} abandoned health probes still queued"
        assert probe.state == oe.HEALTH_STATE_READY
        assert outcome and not isinstance(outcome[0], grpc.RpcError), outcome[:1]
        assert outcome[-1].WhichOneof("event") == "finished", outcome[-1]
    finally:
        server.stop()


#: The step raises for a "boom-*" request, and the fail_all after it raises too: the engine
#: stops itself (engine_loop._end_all).
FAULTY_ENGINE = """
from refengine.engine import core
step = core.EngineCore._step
def faulty_step(self, abort_ids, on_scheduled):
    if any(rid.startswith("boom") for rid in self.requests):
        raise RuntimeError("injected step fault")
    return step(self, abort_ids, on_scheduled)
def faulty_fail_all(self, message, code="internal", retryable=False):
    raise RuntimeError("injected fail_all fault")
core.EngineCore._step, core.EngineCore.fail_all = faulty_step, faulty_fail_all
"""


def test_an_engine_that_stopped_itself_makes_the_server_not_ready(tmp_path: Path) -> None:
    """H3: once the engine stops after a fault it serves nothing: Health NOT_READY naming it,
    grpc.health.v1 NOT_SERVING, new Generate UNAVAILABLE (retry elsewhere). Before: READY,
    SERVING, and RESOURCE_EXHAUSTED for every request. SIGTERM then exits 0 at once: the drain's
    flush waited for the blocks the stopped engine never frees, its whole 16 s bound (found by review)."""
    server = start_server(tmp_path / "server.log", "--max-model-len", "512", "--num-kv-blocks", "64",
                          "--shutdown-grace-seconds", "1", patch=FAULTY_ENGINE)
    try:
        with server.client() as client:
            running = client.generate(request_id="running", prompt="Tell me a story.", max_tokens=400)
            next(running)  # it holds KV blocks when the engine stops
            events = list(client.generate(request_id="boom-1", prompt="Hi", max_tokens=2))
            assert events[-1].WhichOneof("event") == "error" and "engine stopped" in events[-1].error.message
            assert list(running)[-1].WhichOneof("event") == "error"
            deadline = time.monotonic() + 10
            while client.health().state != oe.HEALTH_STATE_NOT_READY and time.monotonic() < deadline:
                time.sleep(0.05)
            health = client.health()
            with pytest.raises(grpc.RpcError) as refused:
                list(client.generate(request_id="after", prompt="Hi", max_tokens=2))
            with grpc.insecure_channel(server.address) as channel:
                serving = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status
        server.signal(signal.SIGTERM)
        signalled = time.monotonic()
        code = server.proc.wait(60)
        exit_seconds = time.monotonic() - signalled
        assert code == 0, server.log_tail()
        assert exit_seconds < 8, f"exit took {exit_seconds:.1f} s with a 1 s grace period"
        assert health.state == oe.HEALTH_STATE_NOT_READY, health
        assert any("engine stopped" in check.message for check in health.checks), health
        assert serving == health_pb2.HealthCheckResponse.NOT_SERVING
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
        assert "engine stopped" in refused.value.details()
    finally:
        server.stop()


def test_a_stream_cut_off_by_the_drain_reports_the_tokens_it_was_sent(tmp_path: Path) -> None:
    """G16: the terminal EngineError's usage counts what the client received (output the
    engine produced after the cut-off is never sent). Before: 1 token per output too many."""
    server = start_server(tmp_path / "server.log", "--max-model-len", "512", "--num-kv-blocks", "64",
                          "--shutdown-grace-seconds", "1")
    try:
        with server.client() as client:
            request = oe.GenerateRequest(request_id="drained", prompt="Tell me a story.")
            request.stopping.max_tokens, request.stopping.ignore_eos = 450, True
            request.sampling.temperature, request.sampling.num_sequences = 0.0, 2
            events = []
            for event in client.generate(request, timeout=60):
                events.append(event)
                if len(events) == 20:
                    server.signal(signal.SIGTERM)
        last = events[-1]
        assert last.WhichOneof("event") == "error" and last.error.retryable, last
        sent = sum(len(e.token.tokens) for e in events if e.WhichOneof("event") == "token")
        assert last.usage.completion_tokens == sent, (last.usage, sent)
        assert last.usage.total_tokens == last.usage.prompt_tokens + sent
    finally:
        server.stop()


SLOW_ACCEPTANCE = """
import time
from refengine.engine import input_processor
_process = input_processor.InputProcessor.process
def slow_process(self, params):
    if params.request_id.startswith("slow-"):  # as a large grammar compiling (on a worker thread)
        time.sleep(1.5)
    return _process(self, params)
input_processor.InputProcessor.process = slow_process
"""


@pytest.mark.parametrize("target", ["request_id", "all_requests"])
def test_an_abort_during_acceptance_cancels_the_request(tmp_path: Path, target: str) -> None:
    """A2/A3/A4, found by review: an Abort that arrived while a request was still being accepted
    (its grammar compiling) answered NOT_FOUND (ALREADY_FINISHED for all_requests), and the request
    then ran to its end. Now it is ABORTED, and the stream ends CANCELLED once the request is in."""
    server = start_server(tmp_path / "server.log", "--max-model-len", "512", "--num-kv-blocks", "64",
                          patch=SLOW_ACCEPTANCE)
    try:
        with server.client() as client:
            events: list[oe.GenerateResponse] = []
            request = oe.GenerateRequest(request_id="slow-1", prompt="Tell me a story.")
            request.stopping.max_tokens, request.stopping.ignore_eos = 200, True
            request.guided.regex = "[a-z ]+"  # a guided request is accepted on a worker thread
            stream = threading.Thread(target=lambda: events.extend(client.generate(request, timeout=60)))
            stream.start()
            time.sleep(0.5)  # the Generate is on the server, still being accepted
            abort = oe.AbortRequest(request_id="slow-1") if target == "request_id" else \
                oe.AbortRequest(all_requests=oe.AllRequests())
            answer = client.control.Abort(abort, timeout=10)
            stream.join(60)
            load = client.load()
        assert answer.status == oe.ABORT_STATUS_ABORTED, answer
        finished = [e.finished for e in events if e.WhichOneof("event") == "finished"]
        assert [f.reason for f in finished] == [oe.FINISH_REASON_CANCELLED], events[-3:]
        assert events[-1].usage.completion_tokens < 200
        assert load.running_requests == load.queued_requests == load.used_kv_blocks == 0
    finally:
        server.stop()
