"""The whole media pipeline of ``multimodal/sources.py`` for one item, as the engine runs it."""

from __future__ import annotations

from refengine.config import MediaConfig
from refengine.multimodal.sources import LoadedImage, check_item, fetched_bytes, image_of, local_bytes
from refengine.types import MediaInput


def load_image(item: MediaInput, config: MediaConfig) -> LoadedImage:
    """Check ``item``, fetch or decode its bytes, decode the image (``MediaInputs.fetch`` + ``decode``)."""
    check_item(item)
    data = local_bytes(item, config)
    return image_of(item, data if data is not None else fetched_bytes(item, config), config)
