"""The engine's LoRA: the lifecycle API (any thread) and each step's slot assignment.

A request names its adapter by ``lora_name``; acceptance resolves it to a ``LoadedLora``
(``LoraNotFoundError`` if none is loaded under that name), which the request keeps until
it ends, so an unload never pulls weights from under it. Each step, ``step_slots`` puts
the step's adapters into device slots (``LoraSlots``) and returns each scheduled
sequence's slot (-1: the base model), or None for a step without adapters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from refengine.lora.registry import LoraRegistry
from refengine.lora.slots import LoraSlots
from refengine.model.runner import ModelRunner
from refengine.scheduler.scheduler import SchedulerOutput
from refengine.types import LoraAdapterSpec

if TYPE_CHECKING:
    from refengine.engine.request import Request


class StepLora:
    """Core side (step thread): slots for the scheduled sequences' adapters."""

    def __init__(self, num_slots: int, runner: ModelRunner) -> None:
        self.slots = LoraSlots(num_slots, lambda slot, loaded: runner.set_lora_slot(slot, loaded.adapter.layers))

    def step_slots(self, sched: SchedulerOutput, requests: Mapping[str, Request]) -> list[int] | None:
        adapters = [requests[item.request_id].lora for item in sched.scheduled]
        if all(loaded is None for loaded in adapters):
            return None
        slots = self.slots.assign(loaded for loaded in adapters if loaded is not None)
        return [-1 if loaded is None else slots[loaded.key] for loaded in adapters]


class EngineLoraMixin:
    """The lifecycle RPCs' engine side (R1–R5); raises the ``refengine.types`` LoRA errors."""

    loras: LoraRegistry

    def load_lora(self, spec: LoraAdapterSpec) -> tuple[LoraAdapterSpec, bool]:
        """Load (or find loaded) an adapter; returns it and ``already_loaded``."""
        loaded, already = self.loras.load(spec)
        return loaded.spec, already

    def unload_lora(self, name: str) -> LoraAdapterSpec:
        return self.loras.unload(name)

    def list_loras(self) -> list[LoraAdapterSpec]:
        return self.loras.list()
