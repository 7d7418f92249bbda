"""Checks a request before the engine accepts it (RULES G1, G4–G7; ref: the cache salt's size).

Every check raises ``InvalidRequestError`` with a message naming the field and
the allowed range; nothing is allocated before all checks pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from refengine.types import CandidateSpec, GenerationRequest, InvalidRequestError

MAX_STOP_STRINGS = 1024
MAX_STOP_STRING_CHARS = 1024
#: All of a request's stop strings together: the matcher's automaton takes about 260 bytes per
#: character, so 1,024 strings of 1,024 characters cost 260 MB each (and 64 are cached).
MAX_STOP_CHARS_TOTAL = 16384
MAX_STOP_TOKEN_IDS = 1024
#: ``kv.cache_salt`` (and an Encode's ``cache_salt``), in UTF-8 bytes. The contract sets no bound
#: (K2); the salt is hashed into every block key of the request and sent in every BlockStored
#: event's ``extra_keys``, and encoder-cache entries keep it: unbounded, a 4 MB salt grew an
#: encoder by 33 MB per Encode, kept after release (found by review). Salts are tenant ids or
#: random tokens: 1 KiB holds any of them.
MAX_CACHE_SALT_BYTES = 1024


@dataclass(frozen=True)
class Limits:
    """``max_model_len``: the context a request may use, the model's bounded by the KV pool's
    tokens (a request that could never hold its KV would wait forever; the engine sets it)."""

    vocab_size: int
    max_model_len: int
    max_sequences_per_request: int
    max_logprobs: int


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message)


def _finite(name: str, value: float) -> None:
    _require(isinstance(value, int | float) and math.isfinite(value), f"{name} must be a finite number, got {value}")


def validate_inputs(request: GenerationRequest) -> None:
    """G1: exactly one input. Checked before tokenizing."""
    _require(bool(request.request_id), "request_id must be non-empty")
    has_prompt = request.prompt is not None
    has_ids = request.prompt_token_ids is not None
    _require(has_prompt != has_ids, "exactly one of prompt or token_ids must be set")
    validate_cache_salt("kv.cache_salt", request.kv.cache_salt)


def validate_cache_salt(field: str, salt: str | None) -> None:
    """``MAX_CACHE_SALT_BYTES`` at most; checked before anything is hashed or cached."""
    size = len(salt.encode()) if salt else 0
    _require(size <= MAX_CACHE_SALT_BYTES, f"{field} is {size} bytes; at most {MAX_CACHE_SALT_BYTES}")


def validate_encode(num_items: int, max_items: int, cache_salt: str) -> None:
    """An Encode's item count and salt (draft profile ``encoder``), before any media is read."""
    _require(num_items > 0, "items: at least one media item is required")
    _require(num_items <= max_items, f"{num_items} media items; at most {max_items} per request")
    validate_cache_salt("cache_salt", cache_salt)


def validate_sampling(request: GenerationRequest, limits: Limits) -> None:
    s = request.sampling
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        _finite(name, getattr(s, name))
    _require(s.temperature >= 0, f"temperature must be >= 0, got {s.temperature}")
    _require(0 < s.top_p <= 1, f"top_p must be in (0, 1], got {s.top_p}")
    _require(s.top_k >= -1, f"top_k must be >= 0, or -1 to disable, got {s.top_k}")
    _require(0 <= s.min_p <= 1, f"min_p must be in [0, 1], got {s.min_p}")
    _require(s.repetition_penalty > 0, f"repetition_penalty must be > 0, got {s.repetition_penalty}")
    _require(
        1 <= s.num_sequences <= limits.max_sequences_per_request,
        f"num_sequences must be in [1, {limits.max_sequences_per_request}], got {s.num_sequences}",
    )
    _require(s.seed is None or 0 <= s.seed < 1 << 64, f"seed must be a uint64, got {s.seed}")


def validate_stopping(request: GenerationRequest, limits: Limits) -> None:
    st = request.stopping
    _require(st.max_tokens is None or st.max_tokens >= 1, f"max_tokens must be >= 1, got {st.max_tokens}")
    _require(st.min_tokens >= 0, f"min_tokens must be >= 0, got {st.min_tokens}")
    if st.max_tokens is not None:
        _require(st.min_tokens <= st.max_tokens, f"min_tokens ({st.min_tokens}) > max_tokens ({st.max_tokens})")
    _require(len(st.stop_strings) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings")
    _require(len(st.stop_token_ids) <= MAX_STOP_TOKEN_IDS, f"at most {MAX_STOP_TOKEN_IDS} stop token ids")
    for index, text in enumerate(st.stop_strings):
        _require(0 < len(text) <= MAX_STOP_STRING_CHARS,
                 f"stop string {index} has {len(text)} characters; each must have 1-{MAX_STOP_STRING_CHARS}")
    total = sum(len(text) for text in st.stop_strings)
    _require(total <= MAX_STOP_CHARS_TOTAL,
             f"the stop strings have {total} characters in all; at most {MAX_STOP_CHARS_TOTAL}")
    for token_id in st.stop_token_ids:
        _require(0 <= token_id < limits.vocab_size, f"stop token id {token_id} is not in the vocabulary")


def _validate_candidates(name: str, spec: CandidateSpec | None, limits: Limits) -> None:
    if spec is None:
        return
    if spec.mode == "top_n":
        # Not "must be in [1, 0]" (found by review): top_n 0 asks for none, which is accepted.
        _require(limits.max_logprobs > 0, f"{name}.top_n: this server returns no candidates (--max-logprobs 0)")
        _require(
            1 <= spec.top_n <= limits.max_logprobs,
            f"{name}.top_n must be in [1, {limits.max_logprobs}], got {spec.top_n}",
        )
    elif spec.mode == "token_ids":
        _require(len(spec.token_ids) > 0, f"{name}.token_ids must list at least one token id")
        # (ref) each id once: a list of 200,000 copies of one id passed every size estimate (found by review)
        _require(len(set(spec.token_ids)) == len(spec.token_ids), f"{name}.token_ids lists a token id more than once")
        for token_id in spec.token_ids:
            _require(0 <= token_id < limits.vocab_size, f"{name} token id {token_id} is not in the vocabulary")


def validate_logprobs(request: GenerationRequest, limits: Limits) -> None:
    lp = request.logprobs
    _validate_candidates("prompt_candidates", lp.prompt_candidates, limits)
    _validate_candidates("output_candidates", lp.output_candidates, limits)
    _require(lp.prompt_logprob_start >= 0, "prompt_logprob_start must be >= 0")


def validate_prompt(request: GenerationRequest, prompt_token_ids: list[int], limits: Limits) -> int:
    """Checks the tokenized prompt against the vocabulary and context limit (G7).
    Returns the resolved ``max_tokens``: unset means up to the context limit."""
    num_prompt = len(prompt_token_ids)
    _require(num_prompt > 0, "the prompt is empty")
    for token_id in prompt_token_ids:
        _require(
            isinstance(token_id, int) and 0 <= token_id < limits.vocab_size,
            f"token id {token_id} is not in the vocabulary (size {limits.vocab_size})",
        )
    lp = request.logprobs  # (ref) only when a PromptOutput is asked for: otherwise the start selects nothing
    _require(
        not (lp.prompt_logprobs or lp.prompt_candidates is not None) or lp.prompt_logprob_start < num_prompt,
        f"prompt_logprob_start ({lp.prompt_logprob_start}) must be < the prompt length ({num_prompt})",
    )
    _check_prompt_positions(request, num_prompt)
    return validate_context(request, num_prompt, limits)


def validate_context(request: GenerationRequest, num_prompt: int, limits: Limits) -> int:
    """G7 and G6 for a prompt of ``num_prompt`` tokens: it and ``max_tokens`` fit the context.
    Returns the resolved ``max_tokens``. Each check only gets stricter as the prompt grows, so
    an image prompt is checked before its media are fetched and encoded (with its tokens
    before expansion), and again after."""
    _require(
        num_prompt < limits.max_model_len,
        f"the prompt has {num_prompt} tokens; the context limit is {limits.max_model_len} "
        "and at least one token must be generated",
    )
    max_tokens = request.stopping.max_tokens
    if max_tokens is None:
        max_tokens = limits.max_model_len - num_prompt
        _require(  # G6 against the resolved limit: an unreachable min_tokens would be silently not honoured
            request.stopping.min_tokens <= max_tokens,
            f"min_tokens ({request.stopping.min_tokens}) exceeds what the context leaves after the prompt "
            f"({max_tokens} = {limits.max_model_len} - {num_prompt}), the limit of an unset max_tokens",
        )
    else:
        _require(
            num_prompt + max_tokens <= limits.max_model_len,
            f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) exceeds the context limit "
            f"of {limits.max_model_len}",
        )
    return max_tokens


def _check_prompt_positions(request: GenerationRequest, num_prompt: int) -> None:
    lp = request.logprobs
    if lp.max_prompt_positions is None or not (lp.prompt_logprobs or lp.prompt_candidates is not None):
        return
    positions = num_prompt - lp.prompt_logprob_start
    _require(
        positions <= lp.max_prompt_positions,
        f"prompt logprobs for {positions} positions do not fit in one response (at most "
        f"{lp.max_prompt_positions} with these candidates under the message-size limit); raise "
        "prompt_logprob_start, select fewer candidates, or raise the server's message limit",
    )
