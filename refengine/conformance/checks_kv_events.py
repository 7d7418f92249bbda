"""Section E — KV events (E1–E6): ``Control.SubscribeKvEvents`` and ``GetKvEventSources``.

What a client can see on any server: while the suite generates a few requests with fresh
prompts, the batches a subscriber receives are numbered strictly increasing per rank (E1);
a snapshot lists the blocks cached by an earlier request and live batches follow it
without a gap (E2); a replay from a number still retained gives the same batches again and
one that is gone ends with exactly one terminal ``EngineError``, then status OK (E1, E5);
every stored block's parent is known to a view built from a snapshot (E3/E4), and a salted
copy of a prompt stores blocks of its own (E4); ``GetKvEventSources`` never advertises a
wildcard host, answers one source per requested rank or none, and refuses unknown or
repeated ranks (E6). Every check skips, saying why, on a server whose ``SubscribeKvEvents``
is UNIMPLEMENTED.

:class:`KvSubscriber` and :class:`KvView` are also used by refengine's own integration tests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from refengine.conformance.registry import check, expect, fail, skip
from refengine.conformance.target import Target
from refengine.protocol import oe

HashKey = tuple[bytes, str]  # KvBlockHash (value, encoding)
WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]", "*", "0:0:0:0:0:0:0:0"}
SETTLE_S = 0.3  # a live subscription sends nothing until an event: time for it to be set up (or refused)
EVENT_WAIT_S = 10.0  # for a batch that a finished request caused


class KvSubscriber:
    """One ``SubscribeKvEvents`` call, read on a daemon thread until it ends or is closed.

    ``responses`` holds every ``SubscribeKvEventsResponse`` in order; ``code``/``details``
    the final status once the call ended (None while it runs). ``on_response`` sees each one
    (the conformance target records enum values and EngineErrors through it)."""

    def __init__(self, control: Any, request: Any, timeout: float,
                 on_response: Callable[[Any], None] | None = None) -> None:
        self.call = control.SubscribeKvEvents(request, timeout=timeout)
        self.responses: list[Any] = []
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self._on_response = on_response
        self._closed = False
        self._cond = threading.Condition()
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

    @property
    def last_sequence_number(self) -> int | None:
        batches = self.batches
        return batches[-1].sequence_number if batches else None

    def kinds(self) -> list[str]:
        with self._cond:
            return [r.WhichOneof("event") or "<none>" for r in self.responses]

    def describe(self) -> str:
        status = self.code.name if self.code is not None else "still open"
        return f"status {status} ({self.details!r}), responses {self.kinds()}"

    # -- waiting -----------------------------------------------------------------
    def wait(self, predicate: Callable[[KvSubscriber], bool], timeout: float) -> bool:
        """Wait until ``predicate(self)`` holds or the call ended; returns the predicate."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self) and not self.ended:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return predicate(self)

    def wait_responses(self, n: int, timeout: float = EVENT_WAIT_S) -> bool:
        return self.wait(lambda s: len(s.responses) >= n, timeout)

    def wait_sequence(self, number: int, timeout: float = EVENT_WAIT_S) -> bool:
        """Until a batch numbered ``number`` or later arrived."""
        return self.wait(lambda s: any(r.batch.sequence_number >= number for r in s.responses
                                       if r.WhichOneof("event") == "batch"), timeout)

    def wait_end(self, timeout: float) -> bool:
        return self.wait(lambda s: s.ended, timeout)

    def close(self) -> None:
        """Cancel the call (the client goes away) and stop the reader."""
        self._closed = True
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
    sub = KvSubscriber(t.control, request, t.options.stream_timeout_s, on_response=t.observe)
    if include_snapshot or start:
        sub.wait_responses(1)
    else:
        sub.wait_end(SETTLE_S)
    if sub.code == grpc.StatusCode.UNIMPLEMENTED:
        skip(f"SubscribeKvEvents is UNIMPLEMENTED ({sub.details!r}): no KV events")
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
    return f"[{t.new_id(tag)}] " + " ".join([t.options.prompt] * repeats)


def generate(t: Target, prompt: str, salt: str = "") -> None:
    """One short greedy request; it must succeed."""
    req = t.request("e", prompt=prompt, max_tokens=2)
    if salt:
        req.kv.cache_salt = salt
    res = t.generate(req)
    expect(res.ok and not res.of("error"), f"Generate for the KV event checks failed: {res.describe()}")


def _need_text(t: Target) -> None:
    if not t.supports_text():
        skip("the model takes no text prompt; the KV event checks send fresh text prompts")


def live_batches(t: Target, tag: str, wanted: int = 2, max_requests: int = 4) -> tuple[KvSubscriber, list[Any]]:
    """A live subscription and the batches that fresh requests caused (at least ``wanted``,
    one request at a time); skip when the server published none."""
    _need_text(t)
    sub = subscribe(t)
    if sub.ended:
        fail(f"SubscribeKvEvents ended at once: {sub.describe()}")
    for _ in range(max_requests):
        generate(t, fresh_prompt(t, tag))
        sub.wait(lambda s: bool(s.responses), 2.0)
        if len(sub.batches) >= wanted or sub.ended:
            break
    sub.wait_responses(wanted, 2.0)
    if sub.errors or (sub.ended and sub.code != grpc.StatusCode.OK):
        fail(f"a live subscription failed: {sub.describe()}")
    batches = sub.batches
    if not batches:
        sub.close()
        skip(f"no KV event batch after {max_requests} requests with fresh multi-block prompts "
             "(prefix caching off?)")
    return sub, batches


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
    if not sub.wait_end(EVENT_WAIT_S):
        sub.close()
        fail(f"{what}: the stream neither ended nor sent an error within {EVENT_WAIT_S:.0f} s "
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


# -- E1 ------------------------------------------------------------------------------------
@check("E1", "sequence_number strictly increases per rank while requests run")
def sequence_numbers_increase(t: Target) -> str:
    """E1: a live subscriber's batches, caused by fresh requests, are numbered strictly increasing."""
    sub, _ = live_batches(t, "e1", wanted=3)
    try:
        batches = sub.batches
    finally:
        sub.close()
    last: dict[int, int] = {}
    for b in batches:
        previous = last.get(b.data_parallel_rank)
        expect(previous is None or b.sequence_number > previous,
               f"rank {b.data_parallel_rank}: batch {b.sequence_number} after {previous}; sequence numbers must "
               "strictly increase")
        last[b.data_parallel_rank] = b.sequence_number
    return f"{len(batches)} batches {[b.sequence_number for b in batches]}"


@check("E1", "start_sequence_number still retained: the same batches again")
def replay_retained(t: Target) -> str:
    """E1: replaying from the first batch a live subscriber got gives those batches, equal."""
    live, _ = live_batches(t, "e1r", wanted=2)
    try:
        seen = live.batches
    finally:
        live.close()
    start, end = seen[0].sequence_number, seen[-1].sequence_number
    replay = subscribe(t, start=start)
    try:
        replay.wait_sequence(end)
        got = [b for b in replay.batches if b.sequence_number <= end]
        expect(not replay.errors, f"replay from {start} (retained a moment ago) failed: {replay.describe()}")
    finally:
        replay.close()
    expect(got == seen,
           f"replay from {start} gave batches {[b.sequence_number for b in got]}, the live subscriber saw "
           f"{[b.sequence_number for b in seen]} (or their contents differ); a replay repeats the same batches")
    return f"batches {start}..{end} replayed identically"


@check("E1", "start_sequence_number no longer retained: one terminal EngineError, then OK")
def replay_expired(t: Target) -> str:
    """E1: replay from batch 1 after the suite's requests (and two more of its own); skips
    while batch 1 is still retained."""
    live, batches = live_batches(t, "e1x", wanted=2)
    live.close()
    newest = batches[-1].sequence_number
    if newest <= 1:
        skip(f"the newest batch is {newest}: nothing can have expired yet")
    sub = subscribe(t, start=1)
    try:
        sub.wait_responses(1)
        first = sub.responses[0] if sub.responses else None
        if first is not None and first.WhichOneof("event") == "batch":
            number = first.batch.sequence_number
            expect(number <= 1, f"replay from 1 began at batch {number} without an error: batches 1..{number - 1} "
                                "were skipped silently (expected a terminal EngineError)")
            skip(f"batch 1 is still retained (newest {newest}): the retention window covers this run")
        error = terminal_error(sub, "replay from expired sequence number 1")
    finally:
        sub.close()
    return f"replay from 1 (newest {newest}): {oe.ErrorCode.Name(error.code)} {error.message!r}, then OK"


# -- E2 ------------------------------------------------------------------------------------
@check("E2", "include_snapshot: first the cached blocks, then live batches without a gap")
def snapshot_then_live(t: Target) -> str:
    """E2: after a long prompt ran, a snapshot's first batch lists blocks (BlockStored only);
    the first live batch a new request causes is numbered right after it."""
    _need_text(t)
    generate(t, fresh_prompt(t, "e2", blocks=4))
    sub = subscribe(t, include_snapshot=True)
    try:
        expect(bool(sub.responses), f"include_snapshot sent nothing within {EVENT_WAIT_S:.0f} s: "
                                    f"{sub.describe()}")
        expect(sub.kinds()[0] == "batch", f"include_snapshot's first response is not a batch: {sub.describe()}")
        snap = sub.batches[0]
        kinds = {e.WhichOneof("event") for e in snap.events}
        expect(bool(snap.events), "the snapshot is empty right after a 4-block prompt ran; it lists the blocks "
                                  "currently cached")
        expect(kinds == {"block_stored"}, f"the snapshot holds {sorted(kinds)}; it lists cached blocks "
                                          "(BlockStored only)")
        view = KvView()
        view.apply(snap)
        expect(not view.problems, f"snapshot: {view.problems[:3]} (parents come before children)")
        generate(t, fresh_prompt(t, "e2live"))
        expect(sub.wait_responses(2), f"no live batch after the snapshot and a new request: {sub.describe()}")
        live = sub.batches[1]
    finally:
        sub.close()
    expect(live.sequence_number == snap.sequence_number + 1,
           f"snapshot numbered {snap.sequence_number}, first live batch {live.sequence_number}: a gap or a "
           "duplicate (the snapshot carries the number of the last batch it includes)")
    return f"snapshot {snap.sequence_number} with {len(view.blocks)} blocks, live from {live.sequence_number}"


# -- E3/E4 ---------------------------------------------------------------------------------
@check("E4", "every BlockStored's parent is known; a salted copy of a prompt stores blocks of its own")
def stored_events_chain(t: Target) -> str:
    """E3/E4: a view built from a snapshot and the live batches never meets a child before
    its parent or a removal of an unknown block; with ``supports_cache_salt``, the same prompt
    under a new salt stores blocks with the same tokens under different hashes."""
    _need_text(t)
    sub = subscribe(t, include_snapshot=True)
    salted = bool(t.caps.supports_cache_salt)
    try:
        expect(bool(sub.batches), f"include_snapshot sent no batch: {sub.describe()}")
        prompt = fresh_prompt(t, "e4")
        generate(t, prompt)
        generate(t, prompt + " And then")  # a shared prefix: its new blocks chain onto cached ones
        if salted:
            generate(t, prompt, salt=t.new_id("salt"))
        time.sleep(0.5)  # let the last batches arrive
        batches = sub.batches
        expect(not sub.errors, f"the subscription failed: {sub.describe()}")
    finally:
        sub.close()
    view = KvView()
    for i, b in enumerate(batches):
        view.apply(b)
        expect(i == 0 or b.sequence_number > batches[i - 1].sequence_number, "sequence numbers not increasing")
    expect(not view.problems, "; ".join(view.problems[:3]))
    if not salted:
        return f"{len(batches)} batches chain; cache_salt not advertised"
    live = KvView()  # what this check's own requests stored (the snapshot may hold other salts' blocks)
    for b in batches[1:]:
        live.apply(b)
    by_tokens: dict[tuple[int, ...], set[HashKey]] = {}
    for key, tokens in live.tokens.items():
        by_tokens.setdefault(tokens, set()).add(key)
    expect(any(len(keys) > 1 for keys in by_tokens.values()),
           "the same prompt under a new cache_salt stored no block with the same tokens under another hash: the "
           "salt is not in the block hash (E4, K2)")
    return f"{len(batches)} batches chain; a salted copy stored blocks under other hashes"


# -- E5 ------------------------------------------------------------------------------------
@check("E5", "a failure after acceptance (replay point not retained) is one final error event, then OK")
def failure_is_error_then_ok(t: Target) -> str:
    """E5: a replay from a number far beyond the newest batch cannot be served (not retained):
    exactly one EngineError, nothing after it, status OK."""
    _need_text(t)
    start = latest_number(t) + 1000
    sub = subscribe(t, start=start)
    try:
        if not sub.wait_responses(1, 3.0) and not sub.ended:
            skip(f"replay from {start} (beyond the newest batch) waits instead of failing: no failure to observe")
        error = terminal_error(sub, f"replay from {start}, beyond the newest batch")
    finally:
        sub.close()
    return f"{oe.ErrorCode.Name(error.code)} (retryable={error.retryable}) {error.message!r}, then OK"


# -- E6 ------------------------------------------------------------------------------------
def _sources(t: Target, ranks: list[int]) -> tuple[grpc.StatusCode, Any]:
    return t.unary_code("GetKvEventSources", oe.GetKvEventSourcesRequest(data_parallel_ranks=ranks))


def _ranks(t: Target) -> tuple[int, int]:
    """(first rank, number of ranks) as ServerInfo.parallelism reports them (0, 1 when absent)."""
    p = t.server_info.parallelism
    first = p.data_parallel_start_rank if p.HasField("data_parallel_start_rank") else 0
    size = p.data_parallel_size if p.HasField("data_parallel_size") and p.data_parallel_size > 0 else 1
    return first, size


def _source_problems(sources: Any) -> list[str]:
    problems = []
    for s in sources:
        host = s.endpoint_addr.host
        if host.strip("[]") in WILDCARD_HOSTS or host in WILDCARD_HOSTS:
            problems.append(f"source for rank {s.data_parallel_rank} advertises wildcard host {host!r}")
        if not 0 < s.endpoint_addr.port < 65536:
            problems.append(f"source for rank {s.data_parallel_rank} has port {s.endpoint_addr.port}")
    return problems


@check("E6", "GetKvEventSources: no wildcard host, one source per requested rank or none, bad ranks refused")
def kv_event_sources(t: Target) -> str:
    """E6: every endpoint is connectable (a concrete host, a port); asking for one rank gives
    that rank's source or none; an unknown rank and a rank named twice are INVALID_ARGUMENT."""
    code, every = _sources(t, [])
    if code == grpc.StatusCode.UNIMPLEMENTED:
        skip("GetKvEventSources is UNIMPLEMENTED")
    expect(code == grpc.StatusCode.OK, f"GetKvEventSources() returned {code.name}")
    problems = _source_problems(every.sources)
    expect(not problems, "; ".join(problems))
    first, size = _ranks(t)
    code, one = _sources(t, [first])
    expect(code == grpc.StatusCode.OK, f"GetKvEventSources([{first}]) returned {code.name}")
    expect(len(one.sources) <= 1, f"GetKvEventSources([{first}]) returned {len(one.sources)} sources; one per rank")
    for s in one.sources:
        expect(not s.HasField("data_parallel_rank") or s.data_parallel_rank == first,
               f"asked for rank {first}, got a source for rank {s.data_parallel_rank}")
    expect(not _source_problems(one.sources), "; ".join(_source_problems(one.sources)))
    for what, ranks in (("an unknown rank", [first + size]), ("a rank named twice", [first, first])):
        code, _ = _sources(t, ranks)
        expect(code == grpc.StatusCode.INVALID_ARGUMENT,
               f"GetKvEventSources({ranks}) ({what}) returned {code.name}; expected INVALID_ARGUMENT")
    return f"{len(every.sources)} source(s); ranks [{first + size}] and [{first}, {first}] refused"
