"""Profiles: what a server can claim, and which checks hold it to each claim.

A profile groups checks by the capability they exercise. ``core`` (discovery, request
metadata, Generate, abort, health, errors) is claimed by every OpenEngine server; every other
profile is claimed by what discovery says (ModelInfo capabilities, the engine role, the named
targets of a multi-target run, the draft-profile list). Checks of a profile the server does
not claim report NOT_CLAIMED without running; a claimed profile's checks must pass, so an
advertised-but-broken feature fails. The checks that hold a server to what it does *not*
advertise (D4: an unadvertised mode is refused before acceptance; R5: LoRA disabled answers
FAILED_PRECONDITION) belong to ``core``, so they run against every server.

:data:`PROFILES` is the one table: each profile lists its members as check names
(``G12:one_finish_per_output``), rule ids (``H4``) or sections (``L``); a check belongs to the
profile naming it most specifically (name, then rule, then section). docs/support-matrix.md
renders the table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from refengine.conformance.enums import enum_name
from refengine.conformance.registry import Check, CheckFailed, CheckNotClaimed, all_checks, rule_section
from refengine.protocol import oe

if TYPE_CHECKING:  # pragma: no cover
    from refengine.conformance.target import Target

#: (claimed, why): the why says which discovery fact decided it.
Claim = tuple[bool, str]


@dataclass(frozen=True)
class Profile:
    """One claimable capability. ``members``: check names, rule ids or sections."""

    name: str
    title: str
    members: tuple[str, ...]
    claim: Callable[[Target], Claim]
    claimed_when: str  # what ``claim`` asks, in words (the docs' table)
    draft: bool = False  # a draft profile of docs/profiles/ (its own proto package and rule ids)


def _always(t: Target) -> Claim:
    return True, "every OpenEngine server"


def _load(t: Target) -> Claim:
    code, _ = t.unary_code("GetLoad", oe.GetLoadRequest())
    return code == grpc.StatusCode.OK, f"GetLoad answers {code.name}"


def _logprobs(t: Target) -> Claim:
    kinds = [k for k in ("output_logprobs", "prompt_logprobs")
             if t.caps.HasField(k) and getattr(t.caps, k).supported]
    return (True, f"{' and '.join(kinds)} supported") if kinds else (False, "neither output_logprobs nor "
                                                                      "prompt_logprobs is supported")


def _multi_sequence(t: Target) -> Claim:
    n = t.max_num_sequences
    return (n is not None and n >= 2), f"max_num_sequences = {n if n is not None else 'not reported'}"


def _guided(t: Target) -> Claim:
    from refengine.conformance.checks_guided import advertised_modes

    try:
        modes = advertised_modes(t)
    except CheckNotClaimed as exc:
        return False, str(exc)
    return True, f"{len(modes)} guided mode(s) advertised"


def _flag(field: str) -> Callable[[Target], Claim]:
    def claim(t: Target) -> Claim:
        if not t.model_info.HasField(field):
            return False, f"ModelInfo.{field} is not reported"
        return getattr(t.model_info, field), f"{field} = {str(getattr(t.model_info, field)).lower()}"

    return claim


#: How a server says it has no KV events: not implemented, or (as R5 for LoRA) turned off in its configuration.
NO_KV_EVENTS = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION)


def _kv_events(t: Target) -> Claim:
    code, _ = t.unary_code("GetKvEventSources", oe.GetKvEventSourcesRequest())
    if code not in NO_KV_EVENTS:
        return True, f"GetKvEventSources answers {code.name}"
    call = t.control.SubscribeKvEvents(oe.SubscribeKvEventsRequest(), timeout=1.0)
    try:
        next(call, None)
    except grpc.RpcError as err:
        if err.code() in NO_KV_EVENTS:
            return False, f"GetKvEventSources answers {code.name}, SubscribeKvEvents {err.code().name}"
    finally:
        call.cancel()
    return True, "SubscribeKvEvents is implemented"


def _prefix_cache(t: Target) -> Claim:
    """One one-token Generate. Found by review: on a PREFILL target it left a KV session held until
    its lease ended (one more each run), and a DECODE target was said to report no usage."""
    if t.server_info.engine_role == oe.ENGINE_ROLE_DECODE:
        return False, "the target is a DECODE server: the K checks send plain prompts, and each request it takes " \
                      "carries a KV session prefilled elsewhere"
    res = t.generate(t.request("claim", max_tokens=1))
    for ready in res.of("prefill_ready"):  # a PREFILL target holds the prompt's KV for a decode server: free it
        t.unary_code("Abort", oe.AbortRequest(kv_session=ready.kv_session))
    usage = res.usage()
    if not res.ok or usage is None:
        return False, f"a one-token Generate gave no usage ({res.describe()})"
    reported = usage.HasField("cached_prompt_tokens")
    return reported, f"Usage.cached_prompt_tokens is {'' if reported else 'not '}reported"


def _role(role: int, option: str, flag: str) -> Callable[[Target], Claim]:
    name = enum_name(oe.EngineRole, role).removeprefix("ENGINE_ROLE_")

    def claim(t: Target) -> Claim:
        if t.server_info.engine_role == role:
            return True, f"the target's engine_role is {name}"
        if getattr(t.options, option):
            return True, f"a {name} server is named ({flag} {getattr(t.options, option)})"
        return False, f"the target is not {name} and no {flag} server is named"

    return claim


def _encoder(t: Target) -> Claim:
    from refengine.conformance.encoder_support import discover

    try:
        setup = discover(t)
    except CheckNotClaimed as exc:
        return False, str(exc)
    except CheckFailed as exc:  # claimed by being named, but unreachable: its checks fail with this
        return True, str(exc)
    sides = sorted(setup.target_sides | setup.encoder_sides)
    return True, f"listed with sides {sides}"


GUIDED_CHECKS = ("D4:guided_backends_honoured", "D4:guided_modes_honoured", "G13:guided_finish_stop",
                 "G17:guided_seed_reproducible", "G18:guided_greedy_batch_invariant", "L5:guided_logprobs_finite",
                 "L6:guided_logprobs_after_mask", "X1:guided_invalid_spec_refused")

PROFILES: tuple[Profile, ...] = (
    Profile("core", "discovery (with the KV connector), request metadata, Generate, abort, health, errors; "
            "refusal of what is not advertised",
            ("D", "M", "G", "A", "H", "X", "K11", "R5:disabled_lifecycle", "R6:supports_lora_means_it"),
            _always, "always"),
    Profile("load", "GetLoad: counts, presence, back to idle", ("H4",), _load, "GetLoad answers OK"),
    Profile("logprobs", "prompt and output logprobs, candidates", ("L",), _logprobs,
            "output_logprobs or prompt_logprobs supported"),
    Profile("multi-sequence", "num_sequences > 1", ("G10:output_index_multi", "G12:one_finish_per_output"),
            _multi_sequence, "max_num_sequences >= 2"),
    Profile("guided", "guided decoding: advertised modes and backends honoured", GUIDED_CHECKS, _guided,
            "guided_decoding supported with at least one mode"),
    Profile("lora", "LoRA lifecycle and per-request adapters", ("R",), _flag("supports_lora"),
            "supports_lora = true"),
    Profile("kv-events", "KV events: SubscribeKvEvents, GetKvEventSources", ("E",), _kv_events,
            "GetKvEventSources or SubscribeKvEvents implemented, and not turned off (FAILED_PRECONDITION)"),
    Profile("prefix-cache", "prefix-cache reuse reported, bypassed, namespaced by salt", ("K1", "K2", "K3"),
            _prefix_cache, "Usage.cached_prompt_tokens is reported (a DECODE target: not claimed)"),
    Profile("prefill", "PREFILL role: PrefillReady, sessions held and released", ("K4", "K6", "K7"),
            _role(oe.ENGINE_ROLE_PREFILL, "prefill_address", "--prefill"),
            "the target is PREFILL, or a --prefill server is named"),
    Profile("decode", "DECODE role: sessions validated and decoded, equal to aggregated",
            ("K5", "K8", "K9", "K10", "M3:decode_session_rank_conflict"),
            _role(oe.ENGINE_ROLE_DECODE, "decode_address", "--decode"),
            "the target is DECODE, or a --decode server is named"),
    Profile("multimodal", "media input: images accepted and validated",
            ("D9:multimodal_image_accepted", "D9:multimodal_image_used", "G19:media_malformed_image_refused",
             "G19:media_placeholder_mismatch_refused"), _flag("supports_multimodal"), "supports_multimodal = true"),
    Profile("encoder", "draft profile encoder v1alpha1 (docs/profiles/encoder.md)", ("ENC",), _encoder,
            "the target or the --encoder server lists it in ServerInfo.extra['refengine.profiles']", draft=True),
)
BY_NAME = {p.name: p for p in PROFILES}


def profile_of(check: Check) -> Profile:
    """The profile naming ``check`` most specifically: its name, else its rule, else its section."""
    for key in (check.name, check.rule, rule_section(check.rule)):
        owners = [p for p in PROFILES if key in p.members]
        if len(owners) > 1:
            raise ValueError(f"{key} is in profiles {[p.name for p in owners]}")
        if owners:
            return owners[0]
    raise ValueError(f"check {check.name} is in no profile")


def checks_of(names: list[str]) -> list[Check]:
    """The registered checks of the named profiles, in RULES.md order."""
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise ValueError(f"unknown profile(s) {unknown}; known: {', '.join(BY_NAME)}")
    return [c for c in all_checks() if profile_of(c).name in names]


def claims(t: Target) -> dict[str, Claim]:
    """What the target claims, profile by profile (asked once per run, cached on ``t``)."""
    if "claims" not in t.cache:
        t.cache["claims"] = {p.name: p.claim(t) for p in PROFILES}
    return t.cache["claims"]
