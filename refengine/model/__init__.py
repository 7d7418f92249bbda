"""Model families, the model runner, and weight loading.

The loading API (``resolve_model`` -> ``load_model_config`` / ``load_weights`` /
``load_tokenizer`` / ``model_fingerprint``) is re-exported here; see ``loader``.
"""

from refengine.model.loader import (
    ResolvedModel,
    load_model_config,
    load_tokenizer,
    load_weights,
    model_fingerprint,
    resolve_model,
)
from refengine.model.manifest import Manifest, ModelNotFoundError, UnsupportedModelError

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
