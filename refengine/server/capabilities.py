"""The one table of what ``Generate`` accepts (RULES D4).

:class:`Capabilities` is built once from the loaded engine. ``GetModelInfo`` renders it
(:func:`model_info`), and ``validation.py`` checks every request against the same object,
so an advertised mode is always accepted and an unadvertised one is always refused before
acceptance. To add a feature: flip it here, implement it, and both sides follow.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf import struct_pb2

from refengine.engine.interface import EngineInfo
from refengine.protocol import oe

CANDIDATE_MODES = {
    "top_n": oe.CandidateTokenSelectionMode.CANDIDATE_TOKEN_SELECTION_MODE_TOP_N,
    "token_ids": oe.CandidateTokenSelectionMode.CANDIDATE_TOKEN_SELECTION_MODE_TOKEN_IDS,
    "all": oe.CandidateTokenSelectionMode.CANDIDATE_TOKEN_SELECTION_MODE_ALL,
}
GUIDED_MODES = {
    "json_schema": oe.GuidedDecodingMode.GUIDED_DECODING_MODE_JSON_SCHEMA,
    "regex": oe.GuidedDecodingMode.GUIDED_DECODING_MODE_REGEX,
    "ebnf_grammar": oe.GuidedDecodingMode.GUIDED_DECODING_MODE_EBNF_GRAMMAR,
    "structural_tag": oe.GuidedDecodingMode.GUIDED_DECODING_MODE_STRUCTURAL_TAG,
    "choice": oe.GuidedDecodingMode.GUIDED_DECODING_MODE_CHOICE,
    "json_object": oe.GuidedDecodingMode.GUIDED_DECODING_MODE_JSON_OBJECT,
}


@dataclass(frozen=True)
class Capabilities:
    """Supported request features of the served model. Mode names are the proto oneof
    field names (``top_n``, ``json_schema``, ...)."""

    served_model_name: str
    model_id: str  # D8: the canonical model and tokenizer source (manifest name or path)
    max_context_length: int
    vocab_size: int
    max_num_sequences: int
    max_top_n: int
    text_input: bool = True
    token_ids_input: bool = True
    prompt_logprobs: bool = True
    output_logprobs: bool = True
    candidate_modes: tuple[str, ...] = ("top_n", "token_ids", "all")
    guided_modes: tuple[str, ...] = ()  # the default grammar backend's modes (D4)
    guided_backends: tuple[tuple[str, tuple[str, ...]], ...] = ()  # each backend and its modes
    priority: bool = True  # openengine-priority metadata, honoured by the scheduler (M4)
    stop_in_output: bool = True
    cache_salt: bool = True
    prefix_cache_bypass: bool = True
    lora: bool = False  # R6: the LoRA RPCs and lora_name work (LoraConfig.enabled)
    multimodal: bool = False
    served_model_aliases: tuple[str, ...] = ()  # D8: every other accepted name

    @property
    def served_names(self) -> tuple[str, ...]:
        """Names ``GenerateRequest.model`` / ``GetModelInfo.model`` may use: the primary name first."""
        return (self.served_model_name, *self.served_model_aliases)

    @property
    def max_output_tokens(self) -> int:
        return self.max_context_length - 1  # a one-token prompt


def capabilities_of(info: EngineInfo) -> Capabilities:
    """D4, role-correct: a prefill or decode engine takes one output per request, and a decode
    engine no prompt logprobs (``engine/role_check.py``)."""
    if info.role == "encoder":  # ENC2: no Generate at all (media go to refengine.v1alpha1.Media)
        return Capabilities(
            served_model_name=info.served_model_name, served_model_aliases=info.served_model_aliases,
            model_id=info.model_id, max_context_length=info.max_model_len, vocab_size=info.vocab_size,
            max_num_sequences=0, max_top_n=0, text_input=False, token_ids_input=False, prompt_logprobs=False,
            output_logprobs=False, candidate_modes=(), guided_backends=info.guided_backends, priority=False,
            stop_in_output=False, cache_salt=False, prefix_cache_bypass=False, multimodal=True)
    disaggregated = info.role != "aggregated"
    return Capabilities(
        served_model_name=info.served_model_name,
        served_model_aliases=info.served_model_aliases,
        model_id=info.model_id,
        max_context_length=info.max_model_len,
        vocab_size=info.vocab_size,
        max_num_sequences=1 if disaggregated else info.max_sequences_per_request,
        max_top_n=info.max_logprobs,
        prompt_logprobs=info.role != "decode",
        guided_modes=tuple(m for m in GUIDED_MODES if m in info.guided_modes),
        guided_backends=info.guided_backends,
        lora=info.max_loras > 0,
        multimodal=info.supports_multimodal,
    )


#: ModelInfo.extra keys: every grammar backend with its modes ({"xgrammar": ["json_schema", ...], ...}; a
#: Struct's keys have no order), and the default backend's name (used when guided.backend is empty; its
#: modes are the advertised ``guided_decoding.modes``).
GUIDED_BACKENDS_KEY = "refengine.guided_backends"
GUIDED_DEFAULT_BACKEND_KEY = "refengine.guided_default_backend"


def guided_backends(caps: Capabilities) -> dict[str, list[str]]:
    return {name: list(modes) for name, modes in caps.guided_backends}


def _logprob_caps(supported: bool, caps: Capabilities) -> oe.LogprobCapabilities:
    if not supported:
        return oe.LogprobCapabilities(supported=False)
    return oe.LogprobCapabilities(
        supported=True,
        candidate_selection_modes=[CANDIDATE_MODES[m] for m in caps.candidate_modes],
        max_top_n=caps.max_top_n,
    )


def model_info(caps: Capabilities, extra: dict | None = None) -> oe.ModelInfo:
    """``GetModelInfo`` for the served model, rendered from the table (D2: every scalar
    we can report is present, ``false`` included)."""
    extra_struct = struct_pb2.Struct()
    extra_struct.update(extra or {})
    return oe.ModelInfo(
        model_id=caps.model_id,
        served_model_name=caps.served_model_name,
        served_model_aliases=list(caps.served_model_aliases),
        max_context_length=caps.max_context_length,
        max_output_tokens=caps.max_output_tokens,
        supports_text_input=caps.text_input,
        supports_token_ids_input=caps.token_ids_input,
        generation=oe.GenerationCapabilities(
            prompt_logprobs=_logprob_caps(caps.prompt_logprobs, caps),
            output_logprobs=_logprob_caps(caps.output_logprobs, caps),
            guided_decoding=oe.GuidedDecodingCapabilities(
                supported=bool(caps.guided_modes),
                modes=[GUIDED_MODES[m] for m in caps.guided_modes],
            ),
            max_num_sequences=caps.max_num_sequences,
            supports_priority=caps.priority,
            supports_stop_in_output=caps.stop_in_output,
            supports_cache_salt=caps.cache_salt,
            supports_prefix_cache_bypass=caps.prefix_cache_bypass,
        ),
        supports_lora=caps.lora,
        supports_multimodal=caps.multimodal,
        extra=extra_struct,
    )
