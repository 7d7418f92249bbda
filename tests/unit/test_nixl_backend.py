"""The NIXL KV transfer backend between two real processes: a spawned child is the prefill
(source) engine holding random KV blocks, this process is the decode engine pulling them.

One child serves every test (module fixture). It answers, over a Pipe:
``("offer", session_id, block_ids)`` -> ``(attributes, bytes of those blocks)``;
``("confirmed", session_id, seconds)`` -> whether its ``on_confirmed`` saw the session;
``("exit",)`` -> closes its backend and ends.
"""

from __future__ import annotations

import copy
import json
import multiprocessing
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

from refengine.kv.transfer.base import PullOrder, TransferFailure
from refengine.kv.transfer.nixl_backend import NixlKvTransfer, nixl_available
from refengine.kv.transfer.nixl_source import runs as _runs
from refengine.model.kv_io import KvBlockIO
from refengine.types import KvSessionSpec

_AVAILABLE, _WHY = nixl_available()
if not _AVAILABLE:
    pytest.skip(_WHY, allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
LAYERS, NUM_BLOCKS, BLOCK_SHAPE = 3, 16, (4, 2, 8)


def _kv(fill: Callable[[tuple[int, ...]], torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (NUM_BLOCKS, *BLOCK_SHAPE)
    return [(fill(shape), fill(shape)) for _ in range(LAYERS)]


def _source_main(conn: Connection) -> None:
    """The prefill engine: random KV, a bound backend, confirmations recorded."""
    torch.manual_seed(0)
    kv = _kv(lambda shape: torch.randn(shape, dtype=torch.float32))
    store = KvBlockIO(kv, "torch")
    confirmed: set[str] = set()
    seen = threading.Condition()

    def on_confirmed(session_id: str, pulled: bool) -> None:
        with seen:
            confirmed.add(session_id if pulled else "unpin:" + session_id)  # a failed pull's pin ended
            seen.notify_all()

    backend = NixlKvTransfer(None)
    backend.bind(store, on_confirmed)
    while (message := conn.recv())[0] != "exit":
        if message[0] == "offer":
            _, session_id, block_ids = message
            conn.send((backend.source_attributes(session_id, block_ids), [store.read([b]) for b in block_ids]))
        else:
            _, session_id, seconds = message
            with seen:
                conn.send(seen.wait_for(lambda wanted=session_id: wanted in confirmed, timeout=seconds))
    backend.close()


class Source:
    """The parent's handle on the child."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def offer(self, session_id: str, block_ids: list[int]) -> tuple[dict[str, Any], list[bytes]]:
        """The transfer attributes, and each block's bytes as the source reads it."""
        self.conn.send(("offer", session_id, block_ids))
        return self.conn.recv()

    def confirmed(self, session_id: str, seconds: float) -> bool:
        self.conn.send(("confirmed", session_id, seconds))
        return self.conn.recv()


class FakePinner:
    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []
        self.traces: list[tuple[tuple[str, str], ...]] = []  # each pin's metadata (M5)
        self.error: TransferFailure | None = None
        self.granted_seconds: float | None = None  # what the source grants (None: what was asked)

    def start_pin(self, session: KvSessionSpec, seconds: float, trace: tuple[tuple[str, str], ...] = (),
                  content: str = "", cancelled: object = None) -> Callable[[], float]:
        self.calls.append((session.session_id, seconds))
        self.traces.append(trace)
        sent = time.monotonic()

        def outcome() -> float:
            if self.error is not None:
                raise self.error
            return sent + (seconds if self.granted_seconds is None else self.granted_seconds)
        return outcome


@pytest.fixture(scope="module")
def source() -> Iterator[Source]:
    context = multiprocessing.get_context("spawn")
    mine, theirs = context.Pipe()
    child = context.Process(target=_source_main, args=(theirs,), daemon=True)
    child.start()
    try:
        yield Source(mine)
        mine.send(("exit",))
        child.join(10)
    finally:
        if child.is_alive():
            child.kill()
            child.join(5)


@pytest.fixture(scope="module")
def decode() -> Iterator[tuple[NixlKvTransfer, KvBlockIO, FakePinner]]:
    pinner = FakePinner()
    store = KvBlockIO(_kv(lambda shape: torch.zeros(shape, dtype=torch.float32)), "torch")
    backend = NixlKvTransfer(pinner, pull_timeout_seconds=10.0)
    backend.bind(store, lambda session_id, pulled: None)
    yield backend, store, pinner
    backend.close()
    backend.close()  # idempotent


@pytest.fixture
def side(decode: tuple[NixlKvTransfer, KvBlockIO, FakePinner]) -> tuple[NixlKvTransfer, KvBlockIO, FakePinner]:
    """The decode side with its KV zeroed and a fresh pinner record."""
    backend, store, pinner = decode
    store.write(range(NUM_BLOCKS), bytes(NUM_BLOCKS * store.block_nbytes))
    pinner.calls.clear()
    pinner.error = None
    pinner.granted_seconds = None
    return decode


def _order(session_id: str, attributes: dict[str, Any], first: int, dest: tuple[int, ...]) -> PullOrder:
    session = KvSessionSpec(session_id, "nixl", attributes={"transfer": attributes})
    return PullOrder("request-" + session_id, session, first, dest)


def _untouched(store: KvBlockIO) -> bool:
    return store.read(range(NUM_BLOCKS)) == bytes(NUM_BLOCKS * store.block_nbytes)


def test_pull_copies_the_blocks_and_confirms_the_session(source: Source, side: Any) -> None:
    backend, store, pinner = side
    attributes, expected = source.offer("s-full", [3, 7, 8, 9])
    dest = (10, 2, 3, 4)  # 2..4 <- 7..9 is one merged run, 10 <- 3 another
    trace = (("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),)
    backend.pull(replace(_order("s-full", attributes, 0, dest), trace=trace), threading.Event())
    assert [store.read([d]) for d in dest] == expected
    others = [b for b in range(NUM_BLOCKS) if b not in dest]
    assert store.read(others) == bytes(len(others) * store.block_nbytes)
    assert pinner.calls == [("s-full", 10.0)] and pinner.traces == [trace]  # M5: the pin carries it
    assert source.confirmed("s-full", 5.0)


def test_source_attributes_are_json_values_with_addresses_as_strings(source: Source) -> None:
    attributes, _ = source.offer("s-json", [4, 0])
    assert json.loads(json.dumps(attributes)) == attributes  # [K9]
    assert attributes["nixl_block_ids"] == [4, 0] and len(attributes["nixl_regions"]) == 2 * LAYERS
    assert all(isinstance(address, str) and address.isdigit() for address, _, _ in attributes["nixl_regions"])


def test_runs_merge_blocks_consecutive_on_both_sides() -> None:
    pairs = [(2, 7), (3, 8), (4, 9), (10, 3), (11, 5), (5, 6)]
    assert list(_runs(pairs)) == [(2, 7, 3), (10, 3, 1), (11, 5, 1), (5, 6, 1)]
    assert list(_runs([])) == []


def test_a_partial_pull_starts_at_first_block_index(source: Source, side: Any) -> None:
    backend, store, _ = side
    attributes, expected = source.offer("s-part", [1, 2, 3, 4, 5])
    backend.pull(_order("s-part", attributes, 2, (0, 1, 2)), threading.Event())
    assert [store.read([d]) for d in (0, 1, 2)] == expected[2:]
    assert source.confirmed("s-part", 5.0)


def _wider_blocks(a: dict[str, Any]) -> None:
    a["nixl_regions"][0][2] += 4


def _address_as_int(a: dict[str, Any]) -> None:
    a["nixl_regions"][1][0] = int(a["nixl_regions"][1][0])  # K9: addresses travel as strings


@pytest.mark.parametrize(("mutate", "first", "match"), [
    (_wider_blocks, 0, "region 0"),
    (_address_as_int, 0, "nixl_regions entry"),
    (lambda a: a["nixl_regions"].pop(), 0, "KV regions"),
    (lambda a: a.pop("nixl_block_ids"), 0, "nixl_block_ids"),
    (lambda a: a["nixl_block_ids"].__setitem__(0, NUM_BLOCKS), 0, "outside the source"),
    (lambda a: None, 2, "requested"),
], ids=["block_nbytes", "address-int", "region-count", "missing-key", "block-id-range", "index-range"])
def test_incompatible_attributes_fail_before_any_transfer(
        source: Source, side: Any, mutate: Callable[[dict[str, Any]], Any], first: int, match: str) -> None:
    backend, store, pinner = side
    attributes, _ = source.offer("s-bad", [5, 6])
    attributes = copy.deepcopy(attributes)
    mutate(attributes)
    with pytest.raises(TransferFailure, match=match) as failure:
        backend.pull(_order("s-bad", attributes, first, (0, 1)), threading.Event())
    assert (failure.value.kind, failure.value.retryable) == ("failed", False)
    assert pinner.calls == [] and _untouched(store)


@pytest.mark.parametrize("metadata", ["bm90IG5peGwgbWV0YWRhdGE=", "%%% not base64"])
def test_garbage_metadata_fails(source: Source, side: Any, metadata: str) -> None:
    backend, store, _ = side
    attributes, _ = source.offer("s-garbage", [1])
    attributes = {**attributes, "nixl_agent_name": "nobody", "nixl_agent_metadata": metadata}
    with pytest.raises(TransferFailure, match="metadata") as failure:
        backend.pull(_order("s-garbage", attributes, 0, (0,)), threading.Event())
    assert failure.value.kind == "failed" and not failure.value.retryable
    assert _untouched(store)


def test_a_pinner_failure_propagates(source: Source, side: Any) -> None:
    backend, store, pinner = side
    attributes, _ = source.offer("s-gone", [1, 2])
    pinner.error = TransferFailure("not_found", "the source released it")
    with pytest.raises(TransferFailure) as failure:
        backend.pull(_order("s-gone", attributes, 0, (0, 1)), threading.Event())
    assert failure.value is pinner.error  # what the overlapping READ copied is not to be used
    assert not source.confirmed("s-gone", 0.2)  # and the source is not told it was pulled
    assert not source.confirmed("unpin:s-gone", 0.2)  # nor to end a pin it never made


def test_a_read_that_outlasts_the_pin_the_source_granted_fails(source: Source, side: Any) -> None:
    """K10 (found by review): the source grants at most its own --kv-pull-timeout, whatever this
    side asked. A READ that ended after that window may have read blocks freed and reused by then:
    it fails (retryable: the session may still be held), and the source is not told it was pulled."""
    backend, _, pinner = side
    attributes, _ = source.offer("s-short", [1, 2])
    pinner.granted_seconds = 0.0  # the window ends as the pin is sent: any READ ends after it
    with pytest.raises(TransferFailure) as failure:
        backend.pull(_order("s-short", attributes, 0, (0, 1)), threading.Event())
    assert failure.value.retryable and "after the source's pin" in str(failure.value), failure.value
    assert not source.confirmed("s-short", 0.2)
    pinner.granted_seconds = 30.0  # a window the READ fits in: the same session pulls
    backend.pull(_order("s-short", attributes, 0, (0, 1)), threading.Event())
    assert source.confirmed("s-short", 5.0)


def test_a_pin_whose_content_check_failed_is_ended_and_the_session_kept(source: Source, side: Any) -> None:
    """K10: the source made the pin, then said it holds another item. The source's pin ends at
    once (it held the blocks, released or not, for the whole pin window), and the session is not
    released: a pull with the right attributes may still take it."""
    backend, _, pinner = side
    attributes, _ = source.offer("s-other", [1, 2])
    pinner.error = TransferFailure("failed", "the source holds another item", pin_held=True)
    with pytest.raises(TransferFailure):
        backend.pull(_order("s-other", attributes, 0, (0, 1)), threading.Event())
    assert source.confirmed("unpin:s-other", 5.0)
    assert not source.confirmed("s-other", 0.2)


def test_a_source_no_pin_vouched_for_is_not_read_before_its_pin(source: Source, side: Any) -> None:
    """ENC11/ENC13 (found by review): the agent, metadata and regions come from the request; until
    a pin at an allowed endpoint has confirmed them once, nothing is READ from them before the
    pin's answer. A refused first pin leaves the destination untouched (before: the overlapping
    READ had already copied the named agent's memory)."""
    backend, store, pinner = side
    attributes, expected = source.offer("s-unvouched", [1, 2])
    pinner.error = TransferFailure("failed", "the source holds another item")
    with pytest.raises(TransferFailure):
        backend.pull(replace(_order("s-unvouched", attributes, 0, (0, 1)), content="media:x"), threading.Event())
    assert _untouched(store)
    pinner.error = None  # the pin vouches for the source now: the pull goes through
    backend.pull(replace(_order("s-unvouched", attributes, 0, (0, 1)), content="media:x"), threading.Event())
    assert [store.read([d]) for d in (0, 1)] == expected


class FakeAgent:
    """What of a nixl_agent ``_remote`` uses: metadata b"<name>|..." loads agent <name>."""

    def __init__(self) -> None:
        self.loaded: set[str] = set()

    def add_remote_agent(self, metadata: bytes) -> bytes:
        name = metadata.split(b"|")[0]
        self.loaded.add(name.decode())
        return name

    def remove_remote_agent(self, name: str) -> None:
        self.loaded.remove(name)


def test_loaded_agents_are_capped_and_those_in_use_kept() -> None:
    """MAX_REMOTE_AGENTS (found by the diff review: the cap removed the metadata, not the agent,
    so NIXL kept every agent); one still read from is never forgotten."""
    from refengine.kv.transfer.nixl_remotes import MAX_REMOTE_AGENTS, RemoteAgents
    from refengine.kv.transfer.nixl_source import NixlSource

    remotes = RemoteAgents(agent := FakeAgent())
    for i in range(MAX_REMOTE_AGENTS + 3):
        name = remotes.use(NixlSource(f"agent-{i}", f"agent-{i}|md".encode(), (), ()))
        if i:  # agent-0's pull is still reading
            remotes.done_with(name)
    assert len(agent.loaded) == MAX_REMOTE_AGENTS
    assert "agent-0" in agent.loaded and not {"agent-1", "agent-2", "agent-3"} & agent.loaded


def test_a_cancelled_pull_writes_nothing(source: Source, side: Any) -> None:
    backend, store, _ = side
    attributes, _ = source.offer("s-cancel", [1, 2])
    cancelled = threading.Event()
    cancelled.set()
    with pytest.raises(TransferFailure, match="cancelled") as failure:
        backend.pull(_order("s-cancel", attributes, 0, (0, 1)), cancelled)
    assert failure.value.kind == "failed" and not failure.value.retryable
    assert _untouched(store)
    assert not source.confirmed("s-cancel", 0.2)


def test_the_module_imports_without_nixl() -> None:
    """nixl is imported lazily: blocked, the module still loads and says why it cannot work."""
    code = ("import sys; sys.modules['nixl_cu12'] = sys.modules['nixl'] = None; "
            "from refengine.kv.transfer.nixl_backend import nixl_available; "
            "ok, why = nixl_available(); assert not ok and 'nixl' in why, why; "
            "assert 'torch' not in sys.modules")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("dest", [(0, NUM_BLOCKS), (-1, 1)], ids=["past-the-end", "negative"])
def test_destination_blocks_outside_the_cache_fail_before_any_transfer(source: Source, side: Any,
                                                                       dest: tuple[int, int]) -> None:
    backend, store, pinner = side
    attributes, _ = source.offer("s-dest", [5, 6])
    with pytest.raises(TransferFailure, match="outside this engine's KV cache"):
        backend.pull(_order("s-dest", attributes, 0, dest), threading.Event())
    assert pinner.calls == [] and _untouched(store)
