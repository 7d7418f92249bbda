"""A first token the grammar forbids, on llguidance (K10 with a grammar; see test_disagg_engine)."""

from __future__ import annotations

from dataclasses import replace

from refengine.config import GuidedConfig
from refengine.engine.disagg import first_sampled_token
from refengine.engine.first_token_options import first_token_options
from refengine.sampling.guided import GuideCompiler
from refengine.types import GuidedSpec, KvParams
from tests.unit.test_disagg_engine import PROMPTS, TOKENIZER, request, run, tiny, trio, wait_idle  # noqa: F401
from tests.unit.test_guided_engine import EOS, VOCAB
from tests.unit.test_guided_engine import TOKENIZER as GUIDED_TOKENIZER


def test_llguidance_first_token_the_grammar_forbids_is_internal_not_the_spec(trio) -> None:  # noqa: F811
    """As test_a_first_token_the_grammar_forbids_fails_only_that_request, on llguidance: a token
    the grammar forbids is the engine's fault (internal), never the client's spec hitting a limit
    (found by review: llguidance's parser error read as a spec limit, INVALID_ARGUMENT)."""
    _, prefill, decode, _ = trio
    plain = request("f", PROMPTS[2], None, 0.0, logprobs=False)
    handoff = run(prefill, plain)
    first_text = TOKENIZER.decode([first_sampled_token(handoff.prefill).token_id])
    forbidden = next(c for c in "xyz" if not first_text.startswith(c)) * 3
    guided = replace(plain, guided=GuidedSpec("choice", choices=(forbidden,), backend="llguidance"))
    forged = replace(handoff.prefill, attributes={**handoff.prefill.attributes,
                                                  "first_token_options": first_token_options(guided, "xgrammar")})
    result = run(decode, replace(guided, kv=KvParams(session=forged)))
    assert result.error is not None and result.error.code == "internal", result.error
    assert "grammar rejected token" in result.error.message, result.error
    for engine in (prefill, decode):
        wait_idle(engine)


def test_a_stop_token_where_the_grammar_cannot_end_is_a_rejection_not_a_limit() -> None:
    compiler = GuideCompiler(GUIDED_TOKENIZER, VOCAB, (EOS,), GuidedConfig())
    try:
        guide = compiler.compile(GuidedSpec("regex", "a", backend="llguidance"))
        early = guide.new_matcher()
        assert not early.accept_token(EOS) and early.error() == "", early.error()
        done = guide.new_matcher()
        assert done.accept_token(GUIDED_TOKENIZER.convert_tokens_to_ids("a"))
        assert done.accept_token(EOS) and done.is_terminated()
    finally:
        compiler.close()
