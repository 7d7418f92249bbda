"""From a model name or path to a config, weights and a tokenizer.

Every model is served from a Hugging Face-style directory: ``config.json``,
``*.safetensors`` (one file, or shards listed in ``model.safetensors.index.json``),
``tokenizer.json`` + ``tokenizer_config.json`` (with the chat template), and an
optional ``generation_config.json``. A GGUF is first converted into such a directory
in the cache (see ``gguf_convert``), so everything below reads one format.

Weights are safetensors only: a pickle checkpoint (``pytorch_model.bin``) is refused,
because loading one can run arbitrary code.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, BinaryIO

import torch
from safetensors import SafetensorError, safe_open

from refengine.config import default_cache_dir
from refengine.model.gguf_convert import ensure_converted, source_fingerprint
from refengine.model.hf_config import load_model_config, read_json
from refengine.model.manifest import (
    Manifest,
    ModelNotFoundError,
    UnsupportedModelError,
    locate_model,
    refuse_pickle_only,
)
from refengine.model.weight_shapes import check_lm_weights

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

#: model_fingerprint hashes weight files up to this size whole, larger ones by header + windows.
FINGERPRINT_WHOLE_FILE_BYTES = 64 << 20
FINGERPRINT_WINDOWS = 64
FINGERPRINT_WINDOW_BYTES = 4 << 10

#: LLaVA checkpoints name the LM's tensors under a prefix (two spellings: the original one,
#: and transformers 5's module tree); loaded, they are renamed to the plain LM's names.
LLAVA_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                  ("model.language_model.", "model."), ("model.vision_tower.", "vision_tower."),
                  ("model.multi_modal_projector.", "multi_modal_projector."))


@dataclass(frozen=True)
class ResolvedModel:
    """A model ready to load: ``path`` is a complete Hugging Face directory.

    ``name`` is the served model name (the manifest name, or the directory/file stem);
    ``manifest`` is ``None`` when the model was given as a path.
    """

    name: str
    path: Path
    manifest: Manifest | None = None


def _converted(gguf_path: Path, target: Path) -> Path:
    """``ensure_converted``, with a cache it cannot write said in one line (found by review: an
    unusable ``REFENGINE_CACHE_DIR`` ended ``refengine generate`` in a traceback)."""
    try:
        return ensure_converted(gguf_path, target)
    except ModelNotFoundError:
        raise
    except OSError as exc:
        detail = f"{exc.strerror}: {exc.filename}" if exc.strerror and exc.filename else str(exc)
        raise ModelNotFoundError(f"cannot convert {gguf_path.name} into the model cache {target.parent} "
                                 f"($REFENGINE_CACHE_DIR or $XDG_CACHE_HOME): {detail}") from None


def resolve_model(name_or_path: str, cache_dir: Path | None = None) -> ResolvedModel:
    """Turn a manifest name, a Hugging Face directory or a ``.gguf`` file (``locate_model``) into
    a ResolvedModel.

    A GGUF is converted once into ``<cache_dir>/models/<name>`` (a manifest's) or
    ``<name>-<fingerprint>`` (a file's); ``cache_dir`` defaults to ``config.default_cache_dir()``
    (``$REFENGINE_CACHE_DIR``, else ``$XDG_CACHE_HOME/refengine``, else ``~/.cache/refengine``).
    Raises ModelNotFoundError (what to put where) or UnsupportedModelError.
    """
    models_cache = (cache_dir or default_cache_dir()) / "models"
    located = locate_model(name_or_path)
    path = located.path
    if located.is_gguf:
        target = located.name if located.manifest else f"{located.name}-{source_fingerprint(path)[:12]}"
        path = _converted(path, models_cache / target)
    if located.manifest is not None:
        _warn_on_architecture_mismatch(located.manifest, path)
    return ResolvedModel(name=located.name, path=path, manifest=located.manifest)


def _warn_on_architecture_mismatch(manifest: Manifest, path: Path) -> None:
    """A directory pointed at by an env var may hold another model than the manifest says."""
    found = (read_json(path / "config.json").get("architectures") or [None])[0]
    if found != manifest.architecture:
        logger.warning("%s: manifest says %s, %s holds %s", manifest.name, manifest.architecture, path, found)


def weight_files(hf_dir: Path) -> list[Path]:
    """The safetensors files holding the weights: the index's shards, else model.safetensors,
    else every ``*.safetensors`` except Mistral's duplicate ``consolidated*`` format."""
    refuse_pickle_only(hf_dir)
    if (weight_map := _index_in_use(hf_dir)) is not None:
        names = sorted(set(weight_map.values()))
    elif (hf_dir / "model.safetensors").is_file():
        names = ["model.safetensors"]
    else:
        names = sorted(p.name for p in hf_dir.glob("*.safetensors") if not p.name.startswith("consolidated"))
    if not names:
        only = "only Mistral's own consolidated*.safetensors, not the Hugging Face format's" \
            if any(hf_dir.glob("consolidated*.safetensors")) else "no *.safetensors weights"
        raise ModelNotFoundError(f"{hf_dir} has {only}")
    return [hf_dir / name for name in names]


def _index_in_use(hf_dir: Path) -> dict[str, str] | None:
    """The index's tensor -> shard map where the weights are its shards: there is an index and no
    ``model.safetensors`` (transformers looks for that first, so it wins over an index beside it)."""
    index = hf_dir / "model.safetensors.index.json"
    if (hf_dir / "model.safetensors").is_file() or not index.is_file():
        return None
    return _index_weight_map(index)


def _index_weight_map(index: Path) -> dict[str, str]:
    """The index's tensor -> shard map. A shard must be a ``.safetensors`` file inside the model
    directory: an index naming ``../elsewhere.safetensors`` or ``/abs/path`` is refused."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise UnsupportedModelError(f"{index}: weight_map must map tensor names to file names")
    for shard in set(weight_map.values()):
        relative = PurePosixPath(shard)
        if relative.is_absolute() or ".." in relative.parts or "\\" in shard or relative.suffix != ".safetensors":
            raise UnsupportedModelError(f"{index}: shard {shard!r} is not a .safetensors file in the model directory")
    return weight_map


def load_weights(hf_dir: Path, dtype: torch.dtype = torch.float32,
                 prefixes: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """All parameters by Hugging Face name (``model.layers.0.self_attn.q_proj.weight``), on CPU;
    with ``prefixes``, only those whose name starts with one (the rest is never read).

    Normalized so consumers see one shape of dict: ``lm_head.weight`` is present iff the model
    has its own head -- untied embeddings, or (as transformers 5 decides) a stored head that
    differs from the embeddings despite ``tie_word_embeddings``; a tied copy equal to them is
    dropped. Saved ``rotary_emb.inv_freq`` buffers (computed, not learned) are skipped. The
    whole model's tensors are checked against config.json (``weight_shapes``).
    """
    config = read_json(hf_dir / "config.json")
    llava = "vision_config" in config
    weights: dict[str, torch.Tensor] = {}
    for path in weight_files(hf_dir):
        try:
            _read_weight_file(path, llava, prefixes, dtype, weights)
        except (OSError, SafetensorError) as exc:  # missing shard, truncated or garbage file
            raise UnsupportedModelError(f"{path}: cannot read the weights: {exc}") from exc
    if (weight_map := _index_in_use(hf_dir)) is not None:
        expected = {_llava_name(n) if llava else n for n in weight_map if not n.endswith("rotary_emb.inv_freq")}
        expected = {n for n in expected if prefixes is None or n.startswith(prefixes)}
        if missing := expected - weights.keys():
            raise UnsupportedModelError(f"{hf_dir}: shards lack {sorted(missing)[:5]} listed in the index")
    if prefixes is not None:
        return weights
    model_config = load_model_config(hf_dir)
    _drop_tied_head(weights, model_config.tie_word_embeddings, hf_dir)
    check_lm_weights(weights, model_config, hf_dir)
    return weights


def _read_weight_file(path: Path, llava: bool, prefixes: tuple[str, ...] | None, dtype: torch.dtype,
                      weights: dict[str, torch.Tensor]) -> None:
    """Add ``path``'s tensors to ``weights`` (see load_weights)."""
    with safe_open(path, framework="pt") as f:
        for stored in f.keys():
            if stored.endswith("rotary_emb.inv_freq"):
                continue
            name = _llava_name(stored) if llava else stored
            if prefixes is not None and not name.startswith(prefixes):
                continue
            if name in weights:
                raise UnsupportedModelError(f"{path.parent}: tensor {name} appears in two weight files")
            tensor = f.get_tensor(stored)
            if tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16) and not name.endswith("position_ids"):
                raise UnsupportedModelError(f"{path}: tensor {stored} is {tensor.dtype}; only float32/float16/bfloat16 "
                                            "weights are supported (quantized checkpoints are not)")
            weights[name] = tensor.to(dtype)


def _drop_tied_head(weights: dict[str, torch.Tensor], tied: bool, hf_dir: Path) -> None:
    """Keep ``lm_head.weight`` only where the model has its own head (see load_weights)."""
    head, embeddings = weights.get("lm_head.weight"), weights.get("model.embed_tokens.weight")
    if tied and embeddings is None and head is not None:  # only the head stored: transformers ties to it
        weights["model.embed_tokens.weight"] = weights.pop("lm_head.weight")
        return
    if not tied:
        if head is None:
            raise UnsupportedModelError(f"{hf_dir}: no lm_head.weight and tie_word_embeddings is false")
        return
    if head is None or (embeddings is not None and head.shape == embeddings.shape and torch.equal(head, embeddings)):
        weights.pop("lm_head.weight", None)
        return
    logger.warning("%s: tie_word_embeddings is true but lm_head.weight differs from the embeddings; "
                   "using the stored head, as transformers does", hf_dir)


def _llava_name(stored: str) -> str:
    for prefix, plain in LLAVA_PREFIXES:
        if stored.startswith(prefix):
            return plain + stored[len(prefix):]
    return stored


def load_tokenizer(hf_dir: Path) -> PreTrainedTokenizerFast:
    """The fast (Rust) tokenizer of ``hf_dir``, chat template included; never downloads."""
    missing = [n for n in ("tokenizer.json", "tokenizer_config.json") if not (hf_dir / n).is_file()]
    if missing:
        raise ModelNotFoundError(f"{hf_dir} lacks {', '.join(missing)} (refengine needs a fast tokenizer)")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:  # never a tokenizer class from the model directory (``auto_map``): that would run its code
        tokenizer = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # the Rust tokenizer raises a bare Exception on a malformed tokenizer.json
        raise UnsupportedModelError(f"{hf_dir}: cannot load the tokenizer: {exc}") from exc
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise UnsupportedModelError(f"{hf_dir}: {type(tokenizer).__name__} is not a fast tokenizer")
    return tokenizer


def model_fingerprint(hf_dir: Path, compute_dtype: str = "", kv_dtype: str = "", vision: str = "") -> str:
    """A stable identity of the weights as run, for prefix-cache keys and for a decode engine's check
    of a prefill's KV: equal fingerprints => equal KV. ``compute_dtype`` (the engine's ``--dtype``)
    counts: the same weights run in bfloat16 and in float32 compute different KV. So does a KV
    cache stored in another dtype (``kv_dtype``, ``--kv-cache-dtype``), where it differs from
    ``compute_dtype`` (found by review: two engines differing only in it had equal block keys for
    different KV); the same dtype adds nothing, so those fingerprints did not change. So does a
    vision model's image path (``vision``: its encoder's fingerprint, preprocessing included): an
    image's rows, so its KV, depend on how it is resized and normalized, which the image
    processor's own file says (found by review: two replicas differing only there keyed different
    KV alike).

    Hashes the canonical config and each weight file's name, size and contents: the whole file when
    it is small (<= 64 MiB), else its safetensors header (every tensor's name, dtype, shape and
    offsets) plus 64 evenly spread 4 KiB windows of its data -- a few milliseconds where hashing
    gigabytes would take seconds per start. A fine-tune or another checkpoint of the same shapes
    changes (nearly) every weight, so the sample catches it; a file crafted to differ only between
    the windows would not be caught (this is an identity, not a defence). The directory's location
    does not count.
    """
    config = read_json(hf_dir / "config.json")
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    if compute_dtype:
        digest.update(f"\0dtype {compute_dtype}".encode())
    if kv_dtype and kv_dtype != compute_dtype:
        digest.update(f"\0kv dtype {kv_dtype}".encode())
    if vision:
        digest.update(f"\0vision {vision}".encode())
    for path in weight_files(hf_dir):
        try:
            _hash_weight_file(digest, path)
        except OSError as exc:
            raise UnsupportedModelError(f"{path}: cannot read the weights: {exc}") from exc
    return digest.hexdigest()[:32]


def _hash_weight_file(digest: hashlib._Hash, path: Path) -> None:
    """Add ``path``'s name, size and content (whole, or header + sampled windows) to ``digest``."""
    size = path.stat().st_size
    digest.update(f"\0{path.name}\0{size}\0".encode())
    with path.open("rb") as f:
        if size <= FINGERPRINT_WHOLE_FILE_BYTES:
            _hash_bytes(digest, f, size)
            return
        header_end = min(size, 8 + int.from_bytes(f.read(8), "little"))  # length-prefixed JSON header
        f.seek(0)
        _hash_bytes(digest, f, header_end)
        span = max(0, size - header_end - FINGERPRINT_WINDOW_BYTES)
        for i in range(FINGERPRINT_WINDOWS):
            f.seek(header_end + span * i // (FINGERPRINT_WINDOWS - 1))
            digest.update(f.read(FINGERPRINT_WINDOW_BYTES))


def _hash_bytes(digest: hashlib._Hash, f: BinaryIO, count: int) -> None:
    """The next ``count`` bytes of ``f``, in 1 MiB reads (a header can be large)."""
    while count > 0 and (chunk := f.read(min(count, 1 << 20))):
        digest.update(chunk)
        count -= len(chunk)
