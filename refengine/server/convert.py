"""``GenerateRequest`` (proto) → ``GenerationRequest`` (engine), every field mapped.

| proto                                   | engine                                           |
|-----------------------------------------|--------------------------------------------------|
| prompt / token_ids.ids                  | prompt / prompt_token_ids                        |
| sampling.* (unset = engine default)     | SamplingParams (num_sequences unset = 1)         |
| stopping.max_tokens (unset = to limit)  | StoppingParams.max_tokens                        |
| stopping.conditions stop_text / id      | stop_strings / stop_token_ids (order kept)       |
| stopping.min_tokens/ignore_eos/include_stop_in_output | same names                         |
| response.return_*_logprobs, *_candidates| LogprobParams (top_n 0 = no candidates, ref)     |
| response.prompt_logprob_start           | LogprobParams.prompt_logprob_start               |
| kv.bypass_prefix_cache / kv.cache_salt  | KvParams ("" salt = no salt, ref)                |
| metadata openengine-priority            | GenerationRequest.priority                       |
| extra (Struct)                          | :class:`StreamSettings`, ``detokenize`` (below)  |

``extra`` known keys (G8; anything else is ignored, a wrong type or range is INVALID_ARGUMENT):

- ``refengine.stream_buffer`` (integer ≥ 1): lower this stream's buffer below the server's;
- ``refengine.stall_timeout_seconds`` (number > 0): lower this stream's stall timeout.

Both can only tighten the server's settings, never loosen them.

- ``refengine.v1alpha1.media_handles`` (list): embedding handles of the draft profile
  ``encoder`` filling the prompt's media placeholders (``media_wire.py``, ENC10).

- ``detokenize`` (bool, default true): ``false`` sends token ids only — ``TokenOutput.text``
  and every ``TokenInfo.token`` / candidate ``token`` are empty — and skips detokenization,
  unless the request has stop strings, which are still matched on the (unsent) text. Sent by
  clients that detokenize themselves (e.g. Dynamo's frontend).

| guided.<mode> / guided.backend          | GuidedSpec (mode = the oneof field's name)       |

Rejected here (INVALID_ARGUMENT): an empty ``StopCondition`` (G6). ``media`` items map one to
one, in order, to ``MediaInput`` (no source set: all three None); the engine checks and
decodes them before acceptance (``engine/media.py``). ``lora_name`` (empty = the base
model) is resolved by the engine before acceptance (unknown → NOT_FOUND, R4); a guided spec
is checked and compiled by the engine before acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf import json_format, struct_pb2

from refengine.protocol import oe
from refengine.server.errors import invalid
from refengine.server.media_wire import EXTRA_MEDIA_HANDLES, handles_from_extra
from refengine.server.metadata import RequestMetadata
from refengine.types import (
    CandidateSpec,
    GenerationRequest,
    GuidedSpec,
    KvEndpointSpec,
    KvParams,
    KvSessionSpec,
    LogprobParams,
    MediaInput,
    SamplingParams,
    StoppingParams,
)

EXTRA_STREAM_BUFFER = "refengine.stream_buffer"
EXTRA_STALL_TIMEOUT = "refengine.stall_timeout_seconds"
EXTRA_DETOKENIZE = "detokenize"
GENERATE_EXTRA_KEYS = {EXTRA_STREAM_BUFFER: "number", EXTRA_STALL_TIMEOUT: "number",
                       EXTRA_DETOKENIZE: "bool", EXTRA_MEDIA_HANDLES: "list"}  # key -> JSON type


@dataclass(frozen=True)
class StreamSettings:
    """Per-stream delivery settings: the server's, possibly tightened by ``extra``."""

    stream_buffer: int
    stall_timeout_seconds: float


def _number(extra: struct_pb2.Struct, key: str) -> float | None:
    if key not in extra.fields:
        return None
    value = extra.fields[key]
    if value.WhichOneof("kind") != "number_value":
        raise invalid(f"extra[{key!r}] must be a number, got {value.WhichOneof('kind')}")
    return value.number_value


def stream_settings(extra: struct_pb2.Struct, server: StreamSettings) -> StreamSettings:
    """G8: read the known ``extra`` keys; unknown keys are ignored."""
    buffer = _number(extra, EXTRA_STREAM_BUFFER)
    if buffer is not None and not (buffer.is_integer() and 1 <= buffer <= server.stream_buffer):  # NaN, inf: False
        raise invalid(f"extra[{EXTRA_STREAM_BUFFER!r}] must be an integer in [1, {server.stream_buffer}], "
                      f"got {buffer}")
    stall = _number(extra, EXTRA_STALL_TIMEOUT)
    if stall is not None and not 0 < stall <= server.stall_timeout_seconds:
        raise invalid(f"extra[{EXTRA_STALL_TIMEOUT!r}] must be in (0, {server.stall_timeout_seconds}], "
                      f"got {stall}")
    return StreamSettings(
        stream_buffer=int(buffer) if buffer is not None else server.stream_buffer,
        stall_timeout_seconds=stall if stall is not None else server.stall_timeout_seconds,
    )


def detokenize_of(extra: struct_pb2.Struct) -> bool:
    """G8: ``extra["detokenize"]``, a bool when present; absent = true."""
    if EXTRA_DETOKENIZE not in extra.fields:
        return True
    value = extra.fields[EXTRA_DETOKENIZE]
    if value.WhichOneof("kind") != "bool_value":
        raise invalid(f"extra[{EXTRA_DETOKENIZE!r}] must be a bool, got {value.WhichOneof('kind')}")
    return value.bool_value


_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                    "repetition_penalty", "seed", "num_sequences")


def _sampling(s: oe.SamplingParams) -> SamplingParams:
    """Only the fields the client set; the rest keep the engine's defaults (proto3 presence)."""
    return SamplingParams(**{name: getattr(s, name) for name in _SAMPLING_FIELDS if s.HasField(name)})


def _stopping(st: oe.StoppingOptions) -> StoppingParams:
    stop_strings: list[str] = []
    stop_token_ids: list[int] = []
    for position, condition in enumerate(st.conditions):
        kind = condition.WhichOneof("condition")
        if kind == "stop_text":
            stop_strings.append(condition.stop_text)
        elif kind == "stop_token_id":
            stop_token_ids.append(condition.stop_token_id)
        else:
            raise invalid(f"stopping.conditions[{position}] is empty; set stop_text or stop_token_id")
    return StoppingParams(
        max_tokens=st.max_tokens if st.HasField("max_tokens") else None,
        min_tokens=st.min_tokens,
        stop_strings=tuple(stop_strings),
        stop_token_ids=tuple(stop_token_ids),
        ignore_eos=st.ignore_eos,
        include_stop_in_output=st.include_stop_in_output,
    )


def _candidates(selection: oe.CandidateTokenSelection) -> CandidateSpec | None:
    mode = selection.WhichOneof("selection")
    if mode == "top_n":
        return CandidateSpec("top_n", top_n=selection.top_n) if selection.top_n > 0 else None
    if mode == "token_ids":
        return CandidateSpec("token_ids", token_ids=tuple(selection.token_ids.ids))
    if mode == "all":
        return CandidateSpec("all")
    return None


def _logprobs(r: oe.ResponseOptions, max_prompt_positions: int | None) -> LogprobParams:
    return LogprobParams(
        max_prompt_positions=max_prompt_positions,
        prompt_logprobs=r.return_prompt_logprobs,
        prompt_candidates=_candidates(r.prompt_candidates) if r.HasField("prompt_candidates") else None,
        prompt_logprob_start=r.prompt_logprob_start,
        output_logprobs=r.return_output_logprobs,
        output_candidates=_candidates(r.output_candidates) if r.HasField("output_candidates") else None,
    )


def _guided(g: oe.GuidedDecoding) -> GuidedSpec | None:
    """The validated ``guided`` field (``validation.check_features`` refused a backend with no guide)."""
    mode = g.WhichOneof("guide")
    if mode is None:
        return None
    if mode == "choice":
        return GuidedSpec("choice", choices=tuple(g.choice.choices), backend=g.backend)
    if mode == "json_object":
        return GuidedSpec("json_object", backend=g.backend)
    return GuidedSpec(mode, spec=getattr(g, mode), backend=g.backend)


#: Modality enum → the engine's modality names (G19: order kept, every item mapped; the
#: engine refuses the modalities its model lacks).
MODALITIES = {oe.MODALITY_IMAGE: "image", oe.MODALITY_VIDEO: "video", oe.MODALITY_AUDIO: "audio",
              oe.MODALITY_UNSPECIFIED: "unspecified"}


def media_input(item: oe.MediaItem) -> MediaInput:
    source = item.WhichOneof("source")
    return MediaInput(
        modality=MODALITIES.get(item.modality, f"modality {item.modality}"),
        url=item.url if source == "url" else None,
        data_uri=item.data_uri if source == "data_uri" else None,
        raw_bytes=item.raw_bytes if source == "raw_bytes" else None,
        mime_type=item.mime_type, uuid=item.uuid)


def to_engine_request(request: oe.GenerateRequest, meta: RequestMetadata,
                      max_prompt_positions: int | None = None) -> GenerationRequest:
    """Map a validated ``GenerateRequest``; raises ``Rejection`` for G6's empty condition.
    ``max_prompt_positions``: the edge's message-size limit on prompt logprobs, in positions."""
    kind = request.WhichOneof("input")
    return GenerationRequest(
        request_id=request.request_id,
        prompt=request.prompt if kind == "prompt" else None,
        prompt_token_ids=list(request.token_ids.ids) if kind == "token_ids" else None,
        sampling=_sampling(request.sampling),
        stopping=_stopping(request.stopping),
        logprobs=_logprobs(request.response, max_prompt_positions),
        kv=KvParams(
            bypass_prefix_cache=request.kv.bypass_prefix_cache,
            cache_salt=request.kv.cache_salt or None,
            session=session_spec(request.kv.session) if request.kv.HasField("session") else None,
        ),
        priority=meta.priority or 0,
        guided=_guided(request.guided) if request.HasField("guided") else None,
        detokenize=detokenize_of(request.extra),
        lora_name=request.lora_name or None,
        media=tuple(media_input(item) for item in request.media),
        media_handles=handles_from_extra(request.extra),
        trace=meta.trace.as_metadata() if meta.trace is not None else (),
    )


def session_spec(ref: oe.KvSessionRef) -> KvSessionSpec:
    """``KvSessionRef`` → the engine's ``KvSessionSpec`` (attributes as JSON values, K9). A NaN or
    infinity in ``attributes_struct`` is no JSON value: the session is malformed (K5)."""
    try:
        attributes = json_format.MessageToDict(ref.attributes_struct)
    except ValueError as exc:
        raise invalid(f"kv.session.attributes_struct is not JSON: {exc}") from None
    return KvSessionSpec(
        session_id=ref.session_id,
        transfer_backend=ref.transfer_backend,
        endpoints=tuple(KvEndpointSpec(e.host, e.port, e.protocol) for e in ref.endpoints),
        dp_rank=ref.dp_rank,
        attributes=attributes,
    )


def session_ref(spec: KvSessionSpec, endpoints: tuple[KvEndpointSpec, ...]) -> oe.KvSessionRef:
    """A prefill engine's session, with this server's routable ``endpoints`` (K4, K9)."""
    attributes = struct_pb2.Struct()
    attributes.update(dict(spec.attributes))
    return oe.KvSessionRef(
        session_id=spec.session_id, transfer_backend=spec.transfer_backend,
        endpoints=[oe.KvEndpoint(host=e.host, port=e.port, protocol=e.protocol) for e in endpoints],
        dp_rank=spec.dp_rank, attributes_struct=attributes)
