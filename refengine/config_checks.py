"""The field checks every configuration dataclass runs in ``__post_init__`` (``config.py``,
``config_features.py``): each raises ``ValueError`` naming the class, the field and the
allowed range. No torch (the server imports the configs)."""

from __future__ import annotations

import ipaddress
import math
import numbers
import re


def check_int(owner: object, name: str, minimum: int, maximum: int | None = None, optional: bool = False) -> None:
    """``owner.name`` is an int in ``[minimum, maximum]`` (or ``None`` when ``optional``)."""
    value = getattr(owner, name)
    if optional and value is None:
        return
    if not (is_int(value) and value >= minimum and (maximum is None or value <= maximum)):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        none = " or None" if optional else ""
        raise ValueError(f"{type(owner).__name__}.{name} must be an integer {bound}{none}, got {value!r}")


def is_int(value: object) -> bool:
    # Integral admits numpy integers (from parsed model files); True is an int to Python, not to us.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_positive_float(owner: object, name: str) -> None:
    value = getattr(owner, name)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
        raise ValueError(f"{type(owner).__name__}.{name} must be a finite number > 0, got {value!r}")


#: The longest time a ``*_seconds`` setting may hold (~116 days): threads wait at most
#: ``threading.TIMEOUT_MAX`` (9.2e9 s) and gRPC turns a deadline into a time_t, so inf, or
#: 1e10, failed every guided compile and every pull, and crashed a prefill engine's step loop
#: (found by review).
MAX_SECONDS = 1e7
#: Counts the wire carries as uint32 (ModelInfo's max_num_sequences and max_top_n, GetLoad's counts,
#: KvEventSource's max_queue_size): a larger setting was accepted, then failed those RPCs with
#: INTERNAL (found by review). The bound of every such count, and of the buffers beside them.
UINT32_MAX = (1 << 32) - 1


def check_seconds(owner: object, name: str) -> None:
    """``owner.name`` is a duration in seconds: a number in ``(0, MAX_SECONDS]``."""
    value = getattr(owner, name)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= MAX_SECONDS:
        raise ValueError(f"{type(owner).__name__}.{name} must be a number of seconds in (0, {MAX_SECONDS:g}], "
                         f"got {value!r}")


def check_bool(owner: object, name: str) -> None:
    value = getattr(owner, name)
    if not isinstance(value, bool):
        raise ValueError(f"{type(owner).__name__}.{name} must be True or False, got {value!r}")


def check_choice(owner: object, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(owner, name)
    if value not in choices:
        raise ValueError(f"{type(owner).__name__}.{name} must be one of {', '.join(choices)}; got {value!r}")


def check_name(owner: object, name: str, optional: bool = False) -> None:
    value = getattr(owner, name)
    if optional and value is None:
        return
    if not isinstance(value, str) or not value:
        none = " or None" if optional else ""
        raise ValueError(f"{type(owner).__name__}.{name} must be a non-empty string{none}, got {value!r}")
    if value != value.strip():  # " " was served as a model name no client would type (found by review)
        raise ValueError(f"{type(owner).__name__}.{name} must not begin or end with white space, got {value!r}")


#: ``KvTransferConfig.allowed_sources`` entries that are not a host or network.
LOOPBACK_SOURCES, ANY_SOURCE = "loopback", "any"


def source_entry(entry: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | str:
    """One allowed KV source: an IP network (an address is a /32 or /128), else a host name
    (lower case), else ``loopback`` or ``any``; raises ``ValueError`` for anything else."""
    if not isinstance(entry, str):
        raise ValueError(f"{entry!r} is not a string")
    if entry in (LOOPBACK_SOURCES, ANY_SOURCE):
        return entry
    try:
        return ipaddress.ip_network(entry, strict=False)
    except ValueError:
        pass
    if not is_host_name(entry):
        raise ValueError(f"{entry!r} is not a host name, IP address, CIDR network, {LOOPBACK_SOURCES!r} or "
                         f"{ANY_SOURCE!r}")
    return entry.lower().rstrip(".")


def is_host(text: str) -> bool:
    """A host name (``is_host_name``) or an IP address, an IPv6 one with or without brackets."""
    if is_host_name(text):
        return True
    try:
        ipaddress.ip_address(text[1:-1] if text.startswith("[") and text.endswith("]") else text)
    except ValueError:
        return False
    return True


def is_host_name(text: str) -> bool:
    """Letters, digits, hyphens and underscores (names a resolver takes, as Docker's service
    names) in dot-separated labels, an optional final dot: nothing a dialer would decode or
    split (``%``, ``/``, ``:``, ``@``, spaces)."""
    return bool(_HOST_NAME.fullmatch(text))


_HOST_NAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?(\.[A-Za-z0-9_]"
                        r"([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?")
