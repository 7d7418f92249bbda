"""Safe media sources (``refengine.multimodal``): every malformed item is an ``InvalidRequestError``,
images decode under the size and format limits, identities follow the documented rule, and URL
fetching keeps to the SSRF policy, checked against a local HTTP(S) server on loopback."""

from __future__ import annotations

import base64
import io
import random
import struct
import threading
import zlib

import pytest
from PIL import Image

from refengine.config import MediaConfig
from refengine.multimodal.sources import LoadedImage, decode_data_uri
from refengine.types import InvalidRequestError, MediaInput
from tests.unit.media_helpers import load_image

DEFAULT = MediaConfig()
RED, BLUE = (255, 0, 0), (0, 0, 255)


def encode(image: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def noise(size: tuple[int, int] = (48, 48), seed: int = 0) -> Image.Image:
    return Image.frombytes("RGB", size, random.Random(seed).randbytes(size[0] * size[1] * 3))


def png_header_only(width: int, height: int) -> bytes:
    """A 1x1 PNG whose IHDR claims ``width`` x ``height``: tiny, and decodes nothing."""
    data = bytearray(encode(Image.new("1", (1, 1)), "PNG"))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


PNG = encode(noise(), "PNG")
JPEG = encode(noise(), "JPEG")


def raw(data: bytes, **fields: str) -> MediaInput:
    return MediaInput(modality="image", raw_bytes=data, **fields)


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def refused(item: MediaInput, match: str, config: MediaConfig = DEFAULT) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        load_image(item, config)


# --- items and data URIs ---------------------------------------------------------------------

def test_only_images_are_accepted() -> None:
    with pytest.raises(InvalidRequestError) as info:
        load_image(MediaInput(modality="video", raw_bytes=PNG), DEFAULT)
    assert str(info.value) == "modality 'video' is not supported (this model accepts: image)"
    for modality in ("audio", "", "IMAGE"):
        refused(MediaInput(modality=modality, raw_bytes=PNG), "is not supported")


@pytest.mark.parametrize("fields, match", [
    ({}, "exactly one source .* got none"),
    ({"raw_bytes": PNG, "data_uri": data_uri(PNG)}, "got data_uri, raw_bytes"),
    ({"raw_bytes": PNG, "data_uri": data_uri(PNG), "url": "http://x/"}, "got url, data_uri, raw_bytes"),
    ({"raw_bytes": b""}, "raw_bytes holds no bytes"),
    ({"data_uri": "data:image/png;base64,"}, "data_uri holds no bytes"),
    ({"url": ""}, "non-empty"),
    ({"raw_bytes": PNG, "uuid": "u" * 257}, "uuid must be"),
])
def test_malformed_items(fields: dict[str, object], match: str) -> None:
    refused(MediaInput(modality="image", **fields), match)  # type: ignore[arg-type]


@pytest.mark.parametrize("uri, match", [
    ("image/png;base64,AAAA", "must start with 'data:'"),
    ("http:image/png;base64,AAAA", "must start with 'data:'"),
    ("data:image/png;base64", "no ','"),
    ("data:image/png,AAAA", "must be base64"),
    ("data:image/png;utf8,AAAA", "must be base64"),
    ("data:;base64,AAAA", "no valid media type"),
    ("data:png;base64,AAAA", "no valid media type"),
    ("data:image/png;base64,AAA", "not a multiple of 4"),
    ("data:image/png;base64,@@@@", "not valid base64"),
    ("data:image/png;base64,AA-_", "not valid base64"),
    ("data:image/png;base64,AAAA AAA", "not valid base64"),
    ("data:image/png;base64,AA==AAAA", "not valid base64"),
    ("data:image/png;base64,AAAé", "not valid base64"),
])
def test_bad_data_uris(uri: str, match: str) -> None:
    refused(MediaInput(modality="image", data_uri=uri), match)


def test_data_uri_size_is_checked_before_decoding() -> None:
    # invalid base64, yet refused for its size: the length alone decides, nothing was decoded
    with pytest.raises(InvalidRequestError, match="300 bytes, more than max_bytes=100"):
        decode_data_uri("data:image/png;base64," + "!!!!" * 100, 100)
    for size in range(96, 101):
        payload = bytes(range(size))
        assert decode_data_uri(data_uri(payload), size) == payload
        with pytest.raises(InvalidRequestError, match=f"{size} bytes, more than"):
            decode_data_uri(data_uri(payload), size - 1)
    assert decode_data_uri("DATA:image/png;name=a.png;BASE64,AAAA", 3) == b"\0\0\0"


def test_a_data_uri_header_is_bounded() -> None:
    """``data:a/b;x=y;x=y...;base64,``: 15.6 MB of parameters were split and matched (0.75 s,
    670 MB) before the payload was refused; past 256 characters the header is refused unread."""
    header = "data:a/b" + ";x=y" * 3_900_000 + ";base64,"
    with pytest.raises(InvalidRequestError, match="no ',' within its first 256 characters"):
        decode_data_uri(header + "AAAA", 1 << 30)
    long_but_fine = "data:image/png;" + "n=" + "a" * 200 + ";base64,AAAA"
    assert decode_data_uri(long_but_fine, 3) == b"\0\0\0"


def test_data_uri_and_mime_hint_do_not_choose_the_decoder() -> None:
    for item in (MediaInput(modality="image", data_uri=data_uri(PNG, "image/jpeg")),
                 raw(PNG, mime_type="image/jpeg"), raw(PNG, mime_type="text/plain")):
        loaded = load_image(item, DEFAULT)
        assert (loaded.format, loaded.num_bytes, loaded.image.size) == ("PNG", len(PNG), (48, 48))


def test_max_bytes() -> None:
    config = MediaConfig(max_bytes=len(PNG))
    assert load_image(raw(PNG), config).num_bytes == len(PNG)
    refused(raw(PNG), f"{len(PNG)} bytes, more than max_bytes={len(PNG) - 1}", MediaConfig(max_bytes=len(PNG) - 1))
    refused(MediaInput(modality="image", data_uri=data_uri(PNG)), "more than max_bytes", MediaConfig(max_bytes=100))


# --- decoding --------------------------------------------------------------------------------

@pytest.mark.parametrize("data, match", [
    (b"hello, world", "not an image in an accepted format"),
    (b"\0" * 1000, "not an image in an accepted format"),
    (b"%PDF-1.4\n" + b"x" * 100, "not an image in an accepted format"),
    (PNG[: len(PNG) // 2], "truncated or corrupt"),
    (JPEG[: len(JPEG) // 2], "truncated or corrupt"),
    (PNG[:40], "not an image"),
    (JPEG[:40], "truncated or corrupt"),
    (PNG[:60] + bytes(b ^ 0x55 for b in PNG[60:200]) + PNG[200:], "truncated or corrupt"),
    (png_header_only(0, 5), "not an image"),
    (encode(noise(), "TIFF"), "not an image in an accepted format"),
])
def test_bad_image_bytes(data: bytes, match: str) -> None:
    refused(raw(data), match)


def test_max_pixels_is_checked_from_the_header_before_decoding() -> None:
    limit = Image.MAX_IMAGE_PIXELS
    refused(raw(encode(noise((40, 40)), "PNG")), "40x40 = 1600 pixels, more than max_pixels=1000",
            MediaConfig(max_pixels=1000))
    assert load_image(raw(encode(noise((40, 25)), "PNG")), MediaConfig(max_pixels=1000)).image.size == (40, 25)
    # no pixel data behind this header: a decode attempt would say "truncated", not name the size
    refused(raw(png_header_only(5000, 5000)), "5000x5000 = 25000000 pixels, more than max_pixels=16000000")
    refused(raw(png_header_only(20000, 20000)), "too large to decode", MediaConfig(max_pixels=10**9))
    assert Image.MAX_IMAGE_PIXELS == limit


def test_thin_images_are_refused_from_the_header() -> None:
    """A thin image costs what its short side scaled to the model's input makes of it (80,000 x 1
    pixels in 318 bytes took 2.5 GB to preprocess): above max_aspect_ratio it is refused before
    decoding, either way round; at the ratio it loads."""
    refused(raw(png_header_only(80000, 1)), "80000x1, longer than 100 times its short side")
    refused(raw(png_header_only(3, 400)), "3x400, longer than 100 times", MediaConfig(max_aspect_ratio=100))
    assert load_image(raw(encode(noise((300, 3)), "PNG")), MediaConfig()).image.size == (300, 3)
    refused(raw(encode(noise((300, 3)), "PNG")), "longer than 50 times", MediaConfig(max_aspect_ratio=50))


def test_formats_are_limited_to_image_formats() -> None:
    refused(raw(PNG), r"not an image in an accepted format \(JPEG\)", MediaConfig(image_formats=("JPEG",)))
    refused(raw(PNG), "accepted format", MediaConfig(image_formats=("HEIC",)))  # no such plugin: no crash
    assert load_image(raw(PNG), MediaConfig(image_formats=("png",))).format == "PNG"
    assert load_image(raw(JPEG), MediaConfig(image_formats=("JPEG",))).format == "JPEG"
    mpo = encode(Image.new("RGB", (8, 8), RED), "MPO", save_all=True, append_images=[Image.new("RGB", (8, 8), BLUE)])
    assert load_image(raw(mpo), MediaConfig(image_formats=("JPEG",))).format == "MPO"


def test_animated_gif_gives_its_first_frame() -> None:
    frames = [Image.new("RGB", (16, 8), colour) for colour in (RED, BLUE)]
    gif = encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    loaded = load_image(raw(gif), DEFAULT)
    assert (loaded.format, loaded.image.mode, loaded.image.getpixel((3, 3))) == ("GIF", "RGB", RED)
    assert loaded.identity == load_image(raw(encode(frames[0], "PNG")), DEFAULT).identity


@pytest.mark.parametrize("mode", ["1", "L", "P", "LA", "RGBA", "CMYK", "I;16"])
def test_every_mode_becomes_rgb(mode: str) -> None:
    fmt = "JPEG" if mode == "CMYK" else "PNG"
    assert load_image(raw(encode(noise().convert(mode), fmt)), DEFAULT).image.mode == "RGB"


def test_transparency_is_composited_onto_white() -> None:
    image = Image.new("RGBA", (2, 1), (0, 0, 0, 0))
    image.putpixel((1, 0), (10, 20, 30, 255))
    loaded = load_image(raw(encode(image, "PNG")), DEFAULT).image
    assert [loaded.getpixel((x, 0)) for x in range(2)] == [(255, 255, 255), (10, 20, 30)]


def test_identity_rule() -> None:
    first = load_image(raw(PNG), DEFAULT)
    assert first.identity.startswith("sha256:") and len(first.identity) == 7 + 64
    assert load_image(raw(bytes(PNG)), DEFAULT).identity == first.identity
    # the rule hashes decoded pixels: the same picture as BMP (different bytes) has the same identity
    assert load_image(raw(encode(noise(), "BMP")), DEFAULT).identity == first.identity
    assert load_image(raw(encode(noise(seed=1), "PNG")), DEFAULT).identity != first.identity
    assert load_image(raw(JPEG), DEFAULT).identity != first.identity  # lossy: other pixels
    assert load_image(raw(PNG, uuid="abc"), DEFAULT).identity == "uuid:abc"
    assert load_image(raw(JPEG, uuid=first.identity), DEFAULT).identity == "uuid:" + first.identity


def test_loaded_image_is_frozen_and_detached() -> None:
    loaded = load_image(raw(PNG), DEFAULT)
    assert isinstance(loaded, LoadedImage) and loaded.image.tobytes() == noise().tobytes()
    with pytest.raises(AttributeError):
        loaded.identity = "x"  # type: ignore[misc]


def test_damaged_images_only_ever_raise_invalid_request() -> None:
    rng = random.Random(7)
    small = noise((12, 10))
    samples = [encode(small, fmt) for fmt in ("PNG", "JPEG", "WEBP", "BMP", "GIF")]
    for _ in range(300):
        data = bytearray(rng.choice(samples))
        for _ in range(rng.randint(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            load_image(raw(bytes(data[: rng.randint(1, len(data))] if rng.random() < 0.3 else data)), DEFAULT)
        except InvalidRequestError:
            pass


def test_limits_are_per_call_across_threads() -> None:
    big, small = encode(noise((40, 40)), "PNG"), encode(noise((10, 10)), "PNG")
    outcomes: list[bool] = []

    def work(limit: int) -> None:
        for _ in range(20):
            try:
                load_image(raw(big), MediaConfig(max_pixels=limit))
                outcomes.append(limit > 1600)
            except InvalidRequestError:
                outcomes.append(limit <= 1600)
            load_image(raw(small), MediaConfig(max_pixels=limit))

    threads = [threading.Thread(target=work, args=(limit,)) for limit in (1000, 2000, 1000, 5000)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(outcomes) == 80 and all(outcomes)


def webp_claiming(width: int, height: int, kind: str) -> bytes:
    """A tiny WebP (``kind``: lossless, lossy or animated) whose header says ``width`` x ``height``."""
    frames = [Image.new("RGB", (8, 8), colour) for colour in (RED, BLUE)]
    options: dict[str, object] = ({"save_all": True, "append_images": frames[1:], "lossless": True}
                                  if kind == "animated" else {"lossless": kind == "lossless"})
    data = bytearray(encode(frames[0], "WEBP", **options))
    chunk = bytes(data[12:16])
    if chunk == b"VP8X":
        data[24:27], data[27:30] = (width - 1).to_bytes(3, "little"), (height - 1).to_bytes(3, "little")
    elif chunk == b"VP8L":
        bits = int.from_bytes(data[21:25], "little") & ~((1 << 28) - 1)
        data[21:25] = (bits | (width - 1) | (height - 1) << 14).to_bytes(4, "little")
    else:
        assert chunk == b"VP8 "
        data[26:28], data[28:30] = width.to_bytes(2, "little"), height.to_bytes(2, "little")
    return bytes(data)


@pytest.mark.parametrize("kind", ["lossless", "lossy", "animated"])
def test_webp_size_is_checked_before_pillow_opens_it(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """Pillow's WebP plugin has libwebp allocate two canvas-sized RGBA buffers inside
    ``Image.open``, before any size check (140 bytes claiming 16383 x 16383 reserved 2 GB of
    memory): an oversized WebP must be refused without Pillow ever parsing it."""
    ok = webp_claiming(8, 8, kind)
    assert Image.open(io.BytesIO(ok)).size == (8, 8)  # the oracle: Pillow reads the header as we wrote it
    assert load_image(raw(ok), DEFAULT).image.size == (8, 8)
    real = encode(noise((60, 30)), "WEBP", **({"lossless": True} if kind == "lossless" else {"quality": 80}))
    assert load_image(raw(real), DEFAULT).image.size == (60, 30)  # the check reads real headers right too
    assert Image.open(io.BytesIO(webp_claiming(5000, 4000, kind))).size == (5000, 4000)
    big = webp_claiming(16383, 16383, kind)

    def no_open(*args: object, **kwargs: object) -> None:
        raise AssertionError("Image.open was reached for an oversized WebP")

    monkeypatch.setattr(Image, "open", no_open)
    refused(raw(big), "16383x16383 = 268402689 pixels, more than max_pixels=16000000")
    refused(raw(webp_claiming(5000, 4000, kind)), "5000x4000 = 20000000 pixels, more than max_pixels=16000000")
    refused(raw(webp_claiming(2000, 2000, kind)), "4000000 pixels, more than max_pixels=1000000",
            MediaConfig(max_pixels=10**6))
    refused(raw(webp_claiming(8000, 20, kind)), "8000x20, longer than 100 times")
