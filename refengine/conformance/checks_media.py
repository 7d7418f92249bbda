"""Multimodal input: D9 (what supports_multimodal promises) and G19 (media refusal).

The suite carries only tiny synthetic samples (a 1x1 PNG, 10 ms of silent WAV, the
first box of an MP4) and knows no model's media placeholder, so against a multimodal
model it can check *when* a request is validated (before acceptance), not what the
model makes of the media; media order needs a model-specific prompt and is not tested.

Given the model's image placeholder token id (``Options.media_placeholder_token_id``,
``--media-placeholder-token-id N``), the prompt is sent as token ids holding N once per
image, and a multimodal model is checked with a real image (a 64x64 PNG written here, no
imaging library): it is accepted and completes (D9); an item count that does not match the
placeholders, and bytes that are not an image, are refused before acceptance (G19: an item
that cannot be placed or decoded is refused, never silently ignored). Without the option
those checks skip, naming it.
"""

from __future__ import annotations

import base64
import io
import struct
import wave
import zlib
from collections.abc import Callable
from typing import Any

from refengine.conformance.assertions import NON_OK, expect_finish, expect_rejected, expect_valid, stream_violations
from refengine.conformance.enums import enum_name
from refengine.conformance.registry import check, expect, fail, not_claimed, skip
from refengine.conformance.streams import StreamResult
from refengine.conformance.target import Target
from refengine.protocol import oe

#: EngineError codes that mean "this request was never valid": seen after acceptance, the
#: request was validated too late (D9/G19 want such a refusal before acceptance).
LATE_VALIDATION = {oe.ERROR_CODE_INVALID_ARGUMENT, oe.ERROR_CODE_UNSUPPORTED_FEATURE, oe.ERROR_CODE_ROLE_MISMATCH}
UNREACHABLE_URL = "https://oeconf.invalid/pixel.png"  # .invalid never resolves: nothing is fetched


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png(width: int, height: int, color_type: int, rows: bytes) -> bytes:
    """A PNG of 8-bit samples; ``rows``: each scanline with its filter byte (0 = none)."""
    header = struct.pack(">IIBBBBB", width, height, 8, color_type, 0, 0, 0)
    return (PNG_SIGNATURE + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", zlib.compress(rows))
            + _png_chunk(b"IEND", b""))


def tiny_png() -> bytes:
    """A valid 1x1 grey PNG."""
    return _png(1, 1, 0, b"\x00\x80")


def rgb_png(width: int = 64, height: int = 64) -> bytes:
    """A valid RGB PNG (a colour gradient), large enough for common image processors' minimum sizes."""
    rows = b"".join(b"\x00" + bytes(v for x in range(width) for v in (x * 4 % 256, y * 4 % 256, (x + y) * 2 % 256))
                    for y in range(height))
    return _png(width, height, 2, rows)


def solid_png(rgb: tuple[int, int, int] = (200, 30, 30), width: int = 64, height: int = 64) -> bytes:
    """A valid RGB PNG of one colour (unlike :func:`rgb_png` everywhere)."""
    return _png(width, height, 2, (b"\x00" + bytes(rgb) * width) * height)


def tiny_wav() -> bytes:
    """A valid WAV: 10 ms of 8 kHz mono silence."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes(b"\x00\x00" * 80)
    return buf.getvalue()


def tiny_mp4() -> bytes:
    """Only an MP4 ``ftyp`` box: enough to name the container, not a playable video."""
    body = b"isom" + struct.pack(">I", 512) + b"isomiso2mp41"
    return struct.pack(">I", 8 + len(body)) + b"ftyp" + body


def _data_uri(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


MediaSpec = Callable[[Any], None]  # fills one MediaItem

#: One item per modality, each through a different source kind (url, data URI, inline bytes).
URL_SAMPLE = "image by url"
SAMPLES: dict[str, MediaSpec] = {
    URL_SAMPLE: lambda m: (setattr(m, "modality", oe.MODALITY_IMAGE), setattr(m, "url", UNREACHABLE_URL)),
    "image as inline bytes": lambda m: (setattr(m, "modality", oe.MODALITY_IMAGE),
                                        setattr(m, "raw_bytes", tiny_png()), setattr(m, "mime_type", "image/png")),
    "audio as data URI": lambda m: (setattr(m, "modality", oe.MODALITY_AUDIO),
                                    setattr(m, "data_uri", _data_uri("audio/wav", tiny_wav()))),
    "video as inline bytes": lambda m: (setattr(m, "modality", oe.MODALITY_VIDEO),
                                        setattr(m, "raw_bytes", tiny_mp4()), setattr(m, "mime_type", "video/mp4")),
}


def _with_media(t: Target, tag: str, *specs: MediaSpec) -> Any:
    req = t.request(tag, max_tokens=2)
    for spec in specs:
        spec(req.media.add())
    return req


def _multimodal(t: Target) -> bool | None:
    return t.model_info.supports_multimodal if t.model_info.HasField("supports_multimodal") else None


def _validated_in_time(res: StreamResult, what: str, fetched: bool = False) -> str:
    """Accepted cleanly or refused before acceptance; a refusal after acceptance fails, except for
    an item the server must fetch (``fetched``): D9 asks the modality to be validated before
    acceptance, not the fetch, which may fail later (found by review: a server fetching after
    acceptance failed D9 for the unreachable URL). Returns "accepted", "refused" or "fetch failed"."""
    if not res.ok or not res.events:
        expect_rejected(res, codes=NON_OK, what=what)
        return "refused"
    late = [e for e in res.of("error") if e.code in LATE_VALIDATION]
    if late and fetched:
        problems = stream_violations(res)
        expect(not problems, f"{what}: " + "; ".join(problems[:3]))
        return "fetch failed"
    if late:
        fail(f"{what}: accepted, then EngineError {enum_name(oe.ErrorCode, late[0].code)} ({late[0].message!r}); "
             "the modality is validated before acceptance")
    problems = stream_violations(res)
    expect(not problems, f"{what}: " + "; ".join(problems[:3]))
    return "accepted"


@check("D9", "media: modality validated before acceptance (refused outright when supports_multimodal = false)")
def multimodal_validated(t: Target) -> str:
    """D9: a text-only model refuses media before acceptance; a multimodal one either
    accepts a sample or refuses it before acceptance, never after."""
    mm = _multimodal(t)
    if mm is None:
        not_claimed("supports_multimodal is not reported")
    outcomes: dict[str, list[str]] = {"accepted": [], "refused": [], "fetch failed": []}
    for what, spec in SAMPLES.items():
        res = t.generate(_with_media(t, "d9", spec))
        if mm:
            outcomes[_validated_in_time(res, what, fetched=what == URL_SAMPLE)].append(what)
        else:
            expect_rejected(res, codes=NON_OK, what=f"{what} with supports_multimodal = false")
            outcomes["refused"].append(what)
    t.wait_idle("D9")
    if not mm:
        return f"supports_multimodal = false: {len(SAMPLES)} media items refused before acceptance"
    fetch = f"; failed after acceptance (a fetch): {outcomes['fetch failed']}" if outcomes["fetch failed"] else ""
    return (f"accepted: {outcomes['accepted'] or 'none'}; refused before acceptance: {outcomes['refused'] or 'none'}"
            f"{fetch} (synthetic samples without the model's placeholder; acceptance of real media not tested)")


@check("G19", "supports_multimodal = false: every media item (any modality, any source) refused, never ignored")
def media_refused_when_unsupported(t: Target) -> str:
    """G19: media the model cannot take is refused before acceptance with a non-OK status
    (ref: INVALID_ARGUMENT), alone, several at once, or mixed with a valid text prompt."""
    if _multimodal(t) is not False:
        not_claimed("the model does not say supports_multimodal = false; which modality or source a multimodal model "
             "refuses is not advertised, so an unsupported one cannot be picked (D9 checks validation timing)")
    cases = [(what, (spec,)) for what, spec in SAMPLES.items()]
    cases.append(("two images (url, then bytes)", (SAMPLES["image by url"], SAMPLES["image as inline bytes"])))
    codes = set()
    for what, specs in cases:
        res = t.generate(_with_media(t, "g19", *specs))
        expect_rejected(res, codes=NON_OK, what=f"{what} on a text-only model")
        codes.add(res.code.name)
    return f"{len(cases)} media requests refused before acceptance ({', '.join(sorted(codes))})"


@check("G19", "a MediaItem setting no source is refused before acceptance")
def media_source_required(t: Target) -> str:
    """G19: each item sets exactly one source (the oneof makes "two" impossible to send);
    an item with none is refused, alone or after a well-formed item, on any model."""
    def no_source(m: Any) -> None:
        m.modality, m.mime_type, m.uuid = oe.MODALITY_IMAGE, "image/png", "oeconf-no-source"

    cases = {"an image item without source": (no_source,),
             "an inline image, then an item without source": (SAMPLES["image as inline bytes"], no_source)}
    for what, specs in cases.items():
        expect_rejected(t.generate(_with_media(t, "g19s", *specs)), codes=NON_OK, what=what)
    mm = _multimodal(t)
    note = "" if mm else " (the model is not multimodal, so any media is refused anyway)"
    return f"{len(cases)} source-less items refused before acceptance{note}"


# -- a multimodal model whose image placeholder is known (Options.media_placeholder_token_id) --
PLACEHOLDER_FLAG = "--media-placeholder-token-id"


def _placeholder(t: Target) -> int:
    """The model's image placeholder token id; skips unless supports_multimodal = true and it is given."""
    if not _multimodal(t):
        not_claimed("the model does not say supports_multimodal = true")
    token = t.options.media_placeholder_token_id
    if token is None:
        skip(f"the model's image placeholder token id is not known: pass {PLACEHOLDER_FLAG} N "
             "(Options.media_placeholder_token_id) to send real images")
    return token


def _image(data: bytes, source: str = "raw_bytes") -> MediaSpec:
    """An image item carrying ``data`` inline (``raw_bytes``) or as a base64 data URI."""
    def fill(m: Any) -> None:
        m.modality = oe.MODALITY_IMAGE
        if source == "data_uri":
            m.data_uri = _data_uri("image/png", data)
        else:
            m.raw_bytes, m.mime_type = data, "image/png"

    return fill


def _image_request(t: Target, tag: str, placeholders: int, *specs: MediaSpec) -> Any:
    """Token ids holding the placeholder ``placeholders`` times (each between text ids), with ``specs``."""
    token = _placeholder(t)
    text = [i for i in t.known_token_ids() if i != token]
    expect(len(text) >= 4, f"too few known token ids other than the placeholder {token}: {text}")
    ids = text[:4]
    for k in range(placeholders):
        ids += [token, text[k % len(text)]]
    req = t.request(tag, token_ids=ids, max_tokens=4, ignore_eos=True)
    for spec in specs:
        spec(req.media.add())
    return req


@check("D9", "supports_multimodal = true: a real image at the model's placeholder is accepted and completes")
def multimodal_image_accepted(t: Target) -> str:
    """D9: with the placeholder known, one valid 64x64 PNG (inline bytes) is accepted and
    the stream completes (max_tokens, ignore_eos); the same image as a data URI is accepted
    too or refused before acceptance (which sources a model takes is not advertised)."""
    token = _placeholder(t)
    res = expect_valid(t.generate(_image_request(t, "d9img", 1, _image(rgb_png()))),
                       what=f"one 64x64 PNG (inline bytes) at placeholder {token}")
    expect_finish(res, oe.FINISH_REASON_LENGTH, what="one 64x64 PNG with max_tokens 4 and ignore_eos")
    uri = _validated_in_time(t.generate(_image_request(t, "d9uri", 1, _image(rgb_png(), "data_uri"))),
                             "the same PNG as a data URI")
    t.wait_idle("D9")
    usage = res.usage()
    prompt = f", prompt_tokens {usage.prompt_tokens}" if usage is not None else ""
    return f"inline PNG accepted and completed ({len(res.tokens())} tokens{prompt}); as a data URI: {uri}"


@check("D9", "supports_multimodal = true: the image is used (two different images, different logprobs)")
def multimodal_image_used(t: Target) -> str:
    """D9/G19 (found by review: a server that accepted images and ignored them passed every media
    check): the same request with two different images must differ in its output logprobs or
    tokens. Without output logprobs equal tokens prove nothing (the check then skips)."""
    _placeholder(t)
    with_logprobs = t.caps.HasField("output_logprobs") and t.caps.output_logprobs.supported
    seen = []
    for what, data in (("a gradient", rgb_png()), ("a solid red", solid_png())):
        req = _image_request(t, "d9use", 1, _image(data))
        req.response.return_output_logprobs = with_logprobs
        res = expect_valid(t.generate(req), what=f"{what} 64x64 PNG at the placeholder")
        seen.append((res.tokens(), [info.logprob for info in res.token_infos()]))
    if seen[0] != seen[1]:
        return "two images, different outputs" + (" (logprobs compared)" if with_logprobs else " (tokens)")
    if not with_logprobs:
        skip(f"two different images gave the same tokens {seen[0][0]} and output logprobs are not advertised: "
             "whether the image was used cannot be told")
    fail(f"two different images gave the same tokens {seen[0][0]} and bit-identical logprobs {seen[0][1]}: "
         "the image is accepted but not used")


@check("G19", "an image count that does not match the prompt's placeholders is refused before acceptance")
def media_placeholder_mismatch_refused(t: Target) -> str:
    """G19: items fill the placeholders in order; an item left without a placeholder, or a
    placeholder without an item, is refused before acceptance (non-OK, no event), never ignored."""
    image = _image(rgb_png())
    cases = {"one placeholder, two images": (1, (image, image)),
             "two placeholders, one image": (2, (image,)),
             "no placeholder, one image": (0, (image,)),
             "one placeholder, no image": (1, ())}
    codes = set()
    for what, (placeholders, specs) in cases.items():
        res = t.generate(_image_request(t, "g19n", placeholders, *specs))
        expect_rejected(res, codes=NON_OK, what=what)
        codes.add(res.code.name)
    t.wait_idle("G19")
    return f"{len(cases)} placeholder/item count mismatches refused before acceptance ({', '.join(sorted(codes))})"


@check("G19", "image bytes that are not a decodable image are refused before acceptance")
def media_malformed_image_refused(t: Target) -> str:
    """G19: an image item whose bytes are not an image (plain text; a PNG signature followed by
    garbage) is refused before acceptance (non-OK, no event), never ignored. A truncated file is
    not tried: some decoders are configured to pad one, and the rules do not forbid that."""
    cases = {"text bytes": b"oeconf: this is not an image",
             "a PNG signature, then garbage": PNG_SIGNATURE + b"\x00garbage" * 8}
    codes = set()
    for what, data in cases.items():
        res = t.generate(_image_request(t, "g19m", 1, _image(data)))
        expect_rejected(res, codes=NON_OK, what=f"an image item holding {what}")
        codes.add(res.code.name)
    t.wait_idle("G19")
    return f"{len(cases)} undecodable image items refused before acceptance ({', '.join(sorted(codes))})"
