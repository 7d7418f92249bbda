"""Draft profile ``encoder`` v1alpha1 (docs/profiles/encoder.md, section ENC): an encoder server
turns media into leased embedding handles (``refengine.v1alpha1.Media``), consumers take them in
``GenerateRequest.extra["refengine.v1alpha1.media_handles"]`` instead of the media.

Which servers are involved: the target and, with ``--encoder HOST:PORT``
(``Options.encoder_address``), an encoder server. Discovery decides what runs (ENC1): when none
of them lists the profile in ``ServerInfo.extra["refengine.profiles"]``, every ENC check skips as
"not claimed". The encoder-side checks (ENC2–ENC7, ENC15) run against the ``--encoder`` server, or
the target itself when it lists side ``encoder``; the consumer checks (ENC9–ENC11, ENC13) need the
target to list side ``consumer`` (an AGGREGATED or PREFILL server), an encoder and the model's image
placeholder (``--media-placeholder-token-id N``); each skips naming what is missing.

The stubs are the generated ``refengine.protocol.v1alpha1`` ones; every call has a deadline, each
image is unique to its check and run (so the encoder cache of earlier runs cannot answer for it),
and every handle a check makes is released at its end, whatever happened: checks are
independent and leave nothing held. Not checked: ENC8 (prefix-cache keys; needs KV events of
both), ENC12 and ENC14 (decode servers), draining and RESOURCE_EXHAUSTED (need server settings or
signals the suite cannot choose).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import json_format

from refengine.conformance.assertions import INVALID, NON_OK, expect_rejected, expect_valid, stream_violations
from refengine.conformance.checks_media import PNG_SIGNATURE, _png, rgb_png
from refengine.conformance.registry import CheckFailed, check, expect, fail, skip
from refengine.conformance.target import Target
from refengine.protocol import oe
from refengine.protocol.v1alpha1 import media_pb2 as media
from refengine.protocol.v1alpha1 import media_pb2_grpc as media_grpc

PROFILES_KEY = "refengine.profiles"
PROFILE, VERSION, STATUS = "encoder", "v1alpha1", "draft"
SIDES = ("encoder", "consumer")
EXTRA_MEDIA_HANDLES = "refengine.v1alpha1.media_handles"
LOAD_PREFIX = "refengine.v1alpha1."
#: ENC15: the encoder's LoadInfo.attributes, each ``refengine.v1alpha1.<name>``.
ACCOUNTING = ("held_handles", "held_rows", "cached_rows", "free_rows", "total_rows", "cached_entries",
              "cache_hits", "cache_misses")
ALGORITHMS = ("refengine-rgb8-sha256", "uuid")
DTYPES = ("float32", "bfloat16", "float16")
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]", "*")
ENCODER_FLAG, PLACEHOLDER_FLAG = "--encoder HOST:PORT", "--media-placeholder-token-id N"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_images = itertools.count()


# -- discovery (ENC1) -------------------------------------------------------------------
def profile_problems(value: Any) -> list[str]:
    """What breaks the discovery convention in a ``ServerInfo.extra["refengine.profiles"]`` value
    (already a Python value: a list of ``{"name", "version", "status", "sides"}``); empty = fine.
    The ``encoder`` v1alpha1 entry must also say status ``draft`` and name one known side."""
    if not isinstance(value, list):
        return [f"{PROFILES_KEY} is {type(value).__name__} {value!r}, not a list of profile objects"]
    problems, seen = [], set()
    for i, entry in enumerate(value):
        if not isinstance(entry, dict):
            problems.append(f"{PROFILES_KEY}[{i}] is {type(entry).__name__} {entry!r}, not an object")
            continue
        for key in ("name", "version", "status"):
            if not isinstance(entry.get(key), str) or not entry.get(key):
                problems.append(f"{PROFILES_KEY}[{i}].{key} is {entry.get(key)!r}, not a non-empty string")
        sides = entry.get("sides")
        if not isinstance(sides, list) or not all(isinstance(s, str) and s for s in sides):
            problems.append(f"{PROFILES_KEY}[{i}].sides is {sides!r}, not a list of strings")
            sides = []
        ident = (entry.get("name"), entry.get("version"))
        if ident in seen:
            problems.append(f"{PROFILES_KEY}[{i}]: {ident[0]!r} {ident[1]!r} listed twice")
        seen.add(ident)
        if ident == (PROFILE, VERSION):
            if entry.get("status") != STATUS:
                problems.append(f"{PROFILES_KEY}[{i}]: encoder v1alpha1 has status {entry.get('status')!r}, "
                                f"not {STATUS!r}")
            unknown = [s for s in sides if s not in SIDES]
            if unknown or not sides:
                problems.append(f"{PROFILES_KEY}[{i}]: encoder sides {sides!r}; each is one of {list(SIDES)}, "
                                "at least one")
            if set(SIDES) <= set(sides):
                problems.append(f"{PROFILES_KEY}[{i}]: both sides {list(SIDES)} on one server (side consumer is "
                                "for any role but encoder)")
    return problems


def _extra(server: Target) -> dict[str, Any]:
    return json_format.MessageToDict(server.server_info.extra)


def claimed_sides(server: Target) -> set[str]:
    """The sides of the ``encoder`` v1alpha1 entry ``server`` lists; empty when it lists none
    (or only another version, which these checks do not cover)."""
    value = _extra(server).get(PROFILES_KEY)
    if not isinstance(value, list):
        return set()
    sides: set[str] = set()
    for entry in value:
        if isinstance(entry, dict) and (entry.get("name"), entry.get("version")) == (PROFILE, VERSION):
            listed = entry.get("sides")
            if isinstance(listed, list):
                sides |= {s for s in listed if isinstance(s, str)}
    return sides


@dataclass
class Setup:
    """The servers of this run: the target's sides and the ``--encoder`` server (connected)."""

    target_sides: set[str]
    extra_encoder: Target | None  # the --encoder server, when it is not the target
    encoder_sides: set[str]  # of the --encoder server (or of the target when it is that)


def _setup(t: Target) -> Setup:
    """Connect the ``--encoder`` server once (cached on ``t``); skip every ENC check as "not
    claimed" when no server involved lists the profile."""
    if "enc_setup" not in t.cache:
        if "enc_connect_error" in t.cache:
            fail(t.cache["enc_connect_error"])
        address = t.options.encoder_address
        extra = None
        if address and address != t.address:
            try:
                extra = Target(address, t.options).connect()
            except Exception as exc:  # noqa: BLE001 - any connect failure: every ENC check fails with it
                t.cache["enc_connect_error"] = f"--encoder {address}: cannot connect: {type(exc).__name__}: {exc}"
                fail(t.cache["enc_connect_error"])
        target_sides = claimed_sides(t)
        encoder_sides = claimed_sides(extra) if extra is not None else (target_sides if address else set())
        t.cache["enc_setup"] = Setup(target_sides, extra, encoder_sides)
    setup: Setup = t.cache["enc_setup"]
    if not setup.target_sides and not setup.encoder_sides:
        listed = f"ServerInfo.extra[{PROFILES_KEY!r}]"
        if t.options.encoder_address:
            skip(f"profile {PROFILE!r} {VERSION} not claimed: neither the target {t.address} nor the --encoder "
                 f"server {t.options.encoder_address} lists it in {listed}")
        skip(f"profile {PROFILE!r} {VERSION} not claimed: the target {t.address} does not list it in {listed} "
             f"(an encoder server is named with {ENCODER_FLAG})")
    return setup


def _encoder(t: Target) -> Target:
    """The encoder server: ``--encoder``, else the target when it lists side encoder; else skip."""
    setup = _setup(t)
    if t.options.encoder_address:
        server = setup.extra_encoder or t
        if "encoder" not in setup.encoder_sides:
            skip(f"the --encoder server {server.address} does not list side 'encoder' (sides "
                 f"{sorted(setup.encoder_sides)}; ENC1 fails)")
        return server
    if "encoder" not in setup.target_sides:
        skip(f"needs an encoder server: run with {ENCODER_FLAG} (a server listing side 'encoder'); the target "
             f"lists sides {sorted(setup.target_sides)}")
    return t


def _consumer(t: Target, roles: Sequence[int] = (oe.ENGINE_ROLE_AGGREGATED, oe.ENGINE_ROLE_PREFILL),
              why: str = "") -> tuple[Target, int]:
    """(the encoder, the image placeholder id) for a check sending handles to the target; skips
    naming everything that is missing."""
    setup = _setup(t)
    missing = []
    if "consumer" not in setup.target_sides:
        missing.append(f"the target listing side 'consumer' (it lists {sorted(setup.target_sides)})")
    elif t.server_info.engine_role not in roles:
        missing.append(f"an {'/'.join(oe.EngineRole.Name(r).removeprefix('ENGINE_ROLE_') for r in roles)} target "
                       f"(it is {oe.EngineRole.Name(t.server_info.engine_role)}{why})")
    if "encoder" not in (setup.encoder_sides if t.options.encoder_address else setup.target_sides):
        missing.append(f"an encoder server ({ENCODER_FLAG}, listing side 'encoder')")
    token = t.options.media_placeholder_token_id
    if token is None:
        missing.append(f"the model's image placeholder token id ({PLACEHOLDER_FLAG})")
    if missing:
        skip("needs " + "; ".join(missing))
    return _encoder(t), token


# -- the Media service ------------------------------------------------------------------------
class Media:
    """``refengine.v1alpha1.Media`` on one server, every call with a deadline (Encode: the stream
    timeout, it computes; the others: the unary one). Remembers every handle it made, so that
    :meth:`close` releases them all."""

    def __init__(self, server: Target) -> None:
        self.server = server
        self.stub = media_grpc.MediaStub(server.channel)
        self.made: list[str] = []

    def encode(self, *items: Any, lease: float | None = None, model: str = "") -> list[Any]:
        request = media.EncodeRequest(model=model, items=list(items))
        if lease is not None:
            request.lease_seconds = lease
        reply = self.stub.Encode(request, timeout=self.server.options.stream_timeout_s)
        self.made.extend(h.handle_id for h in reply.handles)
        return list(reply.handles)

    def encode_one(self, data: bytes, what: str = "one image", **kw: Any) -> Any:
        handles = self.encode(image_item(data), **kw)
        expect(len(handles) == 1, f"Encode of {what} returned {len(handles)} handles, want exactly 1")
        return handles[0]

    def release(self, handle_ids: Sequence[str]) -> int:
        reply = self.stub.Release(media.ReleaseRequest(handle_ids=list(handle_ids)),
                                  timeout=self.server.options.rpc_timeout_s)
        return reply.released

    def renew(self, handle_id: str, lease: float) -> int:
        reply = self.stub.RenewLease(media.RenewLeaseRequest(handle_id=handle_id, lease_seconds=lease),
                                     timeout=self.server.options.rpc_timeout_s)
        return reply.lease_expires_unix_nanos

    def close(self) -> None:
        if self.made:
            with suppress(grpc.RpcError):
                self.release(self.made)
            self.made = []


@contextmanager
def _media(server: Target) -> Iterator[Media]:
    m = Media(server)
    try:
        yield m
    finally:
        m.close()


def _code(fn: Any, *args: Any, **kw: Any) -> tuple[grpc.StatusCode, Any, str]:
    """(status, reply or None, details) of one call."""
    try:
        return grpc.StatusCode.OK, fn(*args, **kw), ""
    except grpc.RpcError as err:
        return err.code(), None, err.details() or ""


def image_item(data: bytes) -> Any:
    return oe.MediaItem(modality=oe.MODALITY_IMAGE, raw_bytes=data, mime_type="image/png")


def unique_png(t: Target, tag: str, size: int = 64) -> bytes:
    """An RGB PNG of seeded noise, different for every call, check and run."""
    seed = f"{t.new_id(tag)}-{next(_images)}".encode()
    need = size * size * 3
    noise = b"".join(hashlib.sha256(seed + i.to_bytes(4, "big")).digest() for i in range(need // 32 + 1))
    rows = b"".join(b"\x00" + noise[y * size * 3:(y + 1) * size * 3] for y in range(size))
    return _png(size, size, 2, rows)


def attributes(server: Target) -> dict[str, float]:
    """The ``refengine.v1alpha1.*`` numbers of the server's LoadInfo.attributes (names without the prefix)."""
    fields = server.load().attributes.fields
    return {k.removeprefix(LOAD_PREFIX): v.number_value for k, v in fields.items()
            if k.startswith(LOAD_PREFIX) and v.WhichOneof("kind") == "number_value"}


def _held(server: Target) -> int | None:
    value = attributes(server).get("held_handles")
    return None if value is None else int(value)


def _handle_problems(h: Any, now_ns: int) -> list[str]:
    """ENC5: what is wrong with one handle's fields."""
    problems = []
    if not h.handle_id:
        problems.append("handle_id is empty")
    if h.mm_hash_algorithm not in ALGORITHMS:
        problems.append(f"mm_hash_algorithm {h.mm_hash_algorithm!r} is not one of {list(ALGORITHMS)}")
    elif h.mm_hash_algorithm == ALGORITHMS[0] and not _HEX64.fullmatch(h.mm_hash):
        problems.append(f"mm_hash {h.mm_hash!r} is not 64 lowercase hex digits ({ALGORITHMS[0]})")
    elif not h.mm_hash:
        problems.append("mm_hash is empty")
    if h.modality != oe.MODALITY_IMAGE:
        problems.append(f"modality {oe.Modality.Name(h.modality)}, the item was an image")
    if len(h.shape) != 2 or not all(h.shape):
        problems.append(f"shape {list(h.shape)} is not [num_tokens, hidden_size], both positive")
    elif h.num_tokens != h.shape[0]:
        problems.append(f"num_tokens {h.num_tokens} != shape[0] {h.shape[0]}")
    if h.dtype not in DTYPES:
        problems.append(f"dtype {h.dtype!r} is not one of {list(DTYPES)}")
    if len(h.shape) == 2:
        want = f"refengine-embeddings/1:row-major:{h.shape[1]}:{h.dtype}"
        if h.layout != want:
            problems.append(f"layout {h.layout!r}, want {want!r} (the profile's layout of these shape and dtype)")
    if not _HEX64.fullmatch(h.fingerprint):
        problems.append(f"fingerprint {h.fingerprint!r} is not a hex sha256 (64 lowercase hex digits)")
    if not h.transfers:
        problems.append("no transfer")
    for transfer in h.transfers:
        if not transfer.backend:
            problems.append("a transfer without backend")
        if not transfer.endpoints or not all(e.host not in WILDCARD_HOSTS and 0 < e.port < 65536
                                             for e in transfer.endpoints):
            problems.append(f"transfer {transfer.backend!r}: endpoints {[(e.host, e.port) for e in transfer.endpoints]}"
                            " are not a routable host:port")
    if h.transfers and "grpc" not in [tr.backend for tr in h.transfers]:
        problems.append(f"transfers {[tr.backend for tr in h.transfers]} do not include 'grpc' (always offered)")
    if h.lease_expires_unix_nanos <= now_ns:
        problems.append(f"lease_expires_unix_nanos {h.lease_expires_unix_nanos} is not in the future (now {now_ns})")
    return problems


# -- consumer requests ---------------------------------------------------------------------
def _image_request(t: Target, token: int, tag: str, data: bytes, max_tokens: int = 4) -> Any:
    """Token ids holding the placeholder once, the image as a raw media item; greedy, ignore_eos."""
    text = [i for i in t.known_token_ids() if i != token]
    expect(len(text) >= 4, f"too few known token ids other than the placeholder {token}: {text}")
    req = t.request(tag, token_ids=[*text[:4], token, text[0]], max_tokens=max_tokens, ignore_eos=True)
    req.media.append(image_item(data))
    return req


def handle_json(handle: Any, snake_case: bool = False) -> dict[str, Any]:
    """An EmbeddingHandle in the proto3 JSON mapping (ENC10; uint64 as a decimal string)."""
    return json_format.MessageToDict(handle, preserving_proto_field_name=snake_case)


def with_handles(t: Target, req: Any, handles: Sequence[Any] | None = None, value: Any = None,
                 keep_media: bool = False) -> Any:
    """``req`` with a new id, its media items removed (unless ``keep_media``) and
    ``extra[media_handles]`` = the handles' JSON (or ``value`` as given)."""
    out = oe.GenerateRequest()
    out.CopyFrom(req)
    out.request_id = t.new_id("enc-handles")
    if not keep_media:
        del out.media[:]
    out.extra.update({EXTRA_MEDIA_HANDLES: value if handles is None else [handle_json(h) for h in handles]})
    return out


def _genuine_accepted(t: Target, req: Any) -> None:
    """The control after refusals: the same request with the genuine handle is accepted and ends
    OK (so the refusals were about what was changed, and the handle was not fetched before
    acceptance). A PREFILL target's KV session is aborted afterwards."""
    res = expect_valid(t.generate(req), what="the same request with the genuine handle, after the refusals "
                       "(nothing may be fetched before acceptance)")
    for ready in res.of("prefill_ready"):
        t.unary_code("Abort", oe.AbortRequest(kv_session=ready.kv_session))


def tampered(handle: Any, **fields: Any) -> Any:
    copy = media.EmbeddingHandle()
    copy.CopyFrom(handle)
    for name, value in fields.items():
        if name in ("shape", "transfers"):
            del getattr(copy, name)[:]
            getattr(copy, name).extend(value)
        else:
            setattr(copy, name, value)
    return copy


# -- ENC1 ------------------------------------------------------------------------------------
@check("ENC1", "ServerInfo.extra['refengine.profiles'] lists 'encoder' well-formed, sides matching each role")
def profile_listed(t: Target) -> str:
    """ENC1: each server involved (the target, the --encoder server) lists a well-formed profiles
    value; side ``encoder`` on an encoder (engine_role UNSPECIFIED), side ``consumer`` on a
    multimodal server of a release role; the --encoder server lists side encoder."""
    setup = _setup(t)
    servers = [("the target", t)]
    if setup.extra_encoder is not None:
        servers.append((f"the --encoder server {setup.extra_encoder.address}", setup.extra_encoder))
    problems, notes = [], []
    for label, server in servers:
        extra = _extra(server)
        if PROFILES_KEY not in extra:
            notes.append(f"{label}: no profiles")
            continue
        problems += [f"{label}: {p}" for p in profile_problems(extra[PROFILES_KEY])]
        sides = claimed_sides(server)
        role = oe.EngineRole.Name(server.server_info.engine_role)
        multimodal = server.model_info.HasField("supports_multimodal") and server.model_info.supports_multimodal
        if "encoder" in sides and server.server_info.engine_role != oe.ENGINE_ROLE_UNSPECIFIED:
            problems.append(f"{label} lists side 'encoder' but reports engine_role {role} (an encoder reports "
                            "UNSPECIFIED, ENC2)")
        if "consumer" in sides and server.server_info.engine_role == oe.ENGINE_ROLE_UNSPECIFIED:
            problems.append(f"{label} lists side 'consumer' with engine_role UNSPECIFIED (consumers are "
                            "aggregated, prefill or decode servers)")
        if sides and not multimodal:
            problems.append(f"{label} lists sides {sorted(sides)} but does not say supports_multimodal = true")
        notes.append(f"{label}: sides {sorted(sides)} ({role.removeprefix('ENGINE_ROLE_')})")
    if t.options.encoder_address and "encoder" not in setup.encoder_sides:
        problems.append(f"the --encoder server {t.options.encoder_address} does not list side 'encoder' "
                        f"(sides {sorted(setup.encoder_sides)})")
    expect(not problems, "; ".join(problems[:5]))
    return "; ".join(notes)


# -- ENC2 ------------------------------------------------------------------------------------
@check("ENC2", "an encoder reports engine_role UNSPECIFIED, no generation, refuses Generate before acceptance")
def encoder_role(t: Target) -> str:
    """ENC2: engine_role UNSPECIFIED; ModelInfo: no text or token-id input, supports_multimodal =
    true; Generate → FAILED_PRECONDITION naming the role mismatch, no events; LoRA →
    FAILED_PRECONDITION (R5, nothing of its own)."""
    enc = _encoder(t)
    role = enc.server_info.engine_role
    expect(role == oe.ENGINE_ROLE_UNSPECIFIED, f"engine_role {oe.EngineRole.Name(role)}, want UNSPECIFIED "
           "(the release has no encoder role)")
    info = enc.model_info
    inputs = [name for name in ("supports_text_input", "supports_token_ids_input")
              if not info.HasField(name) or getattr(info, name)]
    expect(not inputs, f"ModelInfo {inputs} not false: an encoder advertises no generation input")
    expect(info.HasField("supports_multimodal") and info.supports_multimodal,
           "ModelInfo.supports_multimodal is not true on an encoder")
    res = enc.generate(enc.request("enc2-generate", token_ids=[100, 101, 102, 103], max_tokens=2))
    expect_rejected(res, codes=(grpc.StatusCode.FAILED_PRECONDITION,), what="Generate on an encoder")
    expect("role" in res.details.lower(), f"the refusal {res.details!r} does not name the role mismatch")
    code, _ = enc.unary_code("ListLoras", oe.ListLorasRequest())
    expect(code == grpc.StatusCode.FAILED_PRECONDITION, f"ListLoras on an encoder: {code.name}, want "
           "FAILED_PRECONDITION (no LoRA)")
    return f"Generate refused: {res.details[:60]!r}"


@check("ENC2", "an encoder's inference probe encodes an image and holds no handle")
def encoder_health_probe(t: Target) -> str:
    """ENC2: Health(include_inference_probe) on an encoder is READY (the probe encodes one small
    image) and leaves held_handles where it was (no handle)."""
    enc = _encoder(t)
    before = _held(enc)
    health = enc.unary("Health", oe.HealthRequest(include_inference_probe=True))
    expect(health.state == oe.HEALTH_STATE_READY, f"Health with the probe: {oe.HealthState.Name(health.state)} "
           f"{[(c.name, c.message) for c in health.checks]}")
    after = _held(enc)
    expect(before == after, f"held_handles {before} before the probe, {after} after: the probe holds no handle")
    return f"READY, checks {[c.name for c in health.checks]}"


@check("ENC2", "a server that is not an encoder answers Media with UNIMPLEMENTED")
def media_only_on_encoders(t: Target) -> str:
    """ENC2: Media is served only by encoder servers: Encode, Release and RenewLease on the
    target (when it is not the encoder) → UNIMPLEMENTED."""
    setup = _setup(t)
    if "encoder" in setup.target_sides:
        skip("the target is the encoder: no other server to ask (run against a consumer with "
             f"{ENCODER_FLAG})")
    m = Media(t)
    calls = {"Encode": lambda: m.encode(image_item(rgb_png())),
             "Release": lambda: m.release([t.new_id("enc2-unknown")]),
             "RenewLease": lambda: m.renew(t.new_id("enc2-unknown"), 10.0)}
    got = {name: _code(fn)[0] for name, fn in calls.items()}
    m.close()  # should there have been a handle
    wrong = {name: code.name for name, code in got.items() if code != grpc.StatusCode.UNIMPLEMENTED}
    expect(not wrong, f"Media on a non-encoder target: {wrong}, want UNIMPLEMENTED")
    return "Encode, Release, RenewLease → UNIMPLEMENTED"


# -- ENC3 ------------------------------------------------------------------------------------
@check("ENC3", "Encode refuses empty items, undecodable or source-less media, an unknown model; all or nothing")
def encode_refusals(t: Target) -> str:
    """ENC3: no items, bytes that are not an image, an item with no source, an audio item, and a
    valid item next to a bad one → INVALID_ARGUMENT; an unknown model → NOT_FOUND; after each
    refusal no handle is held (held_handles unchanged). The served name is accepted."""
    enc = _encoder(t)
    bad_image = image_item(b"oeconf: this is not an image")
    no_source = oe.MediaItem(modality=oe.MODALITY_IMAGE, mime_type="image/png")
    audio = oe.MediaItem(modality=oe.MODALITY_AUDIO, raw_bytes=b"RIFF\x00\x00\x00\x00WAVE", mime_type="audio/wav")
    cases = {"no items": ((), "", INVALID),
             "undecodable image bytes": ((bad_image,), "", INVALID),
             "a PNG signature, then garbage": ((image_item(PNG_SIGNATURE + b"\x00garbage" * 8),), "", INVALID),
             "an item without source": ((no_source,), "", INVALID),
             "an audio item": ((audio,), "", INVALID),
             "a valid image, then undecodable bytes": ((image_item(unique_png(t, "enc3")), bad_image), "", INVALID),
             "an unknown model": ((image_item(unique_png(t, "enc3")),), f"oeconf-no-such-model-{t.new_id()}",
                                  (grpc.StatusCode.NOT_FOUND,))}
    with _media(enc) as m:
        before = _held(enc)
        problems = []
        for what, (items, model, codes) in cases.items():
            code, reply, details = _code(m.encode, *items, model=model)
            if code not in codes:
                problems.append(f"{what}: {code.name} ({details[:80]!r}), want {'/'.join(c.name for c in codes)}")
            held = _held(enc)
            if before is not None and held != before:
                problems.append(f"{what}: held_handles {before} → {held} after a refusal (all or nothing)")
        expect(not problems, "; ".join(problems[:4]))
        handle = m.encode_one(unique_png(t, "enc3-named"), "an image for the served model name", model=enc.model)
        m.close()
    return f"{len(cases)} refusals, nothing held; model {enc.model!r} accepted ({handle.num_tokens} tokens)"


# -- ENC4 ------------------------------------------------------------------------------------
@check("ENC4", "the same image encoded again is a cache hit: cached = true, same mm_hash, a new handle_id")
def encoder_cache_hit(t: Target) -> str:
    """ENC4: an image never encoded before is a miss (cached = false); Encode of the same image
    again (the first handle still live) says cached = true with the same mm_hash, shape and
    fingerprint and a new handle_id (idempotent by content, new handles)."""
    enc = _encoder(t)
    data = unique_png(t, "enc4")
    with _media(enc) as m:
        first = m.encode_one(data)
        again = m.encode_one(data)
    expect(not first.cached, "the first Encode of an image never seen before says cached = true")
    expect(again.cached, "the second Encode of the same image says cached = false")
    expect(again.mm_hash == first.mm_hash and again.mm_hash_algorithm == first.mm_hash_algorithm,
           f"mm_hash differs: {first.mm_hash_algorithm}:{first.mm_hash} vs {again.mm_hash_algorithm}:{again.mm_hash}")
    expect(again.handle_id != first.handle_id, f"both Encodes returned handle_id {first.handle_id!r}")
    expect(list(again.shape) == list(first.shape) and again.fingerprint == first.fingerprint,
           f"shape/fingerprint differ: {list(first.shape)} {first.fingerprint[:12]} vs "
           f"{list(again.shape)} {again.fingerprint[:12]}")
    return f"mm_hash {first.mm_hash[:12]}…, second cached"


# -- ENC5 ------------------------------------------------------------------------------------
@check("ENC5", "a handle's fields are well-formed: ids, identity, shape, dtype, layout, fingerprint, transfers, lease")
def handle_fields(t: Target) -> str:
    """ENC5: one image → exactly one handle: non-empty handle_id, a known mm_hash_algorithm with a
    well-formed mm_hash, modality IMAGE, shape [num_tokens, hidden] with num_tokens = shape[0],
    dtype, the profile's layout, a hex fingerprint, transfers each with a routable endpoint (grpc
    among them), a lease end in the future; two items → two handles with distinct ids."""
    enc = _encoder(t)
    with _media(enc) as m:
        now = time.time_ns()
        handle = m.encode_one(rgb_png(), "one 64x64 PNG")
        problems = _handle_problems(handle, now)
        pair = m.encode(image_item(unique_png(t, "enc5")), image_item(unique_png(t, "enc5")))
        expect(len(pair) == 2, f"Encode of 2 items returned {len(pair)} handles")
        problems += [f"item {i}: {p}" for i, h in enumerate(pair) for p in _handle_problems(h, now)]
        ids = [handle.handle_id, *(h.handle_id for h in pair)]
        if len(set(ids)) != len(ids):
            problems.append(f"handle ids not unique: {ids}")
    expect(not problems, "; ".join(problems[:5]))
    lease_s = (handle.lease_expires_unix_nanos - now) / 1e9
    return (f"shape {list(handle.shape)} {handle.dtype}, {handle.mm_hash_algorithm}, transfers "
            f"{[tr.backend for tr in handle.transfers]}, default lease ≈ {lease_s:.0f} s")


@check("ENC5", "Encode's lease_seconds: zero, negative or not finite refused; above the maximum bounded")
def lease_bounds(t: Target) -> str:
    """ENC5: lease_seconds 0, -1, NaN, +inf → INVALID_ARGUMENT (nothing held); 30 → a lease end
    within 30 s from now; 1e9 (above any maximum) → accepted, bounded."""
    enc = _encoder(t)
    data = unique_png(t, "enc5-lease")
    with _media(enc) as m:
        before = _held(enc)
        wrong = {}
        for lease in (0.0, -1.0, math.nan, math.inf):
            code, _, details = _code(m.encode, image_item(data), lease=lease)
            if code != grpc.StatusCode.INVALID_ARGUMENT:
                wrong[str(lease)] = f"{code.name} ({details[:60]!r})"
        expect(not wrong, f"lease_seconds refused with the wrong status: {wrong}, want INVALID_ARGUMENT")
        held = _held(enc)
        expect(before == held, f"held_handles {before} → {held} after refused leases")
        now = time.time_ns()
        short = m.encode_one(data, lease=30.0)
        end = (short.lease_expires_unix_nanos - now) / 1e9
        expect(0 < end <= 30.0 + 5.0, f"lease_seconds 30 → the lease ends in {end:.1f} s")
        now = time.time_ns()
        long = m.encode_one(data, lease=1e9)
        long_end = (long.lease_expires_unix_nanos - now) / 1e9
        expect(long_end > 0, f"lease_seconds 1e9 → the lease ends in {long_end:.1f} s")
    return f"4 refused; 30 s → {end:.1f} s; 1e9 s → bounded to {long_end:.0f} s"


# -- ENC6, ENC7 --------------------------------------------------------------------------------
@check("ENC6", "Release is idempotent: live ids counted once, released, unknown ids are no error")
def release_idempotent(t: Target) -> str:
    """ENC6: Release([a]) = 1; again = 0; an unknown id = 0; [b, a, unknown] = 1; [] = 0; no error."""
    enc = _encoder(t)
    with _media(enc) as m:
        a, b = m.encode(image_item(unique_png(t, "enc6")), image_item(unique_png(t, "enc6")))
        unknown = t.new_id("enc6-unknown")
        steps = [("[a]", [a.handle_id], 1), ("[a] again", [a.handle_id], 0), ("[unknown]", [unknown], 0),
                 ("[b, a, unknown]", [b.handle_id, a.handle_id, unknown], 1), ("[]", [], 0),
                 ("[b] again", [b.handle_id], 0)]
        wrong = []
        for what, ids, want in steps:
            code, released, details = _code(m.release, ids)
            if code != grpc.StatusCode.OK or released != want:
                wrong.append(f"Release {what}: {code.name} {details[:60]!r} released={released}, want {want}")
    expect(not wrong, "; ".join(wrong))
    return f"{len(steps)} releases as expected"


@check("ENC6", "Abort(kv_session) naming a handle id on the encoder releases the handle")
def abort_releases_handle(t: Target) -> str:
    """ENC6 (A2): Abort(kv_session = {session_id: handle_id}) on the encoder → ABORTED, the handle
    is released (Release counts 0 afterwards); the same Abort again → NOT_FOUND."""
    enc = _encoder(t)
    with _media(enc) as m:
        handle = m.encode_one(unique_png(t, "enc6-abort"))
        session = oe.KvSessionRef(session_id=handle.handle_id)
        code, reply = enc.unary_code("Abort", oe.AbortRequest(kv_session=session))
        expect(code == grpc.StatusCode.OK and reply.status == oe.ABORT_STATUS_ABORTED,
               f"Abort(kv_session) of a live handle: {code.name} "
               f"{oe.AbortStatus.Name(reply.status) if reply is not None else ''}, want ABORTED")
        released = m.release([handle.handle_id])
        expect(released == 0, f"Release after Abort(kv_session) counted {released}: the abort did not release it")
        code, _ = enc.unary_code("Abort", oe.AbortRequest(kv_session=session))
        expect(code == grpc.StatusCode.NOT_FOUND, f"Abort(kv_session) of a released handle: {code.name}, "
               "want NOT_FOUND (A2)")
    return "ABORTED, released, then NOT_FOUND"


@check("ENC7", "RenewLease extends a live handle's lease; a released or unknown one → NOT_FOUND")
def renew_lease(t: Target) -> str:
    """ENC7: RenewLease(60) on a handle leased for 5 s returns a later end (within 60 s from now);
    lease_seconds 0 → INVALID_ARGUMENT; after Release, and for an unknown id → NOT_FOUND."""
    enc = _encoder(t)
    with _media(enc) as m:
        handle = m.encode_one(unique_png(t, "enc7"), lease=5.0)
        now = time.time_ns()
        renewed = m.renew(handle.handle_id, 60.0)
        expect(renewed > handle.lease_expires_unix_nanos, f"renewed end {renewed} is not after the first "
               f"{handle.lease_expires_unix_nanos}")
        expect(renewed <= now + int(65e9), f"RenewLease(60) → the lease ends in {(renewed - now) / 1e9:.1f} s")
        code, _, details = _code(m.renew, handle.handle_id, 0.0)
        expect(code == grpc.StatusCode.INVALID_ARGUMENT, f"RenewLease(0): {code.name} ({details!r}), want "
               "INVALID_ARGUMENT")
        expect(m.release([handle.handle_id]) == 1, "Release of the renewed handle did not count it")
        code, _, details = _code(m.renew, handle.handle_id, 60.0)
        expect(code == grpc.StatusCode.NOT_FOUND, f"RenewLease of a released handle: {code.name} ({details!r})")
        code, _, details = _code(m.renew, t.new_id("enc7-unknown"), 60.0)
        expect(code == grpc.StatusCode.NOT_FOUND, f"RenewLease of an unknown id: {code.name} ({details!r})")
    return f"renewed +{(renewed - handle.lease_expires_unix_nanos) / 1e9:.1f} s; released → NOT_FOUND"


@check("ENC7", "a handle whose lease ends is gone by itself: no longer held, RenewLease → NOT_FOUND")
def lease_expires(t: Target) -> str:
    """ENC7 (ENC6: expired is a terminal state): a handle leased for 1 s, left alone, is no longer
    held shortly after its lease end (held_handles back, polled up to 5 s past it) and RenewLease
    then → NOT_FOUND."""
    enc = _encoder(t)
    with _media(enc) as m:
        before = _held(enc)
        handle = m.encode_one(unique_png(t, "enc7-expiry"), lease=1.0)
        end = handle.lease_expires_unix_nanos / 1e9
        expect(end - time.time() <= 6.0, f"lease_seconds 1 → the lease ends in {end - time.time():.1f} s")
        time.sleep(max(0.0, end - time.time()) + 0.1)
        deadline = time.monotonic() + 5.0
        while (held := _held(enc)) != before and time.monotonic() < deadline:
            time.sleep(0.1)
        expect(held == before, f"held_handles {held} 5 s after the lease end, {before} before the Encode")
        code, _, details = _code(m.renew, handle.handle_id, 30.0)
        expect(code == grpc.StatusCode.NOT_FOUND, f"RenewLease of an expired handle: {code.name} ({details!r}), "
               "want NOT_FOUND")
    return "expired by itself, then NOT_FOUND"


# -- consumers: ENC9, ENC10, ENC11, ENC13 --------------------------------------------------------
@check("ENC9", "a handle a consumer pulled is released by it: gone on the encoder after the request")
def pulled_handle_released(t: Target) -> str:
    """ENC9/ENC6: after a consumer's request with a handle completes, the handle is consumed:
    RenewLease → NOT_FOUND (polled briefly), Release counts 0."""
    enc, token = _consumer(t, (oe.ENGINE_ROLE_AGGREGATED,), ": a PREFILL stream ends in a KV session")
    with _media(enc) as m:
        data = unique_png(t, "enc9")
        handle = m.encode_one(data)
        req = with_handles(t, _image_request(t, token, "enc9", data, max_tokens=2), [handle])
        expect_valid(t.generate(req), what="a request with one handle")
        deadline = time.monotonic() + 5.0
        while (code := _code(m.renew, handle.handle_id, 30.0)[0]) == grpc.StatusCode.OK \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        expect(code == grpc.StatusCode.NOT_FOUND, f"RenewLease of a pulled handle: {code.name}, want NOT_FOUND "
               "(the consumer releases what it pulled)")
        released = m.release([handle.handle_id])
        expect(released == 0, f"Release of a pulled handle counted {released}")
    t.wait_idle("ENC9")
    return "consumed by the pull"


@check("ENC10", "a handle in extra fills the placeholder: the same tokens as the raw image")
def handle_equals_raw_image(t: Target) -> str:
    """ENC10: the request with the raw image and the same request with a handle of it
    (extra[refengine.v1alpha1.media_handles], lowerCamelCase JSON) complete with equal greedy
    tokens; so does a handle in proto field names with an unknown field added (ignored)."""
    enc, token = _consumer(t, (oe.ENGINE_ROLE_AGGREGATED,), ": no tokens to compare")
    data = unique_png(t, "enc10")
    raw = _image_request(t, token, "enc10-raw", data)
    want = expect_valid(t.generate(raw), what="the request with the raw image")
    expect(bool(want.tokens()), f"the raw-image request produced no tokens: {want.describe()}")
    with _media(enc) as m:
        handle = m.encode_one(data)
        got = expect_valid(t.generate(with_handles(t, raw, [handle])), what="the same request with a handle")
        expect(got.tokens() == want.tokens(), f"with a handle {got.tokens()} != with the image {want.tokens()}")
        other = m.encode_one(data)
        snake = handle_json(other, snake_case=True)
        snake["oeconf_future_field"] = {"ignored": True}
        alt = expect_valid(t.generate(with_handles(t, raw, value=[snake])),
                           what="a handle in proto field names with an unknown field")
        expect(alt.tokens() == want.tokens(), f"handle in proto field names {alt.tokens()} != {want.tokens()}")
    t.wait_idle("ENC10")
    usage = got.usage()
    cached = f", cached_prompt_tokens {usage.cached_prompt_tokens}" if usage is not None and usage.HasField(
        "cached_prompt_tokens") else ""
    return f"{len(want.tokens())} tokens equal (camelCase and snake_case + unknown field){cached}"


@check("ENC10", "a malformed handles value, or items and handles together, is refused before acceptance")
def handles_value_refused(t: Target) -> str:
    """ENC10 (G8): extra[media_handles] a string, a list of numbers, an object that is not an
    EmbeddingHandle → INVALID_ARGUMENT, no events; items and handles together, and two handles
    for one placeholder → refused before acceptance. Then the same request with the handle alone
    is accepted and ends OK (the handle stayed live: nothing is pulled before acceptance)."""
    enc, token = _consumer(t)
    data = unique_png(t, "enc10v")
    raw = _image_request(t, token, "enc10v", data, max_tokens=2)
    with _media(enc) as m:
        handle = m.encode_one(data)
        cases = {"a string": (with_handles(t, raw, value="a handle"), INVALID),
                 "a list of numbers": (with_handles(t, raw, value=[1, 2]), INVALID),
                 "an object that is not an EmbeddingHandle": (with_handles(t, raw, value=[{"shape": "wide"}]),
                                                              INVALID),
                 "items and handles together": (with_handles(t, raw, [handle], keep_media=True), NON_OK),
                 "two handles, one placeholder": (with_handles(t, raw, [handle, handle]), NON_OK)}
        codes = {}
        for what, (req, want) in cases.items():
            res = t.generate(req)
            expect_rejected(res, codes=want, what=f"extra[{EXTRA_MEDIA_HANDLES!r}] {what}")
            codes[what] = res.code.name
        _genuine_accepted(t, with_handles(t, raw, [handle]))
    t.wait_idle("ENC10")
    return f"{len(cases)} refused before acceptance ({', '.join(sorted(set(codes.values())))})"


@check("ENC11", "a handle incompatible with the consumer is refused before acceptance, naming the field")
def incompatible_handle_refused(t: Target) -> str:
    """ENC11: a handle with another fingerprint, shape, dtype, modality, an unknown
    mm_hash_algorithm, a malformed mm_hash, an empty handle_id or no transfer → INVALID_ARGUMENT
    naming the field, no events; then the genuine handle is accepted and ends OK (it was not
    fetched before acceptance)."""
    enc, token = _consumer(t)
    data = unique_png(t, "enc11")
    raw = _image_request(t, token, "enc11", data, max_tokens=2)
    with _media(enc) as m:
        h = m.encode_one(data)
        n = h.num_tokens
        cases = {"fingerprint": tampered(h, fingerprint="0" * 64 if h.fingerprint != "0" * 64 else "1" * 64),
                 "shape": tampered(h, shape=[n + 1, *h.shape[1:]], num_tokens=n + 1),
                 "dtype": tampered(h, dtype="bfloat16" if h.dtype != "bfloat16" else "float16"),
                 "modality": tampered(h, modality=oe.MODALITY_AUDIO),
                 "mm_hash_algorithm": tampered(h, mm_hash_algorithm="md5"),
                 "mm_hash": tampered(h, mm_hash_algorithm=ALGORITHMS[0], mm_hash="not-hex"),
                 "handle_id": tampered(h, handle_id=""),
                 "transfer": tampered(h, transfers=[])}
        problems = []
        for name, bad in cases.items():
            res = t.generate(with_handles(t, raw, [bad]))
            try:
                expect_rejected(res, codes=INVALID, what=f"a handle with another {name}")
            except CheckFailed as exc:
                problems.append(str(exc))
                continue
            if name not in res.details.lower():
                problems.append(f"the refusal of another {name} does not name it: {res.details!r}")
        expect(not problems, "; ".join(problems[:4]))
        _genuine_accepted(t, with_handles(t, raw, [h]))
    t.wait_idle("ENC11")
    return f"{len(cases)} incompatible handles refused, each naming its field"


@check("ENC13", "a handle gone before the pull: accepted, then one EngineError KV_TRANSFER_FAILED, not retryable")
def gone_handle_fails_after_acceptance(t: Target) -> str:
    """ENC13: a handle released before the Generate → the stream is accepted (handles are checked,
    not fetched, before acceptance) and ends with exactly one EngineError KV_TRANSFER_FAILED,
    retryable = false, message beginning "embedding handle", then OK."""
    enc, token = _consumer(t)
    data = unique_png(t, "enc13")
    raw = _image_request(t, token, "enc13", data, max_tokens=2)
    with _media(enc) as m:
        handle = m.encode_one(data)
        expect(m.release([handle.handle_id]) == 1, "Release of a fresh handle did not count it")
    res = t.generate(with_handles(t, raw, [handle]))
    expect(res.ok and res.events, f"a released handle must be found after acceptance: {res.describe()}")
    errors = res.of("error")
    expect(len(errors) == 1 and res.events[-1].WhichOneof("event") == "error",
           f"want exactly one EngineError, the last event: {res.kinds()}")
    err = errors[0]
    expect(err.code == oe.ERROR_CODE_KV_TRANSFER_FAILED, f"EngineError {oe.ErrorCode.Name(err.code)} "
           f"({err.message!r}), want KV_TRANSFER_FAILED")
    expect(not err.retryable, "retryable = true: the unchanged request names a handle that is gone")
    expect(err.message.startswith("embedding handle"), f"the message {err.message!r} does not begin "
           "'embedding handle'")
    problems = stream_violations(res)
    expect(not problems, "; ".join(problems[:3]))
    t.wait_idle("ENC13")
    return f"{oe.ErrorCode.Name(err.code)}: {err.message[:60]!r}"


# -- ENC15 -------------------------------------------------------------------------------------
def _accounting_problems(stats: dict[str, float], when: str) -> list[str]:
    missing = [k for k in ACCOUNTING if k not in stats]
    if missing:
        return [f"{when}: LoadInfo.attributes lack {[LOAD_PREFIX + k for k in missing]}"]
    problems = [f"{when}: {k} = {stats[k]} is not a non-negative integer" for k in ACCOUNTING
                if stats[k] < 0 or stats[k] != int(stats[k])]
    if stats["held_rows"] + stats["cached_rows"] + stats["free_rows"] != stats["total_rows"]:
        problems.append(f"{when}: held {stats['held_rows']:g} + cached {stats['cached_rows']:g} + free "
                        f"{stats['free_rows']:g} != total {stats['total_rows']:g}")
    if stats["total_rows"] <= 0:
        problems.append(f"{when}: total_rows {stats['total_rows']:g}")
    return problems


@check("ENC15", "an encoder's LoadInfo accounts handles and rows: held + cached + free = total, back after release")
def accounting(t: Target) -> str:
    """ENC15: the encoder's LoadInfo.attributes carry every refengine.v1alpha1.* counter; a new
    image: held_handles +1, held_rows +num_tokens, cache_misses +1; the same again: held_handles
    +2, held_rows unchanged (one entry), cache_hits +1; after Release held_handles and held_rows
    return to their values before (polled); held + cached + free = total at every reading."""
    enc = _encoder(t)
    before = attributes(enc)
    problems = _accounting_problems(before, "before")
    expect(not problems, "; ".join(problems))
    data = unique_png(t, "enc15")
    with _media(enc) as m:
        first = m.encode_one(data)
        one = attributes(enc)
        m.encode_one(data)
        two = attributes(enc)
        problems += _accounting_problems(one, "one handle") + _accounting_problems(two, "two handles")
        expect(not problems, "; ".join(problems))
        want = {"one handle": (one, 1, first.num_tokens, {"cache_misses": 1}),
                "two handles (same image)": (two, 2, first.num_tokens, {"cache_misses": 1, "cache_hits": 1})}
        for when, (stats, handles, rows, counters) in want.items():
            if stats["held_handles"] != before["held_handles"] + handles:
                problems.append(f"{when}: held_handles {before['held_handles']:g} → {stats['held_handles']:g}, "
                                f"want +{handles}")
            if stats["held_rows"] != before["held_rows"] + rows:
                problems.append(f"{when}: held_rows {before['held_rows']:g} → {stats['held_rows']:g}, want +{rows}")
            for name, delta in counters.items():
                if stats[name] != before[name] + delta:
                    problems.append(f"{when}: {name} {before[name]:g} → {stats[name]:g}, want +{delta}")
    deadline = time.monotonic() + 5.0
    while True:  # releasing may finish just after Release returns (a read in flight)
        after = attributes(enc)
        back = (after.get("held_handles"), after.get("held_rows")) == (before["held_handles"], before["held_rows"])
        if back or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    problems += _accounting_problems(after, "after Release")
    if (after["held_handles"], after["held_rows"]) != (before["held_handles"], before["held_rows"]):
        problems.append(f"after Release: held_handles/held_rows {after['held_handles']:g}/{after['held_rows']:g}, "
                        f"before {before['held_handles']:g}/{before['held_rows']:g} (within 5 s)")
    expect(not problems, "; ".join(problems[:5]))
    idle = " (0 held: the encoder is idle)" if after["held_handles"] == after["held_rows"] == 0 else ""
    return (f"total {after['total_rows']:.0f} rows; {first.num_tokens} rows held by 2 handles, back to "
            f"{after['held_handles']:.0f} handles after Release{idle}")
