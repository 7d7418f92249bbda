"""What shaped a disaggregated request's first token: recorded by the prefill engine in the KV
session (``first_token_options``) and compared by the decode engine before it accepts.

The prefill engine samples the first token, with its logprob, rank and candidates, under the
prefill request's options; the decode engine emits that token as its own first. A decode request
whose options differ would get a first token drawn under other rules: without the logprob it
asked for, with more candidates than its ``top_n``, outside its grammar (found by review: each
happened, the last as an INTERNAL error after acceptance). So every option that shapes the first
draw or its reported info must match, else INVALID_ARGUMENT naming it:

- sampling: temperature, top_p, top_k, min_p, the three penalties, and the seed where it draws
  (temperature > 0: a greedy first token is the same under any seed);
- the ids masked at the first draw: with ``min_tokens`` > 0, the stop token ids and EOS (unless
  ``ignore_eos``); with ``min_tokens`` 0, none, whatever those are;
- output logprobs and the candidate selection;
- the guided-decoding spec (mode, text, choices, and the backend that ran it: a request naming
  none is compiled by its server's default, so "" on one side and that default named on the
  other are the same, and "" on both sides with different defaults is not; found by review).

Stop strings, ``max_tokens`` and the rest of stopping apply on the decode side, to the first token
too, and may differ. So may ``kv.cache_salt`` (a choice, questioned by review): the KV does not
depend on it, and each server's salt scopes its own prefix cache only, so the decode server files
the pulled blocks under the decode request's salt. The dict is JSON as a protobuf ``Struct``
carries it: the seed (up to 2^64) as a decimal string, everything else a number, string, list or
null.
"""

from __future__ import annotations

from typing import Any

from refengine.types import CandidateSpec, GenerationRequest


def first_token_options(params: GenerationRequest, default_guided_backend: str) -> dict[str, Any]:
    s, st, lp = params.sampling, params.stopping, params.logprobs
    masked = None if st.min_tokens == 0 else {"stop_token_ids": sorted(set(st.stop_token_ids)),
                                               "ignore_eos": st.ignore_eos}
    guided = params.guided
    return {
        "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "min_p": s.min_p,
        "frequency_penalty": s.frequency_penalty, "presence_penalty": s.presence_penalty,
        "repetition_penalty": s.repetition_penalty,
        "seed": None if s.seed is None or s.temperature == 0 else str(s.seed),
        "masked_at_first_draw": masked,
        "output_logprobs": lp.output_logprobs,
        "output_candidates": _candidates(lp.output_candidates),
        "guided": None if guided is None else {"mode": guided.mode, "spec": guided.spec,
                                               "choices": list(guided.choices),
                                               "backend": guided.backend or default_guided_backend},
    }


def _candidates(spec: CandidateSpec | None) -> dict[str, Any] | None:
    return None if spec is None else {"mode": spec.mode, "top_n": spec.top_n, "token_ids": list(spec.token_ids)}


def first_option_differing(recorded: dict[str, Any], wanted: dict[str, Any]) -> str | None:
    """The first key whose recorded value differs from this request's (numbers compared as
    numbers: a ``Struct`` turns 40 into 40.0), or None."""
    for key, want in wanted.items():
        if recorded.get(key, _ABSENT) != want:
            return key
    return None


_ABSENT = object()
