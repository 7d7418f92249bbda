"""Shared parts of the encoder-profile checks (``checks_encoder.py``, ``checks_encoder_consumer.py``):
discovery of who plays which side, a Media client with deadlines, sample images, handle field
checks, and requests carrying handles."""

from __future__ import annotations

import hashlib
import itertools
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import json_format

from refengine.conformance.assertions import expect_valid
from refengine.conformance.checks_media import _png
from refengine.conformance.enums import enum_name
from refengine.conformance.hosts import is_routable
from refengine.conformance.registry import CheckFailed, expect, fail, not_claimed, skip
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


def server_extra(server: Target) -> dict[str, Any]:
    return json_format.MessageToDict(server.server_info.extra)


def claimed_sides(server: Target) -> set[str]:
    """The sides of the ``encoder`` v1alpha1 entry ``server`` lists; empty when it lists none
    (or only another version, which these checks do not cover)."""
    value = server_extra(server).get(PROFILES_KEY)
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


def discover(t: Target) -> Setup:
    """Connect the ``--encoder`` server once (cached on ``t``); skip every ENC check as "not
    claimed" when no server involved lists the profile."""
    if "enc_setup" not in t.cache:
        if "enc_connect_error" in t.cache:
            fail(t.cache["enc_connect_error"])
        address = t.options.encoder_address
        extra = None
        if address and address != t.address:
            try:
                extra = t.connect_peer(address, "--encoder")
            except CheckFailed as exc:  # every ENC check fails with it
                t.cache["enc_connect_error"] = str(exc)
                raise
        target_sides = claimed_sides(t)
        encoder_sides = claimed_sides(extra) if extra is not None else (target_sides if address else set())
        t.cache["enc_setup"] = Setup(target_sides, extra, encoder_sides)
    setup: Setup = t.cache["enc_setup"]
    if not setup.target_sides and not setup.encoder_sides:
        listed = f"ServerInfo.extra[{PROFILES_KEY!r}]"
        if t.options.encoder_address:
            not_claimed(f"profile {PROFILE!r} {VERSION} not claimed: neither the target {t.address} nor the --encoder "
                 f"server {t.options.encoder_address} lists it in {listed}")
        not_claimed(f"profile {PROFILE!r} {VERSION} not claimed: the target {t.address} does not list it in {listed} "
             f"(an encoder server is named with {ENCODER_FLAG})")
    return setup


def encoder_target(t: Target) -> Target:
    """The encoder server: ``--encoder``, else the target when it lists side encoder; else skip."""
    setup = discover(t)
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


def consumer_target(t: Target, roles: Sequence[int] = (oe.ENGINE_ROLE_AGGREGATED, oe.ENGINE_ROLE_PREFILL),
              why: str = "") -> tuple[Target, int]:
    """(the encoder, the image placeholder id) for a check sending handles to the target; skips
    naming everything that is missing."""
    setup = discover(t)
    missing = []
    if "consumer" not in setup.target_sides:
        missing.append(f"the target listing side 'consumer' (it lists {sorted(setup.target_sides)})")
    elif t.server_info.engine_role not in roles:
        missing.append(f"an {'/'.join(enum_name(oe.EngineRole, r).removeprefix('ENGINE_ROLE_') for r in roles)} target "
                       f"(it is {enum_name(oe.EngineRole, t.server_info.engine_role)}{why})")
    if "encoder" not in (setup.encoder_sides if t.options.encoder_address else setup.target_sides):
        missing.append(f"an encoder server ({ENCODER_FLAG}, listing side 'encoder')")
    token = t.options.media_placeholder_token_id
    if token is None:
        missing.append(f"the model's image placeholder token id ({PLACEHOLDER_FLAG})")
    if missing:
        skip("needs " + "; ".join(missing))
    return encoder_target(t), token


# -- the Media service ------------------------------------------------------------------------
class Media:
    """``refengine.v1alpha1.Media`` on one server, every call with a deadline (Encode: the stream
    timeout, it computes; the others: the unary one). Remembers every handle it made, so that
    :meth:`close` releases them all."""

    def __init__(self, server: Target) -> None:
        self.server = server
        self.stub = media_grpc.MediaStub(server.channel)
        self.made: list[str] = []

    def encode(self, *items: Any, lease: float | None = None, model: str = "", cache_salt: str = "") -> list[Any]:
        request = media.EncodeRequest(model=model, items=list(items), cache_salt=cache_salt)
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
def media_client(server: Target) -> Iterator[Media]:
    m = Media(server)
    try:
        yield m
    finally:
        m.close()


def status_of(fn: Any, *args: Any, **kw: Any) -> tuple[grpc.StatusCode, Any, str]:
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


def held_handles(server: Target) -> int | None:
    value = attributes(server).get("held_handles")
    return None if value is None else int(value)


def handle_problems(h: Any, now_ns: int) -> list[str]:
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
        problems.append(f"modality {enum_name(oe.Modality, h.modality)}, the item was an image")
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
        if not transfer.endpoints or not all(is_routable(e.host, e.port) for e in transfer.endpoints):
            problems.append(f"transfer {transfer.backend!r}: endpoints {[(e.host, e.port) for e in transfer.endpoints]}"
                            " are not a routable host:port")
    if h.transfers and "grpc" not in [tr.backend for tr in h.transfers]:
        problems.append(f"transfers {[tr.backend for tr in h.transfers]} do not include 'grpc' (always offered)")
    if h.lease_expires_unix_nanos <= now_ns:
        problems.append(f"lease_expires_unix_nanos {h.lease_expires_unix_nanos} is not in the future (now {now_ns})")
    return problems


# -- consumer requests ---------------------------------------------------------------------
def image_request(t: Target, token: int, tag: str, data: bytes, max_tokens: int = 4) -> Any:
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


def genuine_accepted(t: Target, req: Any) -> None:
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
