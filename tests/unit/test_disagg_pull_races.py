"""Decode-side pull bookkeeping under races (``engine/disagg.py``), between two in-process
engines with a gated in-process pull:

- a client cancel that reaches the engine in the same step as its pull's end must cancel
  that request only (it crashed the step: an engine fault ended every request);
- a request id reused (G2: reusable once its stream ended) while the cancelled namesake's
  pull still waits for a transfer thread must get its own pull (it hung forever, its blocks held).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from refengine.config import CacheConfig, EngineConfig, KvTransferConfig, SchedulerConfig
from refengine.engine.engine import Engine
from refengine.kv.transfer.base import Cancellation, PullOrder, TransferFailure
from refengine.types import FinishReason, KvParams
from tests.tiny_models import hf_weights, make_tiny_hf_model, model_config_from_hf
from tests.unit.test_disagg_engine import BLOCK, PROMPTS, TOKENIZER, VOCAB, InProcessPull, request, run, wait_idle


class GatedPull(InProcessPull):
    """Pulls of the requests in ``gates`` wait for their gate; like the real backends, a pull
    cancelled before it copies raises instead (and never confirms the session)."""

    def __init__(self, source: Engine) -> None:
        super().__init__(source)
        self.gates: dict[str, threading.Event] = {}
        self.started: dict[str, threading.Event] = {}

    def pull(self, order: PullOrder, cancelled: Cancellation) -> None:
        self.started.setdefault(order.request_id, threading.Event()).set()
        if gate := self.gates.get(order.request_id):
            assert gate.wait(30)
        if cancelled.is_set():
            raise TransferFailure("failed", "cancelled")
        super().pull(order, cancelled)


@pytest.fixture(scope="module")
def tiny():
    model = make_tiny_hf_model(vocab_size=VOCAB, max_position_embeddings=256)
    return model_config_from_hf(model), hf_weights(model)


def engine(tiny, role: str, pull: InProcessPull, threads: int = 4) -> Engine:
    config, weights = tiny
    engine_config = EngineConfig(max_model_len=256, role=role, debug_kv_integrity=True, max_sequences_per_request=4,
                                 cache=CacheConfig(block_size=BLOCK, num_blocks=64),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
                                 kv_transfer=KvTransferConfig(num_transfer_threads=threads))
    return Engine(engine_config, config, weights, TOKENIZER, model_fingerprint="tiny", transfer_backends=[pull])


@pytest.fixture()
def pair(tiny, request: pytest.FixtureRequest) -> Iterator[tuple[Engine, Engine, GatedPull]]:
    prefill = engine(tiny, "prefill", InProcessPull())
    pull = GatedPull(prefill)
    decode = engine(tiny, "decode", pull, threads=request.param)
    prefill.start()
    decode.start()
    yield prefill, decode, pull
    prefill.shutdown()
    decode.shutdown()


@pytest.mark.parametrize("pair", [4], indirect=True)
def test_a_cancel_in_the_step_that_takes_its_finished_pull_cancels_only_it(pair) -> None:
    prefill, decode, pull = pair
    params = request("race", PROMPTS[5], None, 0.0)
    session = run(prefill, params).prefill
    pull.gates["race"] = threading.Event()
    stream = decode.add_request(replace(params, kv=KvParams(session=session)))
    deadline = time.monotonic() + 10
    while "race" not in pull.started:
        assert time.monotonic() < deadline, "the pull never started"
        time.sleep(0.01)
    loads = decode.core.disagg.loads
    ended = threading.Event()
    wake = loads._on_done

    def on_done() -> None:  # the pull is recorded as finished; the engine's wake follows
        ended.set()
        wake()

    loads._on_done = on_done
    with decode._lock:  # the step loop cannot take a step while held: the pull's end and the abort meet
        time.sleep(0.2)  # a step already running ends first
        pull.gates["race"].set()
        assert ended.wait(10), "the pull never ended"
        assert decode.abort("race")
    got = stream.result(10)
    assert got.error is None, f"an abort must not fault the engine: {got.error}"
    assert got.outputs[0].finish.reason is FinishReason.CANCELLED
    wait_idle(decode)
    decode.core.check_idle()
    assert not decode.core.kv.owners


@pytest.mark.parametrize("pair", [1], indirect=True)
def test_a_request_id_reused_while_its_cancelled_pull_waits_gets_its_own_pull(pair) -> None:
    prefill, decode, pull = pair
    first, reused = request("busy", PROMPTS[3], None, 0.0), request("r", PROMPTS[5], None, 0.0)
    busy_session, session = run(prefill, first).prefill, run(prefill, reused).prefill
    pull.gates["busy"] = threading.Event()  # holds the only transfer thread
    busy = decode.add_request(replace(first, kv=KvParams(session=busy_session)))
    deadline = time.monotonic() + 10
    while "busy" not in pull.started:
        assert time.monotonic() < deadline, "the pull never started"
        time.sleep(0.01)
    cancelled = decode.add_request(replace(reused, kv=KvParams(session=session)))
    both = -(-len(PROMPTS[3]) // BLOCK) - (-len(PROMPTS[5]) // BLOCK)
    while decode.stats().used_kv_blocks < both:  # admitted: its pull waits for the thread
        assert time.monotonic() < deadline, decode.stats()
        time.sleep(0.01)
    assert decode.abort("r")
    assert cancelled.result(10).outputs[0].finish.reason is FinishReason.CANCELLED
    again = decode.add_request(replace(reused, kv=KvParams(session=session)))  # G2: the id is free again
    time.sleep(0.2)
    pull.gates["busy"].set()
    assert busy.result(10).error is None
    got = again.result(10)
    assert got.error is None and got.outputs[0].finish.reason is FinishReason.LENGTH, got
    wait_idle(decode)
    wait_idle(prefill)
    decode.core.check_idle()
    assert not decode.core.kv.owners
