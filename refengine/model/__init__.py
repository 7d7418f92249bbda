"""Model families, the model runner, and weight loading.

The loading API (``resolve_model`` -> ``load_model_config`` / ``load_weights`` /
``load_tokenizer`` / ``model_fingerprint``) is re-exported here; see ``loader``. It imports
torch, so it is imported on first use: ``refengine.model.manifest`` (names, ``locate_model``)
stays cheap for the CLI, which checks ``--model`` before ``serve`` listens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from refengine.model.manifest import Manifest, ModelNotFoundError, UnsupportedModelError

if TYPE_CHECKING:
    from refengine.model.loader import (
        ResolvedModel,
        load_model_config,
        load_tokenizer,
        load_weights,
        model_fingerprint,
        resolve_model,
    )

_FROM_LOADER = ("ResolvedModel", "load_model_config", "load_tokenizer", "load_weights", "model_fingerprint",
                "resolve_model")

__all__ = [
    "Manifest",
    "ModelNotFoundError",
    "ResolvedModel",
    "UnsupportedModelError",
    "load_model_config",
    "load_tokenizer",
    "load_weights",
    "model_fingerprint",
    "resolve_model",
]


def __getattr__(name: str) -> Any:  # noqa: ANN401 - whatever the loader defines under that name
    if name in _FROM_LOADER:
        from refengine.model import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'refengine.model' has no attribute {name!r}")
