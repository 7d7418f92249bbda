"""A KV event subscriber and the view it builds, for the section E checks (and tests that reuse them)."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from refengine.conformance.options import EVENT_WAIT_S
from refengine.conformance.registry import expect, fail, not_claimed, skip
from refengine.conformance.target import Target
from refengine.protocol import oe

HashKey = tuple[bytes, str]  # KvBlockHash (value, encoding)
SETTLE_S = 0.3  # a live subscription sends nothing until an event: time for it to be set up (or refused)
STILL_ARRIVING = 4  # a wait lasts up to this many timeouts while responses keep arriving


class KvSubscriber:
    """One ``SubscribeKvEvents`` call, read on a daemon thread until it ends or is closed.

    ``responses`` holds every ``SubscribeKvEventsResponse`` in order; ``code``/``details``
    the final status once the call ended (None while it runs). ``on_response`` sees each one
    (the conformance target records enum values and EngineErrors through it). A wait given no
    timeout lasts ``event_wait_s`` (``Options.event_wait_s``)."""

    def __init__(self, control: Any, request: Any, timeout: float,
                 on_response: Callable[[Any], None] | None = None, event_wait_s: float = EVENT_WAIT_S) -> None:
        self.call = control.SubscribeKvEvents(request, timeout=timeout)
        self.event_wait_s = event_wait_s
        self.responses: list[Any] = []
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self._on_response = on_response
        self._cond = threading.Condition()
        self._last_arrival = 0.0  # time.monotonic() when the last response arrived
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        code, details = grpc.StatusCode.OK, ""
        try:
            for response in self.call:
                if self._on_response is not None:
                    self._on_response(response)
                with self._cond:
                    self.responses.append(response)
                    self._last_arrival = time.monotonic()
                    self._cond.notify_all()
            code, details = self.call.code() or grpc.StatusCode.OK, self.call.details() or ""
        except grpc.RpcError as err:
            code, details = err.code(), err.details() or ""
        finally:
            with self._cond:
                self.code, self.details = code, details
                self._cond.notify_all()

    # -- what arrived ------------------------------------------------------------
    @property
    def ended(self) -> bool:
        return self.code is not None

    @property
    def batches(self) -> list[Any]:
        with self._cond:
            return [r.batch for r in self.responses if r.WhichOneof("event") == "batch"]

    @property
    def errors(self) -> list[Any]:
        with self._cond:
            return [r.error for r in self.responses if r.WhichOneof("event") == "error"]

    def kinds(self) -> list[str]:
        with self._cond:
            return [r.WhichOneof("event") or "<none>" for r in self.responses]

    def describe(self) -> str:
        status = self.code.name if self.code is not None else "still open"
        return f"status {status} ({self.details!r}), responses {self.kinds()}"

    # -- waiting -----------------------------------------------------------------
    def wait(self, predicate: Callable[[KvSubscriber], bool], timeout: float | None = None) -> bool:
        """Wait until ``predicate(self)`` holds or the call ended; returns the predicate. The
        ``timeout`` counts from the last response that arrived (at most STILL_ARRIVING times
        ``timeout`` in all): a stream still delivering is behind, not missing what is awaited.
        Found in CI: under load, a conforming server whose events come 0.5-1 s late delivered a
        repeat's BlockStored more than 10 s after the request, and E3 failed it."""
        timeout = self.event_wait_s if timeout is None else timeout
        start = time.monotonic()
        with self._cond:
            while not predicate(self) and not self.ended:
                deadline = min(start + STILL_ARRIVING * timeout, max(start, self._last_arrival) + timeout)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return predicate(self)

    def wait_responses(self, n: int, timeout: float | None = None) -> bool:
        return self.wait(lambda s: len(s.responses) >= n, timeout)

    def wait_sequence(self, number: int, timeout: float | None = None) -> bool:
        """Until a batch numbered ``number`` or later arrived."""
        return self.wait(lambda s: any(r.batch.sequence_number >= number for r in s.responses
                                       if r.WhichOneof("event") == "batch"), timeout)

    def wait_end(self, timeout: float | None = None) -> bool:
        return self.wait(lambda s: s.ended, timeout)

    def close(self) -> None:
        """Cancel the call (the client goes away) and stop the reader."""
        self.call.cancel()
        self._thread.join(5.0)


class KvView:
    """The prefix cache a subscriber knows: block hash -> parent hash (None for a first block),
    built from a snapshot and the live batches after it. ``problems`` lists every E3/E4
    violation seen (a child stored before its parent, a removal of a block never stored)."""

    def __init__(self) -> None:
        self.blocks: dict[HashKey, HashKey | None] = {}
        self.tokens: dict[HashKey, tuple[int, ...]] = {}
        self.problems: list[str] = []

    def apply(self, batch: Any) -> None:
        for event in batch.events:
            kind = event.WhichOneof("event")
            if kind == "block_stored":
                self._stored(event.block_stored, batch.sequence_number)
            elif kind == "block_removed":
                for h in event.block_removed.block_hashes:
                    if self.blocks.pop(_key(h), _MISSING) is _MISSING:
                        self.problems.append(f"batch {batch.sequence_number}: BlockRemoved of a block never stored")
            elif kind == "all_blocks_cleared":
                self.blocks.clear()
                self.tokens.clear()

    def _stored(self, stored: Any, number: int) -> None:
        parent = _key(stored.parent_block_hash) if stored.HasField("parent_block_hash") else None
        if parent is not None and parent not in self.blocks:
            self.problems.append(f"batch {number}: BlockStored whose parent_block_hash was never stored (E4 chain)")
        size = stored.block_size or (len(stored.token_ids) // max(1, len(stored.block_hashes)))
        for i, h in enumerate(stored.block_hashes):  # consecutive blocks chain in order
            self.blocks[_key(h)] = parent
            self.tokens[_key(h)] = tuple(stored.token_ids[i * size:(i + 1) * size])
            parent = _key(h)


_MISSING = object()


def _key(h: Any) -> HashKey:
    return (bytes(h.value), h.encoding)


# -- helpers ---------------------------------------------------------------------------
def subscribe(t: Target, include_snapshot: bool = False, start: int = 0, ranks: tuple[int, ...] = ()) -> KvSubscriber:
    """Open a subscription through the target's channel; skip when the RPC is UNIMPLEMENTED."""
    request = oe.SubscribeKvEventsRequest(include_snapshot=include_snapshot, start_sequence_number=start,
                                          data_parallel_ranks=list(ranks))
    sub = KvSubscriber(t.control, request, t.options.stream_timeout_s, on_response=t.observe,
                       event_wait_s=t.options.event_wait_s)
    if include_snapshot or start:
        sub.wait_responses(1)
    else:
        sub.wait_end(SETTLE_S)
    if sub.code == grpc.StatusCode.UNIMPLEMENTED:
        not_claimed(f"SubscribeKvEvents is UNIMPLEMENTED ({sub.details!r}): no KV events")
    return sub


def _block_size(t: Target) -> int:
    cap = t.server_info.capacity
    return cap.kv_block_size if cap.HasField("kv_block_size") and cap.kv_block_size > 0 else 16


def fresh_prompt(t: Target, tag: str, blocks: int = 3) -> str:
    """A prompt no earlier request began with, long enough for about ``blocks`` full KV blocks
    (a default-prompt sentence is ~20 tokens)."""
    repeats = max(2, -(-blocks * _block_size(t) // 16))
    ctx = t.max_context_length
    if ctx:
        repeats = min(repeats, max(1, (ctx - 32) // 24))
    return tagged_prompt(t, tag, repeats)


def tagged_prompt(t: Target, tag: str, repeats: int) -> str:
    """A prompt no earlier request began with: random hex first (so that it shares no leading
    text with another: a token-granular cache would serve a common start from cache; found by
    review), a run-unique tag, then the default prompt ``repeats`` times."""
    return f"{secrets.token_hex(4)} [{t.new_id(tag)}] " + " ".join([t.options.prompt] * repeats)


def generate(t: Target, prompt: str, salt: str = "", lora_name: str = "") -> Any:
    """One short greedy request (under ``salt`` and adapter ``lora_name`` when given); it must
    succeed. Its Usage (None when the server sent none)."""
    req = t.request("e", prompt=prompt, max_tokens=2)
    if salt:
        req.kv.cache_salt = salt
    if lora_name:
        req.lora_name = lora_name
    res = t.generate(req)
    expect(res.ok and not res.of("error"), f"Generate for the KV event checks failed: {res.describe()}")
    return res.usage()


def _need_text(t: Target) -> None:
    if not t.supports_text():
        not_claimed("the model takes no text prompt; the KV event checks send fresh text prompts")


def live_batches(t: Target, tag: str, wanted: int = 2) -> tuple[KvSubscriber, list[Any]]:
    """A live subscription and the batches that fresh requests caused: one request at a time,
    each once a batch arrived after the previous one, until ``wanted`` batches arrived or a
    request caused none within the event wait; skip when the server published none.

    It waits for a batch, not for a time window: a stream may run behind its engine (RULES set
    no bound). Waiting 2 s, it sent the next request while the last one's batches were still in
    flight, and E1's replay then asked for a batch the server had no longer retained (a toy 2.5 s
    late with 4 batches retained failed E1)."""
    _need_text(t)
    sub = subscribe(t)
    if sub.ended:
        fail(f"SubscribeKvEvents ended at once: {sub.describe()}")
    while len(sub.batches) < wanted:  # invariant: every pass adds a batch, else it stops
        seen = len(sub.batches)
        generate(t, fresh_prompt(t, tag))
        if not sub.wait(lambda s, seen=seen: len(s.batches) > seen):
            break
    if sub.errors or (sub.ended and sub.code != grpc.StatusCode.OK):
        fail(f"a live subscription failed: {sub.describe()}")
    batches = sub.batches
    if not batches:
        sub.close()
        skip(f"no KV event batch within {sub.event_wait_s:.0f} s of a request with a fresh multi-block prompt "
             "(prefix caching off?)")
    return sub, batches


def publish_up_to(t: Target, live: KvSubscriber, budget: int, tag: str) -> int:
    """Fresh requests, one at a time, until ``live`` has seen batch number ``budget`` (or a
    request caused no batch within the event wait, or ``budget`` requests were sent); the newest
    number seen. So a check that needs batch 1 expired does not depend on how many checks ran
    before it. (Waiting 2 s, it stopped early on a stream 2.5 s late, and E1 skipped a replay
    from an expired batch served silently as "still retained".)"""
    newest = max(b.sequence_number for b in live.batches)
    for n in range(budget):
        if newest >= budget:
            break
        seen = len(live.batches)
        generate(t, fresh_prompt(t, f"{tag}{n}"))
        if not live.wait(lambda s, seen=seen: len(s.batches) > seen):
            break
        newest = max(b.sequence_number for b in live.batches)
    return newest


def expired_replay(t: Target, tag: str) -> tuple[KvSubscriber, int]:
    """A subscription replaying from batch 1 once ``Options.replay_budget_batches`` batches were
    published (fresh requests until then: so it does not depend on which checks ran before), and
    the newest batch number; skips when nothing can have expired yet."""
    live, _ = live_batches(t, tag, wanted=1)
    try:
        newest = publish_up_to(t, live, t.options.replay_budget_batches, tag)
    finally:
        live.close()
    if newest <= 1:
        skip(f"the newest batch is {newest}: nothing can have expired yet")
    return subscribe(t, start=1), newest


def latest_number(t: Target) -> int:
    """The newest batch number: a snapshot's (E2), else a live batch caused by one request."""
    sub = subscribe(t, include_snapshot=True)
    try:
        if sub.batches:
            return sub.batches[0].sequence_number
    finally:
        sub.close()
    live, batches = live_batches(t, "e-latest", wanted=1)
    live.close()
    return batches[-1].sequence_number


def terminal_error(sub: KvSubscriber, what: str) -> Any:
    """E1/E5: the call ends with exactly one EngineError, as its last response, then OK."""
    if not sub.wait_end():
        sub.close()
        fail(f"{what}: the stream neither ended nor sent an error within {sub.event_wait_s:.0f} s "
             f"({sub.describe()}); expected one terminal EngineError")
    if sub.code != grpc.StatusCode.OK and not sub.responses:
        fail(f"{what}: refused with status {sub.code.name} ({sub.details!r}); after acceptance a failure is "
             "one terminal EngineError, then OK")
    errors = sub.errors
    expect(len(errors) == 1, f"{what}: {len(errors)} EngineError events ({sub.describe()}); expected exactly one")
    expect(sub.kinds()[-1] == "error", f"{what}: responses after the EngineError ({sub.describe()})")
    expect(sub.code == grpc.StatusCode.OK, f"{what}: status {sub.code.name} after the EngineError; expected OK")
    expect(errors[0].code != oe.ERROR_CODE_UNSPECIFIED, f"{what}: EngineError code UNSPECIFIED")
    return errors[0]
