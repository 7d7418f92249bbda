"""The toy engine's LoRA lifecycle (R1-R7): LoadLora, UnloadLora, ListLoras and ``lora_name``.

The toy reads no weights: an adapter is its (id, name, directory), checked as R1 says (the
directory must exist), and it moves the model's preferred character by ``1 + lora_id % 5``,
so different adapters change greedy output differently. LoRA is off unless ``Faults.lora``.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import grpc

from refengine.protocol import oe
from tests.conformance.toy_faults import Faults
from tests.conformance.toy_requests import INVALID, NOT_FOUND, Refused, require

MAX_LORAS = 4


def _same(a: Any, b: Any) -> bool:
    return (a.lora_id, a.lora_name, a.source_path) == (b.lora_id, b.lora_name, b.source_path)


def _shares(a: Any, b: Any) -> bool:
    return a.lora_id == b.lora_id or a.lora_name == b.lora_name or a.source_path == b.source_path


class ToyLoras:
    """The loaded adapters by name."""

    def __init__(self, faults: Faults) -> None:
        self.faults = faults
        self.lock = threading.Lock()
        self.loaded: dict[str, Any] = {}

    @property
    def max_loras(self) -> int:
        return 0 if self.faults.max_loras_zero else MAX_LORAS

    def enabled(self) -> None:
        """R5: with LoRA disabled every lifecycle RPC is FAILED_PRECONDITION."""
        code = INVALID if self.faults.lora_disabled_invalid else grpc.StatusCode.FAILED_PRECONDITION
        require(self.faults.lora, "LoRA disabled", code)

    def _valid(self, a: Any) -> None:
        """R1."""
        require(a.lora_id > 0, f"lora_id {a.lora_id} must be > 0")
        require(bool(a.lora_name), "lora_name is empty")
        if not self.faults.lora_path_unchecked:
            require(os.path.isabs(a.source_path), f"source_path {a.source_path!r} is not absolute")
            require(os.path.isdir(a.source_path), f"source_path {a.source_path!r} is not a directory")

    def load(self, request: Any) -> Any:
        self.enabled()
        a = request.adapter
        if self.faults.empty_ok_for_invalid_load and request.HasField("adapter") and not a.lora_id \
                and not a.lora_name:
            return oe.LoadLoraResponse()  # X2's fault: the failure hidden in an OK answer
        self._valid(a)
        with self.lock:
            if any(_same(a, b) or (self.faults.path_ignored_when_loaded and (a.lora_id, a.lora_name)
                                   == (b.lora_id, b.lora_name)) for b in self.loaded.values()):
                return oe.LoadLoraResponse(adapter=a, already_loaded=not self.faults.already_loaded_false)
            clashing = [name for name, b in self.loaded.items() if _shares(a, b)]
            require(not clashing or self.faults.conflict_replaces, f"conflicts with loaded {clashing}",
                    grpc.StatusCode.ALREADY_EXISTS)
            for name in clashing:
                del self.loaded[name]
            require(len(self.loaded) < MAX_LORAS, "too many adapters", grpc.StatusCode.RESOURCE_EXHAUSTED)
            self.loaded[a.lora_name] = oe.LoraAdapter(lora_id=a.lora_id, lora_name=a.lora_name,
                                                      source_path=a.source_path)
        return oe.LoadLoraResponse(adapter=a, already_loaded=False)

    def unload(self, request: Any) -> Any:
        self.enabled()
        with self.lock:
            require(request.lora_name in self.loaded, f"adapter {request.lora_name!r} not loaded", NOT_FOUND)
            return oe.UnloadLoraResponse(adapter=self.loaded.pop(request.lora_name))

    def listed(self) -> Any:
        self.enabled()
        with self.lock:
            return oe.ListLorasResponse(adapters=list(self.loaded.values()))

    def shift(self, name: str) -> int:
        """The preferred-character shift of Generate's ``lora_name`` (R4: unknown → NOT_FOUND)."""
        if not name:
            return 0
        code = INVALID if self.faults.unknown_lora_invalid else NOT_FOUND
        with self.lock:
            adapter = self.loaded.get(name) if self.faults.lora else None
        if adapter is None:
            raise Refused(code if self.faults.lora else NOT_FOUND, f"unknown LoRA adapter {name!r}")
        return 1 + adapter.lora_id % 5
