"""Every enum value a server sends, found by walking the received messages.

The release's enums are open (proto3): a value the client's schema does not know is
kept as a plain integer, so a server built from the wrong schema (e.g. HealthState 5
or ErrorCode 12 of the pre-release copy) shows up here as a value missing from the
enum descriptor.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from google.protobuf.descriptor import Descriptor, EnumDescriptor

_HAS_ENUMS: dict[str, bool] = {}


def _has_enums(desc: Descriptor, seen: frozenset[str] = frozenset()) -> bool:
    """Whether ``desc`` (transitively) holds an enum field; cached, so that big enum-free
    subtrees (candidate lists, Struct) are never walked."""
    if desc.full_name in _HAS_ENUMS:
        return _HAS_ENUMS[desc.full_name]
    if desc.full_name.startswith("google.protobuf.") or desc.full_name in seen:
        return False  # Struct's NullValue is not a server's choice; a cycle adds nothing new
    inner = seen | {desc.full_name}
    found = any(fd.enum_type is not None or (fd.message_type is not None and _has_enums(fd.message_type, inner))
                for fd in desc.fields)
    _HAS_ENUMS[desc.full_name] = found
    return found


def enum_values(msg: Any, path: str = "") -> Iterator[tuple[EnumDescriptor, int, str]]:
    """(enum, value, field path) of every enum value set in ``msg``. proto3 leaves 0 unset:
    UNSPECIFIED is always a valid value, so missing it loses nothing."""
    path = path or msg.DESCRIPTOR.name
    for fd, value in msg.ListFields():
        where = f"{path}.{fd.name}"
        repeated = fd.is_repeated
        items = list(value) if repeated else [value]
        if fd.enum_type is not None:
            for i, item in enumerate(items):
                yield fd.enum_type, int(item), f"{where}[{i}]" if repeated else where
        elif fd.message_type is not None and _has_enums(fd.message_type) and not fd.message_type.GetOptions().map_entry:
            for i, item in enumerate(items):
                yield from enum_values(item, f"{where}[{i}]" if repeated else where)


def is_known(enum: EnumDescriptor, value: int) -> bool:
    return value in enum.values_by_number


def value_name(enum: EnumDescriptor, value: int) -> str:
    return enum.values_by_number[value].name if is_known(enum, value) else str(value)


def enum_name(enum: Any, value: int) -> str:
    """The name of ``value`` in a generated enum (``oe.FinishReason``), or the number and "(not in
    the release)": a check describing what a server sent must not crash on a value X4 reports."""
    return value_name(enum.DESCRIPTOR, value) + ("" if is_known(enum.DESCRIPTOR, value) else " (not in the release)")


class EnumLog:
    """Thread-safe record: enum full name -> value -> where it was first seen."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.enums: dict[str, EnumDescriptor] = {}
        self.seen: dict[str, dict[int, str]] = {}

    def observe(self, msg: Any, where: str = "") -> None:
        found = list(enum_values(msg, where))
        with self._lock:
            for enum, value, path in found:
                self.enums[enum.full_name] = enum
                self.seen.setdefault(enum.full_name, {}).setdefault(value, path)

    def unknown(self) -> list[tuple[EnumDescriptor, int, str]]:
        """Every (enum, value, first place) whose value the release does not define."""
        with self._lock:
            return [(self.enums[name], value, where) for name, values in sorted(self.seen.items())
                    for value, where in sorted(values.items()) if not is_known(self.enums[name], value)]

    def summary(self) -> str:
        """``HealthState {READY, STARTING}; ...`` of every enum seen, for a check's note."""
        with self._lock:
            parts = [f"{self.enums[name].name} {{{', '.join(_short(self.enums[name], v) for v in sorted(vals))}}}"
                     for name, vals in sorted(self.seen.items())]
        return "; ".join(parts)

    def values(self, enum_name: str) -> set[int]:
        with self._lock:
            return set(self.seen.get(enum_name, {}))


def _short(enum: EnumDescriptor, value: int) -> str:
    """READY rather than HEALTH_STATE_READY."""
    name = value_name(enum, value)
    prefix = "".join(f"_{c}" if c.isupper() else c.upper() for c in enum.name).lstrip("_") + "_"
    return name.removeprefix(prefix)
