"""What the toy engine (tests/conformance/toy_engine.py) accepts: its limits, request
validation before acceptance (G1-G8, G19, R4, M1/M2) and guided decoding on llguidance over
its ASCII vocabulary. Each deliberate violation is switched on by a ``Faults`` field.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import grpc
import llguidance
from google.protobuf import json_format

from refengine.protocol import oe
from tests.conformance.toy_faults import Faults

EOS, VOCAB, CTX, BLOCK, MAX_RUNNING, MAX_N, MAX_TOP_N = 128, 129, 1024, 4, 4, 4, 20
MODELS = ("toy", "toy-alias")
INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
ROUTING_KEY = re.compile(r"[A-Za-z0-9-]+")  # Faults.strict_routing_key: all the toy would take


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def require(ok: bool, message: str, code: grpc.StatusCode = INVALID) -> None:
    if not ok:
        raise Refused(code, message)


#: Guided decoding (llguidance over the toy's ASCII vocabulary): every mode but structural_tag,
#: so that the suite also sees an unadvertised mode refused.
GUIDED_MODES = {"json_schema": oe.GUIDED_DECODING_MODE_JSON_SCHEMA, "json_object": oe.GUIDED_DECODING_MODE_JSON_OBJECT,
                "regex": oe.GUIDED_DECODING_MODE_REGEX, "ebnf_grammar": oe.GUIDED_DECODING_MODE_EBNF_GRAMMAR,
                "choice": oe.GUIDED_DECODING_MODE_CHOICE}
GUIDED_BACKEND = "llguidance"


class _AsciiTokenizer:
    """What llguidance.TokenizerWrapper reads: one byte per token, EOS last."""

    eos_token_id, bos_token_id = EOS, None
    tokens = [bytes([i]) for i in range(128)] + [b"</s>"]
    special_token_ids = [EOS]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


TOKENIZER = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_AsciiTokenizer()))


def _grammar(g: Any, mode: str) -> str:
    if mode == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(g.json_schema, defaults={"whitespace_flexible": False})
    if mode == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}',
                                                             defaults={"whitespace_flexible": False})
    if mode == "regex":
        return llguidance.grammar_from("regex", g.regex)
    if mode == "ebnf_grammar":
        return llguidance.grammar_from("gbnf", g.ebnf_grammar)
    require(len(g.choice.choices) > 0, "guided.choice: no choices")
    return llguidance.grammar_from("choice", json.dumps(list(g.choice.choices)))


def compile_guide(req: Any, faults: Faults) -> str | None:
    """The llguidance grammar of ``req.guided`` (None: unguided); refuses what cannot run."""
    g = req.guided
    mode = g.WhichOneof("guide")
    if mode is None and not g.backend:
        return None
    require(faults.guided, "guided decoding is not supported")
    require(mode is not None, "guided.backend is set but no guide is")
    require(mode in GUIDED_MODES and mode != faults.refuse_advertised_mode, f"guided mode {mode} is not supported")
    require(g.backend in ("", GUIDED_BACKEND), f"unknown guided backend {g.backend!r}")
    try:
        grammar = _grammar(g, mode)
        error = llguidance.LLMatcher.validate_grammar(grammar, TOKENIZER)
    except (ValueError, Refused) as exc:
        error = str(exc) or "invalid"
    if error:
        require(faults.accept_invalid_guide, f"invalid guided.{mode}: {error}")
        return None
    return None if faults.ignore_grammar else grammar


def allowed_tokens(matcher: llguidance.LLMatcher) -> set[int]:
    mask = matcher.compute_bitmask()
    return {j for j in range(VOCAB) if mask[j // 8] >> (j % 8) & 1}


def prompt_ids(req: Any, faults: Faults) -> list[int]:
    """G1: the prompt as token ids (text: one ASCII character per token)."""
    kind = req.WhichOneof("input")
    if kind is None and faults.accept_no_input:
        return [ord("?")]
    require(kind is not None, "no input")
    ids = [min(ord(c), 63) if ord(c) >= 128 else ord(c) for c in req.prompt] if kind == "prompt" \
        else list(req.token_ids.ids)
    require(bool(ids) and all(t < VOCAB for t in ids), "empty prompt or token id out of vocabulary")
    return ids


def _sampling(s: Any, faults: Faults) -> None:
    """G4, G5."""
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        require(not s.HasField(name) or math.isfinite(getattr(s, name)), f"{name} not finite")
    require(s.temperature >= 0 and (not s.HasField("top_p") or 0 < s.top_p <= 1)
            and (s.top_k >= -1 or faults.top_k_unchecked)
            and 0 <= s.min_p <= 1 and (not s.HasField("repetition_penalty") or s.repetition_penalty > 0),
            "sampling value out of range")
    zero_ok = faults.zero_sequences_is_one and s.num_sequences == 0
    require(not s.HasField("num_sequences") or zero_ok or 1 <= s.num_sequences <= MAX_N, "num_sequences out of range")


def _stopping(st: Any, prompt: list[int], faults: Faults) -> None:
    """G6, G7."""
    require(faults.accept_empty_stop or all(c.WhichOneof("condition") for c in st.conditions), "empty StopCondition")
    require(all(c.stop_token_id < VOCAB for c in st.conditions), "stop token out of vocabulary")
    require(not st.HasField("max_tokens") or st.max_tokens >= 1, "max_tokens 0")
    require(not st.HasField("max_tokens") or st.min_tokens <= st.max_tokens, "min_tokens > max_tokens")
    limit = CTX + 1 if faults.context_off_by_one else CTX
    require(len(prompt) < CTX and len(prompt) + st.max_tokens <= limit, "context limit")


def _response(r: Any, prompt: list[int]) -> None:
    """L2, L4: what the logprob options may ask for."""
    require(r.prompt_logprob_start < len(prompt), "prompt_logprob_start beyond the prompt")
    for spec in (r.prompt_candidates, r.output_candidates):
        kind = spec.WhichOneof("selection")
        require(kind != "top_n" or 1 <= spec.top_n <= MAX_TOP_N, "top_n out of range")
        require(kind != "token_ids" or all(t < VOCAB for t in spec.token_ids.ids), "candidate id out of vocab")


def _media(req: Any, faults: Faults) -> None:
    """G19 (and D9 for the multimodal variants: media failing after acceptance, or images,
    which tests/conformance/toy_media.py validates)."""
    if faults.ignore_media:
        return
    items = [m for m in req.media if m.WhichOneof("source") is not None or not faults.accept_sourceless_media]
    require(all(m.WhichOneof("source") is not None for m in items), "a media item sets no source")
    fetched_late = faults.late_fetch_failure and all(m.WhichOneof("source") == "url" for m in items)
    require(not items or faults.images or faults.late_media_validation or fetched_late,
            "multimodal input is not supported")


def validate(req: Any, faults: Faults) -> list[int]:
    """G1-G8 and G19 as refengine reads them (lora_name and kv.session are the server's);
    returns the prompt token ids."""
    require(bool(req.request_id), "request_id is empty")
    models = ("", MODELS[0]) if faults.refuse_alias else ("", *MODELS)
    require(req.model in models or faults.accept_unknown_model, f"model {req.model!r} not served", NOT_FOUND)
    prompt = prompt_ids(req, faults)
    _sampling(req.sampling, faults)
    _stopping(req.stopping, prompt, faults)
    _response(req.response, prompt)
    _media(req, faults)
    extra = json_format.MessageToDict(req.extra)
    require(faults.extra_untyped or "toy_knob" not in extra or isinstance(extra["toy_knob"], int | float),
            "extra.toy_knob: a number")
    return prompt


def _number(value: str, lo: int, hi: int, unsigned: bool, faults: Faults) -> bool:
    if faults.lenient_metadata:  # "1.5", "1e3" read as numbers
        try:
            return lo <= float(value) <= hi
        except ValueError:
            return False
    if faults.python_int_metadata:  # int() as a Python adapter would: "1_000", "+7", "0_0" are numbers
        try:
            return lo <= int(value) <= hi
        except ValueError:
            return False
    digits = value.isdigit() if unsigned else value.lstrip("-").isdigit()
    return digits and lo <= int(value) <= hi


def parse_metadata(md: Any, faults: Faults) -> dict[str, str]:
    """M1/M2: the openengine-* keys (each at most once, well-formed)."""
    seen: dict[str, str] = {}
    for key, value in md:
        if key.startswith("openengine-"):
            require(key not in seen, f"{key} repeated")
            seen[key] = value
    if "openengine-routing-key" in seen:
        key = seen["openengine-routing-key"]
        require(key != "" and (not faults.strict_routing_key or ROUTING_KEY.fullmatch(key) is not None),
                f"routing key {key!r}")
    for key, lo, hi in (("openengine-target-dp-rank", 0, 2**32 - 1), ("openengine-priority", -(2**31), 2**31 - 1)):
        if key in seen:
            require(_number(seen[key], lo, hi, key == "openengine-target-dp-rank", faults), f"{key}: {seen[key]!r}")
    return seen


def priority(meta: dict[str, str], faults: Faults) -> int:
    """M4: higher = sooner (Faults.ignore_priority: first come, first served)."""
    return 0 if faults.ignore_priority else int(float(meta.get("openengine-priority", "0")))
