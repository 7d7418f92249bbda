"""Shutting down and stopping, found by a fault-injection fuzz of the engine (2026-12-06; 800+
seeds of faults in the runner, sampler, scheduler, sinks, guided matchers and KV pulls ran clean,
these five did not): every stream still ends once and every KV block is freed when ``shutdown``
is called from a sink, when its ``fail_all`` raises, or mid-pull; a broken engine refuses to
start again; a request ended by a shutdown is CANCELLED and retryable (RULES X3)."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from refengine.types import EngineStoppedError, KvParams
from tests.unit import test_disagg_engine as D
from tests.unit.test_engine import greedy, make_engine, prompt, tiny  # noqa: F401 - tiny: a fixture


def test_shutdown_from_a_sink_still_ends_every_other_stream(tiny) -> None:  # noqa: F811
    engine = make_engine(tiny)
    engine.start()
    other = engine.add_request(greedy("other", prompt(1, 8), max_tokens=200))
    engine.add_request(greedy("short", prompt(0, 8), max_tokens=2),
                       lambda out: out.finished and engine.shutdown())
    completion = other.result(timeout=10)  # TimeoutError on main: the loop returned, nobody ends "other"
    assert completion.error is not None
    assert engine.core.pool.num_used == 0


def test_shutdown_whose_fail_all_raises_still_ends_every_stream(tiny) -> None:  # noqa: F811
    engine = make_engine(tiny)
    stopped = []
    engine.on_stopped(stopped.append)
    stream = engine.add_request(greedy("a", prompt(0, 8), max_tokens=4))
    engine.step()

    def broken(*args):  # noqa: ANN002, ANN202
        raise RuntimeError("state broken")

    engine.core.fail_all = broken
    try:
        engine.shutdown()
    except RuntimeError:
        pass
    assert stream.finished, "the stream never ends (the loop's _end_all has a fallback for this; shutdown not)"
    assert engine._shut_down, "the worker pools were not closed"


def test_start_after_a_fault_it_could_not_recover_from_is_refused(tiny) -> None:  # noqa: F811
    """Its requests' KV may still be held while their sinks are gone: it cannot safely restart.
    Before, ``start`` returned without a loop, and every request was refused as "shut down"."""
    engine = make_engine(tiny)
    core = engine.core
    execute, fail_all = core.runner.execute, core.fail_all

    def boom(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("fault")

    core.runner.execute, core.fail_all = boom, boom
    engine.start()
    assert engine.add_request(greedy("a", prompt(0, 8), max_tokens=4)).result(10).error is not None
    time.sleep(0.2)
    core.runner.execute, core.fail_all = execute, fail_all
    with pytest.raises(EngineStoppedError, match="fault it could not recover from"):
        engine.start()


def test_decode_shutdown_mid_pull_leaves_no_block_held() -> None:
    from tests.tiny_models import hf_weights, make_tiny_hf_model, model_config_from_hf
    model = make_tiny_hf_model(vocab_size=D.VOCAB, max_position_embeddings=256)
    tiny_d = (model_config_from_hf(model), hf_weights(model))
    prefill = D.make_engine(tiny_d, "prefill")
    decode = D.make_engine(tiny_d, "decode", D.InProcessPull(prefill, delay=0.2))
    prefill.start()
    decode.start()
    try:
        params = D.request("r", D.PROMPTS[3], None, 0.0, max_tokens=4)
        stream = decode.add_request(replace(params, kv=KvParams(session=D.run(prefill, params).prefill)))
        time.sleep(0.05)  # the pull runs
        decode.shutdown()
        assert stream.result(5).error is not None
        assert decode.stats().used_kv_blocks == 0, list(decode.core.kv.owners)  # on main: 5, held by 'load:r'
    finally:
        prefill.shutdown()


def test_a_request_ended_by_shutdown_is_retryable(tiny) -> None:  # noqa: F811
    """EngineFault.retryable: 'the unchanged request could succeed later'; RULES X3 names the server
    shutting down as such a case."""
    engine = make_engine(tiny)
    stream = engine.add_request(greedy("a", prompt(0, 8), max_tokens=4))
    engine.shutdown()
    error = stream.result(5).error
    assert error is not None and error.retryable and error.code == "cancelled", error
