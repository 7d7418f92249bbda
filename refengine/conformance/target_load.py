"""Waiting on a target's load (GetLoad): for requests just started to be admitted, and for the
server to be idle again after a check's work. A mixin of :class:`~refengine.conformance.target.Target`.

GetLoad is optional (only the load profile needs it): without it the waits that merely pace a
check go on at once, and what only GetLoad can show is skipped, naming it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc

from refengine.conformance.options import Options
from refengine.conformance.registry import CheckFailed, CheckSkipped

#: The rules whose checks judge whether a server returns to idle (no running or queued request,
#: KV blocks released) after work they caused: abort all (A3), abort (A4), client cancel (A5), load
#: counts (H4), session release (K7). See :meth:`Target.wait_idle`.
IDLE_RULES = frozenset({"A3", "A4", "A5", "H4", "K7"})


class LoadWaits:
    """The load waits of a target. Invariant: the class it is mixed into sets ``options``,
    ``load_code`` (GetLoad's status at connect), ``rule`` (the running check's rule, "" outside a
    check) and ``idle_used_kv_blocks`` (the idle value of used KV blocks, or None), and has
    ``load()`` (one GetLoad call)."""

    options: Options
    load_code: grpc.StatusCode
    rule: str
    idle_used_kv_blocks: int | None

    def load(self, per_rank: bool = False) -> Any:
        raise NotImplementedError

    @property
    def has_load(self) -> bool:
        """Whether GetLoad answered at connect (it is optional: only the load profile needs it)."""
        return self.load_code == grpc.StatusCode.OK

    def need_load(self, what: str) -> None:
        """Skip unless GetLoad answers: ``what`` can be observed only through it."""
        if not self.has_load:
            raise CheckSkipped(f"{what} cannot be observed: GetLoad answered {self.load_code.name} (it is optional; "
                               "only the load profile requires it)")

    def need_counts(self, load: Any, what: str) -> None:
        """Skip unless ``load`` reports both request counts: an absent one is unavailable (H4),
        not 0, so whether work was released cannot be seen without them."""
        missing = [name for name in ("running_requests", "queued_requests") if not load.HasField(name)]
        if missing:
            raise CheckSkipped(f"{what} cannot be observed: GetLoad does not report {' or '.join(missing)} "
                               "(absent = unavailable, H4)")

    def wait_busy(self, predicate: Callable[[Any], bool], timeout: float) -> Any | None:
        """Give requests just started time to be admitted: poll GetLoad until ``predicate(load)``
        (returns the last LoadInfo), or, without GetLoad, wait a moment (returns None)."""
        if not self.has_load:
            time.sleep(min(timeout, 0.5))
            return None
        return self.wait_until(predicate, timeout)

    def wait_until(self, predicate: Callable[[Any], bool], timeout: float | None = None) -> Any:
        """Poll GetLoad until ``predicate(load)``; returns the last LoadInfo (check it). Skips
        the check when the target has no GetLoad (:meth:`need_load`)."""
        self.need_load("the server's load")
        deadline = time.monotonic() + (timeout or self.options.idle_timeout_s)
        load = self.load()
        while not predicate(load) and time.monotonic() < deadline:
            time.sleep(0.05)
            load = self.load()
        return load

    def is_idle(self, load: Any) -> bool:
        idle = load.running_requests == 0 and load.queued_requests == 0
        if self.idle_used_kv_blocks is not None and load.HasField("used_kv_blocks"):
            idle = idle and load.used_kv_blocks <= self.idle_used_kv_blocks
        return idle

    def wait_idle(self, what: str = "", baseline: int | None = None) -> Any:
        """Wait until no request runs or waits and used KV blocks are back at ``baseline``
        (default: the idle value seen at connect); returns that LoadInfo.

        Not getting back to idle is the finding of the rules about releasing work and KV
        (:data:`IDLE_RULES`): a check of one of them fails for it (as does a caller outside a
        check). Any other check is skipped instead, naming them: it cannot judge its own rule
        on a server still holding earlier work, and a leak (say, a KV block after a client
        cancel) must fail A5 alone, not every check that waits for idle after it. A server that
        has settled (nothing running or waiting) above the idle value leaked those blocks: the
        idle value becomes what it holds, so the checks after this one do not wait again.

        Without GetLoad (optional) a check of another rule goes on at once (returns None); one of
        :data:`IDLE_RULES` skips, as its rule cannot be observed."""
        if not self.has_load:  # nothing to wait for; a rule about releasing work cannot be judged
            if self.rule in IDLE_RULES or not self.rule:
                self.need_load(f"{what or 'returning to idle'}: the release of work and KV")
            return None
        limit = self.idle_used_kv_blocks if baseline is None else baseline

        def idle(load: Any) -> bool:
            if baseline is None:
                return self.is_idle(load)
            settled = load.running_requests == 0 and load.queued_requests == 0
            return settled and (not load.HasField("used_kv_blocks") or load.used_kv_blocks <= baseline)

        load = self.wait_until(idle)
        if self.rule in IDLE_RULES or not self.rule:
            self.need_counts(load, f"{what or 'returning to idle'}: the release of work")
        if not idle(load):
            message = (f"{what + ': ' if what else ''}server not idle after {self.options.idle_timeout_s:.0f} s: "
                       f"running={load.running_requests} queued={load.queued_requests} "
                       f"used_kv_blocks={load.used_kv_blocks} (idle value {limit})")
            if baseline is None and not load.running_requests and not load.queued_requests \
                    and load.HasField("used_kv_blocks"):
                # Settled, but holding KV blocks: earlier work leaked them. That is reported once, here;
                # later checks judge against what the server holds now instead of each waiting out the
                # idle timeout again (against a leaky server that wait made every later check slow).
                self.idle_used_kv_blocks = load.used_kv_blocks
                message += f"; later checks take {load.used_kv_blocks} as the idle value"
            if self.rule and self.rule not in IDLE_RULES:
                raise CheckSkipped(f"{message}; releasing work and KV is checked by {', '.join(sorted(IDLE_RULES))}")
            raise CheckFailed(message)
        return load
