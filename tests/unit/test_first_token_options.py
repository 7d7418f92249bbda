"""The guided backend in a disaggregated request's first-token options is the one that ran the
grammar (``first_token_options``): a request naming none is compiled by its server's default.
Found by review: the name was compared as written, so a prefill request naming none and a decode
request naming that default were refused, and two servers with different defaults were not."""

from __future__ import annotations

from refengine.engine.first_token_options import first_option_differing, first_token_options
from refengine.types import GenerationRequest, GuidedSpec


def guided(backend: str) -> GenerationRequest:
    return GenerationRequest("r", prompt_token_ids=[1, 2], guided=GuidedSpec("regex", "[a-c]+", backend=backend))


def test_no_backend_named_is_the_servers_default() -> None:
    prefill = first_token_options(guided(""), "xgrammar")
    assert first_option_differing(prefill, first_token_options(guided("xgrammar"), "llguidance")) is None
    assert first_option_differing(prefill, first_token_options(guided(""), "xgrammar")) is None


def test_different_defaults_ran_different_backends() -> None:
    prefill = first_token_options(guided(""), "xgrammar")
    assert first_option_differing(prefill, first_token_options(guided(""), "llguidance")) == "guided"
    assert first_option_differing(prefill, first_token_options(guided("llguidance"), "xgrammar")) == "guided"
