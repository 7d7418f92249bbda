"""One ``GenerateRequest.media`` item -> a decoded RGB image, under the ``MediaConfig`` policy.

Rules, in the order they are checked; every refusal is an ``InvalidRequestError`` that says
what is wrong, and no other exception escapes ``check_item`` (rule 1), ``local_bytes`` (2-3
without the network) and ``fetched_bytes`` (2-3 for a url) or ``image_of`` (4-5), which a
caller runs in that order (``engine/media.py``, every item's ``local_bytes`` first):

1. ``modality`` must be ``"image"``; ``uuid``, when given, at most ``MAX_UUID_BYTES`` bytes.
2. Exactly one source. ``url``: fetched by ``url_fetch.fetch_url`` under the URL policy.
   ``data_uri``: ``data:<type>/<subtype>[;param=value]*;base64,<payload>`` with strict base64
   (standard alphabet, padded, no whitespace); the payload's decoded size follows from its
   length and is checked against ``max_bytes`` before anything is decoded. ``raw_bytes``.
3. The encoded bytes are non-empty and at most ``max_bytes``.
4. Only the Pillow plugins named in ``image_formats`` ever parse the bytes (``Image.open``
   with ``formats=``), and the format the header turns out to have must itself be accepted
   (an MPO, the multi-picture JPEG many cameras write, counts as JPEG). Width x height, read
   from the header, must be at most ``max_pixels`` before any pixel is decoded (``load``);
   for WebP, before ``Image.open`` itself (``_webp_canvas``: libwebp allocates the canvas there).
   Truncated, corrupt, zero-size or unrecognised data is refused.
5. Animated images (GIF, APNG, WebP): the first frame only. The result is RGB; transparency
   is composited onto white (as Hugging Face image processors do). EXIF orientation is not
   applied: the pixels are used as stored. Greyscale of more than 8 bits (a 16-bit PNG opens
   as mode ``I;16``; a TIFF can give ``I``) is scaled to 8 bits, 65535 -> 255: Pillow's own
   ``convert`` clips each value at 255 instead, which turns almost any such picture white (and
   so does ``convert("RGB")`` in the Hugging Face and vLLM loaders, where refengine differs).

The ``mime_type`` hint, and a data URI's declared type, are not trusted and choose nothing:
the format is detected from the bytes, and a hint that disagrees with it is ignored.

Pillow's process-global state is left alone, since another thread may be decoding at the
same moment: ``Image.MAX_IMAGE_PIXELS`` is never changed and no warnings filter is installed
(``warnings.catch_warnings`` is not thread-safe). ``max_pixels`` is enforced here, from the
header; Pillow's own check still runs inside ``Image.open`` with its global limit, so a header
over twice that limit raises ``DecompressionBombError`` (refused here) and one over it only
warns, which can happen only where ``max_pixels`` is configured above Pillow's limit. Likewise
``ImageFile.LOAD_TRUNCATED_IMAGES``: if something in the process sets it, truncated files
decode padded instead of being refused.

Identity (the key of prefix-cache and encoder-cache entries): ``"uuid:<uuid>"`` when the item
has a ``uuid``; else ``"sha256:<hex>"`` of the decoded RGB pixels and their width and height.
Pixels rather than bytes, because the pixels are all the model sees: the same picture sent as
PNG and as BMP, or with different metadata, shares cache entries, and equal digests always
mean equal model input. The prefixes keep a client's uuid from ever equalling a digest.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError

from refengine.config import MediaConfig
from refengine.multimodal.url_fetch import check_url, fetch_url
from refengine.types import InvalidRequestError, MediaInput

SUPPORTED_MODALITIES = ("image",)
MAX_UUID_BYTES = 256
#: ``data:<media type>;base64,`` before the payload: far longer than any real media type, and
#: bounded so that a megabyte of ``;x=y`` parameters is refused before any regex runs over it.
MAX_DATA_URI_HEADER = 256
SOURCES = ("url", "data_uri", "raw_bytes")
#: Formats Pillow reports for a file one of the accepted plugins opened, and the format they count as.
FORMAT_ALIASES = {"MPO": "JPEG"}
_TOKEN = r"[a-z0-9][a-z0-9!#$&^_.+-]*"
_MEDIA_TYPE = re.compile(rf"{_TOKEN}/{_TOKEN}(?:;{_TOKEN}=[^;,]*)*", re.IGNORECASE)
_WHITE = (255, 255, 255, 255)
#: Pillow modes of greyscale wider than 8 bits (``_grey_to_8_bits``).
_WIDE_GREY = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I"})


@dataclass(frozen=True, eq=False)
class LoadedImage:
    """A decoded media item. ``image``: RGB and fully loaded (no file behind it);
    ``identity``: see the module docstring; ``num_bytes``: its encoded size; ``format``: the
    Pillow format detected from the bytes (e.g. ``"PNG"``)."""

    image: Image.Image
    identity: str
    num_bytes: int
    format: str


def check_item(item: MediaInput) -> None:
    """Rule 1: what the item is, before any of its bytes are fetched or decoded."""
    if item.modality not in SUPPORTED_MODALITIES:
        accepted = ", ".join(SUPPORTED_MODALITIES)
        raise InvalidRequestError(f"modality {item.modality!r} is not supported (this model accepts: {accepted})")
    if not isinstance(item.uuid, str) or len(item.uuid.encode()) > MAX_UUID_BYTES:
        raise InvalidRequestError(f"media uuid must be a string of at most {MAX_UUID_BYTES} bytes")


def image_of(item: MediaInput, data: bytes, config: MediaConfig) -> LoadedImage:
    """Rules 4-5: ``item``'s encoded bytes (``local_bytes`` or ``fetched_bytes``) decoded."""
    image, fmt = decode_image(data, config)
    return LoadedImage(image=image, identity=_identity(item.uuid, image), num_bytes=len(data), format=fmt)


def local_bytes(item: MediaInput, config: MediaConfig) -> bytes | None:
    """Rules 2-3 as far as they go without the network: the bytes of a ``data_uri`` or
    ``raw_bytes`` item; None for a ``url`` item, whose form and host are checked, not fetched
    (``fetched_bytes``). So a request's every item can be checked before any URL is fetched."""
    source = _the_source(item)
    if source == "url":
        if not isinstance(item.url, str) or not item.url:
            raise InvalidRequestError("media url must be a non-empty string")
        check_url(item.url, config)
        return None
    if source == "data_uri":
        return _within_limits(decode_data_uri(item.data_uri, config.max_bytes), source, config)
    raw = item.raw_bytes
    if not isinstance(raw, bytes | bytearray):
        raise InvalidRequestError(f"media raw_bytes must be bytes, got {type(raw).__name__}")
    return _within_limits(bytes(raw), source, config)


def fetched_bytes(item: MediaInput, config: MediaConfig) -> bytes:
    """The body at a ``url`` item's URL (``local_bytes`` returned None for it)."""
    assert item.url is not None, "only a url item is fetched"
    return _within_limits(fetch_url(item.url, config), "url", config)


def _the_source(item: MediaInput) -> str:
    given = [name for name in SOURCES if getattr(item, name) is not None]
    if len(given) != 1:
        raise InvalidRequestError("a media item needs exactly one source (url, data_uri or raw_bytes), "
                                  f"got {', '.join(given) if given else 'none'}")
    return given[0]


def _within_limits(data: bytes, source: str, config: MediaConfig) -> bytes:
    if not data:
        raise InvalidRequestError(f"media {source} holds no bytes (an empty image)")
    if len(data) > config.max_bytes:
        raise InvalidRequestError(f"media item is {len(data)} bytes, more than max_bytes={config.max_bytes}")
    return data


def decode_data_uri(uri: str, max_bytes: int) -> bytes:
    """The payload of ``data:<mime>;base64,<payload>``; its size is checked before it is decoded."""
    form = "data:<type>/<subtype>;base64,<payload>"
    if not isinstance(uri, str) or uri[:5].lower() != "data:":
        raise InvalidRequestError(f"data_uri must start with 'data:' ({form})")
    comma = uri.find(",", 0, MAX_DATA_URI_HEADER + 1)  # the header is short: never scan a whole payload for it
    if comma < 0:
        raise InvalidRequestError(f"data_uri has no ',' within its first {MAX_DATA_URI_HEADER} characters ({form})")
    media_type, _, encoding = uri[5:comma].rpartition(";")
    if encoding.lower() != "base64":
        raise InvalidRequestError(f"data_uri must be base64-encoded ({form})")
    if not _MEDIA_TYPE.fullmatch(media_type):
        raise InvalidRequestError(f"data_uri has no valid media type before ';base64' ({form})")
    length = len(uri) - comma - 1
    if length % 4:
        raise InvalidRequestError(f"data_uri payload is not valid base64 (length {length} is not a multiple of 4)")
    decoded = length // 4 * 3 - uri.endswith("=") - uri.endswith("==")
    if decoded > max_bytes:
        raise InvalidRequestError(f"data_uri payload is {decoded} bytes, more than max_bytes={max_bytes}")
    try:
        return base64.b64decode(uri[comma + 1:], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequestError(f"data_uri payload is not valid base64 ({exc})") from None


def decode_image(data: bytes, config: MediaConfig) -> tuple[Image.Image, str]:
    """``data`` decoded to an RGB image under ``config``'s format and size limits, and its format."""
    plugins = _plugins(config.image_formats)
    canvas = _webp_canvas(data) if "WEBP" in plugins else None
    if canvas is not None:
        # Pillow's WebP plugin makes libwebp's animation decoder inside ``Image.open``, which
        # allocates two canvas-sized RGBA buffers before any size check: 140 bytes claiming
        # 16383 x 16383 reserved 2 GB (65000 x 65000 in a VP8X header: 33 GB). So a WebP's
        # size is read here, from its first chunk, and checked before Pillow sees the bytes.
        _check_size(*canvas, config)
    try:
        with Image.open(io.BytesIO(data), formats=plugins) as image:
            fmt = _check_header(image, config)
            image.load()
            return _to_rgb(image), fmt
    except InvalidRequestError:
        raise
    except UnidentifiedImageError:
        accepted = ", ".join(config.image_formats)
        raise InvalidRequestError(f"media bytes are not an image in an accepted format ({accepted})") from None
    except Image.DecompressionBombError as exc:
        raise InvalidRequestError(f"image is too large to decode ({exc})") from None
    except Exception as exc:  # a corrupt file can make any step of any decoder fail
        raise InvalidRequestError(f"image data is truncated or corrupt ({type(exc).__name__}: {exc})") from None


def _plugins(image_formats: tuple[str, ...]) -> list[str]:
    """The registered Pillow plugins among ``image_formats`` (Pillow fails on an unknown name)."""
    Image.init()
    wanted = {name.upper() for name in image_formats}
    return [name for name in Image.OPEN if name in wanted]


def _check_header(image: Image.Image, config: MediaConfig) -> str:
    fmt = image.format or ""
    if FORMAT_ALIASES.get(fmt, fmt) not in {name.upper() for name in config.image_formats}:
        raise InvalidRequestError(f"image format {fmt or 'unknown'} is not accepted "
                                  f"(accepted: {', '.join(config.image_formats)})")
    _check_size(*image.size, config)
    return fmt


def _check_size(width: int, height: int, config: MediaConfig) -> None:
    if width <= 0 or height <= 0:
        raise InvalidRequestError(f"image has no pixels ({width}x{height})")
    if width * height > config.max_pixels:
        raise InvalidRequestError(f"image is {width}x{height} = {width * height} pixels, "
                                  f"more than max_pixels={config.max_pixels}")
    if max(width, height) > config.max_aspect_ratio * min(width, height):
        raise InvalidRequestError(f"image is {width}x{height}, longer than {config.max_aspect_ratio} times its short "
                                  "side (max_aspect_ratio): scaled to the model's input size it would take far more "
                                  "memory than its pixels")


def _webp_canvas(data: bytes) -> tuple[int, int] | None:
    """Width and height of the canvas a WebP file declares in its first chunk (what libwebp
    allocates for), or None when ``data`` is not a WebP file whose header says (Pillow judges it)."""
    if len(data) < 30 or data[:4] != b"RIFF" or data[8:12] != b"WEBP":
        return None
    chunk = data[12:16]
    if chunk == b"VP8X":  # extended: 24-bit canvas width - 1 and height - 1
        return 1 + int.from_bytes(data[24:27], "little"), 1 + int.from_bytes(data[27:30], "little")
    if chunk == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":  # lossy key frame: 14-bit width and height
        return int.from_bytes(data[26:28], "little") & 0x3FFF, int.from_bytes(data[28:30], "little") & 0x3FFF
    if chunk == b"VP8L" and data[20] == 0x2F:  # lossless: 14-bit width - 1 and height - 1
        bits = int.from_bytes(data[21:25], "little")
        return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
    return None


def _to_rgb(image: Image.Image) -> Image.Image:
    """A new RGB image (the first frame); transparent parts composited onto white."""
    if image.mode in _WIDE_GREY:
        image = _grey_to_8_bits(image)
    if image.has_transparency_data:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, _WHITE), rgba).convert("RGB")
    return image.convert("RGB")


def _grey_to_8_bits(image: Image.Image) -> Image.Image:
    """Wide greyscale as ``L`` (``LA`` where a transparent grey value is named), each value
    scaled from 0..65535 to 0..255, rounded; a 32-bit ``I`` value is first held to that range."""
    values = np.clip(np.asarray(image), 0, 65535).astype(np.uint32)  # 65535 * 255 + 32767 fits
    grey = Image.fromarray(((values * 255 + 32767) // 65535).astype(np.uint8))  # 2-D uint8: mode L
    key = image.info.get("transparency")
    if not isinstance(key, int):
        return grey
    alpha = Image.fromarray(np.where(values == key, 0, 255).astype(np.uint8))
    return Image.merge("LA", (grey, alpha))


def _identity(uuid: str, image: Image.Image) -> str:
    if uuid:
        return f"uuid:{uuid}"
    digest = hashlib.sha256(f"refengine-image-rgb8:{image.width}x{image.height}:".encode())
    digest.update(image.tobytes())
    return f"sha256:{digest.hexdigest()}"
