"""Draft profile ``encoder`` v1alpha1, the handles themselves: well-formed fields and lease
bounds (ENC5), Release and Abort (ENC6), RenewLease and expiry (ENC7). Which servers run them,
and the rules every encoder check keeps (unique images, every handle released), are in
``checks_encoder``'s docstring.
"""

from __future__ import annotations

import math
import time

import grpc

from refengine.conformance.checks_media import rgb_png
from refengine.conformance.encoder_support import (
    encoder_target,
    handle_problems,
    held_handles,
    image_item,
    media_client,
    status_of,
    unique_png,
)
from refengine.conformance.enums import enum_name
from refengine.conformance.registry import check, expect
from refengine.conformance.target import Target
from refengine.protocol import oe


# -- ENC5 ------------------------------------------------------------------------------------
@check("ENC5", "a handle's fields are well-formed: ids, identity, shape, dtype, layout, fingerprint, transfers, lease")
def handle_fields(t: Target) -> str:
    """ENC5: one image → exactly one handle: non-empty handle_id, a known mm_hash_algorithm with a
    well-formed mm_hash, modality IMAGE, shape [num_tokens, hidden] with num_tokens = shape[0],
    dtype, the profile's layout, a hex fingerprint, transfers each with a routable endpoint (grpc
    among them), a lease end in the future; two items → two handles with distinct ids."""
    enc = encoder_target(t)
    with media_client(enc) as m:
        now = time.time_ns()
        handle = m.encode_one(rgb_png(), "one 64x64 PNG")
        problems = handle_problems(handle, now)
        pair = m.encode(image_item(unique_png(t, "enc5")), image_item(unique_png(t, "enc5")))
        expect(len(pair) == 2, f"Encode of 2 items returned {len(pair)} handles")
        problems += [f"item {i}: {p}" for i, h in enumerate(pair) for p in handle_problems(h, now)]
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
    enc = encoder_target(t)
    data = unique_png(t, "enc5-lease")
    with media_client(enc) as m:
        before = held_handles(enc)
        wrong = {}
        for lease in (0.0, -1.0, math.nan, math.inf):
            code, _, details = status_of(m.encode, image_item(data), lease=lease)
            if code != grpc.StatusCode.INVALID_ARGUMENT:
                wrong[str(lease)] = f"{code.name} ({details[:60]!r})"
        expect(not wrong, f"lease_seconds refused with the wrong status: {wrong}, want INVALID_ARGUMENT")
        held = held_handles(enc)
        expect(before is None or before == held, f"held_handles {before} → {held} after refused leases")
        now = time.time_ns()
        short = m.encode_one(data, lease=30.0)
        end = (short.lease_expires_unix_nanos - now) / 1e9
        expect(0 < end <= 30.0 + 5.0, f"lease_seconds 30 → the lease ends in {end:.1f} s")
        now = time.time_ns()
        long = m.encode_one(data, lease=1e9)
        long_end = (long.lease_expires_unix_nanos - now) / 1e9
        # No maximum is advertised; any real one is far below 1e9 s (31 years): granted in full is unbounded.
        expect(0 < long_end < 1e9 / 2, f"lease_seconds 1e9 → the lease ends in {long_end:.3g} s: not bounded")
    return f"4 refused; 30 s → {end:.1f} s; 1e9 s → bounded to {long_end:.0f} s"


# -- ENC6, ENC7 --------------------------------------------------------------------------------
@check("ENC6", "Release is idempotent: live ids counted once, released, unknown ids are no error")
def release_idempotent(t: Target) -> str:
    """ENC6: Release([a]) = 1; again = 0; an unknown id = 0; [b, a, unknown] = 1; [] = 0; no error."""
    enc = encoder_target(t)
    with media_client(enc) as m:
        a, b = m.encode(image_item(unique_png(t, "enc6")), image_item(unique_png(t, "enc6")))
        unknown = t.new_id("enc6-unknown")
        steps = [("[a]", [a.handle_id], 1), ("[a] again", [a.handle_id], 0), ("[unknown]", [unknown], 0),
                 ("[b, a, unknown]", [b.handle_id, a.handle_id, unknown], 1), ("[]", [], 0),
                 ("[b] again", [b.handle_id], 0)]
        wrong = []
        for what, ids, want in steps:
            code, released, details = status_of(m.release, ids)
            if code != grpc.StatusCode.OK or released != want:
                wrong.append(f"Release {what}: {code.name} {details[:60]!r} released={released}, want {want}")
    expect(not wrong, "; ".join(wrong))
    return f"{len(steps)} releases as expected"


@check("ENC6", "Abort(kv_session) naming a handle id on the encoder releases the handle")
def abort_releases_handle(t: Target) -> str:
    """ENC6 (A2): Abort(kv_session = {session_id: handle_id}) on the encoder → ABORTED, the handle
    is released (Release counts 0 afterwards); the same Abort again → NOT_FOUND."""
    enc = encoder_target(t)
    with media_client(enc) as m:
        handle = m.encode_one(unique_png(t, "enc6-abort"))
        session = oe.KvSessionRef(session_id=handle.handle_id)
        code, reply = enc.unary_code("Abort", oe.AbortRequest(kv_session=session))
        expect(code == grpc.StatusCode.OK and reply.status == oe.ABORT_STATUS_ABORTED,
               f"Abort(kv_session) of a live handle: {code.name} "
               f"{enum_name(oe.AbortStatus, reply.status) if reply is not None else ''}, want ABORTED")
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
    enc = encoder_target(t)
    with media_client(enc) as m:
        handle = m.encode_one(unique_png(t, "enc7"), lease=5.0)
        now = time.time_ns()
        renewed = m.renew(handle.handle_id, 60.0)
        expect(renewed > handle.lease_expires_unix_nanos, f"renewed end {renewed} is not after the first "
               f"{handle.lease_expires_unix_nanos}")
        expect(renewed <= now + int(65e9), f"RenewLease(60) → the lease ends in {(renewed - now) / 1e9:.1f} s")
        code, _, details = status_of(m.renew, handle.handle_id, 0.0)
        expect(code == grpc.StatusCode.INVALID_ARGUMENT, f"RenewLease(0): {code.name} ({details!r}), want "
               "INVALID_ARGUMENT")
        expect(m.release([handle.handle_id]) == 1, "Release of the renewed handle did not count it")
        code, _, details = status_of(m.renew, handle.handle_id, 60.0)
        expect(code == grpc.StatusCode.NOT_FOUND, f"RenewLease of a released handle: {code.name} ({details!r})")
        code, _, details = status_of(m.renew, t.new_id("enc7-unknown"), 60.0)
        expect(code == grpc.StatusCode.NOT_FOUND, f"RenewLease of an unknown id: {code.name} ({details!r})")
    return f"renewed +{(renewed - handle.lease_expires_unix_nanos) / 1e9:.1f} s; released → NOT_FOUND"


@check("ENC7", "a handle whose lease ends is gone by itself: no longer held, RenewLease → NOT_FOUND")
def lease_expires(t: Target) -> str:
    """ENC7 (ENC6: expired is a terminal state): a handle leased for 1 s, left alone, is no longer
    held shortly after its lease end (held_handles back, polled up to 5 s past it) and RenewLease
    then → NOT_FOUND."""
    enc = encoder_target(t)
    with media_client(enc) as m:
        before = held_handles(enc)
        handle = m.encode_one(unique_png(t, "enc7-expiry"), lease=1.0)
        end = handle.lease_expires_unix_nanos / 1e9
        expect(end - time.time() <= 6.0, f"lease_seconds 1 → the lease ends in {end - time.time():.1f} s")
        time.sleep(max(0.0, end - time.time()) + 0.1)
        deadline = time.monotonic() + 5.0
        while (held := held_handles(enc)) != before and time.monotonic() < deadline:
            time.sleep(0.1)
        expect(held == before, f"held_handles {held} 5 s after the lease end, {before} before the Encode")
        # ENC15 fails a server without held_handles: then only RenewLease below tells the handle is gone.
        held_note = "" if before is not None else "; held_handles not reported"
        code, _, details = status_of(m.renew, handle.handle_id, 30.0)
        expect(code == grpc.StatusCode.NOT_FOUND, f"RenewLease of an expired handle: {code.name} ({details!r}), "
               "want NOT_FOUND")
    return f"expired by itself, then NOT_FOUND{held_note}"
