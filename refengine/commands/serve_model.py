"""``refengine serve``'s check of ``--model`` before the server starts.

The server listens first and loads the model in the background (health says NOT_SERVING
meanwhile), so a model that cannot load ends it with exit 1 after it has announced its ports.
A name that is no manifest, a path that does not exist, or an incomplete or pickle-only
directory is known at once, without torch (``manifest.locate_model``): that is the operator's
mistake, refused with exit 2 like a bad flag, before anything listens. What only loading can
find (a bad weight file, an unknown architecture) still ends the server with exit 1.
"""

from __future__ import annotations

from refengine.model.manifest import ModelNotFoundError, UnsupportedModelError, locate_model


def model_problem(model: str) -> str:
    """Why ``model`` cannot be served, or "" when it names files to load."""
    if not model.strip():  # found by review: "" read as the working directory, "not a model directory"
        return "empty: give a manifest name (models/*.toml), an HF directory or a .gguf file"
    try:
        locate_model(model)
    except (ModelNotFoundError, UnsupportedModelError) as exc:
        return str(exc)
    return ""
