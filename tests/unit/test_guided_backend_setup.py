"""Building a grammar backend (a scan of the vocabulary: 0.1-0.5 s for 49k tokens) happens on
first use, in the caller, outside the compile time limit and outside the cache's lock."""

from __future__ import annotations

import threading
import time

from refengine.config import GuidedConfig
from refengine.sampling.guided import GuideCompiler
from refengine.sampling.guided import compiler as compiler_module
from refengine.sampling.guided.llguidance_backend import LlguidanceBackend
from refengine.sampling.guided.xgrammar_backend import XGrammarBackend
from refengine.types import GuidedSpec
from tests.unit.test_guided_engine import EOS, TOKENIZER, VOCAB

BUILD_SECONDS = 0.6
building = threading.Event()


class SlowXGrammar(XGrammarBackend):
    def __init__(self, *args) -> None:  # noqa: ANN002
        time.sleep(BUILD_SECONDS)
        super().__init__(*args)


class SlowLlguidance(LlguidanceBackend):
    def __init__(self, *args) -> None:  # noqa: ANN002
        building.set()
        time.sleep(BUILD_SECONDS)
        super().__init__(*args)


def test_the_first_request_is_not_charged_for_building_the_backend(monkeypatch) -> None:
    monkeypatch.setitem(compiler_module._BACKEND_CLASSES, "xgrammar", SlowXGrammar)
    compiler = GuideCompiler(TOKENIZER, VOCAB, (EOS,), GuidedConfig(compile_timeout_seconds=BUILD_SECONDS / 3))
    try:
        compiler.compile(GuidedSpec("regex", "[ab]{2}", backend="xgrammar"))  # within the limit once built
    finally:
        compiler.close()


def test_a_cache_hit_does_not_wait_for_another_backend_being_built(monkeypatch) -> None:
    monkeypatch.setitem(compiler_module._BACKEND_CLASSES, "llguidance", SlowLlguidance)
    compiler = GuideCompiler(TOKENIZER, VOCAB, (EOS,), GuidedConfig())
    cached = GuidedSpec("regex", "[ab]{2}", backend="xgrammar")
    try:
        compiler.compile(cached)
        other = threading.Thread(target=compiler.compile, args=(GuidedSpec("regex", "c+", backend="llguidance"),))
        other.start()
        assert building.wait(10)
        started = time.perf_counter()
        compiler.compile(cached)
        assert time.perf_counter() - started < BUILD_SECONDS / 3, "a cache hit waited for a backend being built"
        other.join(10)
    finally:
        compiler.close()
