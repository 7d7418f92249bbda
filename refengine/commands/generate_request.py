"""``GenerateOptions`` → the request the chosen path sends: two small adapters, one reading.

``engine_request`` builds the in-process ``GenerationRequest``; ``wire_request`` (with
``wire_metadata``) the ``oe.GenerateRequest`` of ``--remote`` and the disaggregated hops,
setting only the fields the options set, as ``refengine/server/convert.py`` reads them back:

| option                      | GenerationRequest               | GenerateRequest                            |
|-----------------------------|---------------------------------|--------------------------------------------|
| temperature … num_sequences | SamplingParams                  | sampling.*                                 |
| max/min_tokens, stop…       | StoppingParams                  | stopping.* (conditions: texts, then ids)   |
| logprobs N                  | LogprobParams.output_*          | response.return_output_logprobs,           |
|                             |                                 | output_candidates.top_n (N > 0 only)       |
| prompt_logprobs N, start    | LogprobParams.prompt_*          | response.return_prompt_logprobs, …         |
| bypass_prefix_cache, salt   | KvParams                        | kv.*                                       |
| priority                    | priority                        | metadata ``openengine-priority`` (M1)      |
| lora_name, guided, images   | same names, media               | lora_name, guided, media (raw_bytes)       |
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from refengine.commands.generate_options import SAMPLING_FIELDS, GenerateOptions
from refengine.types import (
    CandidateSpec,
    GenerationRequest,
    GuidedSpec,
    KvParams,
    LogprobParams,
    MediaInput,
    SamplingParams,
    StoppingParams,
)

if TYPE_CHECKING:
    from refengine.client import oe

__all__ = ["PRIORITY_KEY", "engine_request", "wire_metadata", "wire_request"]

PRIORITY_KEY = "openengine-priority"  # RULES.md M1: priority is request metadata, not a field


def _top_n(count: int | None) -> CandidateSpec | None:
    return CandidateSpec("top_n", top_n=count) if count else None


def engine_request(options: GenerateOptions, prompt: str, request_id: str) -> GenerationRequest:
    """The in-process request; unset options keep the engine types' defaults."""
    sampling = {name: getattr(options, name) for name in SAMPLING_FIELDS if getattr(options, name) is not None}
    lengths = {name: getattr(options, name) for name in ("max_tokens", "min_tokens")
               if getattr(options, name) is not None}
    return GenerationRequest(
        request_id=request_id,
        prompt=prompt,
        sampling=SamplingParams(**sampling),
        stopping=StoppingParams(**lengths, stop_strings=options.stop, stop_token_ids=options.stop_token_ids,
                                ignore_eos=options.ignore_eos, include_stop_in_output=options.include_stop),
        logprobs=LogprobParams(
            prompt_logprobs=options.prompt_logprobs is not None, prompt_candidates=_top_n(options.prompt_logprobs),
            prompt_logprob_start=options.prompt_logprob_start or 0,
            output_logprobs=options.logprobs is not None, output_candidates=_top_n(options.logprobs)),
        # "" salts nothing, as on the wire (convert.py): both paths read it the same way
        kv=KvParams(bypass_prefix_cache=options.bypass_prefix_cache, cache_salt=options.cache_salt or None),
        priority=options.priority or 0,
        guided=options.guided,
        lora_name=options.lora_name or None,
        media=tuple(MediaInput("image", raw_bytes=data) for data in options.images),
    )


def wire_request(options: GenerateOptions, prompt: str, request_id: str) -> oe.GenerateRequest:
    """The ``GenerateRequest``; priority travels apart, in ``wire_metadata``. The wire types
    come through the client module: the cli reaches the protocol only through it."""
    from refengine.client import oe

    request = oe.GenerateRequest(request_id=request_id, model=options.model, prompt=prompt)
    for name in SAMPLING_FIELDS:
        if getattr(options, name) is not None:
            setattr(request.sampling, name, getattr(options, name))
    _wire_stopping(options, request.stopping)
    _wire_logprobs(options, request.response)
    if options.bypass_prefix_cache:
        request.kv.bypass_prefix_cache = True
    if options.cache_salt is not None:
        request.kv.cache_salt = options.cache_salt
    if options.lora_name is not None:
        request.lora_name = options.lora_name
    if options.guided is not None:
        _wire_guided(options.guided, request.guided)
    for data in options.images:
        request.media.add(modality=oe.MODALITY_IMAGE, raw_bytes=data)
    return request


def wire_metadata(options: GenerateOptions) -> tuple[tuple[str, str], ...]:
    """The request's gRPC metadata: ``openengine-priority`` when ``--priority`` was given."""
    return ((PRIORITY_KEY, str(options.priority)),) if options.priority is not None else ()


def _wire_stopping(options: GenerateOptions, stopping: oe.StoppingOptions) -> None:
    if options.max_tokens is not None:
        stopping.max_tokens = options.max_tokens
    if options.min_tokens is not None:
        stopping.min_tokens = options.min_tokens
    for text in options.stop:
        stopping.conditions.add(stop_text=text)
    for token_id in options.stop_token_ids:
        stopping.conditions.add(stop_token_id=token_id)
    if options.ignore_eos:
        stopping.ignore_eos = True
    if options.include_stop:
        stopping.include_stop_in_output = True


def _wire_logprobs(options: GenerateOptions, response: oe.ResponseOptions) -> None:
    if options.logprobs is not None:
        response.return_output_logprobs = True
        if options.logprobs:  # top_n 0 asks for no candidates: leave the selection out
            response.output_candidates.top_n = options.logprobs
    if options.prompt_logprobs is not None:
        response.return_prompt_logprobs = True
        if options.prompt_logprobs:
            response.prompt_candidates.top_n = options.prompt_logprobs
    if options.prompt_logprob_start is not None:
        response.prompt_logprob_start = options.prompt_logprob_start


def _wire_guided(spec: GuidedSpec, guided: oe.GuidedDecoding) -> None:
    if spec.mode == "choice":
        guided.choice.choices.extend(spec.choices)
    else:
        setattr(guided, spec.mode, spec.spec)
    if spec.backend:
        guided.backend = spec.backend
