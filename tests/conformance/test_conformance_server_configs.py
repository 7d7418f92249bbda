"""The suite against refengine servers set up otherwise than the main conformance server: what each
setting turns off is not claimed or skipped, never failed, and a target the suite cannot test is
said so (exit 2's ConnectError). Found by a review run of ``refengine conformance`` over ten server
configurations; each test fails without its fix.

One server: KV events and the prefix cache turned off, one LoRA adapter at a time, Control on its
own port (``--control-port``). The claims on PREFILL and DECODE targets are tested on the pair of
tests/integration/test_disagg_grpc.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import grpc
import pytest

from refengine.conformance import Options, Status
from refengine.conformance.registry import select
from refengine.conformance.runner import run_report
from refengine.conformance.target import ConnectError
from refengine.protocol import oe
from tests.conformance.conftest import SERVER_ARGS
from tests.integration.conftest import ServerProcess, start_server

OFF = ("--no-kv-events", "--no-prefix-caching", "--max-loras", "1", "--max-loaded-loras", "1")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, conformance_lora: dict[str, str]) -> Iterator[ServerProcess]:
    args = [a for a in SERVER_ARGS if a not in ("--kv-events-zmq", "tcp://127.0.0.1:0")]
    lora = ("--enable-lora", "--lora-root", conformance_lora["lora_dir"])
    process = start_server(tmp_path_factory.mktemp("configs") / "server.log", *args, *OFF, *lora, control_port=True)
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def options(server: ServerProcess, conformance_lora: dict[str, str]) -> Options:
    return Options(control_address=server.control_address, **conformance_lora)


@pytest.fixture(scope="module")
def results(server: ServerProcess, options: Options) -> dict[str, tuple[Status, str]]:
    report = run_report(server.address, select(["D1", "E", "K1", "K2", "R7"]), options)
    return {r.name: (r.status, r.message) for r in report.results}


def test_kv_events_turned_off_answer_failed_precondition(server: ServerProcess) -> None:
    """ref: as R5 for LoRA. They answered INVALID_ARGUMENT (Subscribe) and OK with no source
    (GetKvEventSources), so the suite claimed the profile and failed seven E checks."""
    with grpc.insecure_channel(server.control_address) as channel:
        control = oe.ControlStub(channel)
        with pytest.raises(grpc.RpcError) as sources:
            control.GetKvEventSources(oe.GetKvEventSourcesRequest(), timeout=10)
        with pytest.raises(grpc.RpcError) as subscribe:
            next(iter(control.SubscribeKvEvents(oe.SubscribeKvEventsRequest(), timeout=10)))
    for err in (sources.value, subscribe.value):
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "--no-kv-events" in err.details()


def test_the_kv_events_profile_is_not_claimed(results: dict[str, tuple[Status, str]]) -> None:
    e_checks = {name: outcome for name, outcome in results.items() if name.startswith("E")}
    assert e_checks and all(status is Status.NOT_CLAIMED and "FAILED_PRECONDITION" in message
                            for status, message in e_checks.values()), e_checks


@pytest.mark.parametrize("name", ["K1:bypass_skips_reuse", "K2:salt_namespaces"])
def test_no_prefix_cache_skips_what_needs_a_hit(results: dict[str, tuple[Status, str]], name: str) -> None:
    """They passed on counts that are 0 whatever the server does without a cache."""
    status, message = results[name]
    assert status is Status.SKIP and "not served from cache" in message, (status, message)


def test_one_adapter_at_a_time_skips_r7(results: dict[str, tuple[Status, str]]) -> None:
    """--max-loaded-loras 1 refuses a second load with RESOURCE_EXHAUSTED, as documented: R7 failed it."""
    status, message = results["R7:mixed_adapters"]
    assert status is Status.SKIP and "one adapter at a time" in message, (status, message)


def test_control_apart_is_reached_with_control(results: dict[str, tuple[Status, str]]) -> None:
    assert results["D1:schema_revision"][0] is Status.PASS, results["D1:schema_revision"]


def test_a_target_that_cannot_be_tested_is_said_so(server: ServerProcess, options: Options) -> None:
    """A Control-only port ran every check (63 failed on UNIMPLEMENTED); the Inference port alone
    failed discovery without a word on why."""
    checks = select(["D1"])
    with pytest.raises(ConnectError, match="does not serve openengine.v1.Inference"):
        run_report(server.control_address, checks, Options())
    with pytest.raises(ConnectError, match="name it with --control"):
        run_report(server.address, checks, Options())


def test_r1_skips_when_even_a_valid_adapter_is_refused(server: ServerProcess, options: Options,
                                                      tmp_path_factory: pytest.TempPathFactory) -> None:
    """--lora-dir outside the server's LoRA root: every load is refused, so R1's refusals showed
    nothing, and it passed (found by review)."""
    outside = dataclasses.replace(options, lora_dir=str(tmp_path_factory.mktemp("outside-the-root")))
    (result,) = run_report(server.address, select(["R1"]), outside).results
    assert result.status is Status.SKIP and "refused too" in result.message, result
    (inside,) = run_report(server.address, select(["R1"]), options).results
    assert inside.status is Status.PASS, inside
