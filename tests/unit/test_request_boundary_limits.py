"""Boundary tests for the request boundary (RULES G1-G8, L4, K5, M3, X1), without a model or a
server: each check is pinned on both sides of its limit (a value equal to the limit, one past it),
and proto3 presence is pinned (a present default value vs an unset optional field). The oracle is
RULES.md and the documented (ref) choices of the modules' docstrings, restated here by hand.

Found by a mutation run: every ``_require`` in engine/validation.py could be deleted or have its
comparison flipped (``<=`` -> ``<``) with the unit tests still green, and the edge checks of
server/validation.py (check_features, check_model, candidate and message-size checks) are reached
only by the loopback integration tests, whose invalid cases sit far from every boundary."""

from __future__ import annotations

import math

import grpc
import pytest
from google.protobuf import struct_pb2

from refengine.engine import validation as ev
from refengine.engine.validation import Limits
from refengine.protocol import oe
from refengine.server import validation as sv
from refengine.server.capabilities import Capabilities
from refengine.server.convert import (
    StreamSettings,
    detokenize_of,
    media_input,
    session_ref,
    session_spec,
    stream_settings,
    to_engine_request,
)
from refengine.server.errors import Rejection
from refengine.server.metadata import RequestMetadata
from refengine.types import (
    CandidateSpec,
    GenerationRequest,
    GuidedSpec,
    InvalidRequestError,
    KvParams,
    LogprobParams,
    SamplingParams,
    StoppingParams,
)

VOCAB, CONTEXT, MAX_SEQS, MAX_LOGPROBS = 100, 32, 4, 5
LIMITS = Limits(vocab_size=VOCAB, max_model_len=CONTEXT, max_sequences_per_request=MAX_SEQS,
                max_logprobs=MAX_LOGPROBS)


def _req(**fields: object) -> GenerationRequest:
    fields.setdefault("prompt_token_ids", [1, 2, 3])
    return GenerationRequest("r", **fields)


def _engine_checks(request: GenerationRequest, prompt: list[int] | None = None) -> int:
    """What ``InputProcessor`` runs, in its order; returns the resolved max_tokens."""
    ev.validate_inputs(request)
    ev.validate_sampling(request, LIMITS)
    ev.validate_stopping(request, LIMITS)
    ev.validate_logprobs(request, LIMITS)
    return ev.validate_prompt(request, prompt if prompt is not None else request.prompt_token_ids, LIMITS)


def _ok(request: GenerationRequest, prompt: list[int] | None = None) -> int:
    return _engine_checks(request, prompt)


def _refused(request: GenerationRequest, prompt: list[int] | None = None, match: str = "") -> None:
    with pytest.raises(InvalidRequestError, match=match):
        _engine_checks(request, prompt)


# -- engine: G1 ---------------------------------------------------------------------------------
def test_g1_exactly_one_input_and_a_request_id() -> None:
    _ok(_req())
    _ok(GenerationRequest("r", prompt="hi"), prompt=[5])
    _refused(GenerationRequest("r"), prompt=[5], match="exactly one")
    _refused(GenerationRequest("r", prompt="hi", prompt_token_ids=[5]), match="exactly one")
    _refused(GenerationRequest("", prompt_token_ids=[5]), match="request_id")


# -- engine: G4, G5 -----------------------------------------------------------------------------
ACCEPTED_SAMPLING = [
    dict(temperature=0.0), dict(temperature=1e-9), dict(top_p=1.0), dict(top_p=1e-9), dict(top_k=-1),
    dict(top_k=0), dict(top_k=1), dict(min_p=0.0), dict(min_p=1.0), dict(repetition_penalty=1e-9),
    dict(frequency_penalty=-1e30), dict(presence_penalty=1e30), dict(num_sequences=1),
    dict(num_sequences=MAX_SEQS), dict(seed=0), dict(seed=2**64 - 1), dict(seed=None),
]
REFUSED_SAMPLING = [
    (dict(temperature=-1e-9), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.0000001), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(min_p=-1e-9), "min_p"), (dict(min_p=1.0000001), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(num_sequences=0), "num_sequences"), (dict(num_sequences=MAX_SEQS + 1), "num_sequences"),
    (dict(seed=2**64), "seed"), (dict(seed=-1), "seed"),
    *[(dict(**{name: value}), name) for name in ("temperature", "top_p", "min_p", "frequency_penalty",
                                                  "presence_penalty", "repetition_penalty")
      for value in (math.inf, -math.inf, math.nan)],
]


def test_g5_a_non_number_is_an_invalid_request_not_a_crash() -> None:
    """Every check raises InvalidRequestError (the module's docstring): an in-process caller's
    string or None must not escape as a TypeError from math.isfinite."""
    for value in ("0.5", None):
        _refused(_req(sampling=SamplingParams(temperature=value)), match="temperature must be a finite number")


@pytest.mark.parametrize("fields", ACCEPTED_SAMPLING, ids=str)
def test_g5_sampling_boundaries_accepted(fields: dict) -> None:
    _ok(_req(sampling=SamplingParams(**fields)))


@pytest.mark.parametrize("fields,name", REFUSED_SAMPLING, ids=str)
def test_g5_sampling_boundaries_refused(fields: dict, name: str) -> None:
    _refused(_req(sampling=SamplingParams(**fields)), match=name)


# -- engine: G6 and the stop-condition bounds ---------------------------------------------------
ACCEPTED_STOPPING = [
    dict(max_tokens=1), dict(min_tokens=0), dict(max_tokens=5, min_tokens=5),
    dict(stop_strings=("x",) * ev.MAX_STOP_STRINGS),
    dict(stop_token_ids=tuple(range(VOCAB)) * 10 + tuple(range(ev.MAX_STOP_TOKEN_IDS - 10 * VOCAB))),
    dict(stop_strings=("y" * ev.MAX_STOP_STRING_CHARS,)),
    dict(stop_strings=("z" * ev.MAX_STOP_STRING_CHARS,) * (ev.MAX_STOP_CHARS_TOTAL // ev.MAX_STOP_STRING_CHARS)),
    dict(stop_token_ids=(0, VOCAB - 1)),
]
REFUSED_STOPPING = [
    (dict(max_tokens=0), "max_tokens"), (dict(min_tokens=-1), "min_tokens"),
    (dict(max_tokens=5, min_tokens=6), "min_tokens"),
    (dict(stop_strings=("x",) * (ev.MAX_STOP_STRINGS + 1)), "stop strings"),
    (dict(stop_token_ids=(1,) * (ev.MAX_STOP_TOKEN_IDS + 1)), "stop token ids"),
    (dict(stop_strings=("",)), "stop string 0"),
    (dict(stop_strings=("ok", "y" * (ev.MAX_STOP_STRING_CHARS + 1))), "stop string 1"),
    (dict(stop_strings=("z" * ev.MAX_STOP_STRING_CHARS,) * (ev.MAX_STOP_CHARS_TOTAL // ev.MAX_STOP_STRING_CHARS)
      + ("!",)), "in all"),
    (dict(stop_token_ids=(VOCAB,)), "stop token id"), (dict(stop_token_ids=(-1,)), "stop token id"),
]


@pytest.mark.parametrize("fields", ACCEPTED_STOPPING, ids=lambda f: str(f)[:60])
def test_g6_stopping_boundaries_accepted(fields: dict) -> None:
    _ok(_req(stopping=StoppingParams(**fields)))


@pytest.mark.parametrize("fields,match", REFUSED_STOPPING, ids=lambda f: str(f)[:60])
def test_g6_stopping_boundaries_refused(fields: dict, match: str) -> None:
    _refused(_req(stopping=StoppingParams(**fields)), match=match)


def test_the_stop_bounds_are_the_documented_numbers() -> None:
    assert (ev.MAX_STOP_STRINGS, ev.MAX_STOP_STRING_CHARS, ev.MAX_STOP_CHARS_TOTAL, ev.MAX_STOP_TOKEN_IDS) == \
        (1024, 1024, 16384, 1024)


# -- engine: L4 candidates, prompt_logprob_start ------------------------------------------------
@pytest.mark.parametrize("which", ["prompt_candidates", "output_candidates"])
def test_l4_candidate_boundaries(which: str) -> None:
    def lp(spec: CandidateSpec) -> GenerationRequest:
        return _req(logprobs=LogprobParams(**{which: spec}))

    for spec in (CandidateSpec("top_n", top_n=1), CandidateSpec("top_n", top_n=MAX_LOGPROBS), CandidateSpec("all"),
                 CandidateSpec("token_ids", token_ids=(0, VOCAB - 1)), CandidateSpec("token_ids", token_ids=(7,))):
        _ok(lp(spec))
    for spec, match in ((CandidateSpec("top_n", top_n=0), "top_n"),
                        (CandidateSpec("top_n", top_n=MAX_LOGPROBS + 1), "top_n"),
                        (CandidateSpec("token_ids", token_ids=()), "at least one"),
                        (CandidateSpec("token_ids", token_ids=(3, 3)), "more than once"),
                        (CandidateSpec("token_ids", token_ids=(VOCAB,)), "vocabulary"),
                        (CandidateSpec("token_ids", token_ids=(-1,)), "vocabulary")):
        _refused(lp(spec), match=match)


def test_l4_top_n_on_a_server_returning_no_candidates_says_so() -> None:
    """--max-logprobs 0: a top_n request is refused saying the server returns none, not that
    top_n must be in [1, 0] (found by review)."""
    request = _req(logprobs=LogprobParams(output_candidates=CandidateSpec("top_n", top_n=1)))
    with pytest.raises(InvalidRequestError, match=r"returns no candidates \(--max-logprobs 0\)"):
        ev.validate_logprobs(request, Limits(VOCAB, CONTEXT, MAX_SEQS, max_logprobs=0))


def test_prompt_logprob_start_bounds() -> None:
    prompt = [1, 2, 3, 4]
    _refused(_req(logprobs=LogprobParams(prompt_logprob_start=-1)), match="prompt_logprob_start")
    for asks in (dict(prompt_logprobs=True), dict(prompt_candidates=CandidateSpec("top_n", top_n=1))):
        _ok(_req(prompt_token_ids=prompt, logprobs=LogprobParams(prompt_logprob_start=len(prompt) - 1, **asks)))
        _refused(_req(prompt_token_ids=prompt, logprobs=LogprobParams(prompt_logprob_start=len(prompt), **asks)),
                 match="must be < the prompt length")
    # (ref) a start past the prompt selects nothing when no PromptOutput is asked for
    _ok(_req(prompt_token_ids=prompt, logprobs=LogprobParams(prompt_logprob_start=99, output_logprobs=True)))


def test_max_prompt_positions_bound() -> None:
    prompt = list(range(1, 11))  # 10 positions
    for asks in (dict(prompt_logprobs=True), dict(prompt_candidates=CandidateSpec("all"))):
        _ok(_req(prompt_token_ids=prompt, logprobs=LogprobParams(max_prompt_positions=10, **asks)))
        _ok(_req(prompt_token_ids=prompt, logprobs=LogprobParams(max_prompt_positions=7, prompt_logprob_start=3,
                                                                   **asks)))
        _refused(_req(prompt_token_ids=prompt, logprobs=LogprobParams(max_prompt_positions=9, **asks)),
                 match="positions")
        _refused(_req(prompt_token_ids=prompt, logprobs=LogprobParams(max_prompt_positions=6, prompt_logprob_start=3,
                                                                        **asks)), match="positions")
    _ok(_req(prompt_token_ids=prompt, logprobs=LogprobParams(max_prompt_positions=0)))  # nothing asked: no limit


# -- engine: G7 ---------------------------------------------------------------------------------
def test_g7_prompt_token_ids_bounds() -> None:
    _refused(_req(prompt_token_ids=[]), match="empty")
    _ok(_req(prompt_token_ids=[0, VOCAB - 1]))
    _refused(_req(prompt_token_ids=[1, VOCAB]), match="vocabulary")
    _refused(_req(prompt_token_ids=[-1]), match="vocabulary")
    _refused(_req(prompt_token_ids=[1, 2.0]), match="vocabulary")  # an in-process caller's float: not a token id


def test_g7_context_bounds_and_the_resolved_max_tokens() -> None:
    longest = [1] * (CONTEXT - 1)
    assert _ok(_req(prompt_token_ids=longest)) == 1  # unset max_tokens = what the context leaves
    assert _ok(_req(prompt_token_ids=[1, 2, 3])) == CONTEXT - 3
    _refused(_req(prompt_token_ids=[1] * CONTEXT), match="context limit")
    assert _ok(_req(stopping=StoppingParams(max_tokens=CONTEXT - 3))) == CONTEXT - 3  # prompt + max = limit
    _refused(_req(stopping=StoppingParams(max_tokens=CONTEXT - 2)), match="exceeds the context limit")
    # G6 against the resolved limit of an unset max_tokens
    assert _ok(_req(stopping=StoppingParams(min_tokens=CONTEXT - 3))) == CONTEXT - 3
    _refused(_req(stopping=StoppingParams(min_tokens=CONTEXT - 2)), match="exceeds what the context leaves")
    assert ev.validate_context(_req(), CONTEXT - 1, LIMITS) == 1
    with pytest.raises(InvalidRequestError):
        ev.validate_context(_req(), CONTEXT, LIMITS)


# -- server: validate_generate, check_model, check_role -----------------------------------------
CAPS = Capabilities(served_model_name="m", model_id="org/m", max_context_length=CONTEXT, vocab_size=VOCAB,
                    max_num_sequences=MAX_SEQS, max_top_n=MAX_LOGPROBS, guided_modes=("regex",),
                    served_model_aliases=("alias",))
FACTS = sv.ServerFacts(role="aggregated", caps=CAPS, max_send_message_bytes=1 << 20, max_media_items=2)


def _code(call, *args) -> grpc.StatusCode | None:  # noqa: ANN001
    try:
        call(*args)
    except Rejection as exc:
        assert exc.message
        return exc.code
    return None


INVALID, NOT_FOUND, PRECONDITION = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                                    grpc.StatusCode.FAILED_PRECONDITION)


def _gen(**fields: object) -> oe.GenerateRequest:
    fields.setdefault("request_id", "r")
    fields.setdefault("prompt", "hi")
    return oe.GenerateRequest(**fields)


def test_request_id_bytes_bound() -> None:
    assert sv.MAX_REQUEST_ID_BYTES == 1024
    assert _code(sv.validate_generate, _gen(request_id="é" * 512), RequestMetadata(), FACTS) is None  # 1,024 bytes
    assert _code(sv.validate_generate, _gen(request_id="a" * 1025), RequestMetadata(), FACTS) is INVALID
    assert _code(sv.validate_generate, _gen(request_id="é" * 512 + "a"), RequestMetadata(), FACTS) is INVALID
    assert _code(sv.validate_generate, _gen(request_id=""), RequestMetadata(), FACTS) is INVALID


@pytest.mark.parametrize(("salt", "ok"), [(None, True), ("", True), ("s" * 1024, True), ("\U0001F600" * 256, True),
                                         ("s" * 1025, False), ("\U0001F600" * 256 + "s", False),
                                         ("é" * 300, True), ("é" * 513, False)])
def test_cache_salt_bytes_bound(salt: str | None, ok: bool) -> None:
    """ref: ``kv.cache_salt`` is at most 1,024 UTF-8 bytes (K2 sets no bound; the salt goes into
    every block key, BlockStored event and encoder-cache key), counted in bytes, not characters."""
    assert ev.MAX_CACHE_SALT_BYTES == 1024
    request = _req(kv=KvParams(cache_salt=salt))
    if ok:
        ev.validate_inputs(request)
    else:
        with pytest.raises(InvalidRequestError, match=rf"kv\.cache_salt is {len(salt.encode())} bytes; at most 1024"):
            ev.validate_inputs(request)


def test_g3_model_names() -> None:
    for name in ("", "m", "alias"):
        assert _code(sv.validate_generate, _gen(model=name), RequestMetadata(), FACTS) is None
    for name in ("org/m", "M", "mx"):
        assert _code(sv.validate_generate, _gen(model=name), RequestMetadata(), FACTS) is NOT_FOUND


def _session(**fields: object) -> oe.KvSessionRef:
    base = dict(session_id="s", transfer_backend="kvpull", dp_rank=0,
                endpoints=[oe.KvEndpoint(host="10.0.0.1", port=5000, protocol="grpc")])
    base.update(fields)
    return oe.KvSessionRef(**base)


@pytest.mark.parametrize("fields,ok", [
    (dict(), True),
    (dict(endpoints=[oe.KvEndpoint(host="10.0.0.1", port=65535, protocol="grpc")]), True),
    (dict(endpoints=[oe.KvEndpoint(host="10.0.0.1", port=1, protocol="nixl")]), True),
    (dict(endpoints=[oe.KvEndpoint(host="10.0.0.1", port=65536, protocol="grpc")]), False),
    (dict(endpoints=[oe.KvEndpoint(host="10.0.0.1", port=0, protocol="grpc")]), False),
    (dict(endpoints=[oe.KvEndpoint(host="0.0.0.0", port=5000, protocol="grpc")]), False),
    (dict(endpoints=[oe.KvEndpoint(host="10.0.0.1", port=5000, protocol="tcp")]), False),
    (dict(endpoints=[oe.KvEndpoint(host="10.0.0.1", port=5000, protocol="tcp"),
                     oe.KvEndpoint(host="10.0.0.2", port=5000, protocol="grpc")]), True),
    (dict(endpoints=[]), False),
    (dict(session_id=""), False),
    (dict(transfer_backend="other"), False),
    (dict(dp_rank=1), False),
])
def test_k5_decode_session_checks(fields: dict, ok: bool) -> None:
    request = _gen()
    request.kv.session.CopyFrom(_session(**fields))
    code = _code(sv.check_role, request, "decode", RequestMetadata(), ("kvpull",))
    assert code is (None if ok else INVALID)


def test_m3_k6_role_checks() -> None:
    request = _gen()
    request.kv.session.CopyFrom(_session())
    assert _code(sv.check_role, request, "decode", RequestMetadata(target_dp_rank=0), ("kvpull",)) is None
    assert _code(sv.check_role, request, "decode", RequestMetadata(target_dp_rank=1), ("kvpull",)) is INVALID
    assert _code(sv.check_role, request, "aggregated", RequestMetadata(), ()) is PRECONDITION  # K6
    assert _code(sv.check_role, request, "prefill", RequestMetadata(), ()) is PRECONDITION
    assert _code(sv.check_role, _gen(), "encoder", RequestMetadata(), ()) is PRECONDITION
    assert _code(sv.check_role, _gen(), "aggregated", RequestMetadata(), ()) is None
    for role, said in (("aggregated", "an aggregated server"), ("prefill", "a prefill server")):
        with pytest.raises(Rejection, match=f"this is {said};"):
            sv.check_role(request, role, RequestMetadata(), ())
    with pytest.raises(Rejection, match="must carry kv.session") as info:  # K5: says what is missing
        sv.check_role(_gen(), "decode", RequestMetadata(), ("kvpull",))
    assert info.value.code is INVALID


# -- server: D4 check_features ------------------------------------------------------------------
def _features(request: oe.GenerateRequest, **caps: object) -> grpc.StatusCode | None:
    from dataclasses import replace
    return _code(sv.check_features, request, replace(CAPS, **caps))


def test_d4_inputs_and_guided() -> None:
    assert _features(oe.GenerateRequest(request_id="r")) is INVALID  # G1
    assert _features(_gen(prompt="")) is None  # an empty prompt is still the one input set (oneof presence)
    assert _features(_gen(), text_input=False) is INVALID
    assert _features(_gen(), token_ids_input=False) is None
    assert _features(oe.GenerateRequest(request_id="r", token_ids=oe.TokenIds(ids=[1])), token_ids_input=False) \
        is INVALID
    assert _features(oe.GenerateRequest(request_id="r", token_ids=oe.TokenIds(ids=[1])), text_input=False) is None
    guided = _gen()
    guided.guided.SetInParent()  # present but empty: no guide asked for
    assert _features(guided) is None
    guided.guided.backend = "xgrammar"
    assert _features(guided) is INVALID  # a backend without a guide
    guided.guided.regex = "[a-z]+"
    assert _features(guided) is None
    guided.guided.json_schema = "{}"
    assert _features(guided) is INVALID  # not advertised


def test_g4_num_sequences_presence_at_the_edge() -> None:
    request = _gen()
    assert _features(request) is None
    request.sampling.num_sequences = 0  # present 0 (proto3 optional): refused, never read as "unset = 1"
    assert request.sampling.HasField("num_sequences") and _features(request) is INVALID
    request.sampling.num_sequences = 1
    assert _features(request) is None


def test_d4_logprob_and_kv_features() -> None:
    r = _gen()
    r.response.return_prompt_logprobs = True
    assert _features(r) is None and _features(r, prompt_logprobs=False) is INVALID
    r = _gen()
    r.response.return_output_logprobs = True
    assert _features(r) is None and _features(r, output_logprobs=False) is INVALID
    r = _gen()
    r.response.return_output_logprobs = False  # present false asks for nothing
    assert _features(r, output_logprobs=False) is None
    for name in ("prompt_candidates", "output_candidates"):
        r = _gen()
        getattr(r.response, name).SetInParent()  # set, selecting nothing
        assert _features(r) is INVALID
        getattr(r.response, name).top_n = 2
        assert _features(r) is None and _features(r, candidate_modes=("all",)) is INVALID
    r = _gen()
    r.stopping.include_stop_in_output = True
    assert _features(r) is None and _features(r, stop_in_output=False) is INVALID
    r = _gen()
    r.kv.cache_salt = ""  # present, even empty
    assert _features(r) is None and _features(r, cache_salt=False) is INVALID
    r = _gen()
    r.kv.bypass_prefix_cache = True
    assert _features(r) is None and _features(r, prefix_cache_bypass=False) is INVALID
    assert _features(_gen(), stop_in_output=False, cache_salt=False, prefix_cache_bypass=False,
                     prompt_logprobs=False, output_logprobs=False) is None


# -- server: G19 count, message-size limits -----------------------------------------------------
def test_media_count_bound() -> None:
    r = _gen()
    r.media.extend([oe.MediaItem(modality=oe.MODALITY_IMAGE)] * 2)
    assert _code(sv.check_media_count, r, 2) is None
    assert _code(sv.check_media_count, _gen(), 0) is None  # no media, no handles: fits even a limit of 0
    r.media.add(modality=oe.MODALITY_IMAGE)
    assert _code(sv.check_media_count, r, 2) is INVALID
    from refengine.server.media_wire import EXTRA_MEDIA_HANDLES
    for count, code in ((2, None), (3, INVALID)):
        r = _gen()
        r.extra.update({EXTRA_MEDIA_HANDLES: [{}] * count})
        assert _code(sv.check_media_count, r, 2) is code


def _facts(limit: int) -> sv.ServerFacts:
    return sv.ServerFacts(role="aggregated", caps=CAPS, max_send_message_bytes=limit)


def test_output_candidates_message_size_bound() -> None:
    per = lambda n: sv.TOKEN_INFO_BYTES + sv.CANDIDATE_BYTES * n  # noqa: E731
    r = _gen()
    r.response.output_candidates.token_ids.ids.extend([1, 2, 3])
    assert _code(sv.check_response_sizes, r, _facts(per(3))) is None  # exactly the limit
    assert _code(sv.check_response_sizes, r, _facts(per(3) - 1)) is INVALID
    r = _gen()
    r.response.output_candidates.top_n = 3
    assert _code(sv.check_response_sizes, r, _facts(per(3))) is None
    assert _code(sv.check_response_sizes, r, _facts(per(3) - 1)) is INVALID
    r = _gen()
    r.response.output_candidates.all.SetInParent()
    assert _code(sv.check_response_sizes, r, _facts(per(VOCAB))) is None
    assert _code(sv.check_response_sizes, r, _facts(per(VOCAB) - 1)) is INVALID
    r = _gen()
    r.response.output_candidates.SetInParent()  # selects nothing (check_features refuses it): 0 candidates
    assert _code(sv.check_response_sizes, r, _facts(per(0))) is None
    assert _code(sv.check_response_sizes, _gen(), _facts(1)) is None  # no candidates asked: nothing to check


def test_prompt_positions_limit() -> None:
    per = sv.TOKEN_INFO_BYTES + sv.CANDIDATE_BYTES * 2
    r = _gen()
    assert sv.prompt_positions_limit(r, _facts(1)) is None  # no prompt output asked for
    r.response.return_prompt_logprobs = True  # logprobs alone: each position is a TokenInfo (found by review)
    assert sv.prompt_positions_limit(r, _facts(CONTEXT * sv.TOKEN_INFO_BYTES)) is None
    assert sv.prompt_positions_limit(r, _facts(3 * sv.TOKEN_INFO_BYTES + 1)) == 3
    r.response.prompt_candidates.top_n = 2
    assert sv.prompt_positions_limit(r, _facts(CONTEXT * per)) is None  # the whole context fits exactly
    assert sv.prompt_positions_limit(r, _facts(CONTEXT * per - 1)) == CONTEXT - 1
    assert sv.prompt_positions_limit(r, _facts(3 * per + per - 1)) == 3
    r.response.prompt_candidates.all.SetInParent()
    vocab_per = sv.TOKEN_INFO_BYTES + sv.CANDIDATE_BYTES * VOCAB
    assert sv.prompt_positions_limit(r, _facts(5 * vocab_per)) == 5


# -- convert: G8 extra, presence ----------------------------------------------------------------
def _extra(**values: object) -> struct_pb2.Struct:
    extra = struct_pb2.Struct()
    extra.update({key.replace("__", "."): value for key, value in values.items()})
    return extra


def test_g8_stream_settings_bounds() -> None:
    server = StreamSettings(stream_buffer=8, stall_timeout_seconds=5.0)
    ok = [({"refengine.stream_buffer": 8}, StreamSettings(8, 5.0)),
          ({"refengine.stream_buffer": 1}, StreamSettings(1, 5.0)),
          ({"refengine.stall_timeout_seconds": 5.0}, StreamSettings(8, 5.0)),
          ({"refengine.stall_timeout_seconds": 1e-9}, StreamSettings(8, 1e-9))]
    for values, expected in ok:
        extra = struct_pb2.Struct()
        extra.update(values)
        got = stream_settings(extra, server)
        assert got == expected and type(got.stream_buffer) is int
    for values in ({"refengine.stream_buffer": 0}, {"refengine.stream_buffer": -1},
                   {"refengine.stall_timeout_seconds": 5.000001}, {"refengine.stall_timeout_seconds": -1},
                   {"refengine.stall_timeout_seconds": float("nan")}, {"refengine.stream_buffer": "2"}):
        extra = struct_pb2.Struct()
        extra.update(values)
        with pytest.raises(Rejection) as info:
            stream_settings(extra, server)
        assert info.value.code is INVALID


def test_g8_detokenize() -> None:
    assert detokenize_of(struct_pb2.Struct()) is True
    for value in (True, False):
        extra = struct_pb2.Struct()
        extra.update({"detokenize": value})
        assert detokenize_of(extra) is value
        assert to_engine_request(_gen(extra=extra), RequestMetadata()).detokenize is value
    extra = struct_pb2.Struct()
    extra.update({"detokenize": 0})
    with pytest.raises(Rejection):
        detokenize_of(extra)


def test_sampling_presence_keeps_present_defaults() -> None:
    """Present proto3 defaults (0) reach the engine as 0, never as the engine's defaults."""
    r = _gen()
    for name in ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                 "repetition_penalty", "seed", "num_sequences"):
        setattr(r.sampling, name, 0)
    s = to_engine_request(r, RequestMetadata()).sampling
    assert s == SamplingParams(temperature=0, top_p=0, top_k=0, min_p=0, frequency_penalty=0, presence_penalty=0,
                               repetition_penalty=0, seed=0, num_sequences=0)
    assert to_engine_request(_gen(), RequestMetadata()).sampling == SamplingParams()


def test_stopping_and_response_mapping() -> None:
    r = _gen()
    r.stopping.max_tokens = 0  # present 0 is 0 (the engine refuses it), not "to the limit"
    r.stopping.min_tokens = 3
    r.stopping.ignore_eos = True
    r.stopping.include_stop_in_output = True
    r.stopping.conditions.add(stop_text="B")
    r.stopping.conditions.add(stop_token_id=0)
    r.stopping.conditions.add(stop_text="A")
    r.response.return_prompt_logprobs = True
    r.response.prompt_logprob_start = 2
    r.response.prompt_candidates.token_ids.ids.extend([4, 5])
    r.response.output_candidates.top_n = 3
    params = to_engine_request(r, RequestMetadata(priority=-2), max_prompt_positions=7)
    assert params.stopping == StoppingParams(max_tokens=0, min_tokens=3, stop_strings=("B", "A"),
                                             stop_token_ids=(0,), ignore_eos=True, include_stop_in_output=True)
    assert params.logprobs == LogprobParams(prompt_logprobs=True, prompt_logprob_start=2, max_prompt_positions=7,
                                            prompt_candidates=CandidateSpec("token_ids", token_ids=(4, 5)),
                                            output_candidates=CandidateSpec("top_n", top_n=3))
    assert params.priority == -2
    r = _gen()
    r.response.output_candidates.token_ids.SetInParent()  # present, empty: kept, so the engine refuses it
    r.response.prompt_candidates.all.SetInParent()
    params = to_engine_request(r, RequestMetadata())
    assert params.logprobs.output_candidates == CandidateSpec("token_ids", token_ids=())
    assert params.logprobs.prompt_candidates == CandidateSpec("all")
    assert params.priority == 0 and params.lora_name is None and params.kv.cache_salt is None
    assert params.stopping.max_tokens is None
    r = _gen(lora_name="a", kv=oe.KvOptions(cache_salt="s", bypass_prefix_cache=True))
    params = to_engine_request(r, RequestMetadata())
    assert params.lora_name == "a" and params.kv.cache_salt == "s" and params.kv.bypass_prefix_cache


def test_g6_an_empty_condition_names_its_position() -> None:
    r = _gen()
    r.stopping.conditions.add(stop_text="x")
    r.stopping.conditions.add()
    with pytest.raises(Rejection, match=r"conditions\[1\]") as info:
        to_engine_request(r, RequestMetadata())
    assert info.value.code is INVALID


def test_inputs_guided_and_media_mapping() -> None:
    params = to_engine_request(oe.GenerateRequest(request_id="r", token_ids=oe.TokenIds(ids=[3, 4])),
                               RequestMetadata())
    assert params.prompt is None and params.prompt_token_ids == [3, 4]
    params = to_engine_request(_gen(prompt=""), RequestMetadata())
    assert params.prompt == "" and params.prompt_token_ids is None
    r = _gen()
    r.guided.choice.choices.extend(["a", "b"])
    r.guided.backend = "xgrammar"
    g = to_engine_request(r, RequestMetadata()).guided
    assert (g.mode, g.choices, g.backend) == ("choice", ("a", "b"), "xgrammar")
    r = _gen()
    r.guided.regex = "[a-z]"
    g = to_engine_request(r, RequestMetadata()).guided
    assert (g.mode, g.spec) == ("regex", "[a-z]")
    r = _gen()
    r.guided.json_object.SetInParent()
    r.guided.backend = "llguidance"
    assert to_engine_request(r, RequestMetadata()).guided == GuidedSpec("json_object", backend="llguidance")
    r = _gen()
    r.guided.SetInParent()
    assert to_engine_request(r, RequestMetadata()).guided is None
    item = media_input(oe.MediaItem(modality=oe.MODALITY_VIDEO, raw_bytes=b"x", mime_type="video/mp4", uuid="u"))
    assert (item.modality, item.url, item.data_uri, item.raw_bytes, item.mime_type, item.uuid) == \
        ("video", None, None, b"x", "video/mp4", "u")
    item = media_input(oe.MediaItem(modality=oe.MODALITY_IMAGE, data_uri="data:image/png;base64,AA=="))
    assert (item.modality, item.url, item.data_uri, item.raw_bytes) == \
        ("image", None, "data:image/png;base64,AA==", None)
    item = media_input(oe.MediaItem(modality=oe.MODALITY_IMAGE, url=""))  # set, empty: still the url source
    assert (item.url, item.data_uri, item.raw_bytes) == ("", None, None)
    assert media_input(oe.MediaItem(modality=7)).modality == "modality 7"  # X4: unknown enum value kept visible


def test_k9_session_round_trip() -> None:
    ref = _session(dp_rank=0)
    ref.attributes_struct.update({"big": str(2**60), "n": 3, "nested": {"a": [1, "x"]}})
    spec = session_spec(ref)
    assert spec.session_id == "s" and spec.transfer_backend == "kvpull" and spec.dp_rank == 0
    assert [(e.host, e.port, e.protocol) for e in spec.endpoints] == [("10.0.0.1", 5000, "grpc")]
    back = session_ref(spec, spec.endpoints)
    assert back == ref


def test_validate_generate_runs_every_edge_check() -> None:
    """Each check is wired into validate_generate (the one entry the server calls)."""
    facts = sv.ServerFacts(role="aggregated", caps=CAPS, max_send_message_bytes=sv.TOKEN_INFO_BYTES, max_media_items=1)
    meta = RequestMetadata()
    assert _code(sv.validate_generate, _gen(), meta, facts) is None
    session = _gen()
    session.kv.session.CopyFrom(_session())
    assert _code(sv.validate_generate, session, meta, facts) is PRECONDITION  # check_role (K6)
    assert _code(sv.validate_generate, oe.GenerateRequest(request_id="r"), meta, facts) is INVALID  # check_features
    media = _gen()
    media.media.extend([oe.MediaItem(modality=oe.MODALITY_IMAGE)] * 2)
    assert _code(sv.validate_generate, media, meta, facts) is INVALID  # check_media_count
    sizes = _gen()
    sizes.response.output_candidates.top_n = 1
    assert _code(sv.validate_generate, sizes, meta, facts) is INVALID  # check_response_sizes
