"""Everything ``Generate`` refuses before acceptance (RULES G1–G4, G8 via convert, D4, D7,
K5, K6, M3), each with the gRPC status the contract names and a message saying what is
wrong and what is allowed.

Range checks of sampling/stopping/logprob values (G4–G7) are the engine's, made once
(``Engine.add_request`` raises ``InvalidRequestError`` with the field name); this module
checks only what the engine cannot see: proto presence, the served model, the server's
role, the capability table, message-size limits. The edge never tokenizes: a prompt-size
limit it knows only in bytes goes down as ``LogprobParams.max_prompt_positions``.

Status choices (ref, where the contract only says "non-OK"):
- unsupported feature (guided decoding): INVALID_ARGUMENT, naming the capability; media are
  the engine's to check (a model without a vision path refuses them: INVALID_ARGUMENT);
- ``lora_name`` naming no loaded adapter, LoRA enabled or not: NOT_FOUND (R4), from the
  engine (``LoraNotFoundError``), which resolves the name before acceptance;
- a ``kv.session`` on an aggregated or prefill server: FAILED_PRECONDITION "role mismatch" (K6).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from refengine.engine.no_generate import ROLE_MISMATCH
from refengine.protocol import oe
from refengine.server.capabilities import Capabilities
from refengine.server.errors import Rejection, invalid
from refengine.server.kv_pull_client import PULL_PROTOCOLS
from refengine.server.media_wire import EXTRA_MEDIA_HANDLES
from refengine.server.metadata import RequestMetadata, check_rank
from refengine.server.options import is_wildcard_host

#: Conservative wire size of one candidate (``LogProb``) and of one ``TokenInfo`` without them.
CANDIDATE_BYTES = 40
TOKEN_INFO_BYTES = 48
#: (ref) The longest ``request_id``: every event echoes it (G9) and finished ids are remembered
#: for ALREADY_FINISHED (A2), so an 8 MB id cost 8 MB per event and stayed in memory.
MAX_REQUEST_ID_BYTES = 1024


@dataclass(frozen=True)
class ServerFacts:
    """What validation needs to know about this server."""

    role: str
    caps: Capabilities
    max_send_message_bytes: int
    transfer_backends: tuple[str, ...] = ()  # a decode server pulls sessions with these
    max_media_items: int = 8  # media items (or embedding handles) per request (--media-max-items)


def check_media_count(request: oe.GenerateRequest, max_items: int) -> None:
    """G19 before anything is converted: a repeated field's length costs nothing to read, while
    converting its entries is not free (found by review: 8 million empty items fit the 32 MiB
    message limit, and were turned into Python objects on the event loop before the engine's own
    count refused them, stalling every stream for tens of seconds)."""
    handles = request.extra.fields.get(EXTRA_MEDIA_HANDLES)
    num_handles = len(handles.list_value.values) if handles is not None and handles.HasField("list_value") else 0
    for what, count in (("media items", len(request.media)), (f"extra[{EXTRA_MEDIA_HANDLES!r}] entries", num_handles)):
        if count > max_items:
            raise invalid(f"{count} {what}; at most {max_items} per request")


def check_model(model: str, caps: Capabilities) -> None:
    """G3/D3: empty = the default (only) model; anything else must be served."""
    if model and model not in caps.served_names:
        raise Rejection(grpc.StatusCode.NOT_FOUND,
                        f"model {model!r} is not served here; accepted names (served_model_name and "
                        f"served_model_aliases) = {list(caps.served_names)}")


def _check_session(session: oe.KvSessionRef, backends: tuple[str, ...]) -> None:
    """K5: a decode request's session is checked before acceptance (its attributes against
    this engine and prompt by the engine: ``engine/role_check.py``)."""
    if not session.session_id:
        raise invalid("kv.session.session_id must be non-empty")
    check_rank("kv.session.dp_rank", session.dp_rank)  # M3: authoritative, so it must exist (found by review)
    if not session.endpoints:
        raise invalid("kv.session.endpoints is empty: the session names no prefill server to pull from")
    for endpoint in session.endpoints:
        if is_wildcard_host(endpoint.host) or not 0 < endpoint.port < 65536:
            raise invalid(f"kv.session endpoint {endpoint.host!r}:{endpoint.port} is not a routable host:port")
    if not any(endpoint.protocol in PULL_PROTOCOLS for endpoint in session.endpoints):
        raise invalid(f"kv.session.endpoints: none has a protocol this engine pulls with {list(PULL_PROTOCOLS)} "
                      f"(got {[endpoint.protocol for endpoint in session.endpoints]})")
    if session.transfer_backend not in backends:
        raise invalid(f"kv.session.transfer_backend {session.transfer_backend!r} is not supported "
                      f"(supported: {list(backends)})")


def check_role(request: oe.GenerateRequest, role: str, meta: RequestMetadata,
               backends: tuple[str, ...] = ()) -> None:
    """D7, K5, K6, M3, ENC2: role/request compatibility, before acceptance."""
    if role == "encoder":
        raise Rejection(grpc.StatusCode.FAILED_PRECONDITION, ROLE_MISMATCH)
    has_session = request.HasField("kv") and request.kv.HasField("session")
    if has_session and meta.target_dp_rank is not None and meta.target_dp_rank != request.kv.session.dp_rank:
        raise invalid(f"openengine-target-dp-rank {meta.target_dp_rank} disagrees with "
                      f"kv.session.dp_rank {request.kv.session.dp_rank} (the session is authoritative)")
    if has_session and role != "decode":
        raise Rejection(grpc.StatusCode.FAILED_PRECONDITION,
                        f"role mismatch: this is {'an' if role[0] in 'aeiou' else 'a'} {role} server; only a decode "
                        "server accepts kv.session")
    if role == "decode":
        if not has_session:
            raise invalid("this is a decode server: the request must carry kv.session from a prefill "
                          "server's PrefillReady")
        _check_session(request.kv.session, backends)


def _check_candidates(name: str, selection: oe.CandidateTokenSelection, caps: Capabilities) -> None:
    mode = selection.WhichOneof("selection")
    if mode is None:
        raise invalid(f"response.{name} is set but selects nothing; set top_n, token_ids or all {{}}")
    if mode not in caps.candidate_modes:
        raise invalid(f"response.{name}: candidate mode {mode!r} is not supported "
                      f"(supported: {list(caps.candidate_modes)})")


def check_features(request: oe.GenerateRequest, caps: Capabilities) -> None:
    """D4: every requested feature must be advertised in the capability table."""
    kind = request.WhichOneof("input")
    if kind is None:
        raise invalid("exactly one input is required: set prompt or token_ids")  # G1
    if (kind == "prompt" and not caps.text_input) or (kind == "token_ids" and not caps.token_ids_input):
        raise invalid(f"input {kind!r} is not supported by model {caps.served_model_name!r}")
    if request.HasField("guided") and (request.guided.WhichOneof("guide") or request.guided.backend):
        mode = request.guided.WhichOneof("guide")
        if mode is None:
            raise invalid("guided.backend is set but no guide (json_schema, regex, ...) is")
        if mode not in caps.guided_modes:
            raise invalid(f"guided decoding mode {mode!r} is not supported "
                          f"(generation.guided_decoding.modes = {list(caps.guided_modes)})")
    s = request.sampling
    if s.HasField("num_sequences") and s.num_sequences == 0:  # presence: the engine sees only 1 …
        raise invalid("sampling.num_sequences must be > 0 when present (omit it for 1)")  # G4
    r = request.response
    if r.return_prompt_logprobs and not caps.prompt_logprobs:
        raise invalid("prompt logprobs are not supported")
    if r.return_output_logprobs and not caps.output_logprobs:
        raise invalid("output logprobs are not supported")
    for name in ("prompt_candidates", "output_candidates"):
        if r.HasField(name):
            _check_candidates(name, getattr(r, name), caps)
    if request.stopping.include_stop_in_output and not caps.stop_in_output:
        raise invalid("stopping.include_stop_in_output is not supported")
    if request.kv.HasField("cache_salt") and not caps.cache_salt:
        raise invalid("kv.cache_salt is not supported")
    if request.kv.bypass_prefix_cache and not caps.prefix_cache_bypass:
        raise invalid("kv.bypass_prefix_cache is not supported")


def _candidates_per_token(selection: oe.CandidateTokenSelection, vocab_size: int) -> int:
    mode = selection.WhichOneof("selection")
    if mode == "all":
        return vocab_size
    if mode == "token_ids":
        return len(selection.token_ids.ids)
    return selection.top_n if mode == "top_n" else 0


def check_response_sizes(request: oe.GenerateRequest, facts: ServerFacts) -> None:
    """Refuse a request whose single-token ``TokenOutput`` could not fit in one gRPC message
    (ref). Token outputs are split per token when large; the prompt's size is the engine's
    to check, once it has tokenized (``prompt_positions_limit``)."""
    r = request.response
    if r.HasField("output_candidates"):
        per_token = TOKEN_INFO_BYTES + CANDIDATE_BYTES * _candidates_per_token(r.output_candidates,
                                                                               facts.caps.vocab_size)
        if per_token > facts.max_send_message_bytes:
            raise invalid(f"output candidates need ~{per_token >> 20} MiB per token, over the "
                          f"{facts.max_send_message_bytes >> 20} MiB message limit (--max-send-message-mib)")


def prompt_positions_limit(request: oe.GenerateRequest, facts: ServerFacts) -> int | None:
    """The most prompt positions whose ``PromptOutput`` (sent once, whole) fits in one message
    with the requested candidates; None when the whole context always fits, or no prompt output
    is asked for. Prompt logprobs alone count too (found by review: only candidates were counted,
    so a long prompt's logprobs were refused only after its whole prefill)."""
    r = request.response
    if not (r.return_prompt_logprobs or r.HasField("prompt_candidates")):
        return None
    candidates = _candidates_per_token(r.prompt_candidates, facts.caps.vocab_size) \
        if r.HasField("prompt_candidates") else 0
    per_position = TOKEN_INFO_BYTES + CANDIDATE_BYTES * candidates
    limit = facts.max_send_message_bytes
    return None if facts.caps.max_context_length * per_position <= limit else limit // per_position


def validate_generate(request: oe.GenerateRequest, meta: RequestMetadata, facts: ServerFacts) -> None:
    """All edge checks, in the order a client would want to hear about them. Raises ``Rejection``."""
    if not request.request_id:
        raise invalid("request_id must be non-empty")  # G2
    if len(request.request_id.encode()) > MAX_REQUEST_ID_BYTES:  # ref: it is kept after the request (A2)
        raise invalid(f"request_id has {len(request.request_id.encode())} bytes; at most {MAX_REQUEST_ID_BYTES}")
    check_model(request.model, facts.caps)
    check_role(request, facts.role, meta, facts.transfer_backends)
    check_features(request, facts.caps)
    check_media_count(request, facts.max_media_items)
    check_response_sizes(request, facts)
