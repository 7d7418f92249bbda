"""Which adapter sits in which of the device's ``max_loras`` slots.

Policy: an adapter stays in its slot while it is resident. A step that needs an adapter
that is not resident puts it in a free slot, or else in the slot of the least recently
used adapter this step does not need, copying its weights in (``load_slot``). The
scheduler guarantees a step never needs more adapters than there are slots (its running
requests use at most ``max_loras`` distinct adapters), so a slot is always found.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from refengine.lora.registry import LoadedLora


class LoraSlots:
    def __init__(self, num_slots: int, load_slot: Callable[[int, LoadedLora], None]) -> None:
        self.num_slots = num_slots
        self._load_slot = load_slot
        self._resident: OrderedDict[int, int] = OrderedDict()  # adapter key -> slot, least recent first

    def assign(self, adapters: Iterable[LoadedLora]) -> dict[int, int]:
        """Slots for this step's adapters (``key -> slot``), loading those not resident."""
        needed = {loaded.key: loaded for loaded in adapters}
        assert len(needed) <= self.num_slots, f"a step needs {len(needed)} adapters, there are {self.num_slots} slots"
        for key in needed:
            if key in self._resident:
                self._resident.move_to_end(key)
        for key, loaded in needed.items():
            if key not in self._resident:
                slot = self._free_slot(needed)
                self._load_slot(slot, loaded)
                self._resident[key] = slot
        return {key: self._resident[key] for key in needed}

    def _free_slot(self, needed: dict[int, LoadedLora]) -> int:
        used = set(self._resident.values())
        free = [slot for slot in range(self.num_slots) if slot not in used]
        if free:
            return free[0]
        victim = next(key for key in self._resident if key not in needed)
        return self._resident.pop(victim)
