"""The conformance suite's ENC checks (draft profile ``encoder``, docs/profiles/encoder.md) against
refengine: an encoder server (``--role encoder``) and an aggregated server on the tiny LLaVA
checkpoint (``tests/tiny_llava.py``). refengine is the golden target of its own ENC checks: run
against the aggregated server with ``--encoder`` and the image placeholder, every one PASSes;
run against the encoder itself, the encoder-side ones PASS and those needing a consumer skip.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from refengine.conformance import Options, Status, format_matrix, run, select
from tests import tiny_llava
from tests.conformance import encoder_controls
from tests.conformance.fault_proxy import Fault, FaultProxy
from tests.integration.conftest import ServerProcess, start_server, wait_ready
from tests.support_matrix import observe
from tests.tiny_llava import TinyLlava

pytestmark = pytest.mark.timeout(600)
COMMON = ("--max-model-len", "512", "--num-kv-blocks", "96", "--max-num-seqs", "8", "--num-threads", "1")
ENC_CHECKS = {c.name for c in select(["ENC"])}
#: Checks that need the target to consume handles (side "consumer"), or another server than the encoder.
NEEDS_CONSUMER = {"ENC2:media_only_on_encoders", "ENC9:pulled_handle_released", "ENC10:handle_equals_raw_image",
                  "ENC10:handles_value_refused", "ENC11:incompatible_handle_refused",
                  "ENC13:gone_handle_fails_after_acceptance", "ENC13:edited_mm_hash_fails"}


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> TinyLlava:
    return tiny_llava.build_tiny_llava(tmp_path_factory.mktemp("tiny-llava-enc-conformance"))


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, llava: TinyLlava) -> Iterator[dict[str, ServerProcess]]:
    tmp = tmp_path_factory.mktemp("enc-conformance")
    model = ("--model", str(llava.directory), *COMMON)
    procs = {"encoder": start_server(tmp / "encoder.log", *model, "--role", "encoder", "--shutdown-grace-seconds", "2",
                                       wait_ready=False),
             "aggregated": start_server(tmp / "aggregated.log", *model, wait_ready=False)}
    try:
        for proc in procs.values():
            wait_ready(proc)
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


def test_enc_checks_pass_against_a_consumer(servers: dict[str, ServerProcess]) -> None:
    """The aggregated server as target, the encoder as --encoder: every ENC check PASSes."""
    options = Options(encoder_address=servers["encoder"].address, media_placeholder_token_id=tiny_llava.IMAGE_TOKEN)
    results = run(servers["aggregated"].address, ["ENC"], options)
    matrix = format_matrix(results)
    print("\n" + matrix)
    for result in results:
        observe("encoder+consumer", result)
    assert {r.name for r in results} == ENC_CHECKS
    assert all(r.status is Status.PASS for r in results), matrix


def test_enc_checks_against_the_encoder_itself(servers: dict[str, ServerProcess]) -> None:
    """The encoder as target (no --encoder): discovery and the encoder-side checks PASS; the
    consumer checks skip, naming side 'consumer' (or that the target is the encoder)."""
    options = Options(media_placeholder_token_id=tiny_llava.IMAGE_TOKEN)
    results = run(servers["encoder"].address, ["ENC"], options)
    matrix = format_matrix(results)
    print("\n" + matrix)
    for result in results:
        observe("encoder", result)
    by_name = {r.name: r for r in results}
    assert set(by_name) == ENC_CHECKS
    passed = {n for n, r in by_name.items() if r.status is Status.PASS}
    assert passed == ENC_CHECKS - NEEDS_CONSUMER, matrix
    for name in NEEDS_CONSUMER:
        result = by_name[name]
        assert result.status is Status.SKIP, matrix
        assert "side 'consumer'" in result.message or "the target is the encoder" in result.message, result


CONTROLS = encoder_controls.controls()


@pytest.mark.parametrize("control", CONTROLS, ids=[f"{c.rule or 'none'}-{c.id}" for c in CONTROLS])
def test_each_encoder_control_fails_exactly_its_rule(control: encoder_controls.EncoderControl,
                                                     servers: dict[str, ServerProcess]) -> None:
    """The negative controls (tests/conformance/encoder_controls.py): the encoder and the consumer
    behind fault proxies, one ENC rule broken; the ENC checks run as in the first test and exactly
    that rule fails (the unbroken pair of proxies fails nothing: the proxy itself is transparent)."""
    encoder = FaultProxy(servers["encoder"].address, Fault(control.encoder))
    consumer = FaultProxy(servers["aggregated"].address, Fault(control.consumer))
    try:
        options = Options(encoder_address=encoder.address, media_placeholder_token_id=tiny_llava.IMAGE_TOKEN)
        results = run(consumer.address, ["ENC"], options)
    finally:
        encoder.close()
        consumer.close()
    failed = {r.rule for r in results if r.status is Status.FAIL}
    assert failed == {control.rule} - {""}, format_matrix(results)
    assert all(r.status in (Status.PASS, Status.FAIL) for r in results), format_matrix(results)


#: A consumer that takes whatever rows a handle's session holds (no check of what the encoder says
#: it holds against the handle's mm_hash) and corrupts the first 12 rows it pulls.
CARELESS_CONSUMER = """
from refengine.engine import media_pulls
from refengine.server import kv_pull_client
kv_pull_client.GrpcKvTransfer._check_content = staticmethod(lambda order, call: None)
pull = media_pulls.MediaPulls._pull
def corrupted(self, *args, **kwargs):
    rows = pull(self, *args, **kwargs).clone()
    rows[:12] = 0
    return rows
media_pulls.MediaPulls._pull = corrupted
"""


def test_a_careless_consumer_fails_enc10_and_enc13(servers: dict[str, ServerProcess], llava: TinyLlava,
                                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    """The controls of ENC10:handle_equals_raw_image and ENC13:edited_mm_hash_fails (found by review:
    both passed such a consumer: ENC10's handle request reused the raw request's cached blocks, so
    only the last 4 of 16 rows were pulled; no check sent a handle naming another item)."""
    consumer = start_server(tmp_path_factory.mktemp("careless") / "consumer.log", "--model",
                            str(llava.directory), *COMMON, patch=CARELESS_CONSUMER)
    try:
        options = Options(encoder_address=servers["encoder"].address,
                          media_placeholder_token_id=tiny_llava.IMAGE_TOKEN)
        results = run(consumer.address, ["ENC10", "ENC13"], options)
    finally:
        consumer.stop()
    by_name = {r.name: r for r in results}
    for name in ("ENC10:handle_equals_raw_image", "ENC13:edited_mm_hash_fails"):
        assert by_name[name].status is Status.FAIL, format_matrix(results)
