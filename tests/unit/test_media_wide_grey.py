"""Greyscale wider than 8 bits (``sources._grey_to_8_bits``): scaled to 8 bits, not clipped.

Oracles: the same picture stored as an 8-bit greyscale PNG (equal pixels and identity), and
``round(v * 255 / 65535)`` computed exactly with ``fractions``."""

from __future__ import annotations

import io
from fractions import Fraction

import numpy as np
import pytest
from PIL import Image

from refengine.config import MediaConfig
from refengine.types import MediaInput
from tests.unit.media_helpers import load_image

DEFAULT = MediaConfig()


def _png(image: Image.Image, **params: object) -> MediaInput:
    out = io.BytesIO()
    image.save(out, format="PNG", **params)
    return MediaInput(modality="image", raw_bytes=out.getvalue())


def _grey8(values: np.ndarray) -> Image.Image:
    return Image.fromarray(values.astype(np.uint8))


def _grey16(values: np.ndarray) -> Image.Image:
    image = Image.fromarray(values.astype(np.uint16))
    assert image.mode == "I;16"
    return image


def _noise(seed: int, high: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, high + 1, size=(12, 20))


def test_a_16_bit_png_loads_as_the_same_picture_in_8_bits() -> None:
    values = _noise(1, 255)
    wide = load_image(_png(_grey16(values * 257)), DEFAULT)
    narrow = load_image(_png(_grey8(values)), DEFAULT)
    assert wide.image.mode == "RGB"
    assert np.array_equal(np.asarray(wide.image), np.asarray(narrow.image))
    assert wide.identity == narrow.identity


def test_values_are_scaled_and_rounded() -> None:
    values = np.array([[0, 1, 128, 129, 257, 32767, 32768, 65279, 65534, 65535]])
    loaded = np.asarray(load_image(_png(_grey16(values)), DEFAULT).image)
    expected = [round(Fraction(int(v) * 255, 65535)) for v in values.ravel()]
    assert loaded[0, :, 0].tolist() == expected
    assert (loaded[..., 0] == loaded[..., 1]).all() and (loaded[..., 1] == loaded[..., 2]).all()


def test_a_transparent_grey_value_is_composited_onto_white() -> None:
    values = _noise(2, 255) * 257
    key = int(values[0, 0])
    loaded = np.asarray(load_image(_png(_grey16(values), transparency=key), DEFAULT).image)
    opaque = values != key
    assert (loaded[~opaque] == 255).all()
    assert np.array_equal(loaded[opaque][:, 0], values[opaque] // 257)


def test_32_bit_greyscale_is_held_to_16_bits_first() -> None:
    """A TIFF (where accepted) can hold mode ``I``: values outside 0..65535 are held to it."""
    values = np.array([[-5, 0, 257 * 100, 65535, 70000, 2**31 - 1]], dtype=np.int32)
    out = io.BytesIO()
    Image.fromarray(values).save(out, format="TIFF")
    config = MediaConfig(image_formats=("TIFF",), max_aspect_ratio=10)
    loaded = load_image(MediaInput(modality="image", raw_bytes=out.getvalue()), config)
    assert np.asarray(loaded.image)[0, :, 0].tolist() == [0, 0, 100, 255, 255, 255]


@pytest.mark.parametrize("seed", range(3))
def test_eight_bit_pictures_are_untouched(seed: int) -> None:
    """The 8-bit modes keep Pillow's conversion (only the wide greyscale modes are scaled)."""
    values = _noise(seed, 255)
    colour = np.stack([values, np.roll(values, 1), values[::-1]], axis=-1)
    image = Image.fromarray(colour.astype(np.uint8))
    assert np.array_equal(np.asarray(load_image(_png(image), DEFAULT).image), colour)
