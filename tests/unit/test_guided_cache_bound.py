"""The compile cache is bounded by the memory of its grammars' token masks as well as by their
count (found by review: a 20-character regex compiles to ~9 MB of masks for a 49k vocabulary,
so 256 cached ones could hold gigabytes)."""

from __future__ import annotations

from refengine.config import GuidedConfig
from refengine.sampling.guided import GuideCompiler
from refengine.types import GuidedSpec
from tests.unit.test_guided_engine import EOS, TOKENIZER, VOCAB

FIRST, SECOND = GuidedSpec("regex", "[ab]{1,40}", backend="xgrammar"), GuidedSpec("regex", "[cd]{1,40}",
                                                                                    backend="xgrammar")


def test_grammars_over_the_byte_bound_are_dropped_least_recently_used_first() -> None:
    probe = GuideCompiler(TOKENIZER, VOCAB, (EOS,), GuidedConfig())
    try:
        size = probe.compile(FIRST).memory_bytes
        assert size > 0 and probe.compile(SECOND).memory_bytes > 0
    finally:
        probe.close()
    compiler = GuideCompiler(TOKENIZER, VOCAB, (EOS,), GuidedConfig(cache_bytes=size + size // 2))
    try:
        first = compiler.compile(FIRST)
        assert compiler.compile(FIRST) is first  # a hit while it fits
        compiler.compile(SECOND)  # both no longer fit: the least recently used goes
        assert compiler.compile(FIRST) is not first
    finally:
        compiler.close()


def test_the_newest_grammar_is_kept_whatever_its_size() -> None:
    compiler = GuideCompiler(TOKENIZER, VOCAB, (EOS,), GuidedConfig(cache_bytes=0))
    try:
        first = compiler.compile(FIRST)
        assert compiler.compile(FIRST) is first
    finally:
        compiler.close()
