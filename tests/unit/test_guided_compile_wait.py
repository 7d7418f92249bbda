"""The compile time limit counts a compile's own running time, not its wait for a worker
(``GuideCompiler.compile``). Found by review: a spec that compiles quickly but started just before
the limit (its worker busy with another request's compile) was refused with "took longer than
1 s; simplify it" (INVALID_ARGUMENT, not retryable) though nearly all of that second was queue.
"""

from __future__ import annotations

import threading
import time

import pytest

from refengine.config import GuidedConfig
from refengine.sampling.guided import GuideCompiler, GuidedSpecError
from refengine.types import GuidedSpec, OverloadedError
from tests.unit.test_guided_engine import EOS, TOKENIZER, VOCAB

LIMIT = 1.0


def slowed(compiler: GuideCompiler, seconds: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each compile of ``compiler`` runs ``seconds`` longer (a spec of known cost)."""
    real = compiler._compile

    def slow(*args: object) -> object:
        time.sleep(seconds)
        return real(*args)

    monkeypatch.setattr(compiler, "_compile", slow)


def test_a_compile_that_started_late_gets_its_own_time(monkeypatch: pytest.MonkeyPatch) -> None:
    compiler = GuideCompiler(TOKENIZER, VOCAB, (EOS,), GuidedConfig(compile_timeout_seconds=LIMIT, compile_threads=1))
    try:
        compiler.compile(GuidedSpec("regex", "a", backend="xgrammar"))  # the backend is built
        slowed(compiler, 0.4, monkeypatch)
        compiler._pool.submit(lambda: time.sleep(0.8))  # another request's compile holds the worker
        start = time.monotonic()
        assert compiler.compile(GuidedSpec("regex", "b+", backend="xgrammar")) is not None
        assert LIMIT < time.monotonic() - start < 2 * LIMIT
    finally:
        compiler.close()


def test_a_compile_that_runs_past_the_limit_is_still_blamed(monkeypatch: pytest.MonkeyPatch) -> None:
    compiler = GuideCompiler(TOKENIZER, VOCAB, (EOS,), GuidedConfig(compile_timeout_seconds=LIMIT, compile_threads=1))
    try:
        compiler.compile(GuidedSpec("regex", "a", backend="xgrammar"))
        slowed(compiler, 1.5 * LIMIT, monkeypatch)
        start = time.monotonic()
        with pytest.raises(GuidedSpecError, match="took longer"):
            compiler.compile(GuidedSpec("regex", "c+", backend="xgrammar"))
        assert time.monotonic() - start < 1.4 * LIMIT, "a worker was free: only the limit is waited"
    finally:
        compiler.close()


def test_a_second_waiter_for_a_spec_waits_its_own_time_when_the_first_gives_up() -> None:
    """Two requests for one spec share its compile. Found by review: when the first one's time ran
    out before any worker was free, it withdrew the compile and the second one, which had waited
    only part of its time, was told "busy" too. Now it submits the compile again and gets it
    once the worker is free within its own time."""
    compiler = GuideCompiler(TOKENIZER, VOCAB, (EOS,), GuidedConfig(compile_timeout_seconds=LIMIT, compile_threads=1))
    spec = GuidedSpec("regex", "d+", backend="xgrammar")
    try:
        compiler.compile(GuidedSpec("regex", "a", backend="xgrammar"))
        compiler._pool.submit(lambda: time.sleep(1.3 * LIMIT))  # the only worker, busy past the first's limit
        first: list[BaseException] = []
        waiting = threading.Thread(target=lambda: first.append(_raised(compiler, spec)))
        waiting.start()
        time.sleep(0.6 * LIMIT)  # the second comes while the first waits
        assert compiler.compile(spec) is not None
        waiting.join(5)
        assert isinstance(first[0], OverloadedError), first
    finally:
        compiler.close()


def _raised(compiler: GuideCompiler, spec: GuidedSpec) -> BaseException | None:
    try:
        compiler.compile(spec)
    except BaseException as exc:  # noqa: BLE001 - the test inspects it
        return exc
    return None
