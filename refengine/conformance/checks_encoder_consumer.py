"""Consumer side of the encoder profile (ENC9–ENC11, ENC13) and the encoder's accounting (ENC15);
see ``checks_encoder.py`` for which servers are involved and what is not checked."""

from __future__ import annotations

import time

import grpc

from refengine.conformance.assertions import INVALID, NON_OK, expect_rejected, expect_valid, stream_violations
from refengine.conformance.encoder_support import (
    ACCOUNTING,
    ALGORITHMS,
    EXTRA_MEDIA_HANDLES,
    LOAD_PREFIX,
    attributes,
    consumer_target,
    encoder_target,
    genuine_accepted,
    handle_json,
    image_request,
    media_client,
    status_of,
    tampered,
    unique_png,
    with_handles,
)
from refengine.conformance.enums import enum_name
from refengine.conformance.registry import CheckFailed, check, expect
from refengine.conformance.target import Target
from refengine.protocol import oe


# -- consumers: ENC9, ENC10, ENC11, ENC13 --------------------------------------------------------
@check("ENC9", "a handle a consumer pulled is released by it: gone on the encoder after the request")
def pulled_handle_released(t: Target) -> str:
    """ENC9/ENC6: after a consumer's request with a handle completes, the handle is consumed:
    RenewLease → NOT_FOUND (polled briefly), Release counts 0."""
    enc, token = consumer_target(t, (oe.ENGINE_ROLE_AGGREGATED,), ": a PREFILL stream ends in a KV session")
    with media_client(enc) as m:
        data = unique_png(t, "enc9")
        handle = m.encode_one(data)
        req = with_handles(t, image_request(t, token, "enc9", data, max_tokens=2), [handle])
        expect_valid(t.generate(req), what="a request with one handle")
        deadline = time.monotonic() + 5.0
        while (code := status_of(m.renew, handle.handle_id, 30.0)[0]) == grpc.StatusCode.OK \
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
    enc, token = consumer_target(t, (oe.ENGINE_ROLE_AGGREGATED,), ": no tokens to compare")
    data = unique_png(t, "enc10")
    raw = _uncached(t, image_request(t, token, "enc10-raw", data))
    want = expect_valid(t.generate(raw), what="the request with the raw image")
    expect(bool(want.tokens()), f"the raw-image request produced no tokens: {want.describe()}")
    with media_client(enc) as m:
        handle = m.encode_one(data)
        got = expect_valid(t.generate(_uncached(t, with_handles(t, raw, [handle]))),
                           what="the same request with a handle")
        expect(got.tokens() == want.tokens(), f"with a handle {got.tokens()} != with the image {want.tokens()}")
        other = m.encode_one(data)
        snake = handle_json(other, snake_case=True)
        snake["oeconf_future_field"] = {"ignored": True}
        alt = expect_valid(t.generate(_uncached(t, with_handles(t, raw, value=[snake]))),
                           what="a handle in proto field names with an unknown field")
        expect(alt.tokens() == want.tokens(), f"handle in proto field names {alt.tokens()} != {want.tokens()}")
    t.wait_idle("ENC10")
    usage = got.usage()
    cached = f", cached_prompt_tokens {usage.cached_prompt_tokens}" if usage is not None and usage.HasField(
        "cached_prompt_tokens") else ""
    return f"{len(want.tokens())} tokens equal (camelCase and snake_case + unknown field){cached}"


def _uncached(t: Target, request: oe.GenerateRequest) -> oe.GenerateRequest:
    """``request`` served from no earlier request's cached blocks, so that a handle's rows are
    all pulled (found by review: the handle request reused the raw one's blocks, and only the
    last rows were compared): a salt of its own where salts are advertised, else
    bypass_prefix_cache where that is; as it is where neither is (D4: either would be refused)."""
    request.kv.ClearField("cache_salt")
    if t.caps.supports_cache_salt:
        request.kv.cache_salt = t.new_id("enc10-salt")
    elif t.caps.supports_prefix_cache_bypass:
        request.kv.bypass_prefix_cache = True
    return request


@check("ENC10", "a malformed handles value, or items and handles together, is refused before acceptance")
def handles_value_refused(t: Target) -> str:
    """ENC10 (G8): extra[media_handles] a string, a list of numbers, an object that is not an
    EmbeddingHandle → INVALID_ARGUMENT, no events; items and handles together, and two handles
    for one placeholder → refused before acceptance. Then the same request with the handle alone
    is accepted and ends OK (the handle stayed live: nothing is pulled before acceptance)."""
    enc, token = consumer_target(t)
    data = unique_png(t, "enc10v")
    raw = image_request(t, token, "enc10v", data, max_tokens=2)
    with media_client(enc) as m:
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
        genuine_accepted(t, with_handles(t, raw, [handle]))
    t.wait_idle("ENC10")
    return f"{len(cases)} refused before acceptance ({', '.join(sorted(set(codes.values())))})"


@check("ENC11", "a handle incompatible with the consumer is refused before acceptance, naming the field")
def incompatible_handle_refused(t: Target) -> str:
    """ENC11: a handle with another fingerprint, shape, dtype, modality, an unknown
    mm_hash_algorithm, a malformed mm_hash, an empty handle_id or no transfer → INVALID_ARGUMENT
    naming the field, no events; then the genuine handle is accepted and ends OK (it was not
    fetched before acceptance)."""
    enc, token = consumer_target(t)
    data = unique_png(t, "enc11")
    raw = image_request(t, token, "enc11", data, max_tokens=2)
    with media_client(enc) as m:
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
        genuine_accepted(t, with_handles(t, raw, [h]))
    t.wait_idle("ENC11")
    return f"{len(cases)} incompatible handles refused, each naming its field"


@check("ENC13", "a handle gone before the pull: accepted, then one EngineError KV_TRANSFER_FAILED, not retryable")
def gone_handle_fails_after_acceptance(t: Target) -> str:
    """ENC13: a handle released before the Generate → the stream is accepted (handles are checked,
    not fetched, before acceptance) and ends with exactly one EngineError KV_TRANSFER_FAILED,
    retryable = false, message beginning "embedding handle", then OK."""
    enc, token = consumer_target(t)
    data = unique_png(t, "enc13")
    raw = image_request(t, token, "enc13", data, max_tokens=2)
    with media_client(enc) as m:
        handle = m.encode_one(data)
        expect(m.release([handle.handle_id]) == 1, "Release of a fresh handle did not count it")
    res = t.generate(with_handles(t, raw, [handle]))
    expect(res.ok and res.events, f"a released handle must be found after acceptance: {res.describe()}")
    errors = res.of("error")
    expect(len(errors) == 1 and res.events[-1].WhichOneof("event") == "error",
           f"want exactly one EngineError, the last event: {res.kinds()}")
    err = errors[0]
    expect(err.code == oe.ERROR_CODE_KV_TRANSFER_FAILED, f"EngineError {enum_name(oe.ErrorCode, err.code)} "
           f"({err.message!r}), want KV_TRANSFER_FAILED")
    expect(not err.retryable, "retryable = true: the unchanged request names a handle that is gone")
    expect(err.message.startswith("embedding handle"), f"the message {err.message!r} does not begin "
           "'embedding handle'")
    problems = stream_violations(res)
    expect(not problems, "; ".join(problems[:3]))
    t.wait_idle("ENC13")
    return f"{enum_name(oe.ErrorCode, err.code)}: {err.message[:60]!r}"


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
    enc = encoder_target(t)
    before = attributes(enc)
    problems = _accounting_problems(before, "before")
    expect(not problems, "; ".join(problems))
    data = unique_png(t, "enc15")
    with media_client(enc) as m:
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


@check("ENC13", "a handle whose mm_hash names another item: accepted, then KV_TRANSFER_FAILED, not retryable")
def edited_mm_hash_fails(t: Target) -> str:
    """ENC13/ENC8: the rows of image A under image B's mm_hash would enter the prefix cache as B's;
    the consumer must check what the encoder says the handle holds and fail the request."""
    enc, token = consumer_target(t)
    a, b = unique_png(t, "enc13-a"), unique_png(t, "enc13-b")
    raw = image_request(t, token, "enc13-edit", a, max_tokens=2)
    with media_client(enc) as m:
        ha, hb = m.encode_one(a), m.encode_one(b)
        res = t.generate(with_handles(t, raw, [tampered(ha, mm_hash=hb.mm_hash,
                                                        mm_hash_algorithm=hb.mm_hash_algorithm)]))
    expect(res.ok and res.events, f"an edited mm_hash is found after acceptance: {res.describe()}")
    errors = res.of("error")
    expect(len(errors) == 1 and errors[0].code == oe.ERROR_CODE_KV_TRANSFER_FAILED and not errors[0].retryable,
           f"a handle naming another item's mm_hash: {res.kinds()} "
           f"{[(enum_name(oe.ErrorCode, e.code), e.retryable) for e in errors]}, want one EngineError "
           "KV_TRANSFER_FAILED, retryable = false (its rows would enter the prefix cache as the other item's)")
    t.wait_idle("ENC13")
    return f"{enum_name(oe.ErrorCode, errors[0].code)}: {errors[0].message[:60]!r}"
