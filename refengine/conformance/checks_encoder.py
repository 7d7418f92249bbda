"""Draft profile ``encoder`` v1alpha1 (docs/profiles/encoder.md, section ENC): an encoder server
turns media into leased embedding handles (``refengine.v1alpha1.Media``), consumers take them in
``GenerateRequest.extra["refengine.v1alpha1.media_handles"]`` instead of the media. Here: ENC1–ENC4;
the handles (ENC5–ENC7) in ``checks_encoder_handles``, the consumer side in ``checks_encoder_consumer``.

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

import grpc

from refengine.conformance.assertions import INVALID, expect_rejected
from refengine.conformance.checks_media import PNG_SIGNATURE, rgb_png
from refengine.conformance.encoder_support import (
    ENCODER_FLAG,
    PROFILES_KEY,
    Media,
    claimed_sides,
    discover,
    encoder_target,
    held_handles,
    image_item,
    media_client,
    profile_problems,
    server_extra,
    status_of,
    unique_png,
)
from refengine.conformance.enums import enum_name
from refengine.conformance.registry import check, expect, skip
from refengine.conformance.target import Target
from refengine.protocol import oe


# -- ENC1 ------------------------------------------------------------------------------------
@check("ENC1", "ServerInfo.extra['refengine.profiles'] lists 'encoder' well-formed, sides matching each role")
def profile_listed(t: Target) -> str:
    """ENC1: each server involved (the target, the --encoder server) lists a well-formed profiles
    value; side ``encoder`` on an encoder (engine_role UNSPECIFIED), side ``consumer`` on a
    multimodal server of a release role; the --encoder server lists side encoder."""
    setup = discover(t)
    servers = [("the target", t)]
    if setup.extra_encoder is not None:
        servers.append((f"the --encoder server {setup.extra_encoder.address}", setup.extra_encoder))
    problems, notes = [], []
    for label, server in servers:
        extra = server_extra(server)
        if PROFILES_KEY not in extra:
            notes.append(f"{label}: no profiles")
            continue
        problems += [f"{label}: {p}" for p in profile_problems(extra[PROFILES_KEY])]
        sides = claimed_sides(server)
        role = enum_name(oe.EngineRole, server.server_info.engine_role)
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
    enc = encoder_target(t)
    role = enc.server_info.engine_role
    expect(role == oe.ENGINE_ROLE_UNSPECIFIED, f"engine_role {enum_name(oe.EngineRole, role)}, want UNSPECIFIED "
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
    enc = encoder_target(t)
    before = held_handles(enc)
    health = enc.unary("Health", oe.HealthRequest(include_inference_probe=True))
    expect(health.state == oe.HEALTH_STATE_READY, f"Health with the probe: {enum_name(oe.HealthState, health.state)} "
           f"{[(c.name, c.message) for c in health.checks]}")
    after = held_handles(enc)
    if before is None or after is None:  # ENC15 fails such a server; here the rest is still judged
        return f"READY, checks {[c.name for c in health.checks]}; held_handles not reported: holding not checked"
    expect(before == after, f"held_handles {before} before the probe, {after} after: the probe holds no handle")
    return f"READY, checks {[c.name for c in health.checks]}"


@check("ENC2", "a server that is not an encoder answers Media with UNIMPLEMENTED")
def media_only_on_encoders(t: Target) -> str:
    """ENC2: Media is served only by encoder servers: Encode, Release and RenewLease on the
    target (when it is not the encoder) → UNIMPLEMENTED."""
    setup = discover(t)
    if "encoder" in setup.target_sides:
        skip("the target is the encoder: no other server to ask (run against a consumer with "
             f"{ENCODER_FLAG})")
    m = Media(t)
    calls = {"Encode": lambda: m.encode(image_item(rgb_png())),
             "Release": lambda: m.release([t.new_id("enc2-unknown")]),
             "RenewLease": lambda: m.renew(t.new_id("enc2-unknown"), 10.0)}
    got = {name: status_of(fn)[0] for name, fn in calls.items()}
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
    enc = encoder_target(t)
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
    with media_client(enc) as m:
        before = held_handles(enc)
        problems = []
        for what, (items, model, codes) in cases.items():
            code, reply, details = status_of(m.encode, *items, model=model)
            if code not in codes:
                problems.append(f"{what}: {code.name} ({details[:80]!r}), want {'/'.join(c.name for c in codes)}")
            held = held_handles(enc)
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
    enc = encoder_target(t)
    data = unique_png(t, "enc4")
    with media_client(enc) as m:
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


@check("ENC4", "a salted Encode uses and fills only its own salt's cache entries")
def encoder_cache_salted(t: Target) -> str:
    """ENC4's salt: an image encoded under salt A, then without salt, then under salt B, is a
    miss each time (no entry is shared across salts, nor between salted and unsalted Encodes, in
    either direction: the unsalted Encode comes after a salted entry exists, salt B's after an
    unsalted one does); under salt A again, and unsalted again, it is a hit, with the same mm_hash
    throughout."""
    enc = encoder_target(t)
    data = unique_png(t, "enc4-salt")
    salt_a, salt_b = t.new_id("salt-a"), t.new_id("salt-b")
    with media_client(enc) as m:
        first_a = m.encode_one(data, cache_salt=salt_a)
        plain = m.encode_one(data)
        first_b = m.encode_one(data, cache_salt=salt_b)
        again_a = m.encode_one(data, cache_salt=salt_a)
        again_plain = m.encode_one(data)
    expect(not first_a.cached, "the first Encode of an image never seen before says cached = true")
    expect(not plain.cached, "an unsalted Encode hit the entry made under a cache_salt")
    expect(not first_b.cached, "an Encode under cache_salt B hit the entry of salt A or of an unsalted Encode")
    expect(again_a.cached, "a second Encode of the same image under the same cache_salt says cached = false")
    expect(again_plain.cached, "a second unsalted Encode of the same image says cached = false")
    hashes = {h.mm_hash for h in (plain, first_a, first_b, again_a, again_plain)}
    expect(len(hashes) == 1, f"mm_hash changes with the salt: {sorted(hashes)}")
    return "misses across salts, a hit within one"
