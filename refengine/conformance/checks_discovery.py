"""Section D — discovery: GetServerInfo, GetModelInfo and what they advertise."""

from __future__ import annotations

from typing import Any

import grpc

from refengine.conformance.assertions import NON_OK, expect_rejected, expect_valid
from refengine.conformance.enums import enum_name
from refengine.conformance.guides import CASES
from refengine.conformance.registry import check, expect, fail, not_claimed
from refengine.conformance.release import (
    RELEASE_BSR_COMMIT,
    RELEASE_GIT_COMMIT,
    RELEASE_TAG,
    SCHEMA_REVISION,
    schema_release_problem,
)
from refengine.conformance.target import Target
from refengine.protocol import oe


@check("D1", "schema_revision = 1, minimum_client_revision = 1, schema_release the release's BSR commit")
def schema_revision(t: Target) -> str:
    """D1: revision fields of ServerInfo. ``schema_release`` must name the schema immutably:
    the BSR commit of v0.1.0 (768a93c7...), or for an unpublished build a 40-hex Git
    commit. Tags such as ``v0.1.0``, BSR labels and branch names can move, so never."""
    info = t.server_info
    expect(info.schema_revision == SCHEMA_REVISION,
           f"schema_revision is {info.schema_revision}, expected {SCHEMA_REVISION}")
    expect(info.minimum_client_revision == 1,
           f"minimum_client_revision is {info.minimum_client_revision}, expected 1")
    release = info.schema_release
    problem = schema_release_problem(release)
    expect(problem is None, problem or "")
    if release == RELEASE_BSR_COMMIT:
        return f"schema_release = BSR commit {release} ({RELEASE_TAG})"
    note = " (the release's own Git commit)" if release == RELEASE_GIT_COMMIT else ""
    return f"schema_release = Git commit {release}{note}: an unpublished build"


def _present_values(msg: Any, prefix: str) -> list[tuple[str, Any]]:
    """(path, value) of every optional scalar that is present in ``msg``."""
    out = []
    for fd in msg.DESCRIPTOR.fields:
        if fd.message_type is None and fd.has_presence and msg.HasField(fd.name):
            out.append((f"{prefix}.{fd.name}", getattr(msg, fd.name)))
    return out


# Reported values that cannot be 0: a present 0 means "defaulted", not "reported".
# (decode_context_parallel_size is not here: that it is >= 1 when present is D5's rule.)
POSITIVE_WHEN_PRESENT = {
    "capacity.kv_block_size", "capacity.total_kv_blocks", "capacity.max_running_requests",
    "capacity.max_batched_tokens", "parallelism.tensor_parallel_size", "parallelism.pipeline_parallel_size",
    "parallelism.data_parallel_size", "model.max_context_length", "model.max_output_tokens",
    "generation.max_num_sequences",
}


@check("D2", "optional discovery scalars use presence (absent = unknown; present 0 is a real value)")
def discovery_presence(t: Target) -> str:
    """D2: optional scalars are either absent or a real reported value."""
    info, model = t.server_info, t.model_info
    present = (_present_values(info.capacity, "capacity") + _present_values(info.parallelism, "parallelism")
               + _present_values(model, "model") + _present_values(model.generation, "generation"))
    for name in ("prompt_logprobs", "output_logprobs"):
        if model.generation.HasField(name):
            present += _present_values(getattr(model.generation, name), name)
    for path, value in present:
        if path in POSITIVE_WHEN_PRESENT:
            expect(value > 0, f"{path} is present with value 0; an unknown value must be absent, and 0 "
                              "is not a possible real value here")
    par = info.parallelism
    if par.HasField("data_parallel_size") and par.HasField("data_parallel_rank"):
        expect(par.data_parallel_rank < par.data_parallel_size + par.data_parallel_start_rank,
               f"data_parallel_rank {par.data_parallel_rank} outside data_parallel_size {par.data_parallel_size}")
    return f"{len(present)} optional scalars present"


@check("D3", "GetModelInfo: supported models and aliases found; unknown → NOT_FOUND; empty rejected")
def model_info_lookup(t: Target) -> str:
    """D3: GetModelInfo.model is required and must name a served model or alias."""
    models = list(t.server_info.supported_models)
    expect(bool(models), "ServerInfo.supported_models is empty")
    names = 0
    for name in models:
        code, info = t.unary_code("GetModelInfo", oe.GetModelInfoRequest(model=name))
        expect(code == grpc.StatusCode.OK, f"GetModelInfo({name!r}) of a supported model returned {code.name}")
        for alias in info.served_model_aliases:
            code, _ = t.unary_code("GetModelInfo", oe.GetModelInfoRequest(model=alias))
            expect(code == grpc.StatusCode.OK, f"GetModelInfo(alias {alias!r}) returned {code.name}")
        names += 1 + len(info.served_model_aliases)
    code, _ = t.unary_code("GetModelInfo", oe.GetModelInfoRequest(model="oeconf-no-such-model"))
    expect(code == grpc.StatusCode.NOT_FOUND, f"GetModelInfo(unknown) returned {code.name}, expected NOT_FOUND")
    code, _ = t.unary_code("GetModelInfo", oe.GetModelInfoRequest(model=""))
    expect(code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND),
           f"GetModelInfo('') returned {code.name}, expected INVALID_ARGUMENT (or NOT_FOUND)")
    return f"{names} names resolved; empty → {code.name}"


def _accepted(t: Target, req: Any, what: str) -> None:
    expect_valid(t.generate(req), what=f"advertised {what}")


def _rejected(t: Target, req: Any, what: str) -> None:
    res = t.generate(req)
    if res.ok:
        fail(f"{what} is not advertised but Generate accepted it ({res.describe()})")
    expect_rejected(res, codes=NON_OK, what=f"unadvertised {what}")


def _flag(msg: Any, name: str) -> bool | None:
    return getattr(msg, name) if msg.HasField(name) else None


@check("D4", "inputs: text / token_ids accepted exactly when advertised")
def caps_inputs(t: Target) -> str:
    """D4: supports_text_input / supports_token_ids_input match what Generate accepts."""
    m = t.model_info
    text, ids = _flag(m, "supports_text_input"), _flag(m, "supports_token_ids_input")
    if text is None and ids is None:
        not_claimed("neither supports_text_input nor supports_token_ids_input is reported")
    text_req = t.request("d4")
    text_req.prompt = "Hello"  # set here: ``request`` sends token ids instead to a server without text input
    if text is True:
        _accepted(t, text_req, "text prompt")
    elif text is False:
        _rejected(t, text_req, "text prompt")
    if ids is True:
        _accepted(t, t.request("d4", token_ids=t.known_token_ids()[:4]), "token_ids prompt")
    elif ids is False:
        _rejected(t, t.request("d4", token_ids=[1, 2, 3]), "token_ids prompt")
    return f"text={text} token_ids={ids}"


@check("D4", "generation options (stop in output, cache salt, bypass, num_sequences) match capabilities")
def caps_options(t: Target) -> str:
    """D4: every advertised request option is accepted, every unadvertised one refused."""
    g = t.caps
    seen = []
    cases = {
        "supports_stop_in_output": lambda r: setattr(r.stopping, "include_stop_in_output", True),
        "supports_cache_salt": lambda r: setattr(r.kv, "cache_salt", "oeconf-salt"),
        "supports_prefix_cache_bypass": lambda r: setattr(r.kv, "bypass_prefix_cache", True),
    }
    for flag, apply in cases.items():
        value = _flag(g, flag)
        if value is None:
            continue
        req = t.request("d4", max_tokens=2)
        apply(req)
        (_accepted if value else _rejected)(t, req, flag)
        seen.append(f"{flag}={value}")
    if t.max_num_sequences is not None:
        n = t.max_num_sequences
        req = t.request("d4", max_tokens=2, temperature=1.0)
        req.sampling.num_sequences = n
        req.sampling.seed = 1
        res = t.generate(req, timeout=min(t.options.stream_timeout_s, 30.0))
        expect_valid(res, num_sequences=n, what=f"num_sequences = max_num_sequences = {n} (2 tokens)")
        req = t.request("d4", max_tokens=2)
        req.sampling.num_sequences = n + 1
        expect_rejected(t.generate(req), what=f"num_sequences = {n + 1} > max_num_sequences")
        seen.append(f"max_num_sequences={n}")
    if not seen:
        not_claimed("no generation option capability is reported")
    return ", ".join(seen)


@check("D4", "prompt and output logprobs refused before acceptance when advertised unsupported")
def caps_logprobs(t: Target) -> str:
    """D4 for LogprobCapabilities (found by review: a server advertising prompt logprobs as
    unsupported, then accepting and ignoring them, passed; the L checks are then not claimed).
    What is advertised as supported is the L section's to check."""
    done = []
    for which, field in (("prompt_logprobs", "return_prompt_logprobs"), ("output_logprobs", "return_output_logprobs")):
        if not t.caps.HasField(which) or not getattr(t.caps, which).HasField("supported"):
            continue
        if getattr(t.caps, which).supported:
            done.append(f"{which} supported (section L)")
            continue
        req = t.request("d4lp", max_tokens=2)
        setattr(req.response, field, True)
        _rejected(t, req, f"{field} ({which}.supported = false)")
        done.append(f"{field} refused")
    if not done:
        not_claimed("no LogprobCapabilities.supported is reported")
    return ", ".join(done)


@check("D4", "guided decoding: advertised modes accepted, others refused before acceptance")
def caps_guided(t: Target) -> str:
    """D4: GuidedDecodingCapabilities.modes are exactly the accepted guide kinds."""
    caps = t.caps.guided_decoding
    if not t.caps.HasField("guided_decoding") or not caps.HasField("supported"):
        not_claimed("guided decoding support is not reported")
    modes = set(caps.modes) if caps.supported else set()
    for mode, case in CASES.items():  # the same simple specs as checks_guided.py
        req = t.request("d4g", max_tokens=4)
        case.fill(req.guided)
        name = enum_name(oe.GuidedDecodingMode, mode)
        if mode in modes:
            _accepted(t, req, name)
        else:
            _rejected(t, req, name)
    return f"modes {sorted(enum_name(oe.GuidedDecodingMode, m) for m in modes)}"


@check("D4", "multimodal input and lora_name refused when not advertised")
def caps_media_lora(t: Target) -> str:
    """D4 (with R6): media and lora_name are refused before acceptance unless advertised."""
    done = []
    if _flag(t.model_info, "supports_multimodal") is False:
        req = t.request("d4m", max_tokens=2)
        req.media.add(modality=oe.MODALITY_IMAGE, data_uri="data:image/png;base64,iVBORw0KGgo=")
        _rejected(t, req, "media")
        done.append("media refused")
    if _flag(t.model_info, "supports_lora") is False:
        req = t.request("d4l", max_tokens=2)
        req.lora_name = "oeconf-no-such-adapter"
        _rejected(t, req, "lora_name")
        done.append("lora_name refused")
    if not done:
        not_claimed("multimodal and LoRA are advertised (checked by their own sections) or not reported")
    return ", ".join(done)


@check("D5", "decode_context_parallel_size, when present, is ≥ 1")
def dcp_size(t: Target) -> str:
    """D5: decode_context_parallel_size >= 1 when present."""
    par = t.server_info.parallelism
    if not par.HasField("decode_context_parallel_size"):
        return "absent (not reported)"
    expect(par.decode_context_parallel_size >= 1,
           f"decode_context_parallel_size is {par.decode_context_parallel_size}, expected >= 1")
    return f"decode_context_parallel_size={par.decode_context_parallel_size}"


@check("D6", "DeploymentCapacity is configured capacity: static under load, consistent with GetLoad")
def deployment_capacity(t: Target) -> str:
    """D6: capacity fields are configured values; dynamic use is in LoadInfo."""
    cap = t.server_info.capacity
    if not t.server_info.HasField("capacity"):
        not_claimed("ServerInfo.capacity is not reported")
    before = cap.SerializeToString(deterministic=True)
    busy = t.generate_async(t.request("d6", max_tokens=24, ignore_eos=True))
    t.wait_busy(lambda load: load.running_requests > 0 or load.queued_requests > 0, timeout=5)
    during = t.unary("GetServerInfo", oe.GetServerInfoRequest())
    load = t.load() if t.has_load else None  # GetLoad is optional: then only "static" is checked
    busy.join()
    expect(during.capacity.SerializeToString(deterministic=True) == before,
           f"capacity changed while a request ran: {cap} -> {during.capacity}")
    if load is None:
        t.wait_idle("D6")
        return "static under load; GetLoad unavailable: consistency with LoadInfo not checked"
    if cap.HasField("total_kv_blocks") and load.HasField("total_kv_blocks"):
        expect(load.total_kv_blocks == cap.total_kv_blocks,
               f"LoadInfo.total_kv_blocks {load.total_kv_blocks} != capacity.total_kv_blocks "
               f"{cap.total_kv_blocks}")
    if cap.HasField("max_running_requests"):
        expect(load.running_requests <= cap.max_running_requests,
               f"running_requests {load.running_requests} > max_running_requests {cap.max_running_requests}")
    t.wait_idle("D6")
    fields = [fd.name for fd in cap.DESCRIPTOR.fields if cap.HasField(fd.name)]
    return f"reported: {', '.join(fields) or 'nothing'}"


@check("D7", "engine_role reported; a request that does not fit the role is refused before acceptance")
def engine_role(t: Target) -> str:
    """D7: engine_role is set; role/request mismatches are a non-OK status with no events."""
    role = t.server_info.engine_role
    expect(role != oe.ENGINE_ROLE_UNSPECIFIED, "engine_role is UNSPECIFIED")
    if role in (oe.ENGINE_ROLE_AGGREGATED, oe.ENGINE_ROLE_PREFILL):
        req = t.request("d7", max_tokens=2)
        req.kv.session.session_id = "oeconf-session"
        req.kv.session.transfer_backend = "grpc"
        req.kv.session.endpoints.add(host="127.0.0.1", port=1, protocol="grpc")
        expect_rejected(t.generate(req), codes=NON_OK,
                        what=f"kv.session on a {enum_name(oe.EngineRole, role)} engine")
    elif role == oe.ENGINE_ROLE_DECODE:
        expect_rejected(t.generate(t.request("d7", max_tokens=2)),
                        codes=NON_OK,
                        what="request without kv.session on a DECODE engine")
    return enum_name(oe.EngineRole, role)
