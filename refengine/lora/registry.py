"""The loaded adapters: the LoRA lifecycle rules (R1–R5) and path confinement.

``load`` checks the request (R1); exactly the id, name and ``source_path`` of a loaded
adapter is ``already_loaded`` at once (R2, even if its files have gone since). Otherwise
it resolves ``source_path`` (following symlinks) and refuses it unless it lies inside one
of the configured roots, then compares it with what is loaded: the same id, name and
resolved path → ``already_loaded`` (R2); any one of them shared with a different adapter
→ ``LoraConflictError`` (R3). Only then are the files read (``peft.read_peft_adapter``,
opened from the root without following a symlink swapped in since: ``confined.py``),
outside the registry's lock, so a slow load never blocks generation; loads and unloads
are serialized among themselves. A load that fails leaves nothing behind.

Unloading removes the name at once: new requests naming it get ``LoraNotFoundError``
(R4). Requests already accepted keep their ``LoadedLora`` (and its weights) and finish
on it; its slot is reused only when no running request needs it.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from refengine.config import LoraConfig, ModelConfig
from refengine.lora.confined import root_of
from refengine.lora.peft import PeftAdapter, read_peft_adapter
from refengine.types import (
    InvalidRequestError,
    LoraAdapterSpec,
    LoraConflictError,
    LoraDisabledError,
    LoraNotFoundError,
    OverloadedError,
)

logger = logging.getLogger(__name__)

MAX_NAME_BYTES = 256
INT64_MAX = (1 << 63) - 1


@dataclass(frozen=True, eq=False)
class LoadedLora:
    """One load of an adapter. ``key``: unique per load in this process (slot bookkeeping);
    ``cache_key``: what its KV blocks hash with, from the files' digest, so the same files
    share prefix-cache blocks across loads, ids and processes, and different files never do."""

    spec: LoraAdapterSpec
    key: int
    resolved_path: str
    adapter: PeftAdapter

    @property
    def cache_key(self) -> str:
        return f"lora:{self.adapter.fingerprint}"


def _check_spec(spec: LoraAdapterSpec) -> None:
    if isinstance(spec.lora_id, bool) or not isinstance(spec.lora_id, int) or not 0 < spec.lora_id <= INT64_MAX:
        raise InvalidRequestError(f"lora_id must be > 0, got {spec.lora_id!r}")
    if not spec.lora_name or len(spec.lora_name.encode()) > MAX_NAME_BYTES:
        raise InvalidRequestError(f"lora_name must be a non-empty name of at most {MAX_NAME_BYTES} bytes")
    if not spec.source_path or not os.path.isabs(spec.source_path):
        raise InvalidRequestError(f"source_path must be an absolute directory, got {spec.source_path!r}")
    if "\0" in spec.source_path:  # no file system path holds one (os.path raises on it)
        raise InvalidRequestError(f"source_path must not contain a NUL character, got {spec.source_path!r}")


class LoraRegistry:
    def __init__(self, config: LoraConfig, model: ModelConfig) -> None:
        if config.enabled and model.architecture == "LlavaForConditionalGeneration":
            # PEFT names a LLaVA language model's modules under language_model, which the adapter
            # reader does not map: every adapter was refused, while the server advertised LoRA.
            raise ValueError("--enable-lora is not supported for LLaVA models (adapters of their language model "
                             "are not read); serve without it")
        self.config = config
        self.model = model
        self._roots = tuple(os.path.realpath(root) for root in config.roots)
        for root in self._roots if config.enabled else ():
            if not os.path.isdir(root):  # it may be mounted later: said, not refused (found by review: silent)
                logger.warning("--lora-root %s is not a directory (yet): no adapter loads from it until it is", root)
        self._by_name: dict[str, LoadedLora] = {}
        self._lock = threading.Lock()  # guards _by_name (generation reads it)
        self._lifecycle = threading.Lock()  # one load or unload at a time
        self._keys = itertools.count(1)

    def _enabled(self) -> None:
        if not self.config.enabled:
            raise LoraDisabledError("LoRA is disabled on this server (start it with --enable-lora)")

    def confine(self, source_path: str) -> str:
        """The real path of ``source_path`` if it is a directory inside a root, else refused."""
        resolved = os.path.realpath(source_path)
        if not self._inside_roots(resolved):
            roots = ", ".join(self._roots) or "none configured (--lora-root)"
            raise InvalidRequestError(f"source_path {source_path!r} is not inside an allowed LoRA root ({roots})")
        if not os.path.isdir(resolved):
            raise InvalidRequestError(f"source_path {source_path!r} is not a directory visible to the engine")
        return resolved

    def _inside_roots(self, resolved: str) -> bool:
        return root_of(self._roots, resolved) is not None

    def _existing(self, spec: LoraAdapterSpec, resolved: str) -> LoadedLora | None:
        """The identical loaded adapter (R2), None if there is none; a partial match is R3."""
        for loaded in self._by_name.values():
            same = (loaded.spec.lora_id == spec.lora_id, loaded.spec.lora_name == spec.lora_name,
                    loaded.resolved_path == resolved)
            if all(same):
                return loaded
            if any(same):
                raise LoraConflictError(
                    f"LoRA adapter {spec.lora_name!r} (id {spec.lora_id}, {spec.source_path!r}) conflicts with loaded "
                    f"adapter {loaded.spec.lora_name!r} (id {loaded.spec.lora_id}, {loaded.spec.source_path!r})")
        return None

    def load(self, spec: LoraAdapterSpec) -> tuple[LoadedLora, bool]:
        """R1–R3; returns the adapter and whether it was loaded already."""
        self._enabled()
        _check_spec(spec)
        identical = self._identical(spec)
        if identical is not None:
            return identical, True
        resolved = self.confine(spec.source_path)
        with self._lifecycle:
            with self._lock:
                existing = self._existing(spec, resolved)
                if existing is not None:
                    return existing, True
                if len(self._by_name) >= self.config.max_loaded_loras:
                    raise OverloadedError(f"{len(self._by_name)} LoRA adapters are loaded, the most this server "
                                          f"holds (--max-loaded-loras): unload one first")
            self._confine_entries(resolved)
            adapter = read_peft_adapter(Path(resolved), self.model, self.config.max_lora_rank, self._roots)
            loaded = LoadedLora(spec, next(self._keys), resolved, adapter)
            with self._lock:
                self._by_name[spec.lora_name] = loaded
            return loaded, False

    def _identical(self, spec: LoraAdapterSpec) -> LoadedLora | None:
        """The adapter loaded with exactly this id, name and ``source_path`` (R2), checked before
        the path is: its files were confined when it was loaded, and may be gone since (the
        weights are in memory), yet a client retrying the same LoadLora must get already_loaded."""
        with self._lock:
            loaded = self._by_name.get(spec.lora_name)
        return loaded if loaded is not None and loaded.spec == spec else None

    def _confine_entries(self, resolved: str) -> None:
        """Nor may the directory's files lead outside the roots (a symlinked weight file)."""
        try:
            entries = list(os.scandir(resolved))
        except OSError as exc:  # unreadable or gone since ``confine``: not visible to the engine (R1)
            raise InvalidRequestError(f"source_path {resolved!r} cannot be listed: {exc}") from None
        for entry in entries:
            if not self._inside_roots(os.path.realpath(entry.path)):
                raise InvalidRequestError(f"{entry.path!r} leads outside the allowed LoRA roots (a symlink?)")

    def unload(self, name: str) -> LoraAdapterSpec:
        self._enabled()
        with self._lifecycle, self._lock:
            loaded = self._by_name.pop(name, None)
        if loaded is None:
            raise LoraNotFoundError(f"LoRA adapter {name!r} is not loaded")
        return loaded.spec

    def get(self, name: str) -> LoadedLora:
        """The adapter a request names (R4), for acceptance."""
        with self._lock:
            loaded = self._by_name.get(name)
        if loaded is None:
            raise LoraNotFoundError(f"LoRA adapter {name!r} is not loaded" if self.config.enabled
                                    else f"LoRA adapter {name!r} not found: LoRA is disabled on this server")
        return loaded

    def list(self) -> list[LoraAdapterSpec]:
        self._enabled()
        with self._lock:
            return sorted((loaded.spec for loaded in self._by_name.values()), key=lambda s: s.lora_id)
