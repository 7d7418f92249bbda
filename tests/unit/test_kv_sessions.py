"""``KvSessionStore`` (K7): a session is freed when released or past its lease, never while
it is being read or pinned for a one-sided read; only live sessions are offered."""

from __future__ import annotations

import pytest

from refengine.kv.transfer.sessions import KvSession, KvSessionStore
from refengine.types import KvSessionNotFound


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def store() -> tuple[KvSessionStore, Clock, list[int]]:
    clock, wakes = Clock(), []
    made = KvSessionStore(on_change=lambda: wakes.append(1), clock=clock)
    made.add(KvSession("a", "r-a", (3, 4), expires_at=110.0))
    made.add(KvSession("b", "r-b", (5,), expires_at=120.0))
    return made, clock, wakes


def due_ids(store: KvSessionStore) -> list[str]:
    return [s.session_id for s in store.take_due()]


def test_lease_end_frees_and_unoffers(store) -> None:
    sessions, clock, _ = store
    assert len(sessions) == 2 and due_ids(sessions) == [] and sessions.seconds_until_due() == 10.0
    clock.now = 110.0
    with pytest.raises(KvSessionNotFound):
        sessions.begin_read("a")
    assert len(sessions) == 1 and due_ids(sessions) == ["a"] and "a" not in sessions


def test_release_waits_for_readers_and_wakes_at_the_last_one(store) -> None:
    sessions, _, wakes = store
    assert sessions.begin_read("a") == (3, 4)
    assert sessions.release("a", "aborted") and not sessions.release("a", "again")
    with pytest.raises(KvSessionNotFound):
        sessions.begin_read("a")  # released: no new reader
    assert due_ids(sessions) == [] and sessions.seconds_until_due() == 20.0  # only "b" counts
    wakes.clear()
    sessions.end_read("a")
    assert wakes and due_ids(sessions) == ["a"]


def test_a_reader_of_a_live_session_does_not_wake_the_loop(store) -> None:
    sessions, _, wakes = store
    sessions.begin_read("b")
    sessions.end_read("b")
    assert wakes == []


def test_a_lease_ending_after_a_read_is_waited_for_during_the_read(store) -> None:
    """K7/ENC7: a loop that computes its wait while a session is read must still wake at its
    lease end (the read's end_read wakes nobody: the session is not due then). Once due but for
    its reader, it is left out (no busy wait) until that reader's end_read wakes the loop."""
    sessions, clock, wakes = store
    sessions.release("b", "done")
    due_ids(sessions)
    sessions.begin_read("a")
    assert sessions.seconds_until_due() == 10.0  # it was None: the loop waited forever
    clock.now = 105.0
    sessions.end_read("a")
    assert wakes == [1] and sessions.seconds_until_due() == 5.0  # the one wake was b's release
    sessions.begin_read("a")
    clock.now = 111.0  # the lease ends during the read
    assert sessions.seconds_until_due() is None and due_ids(sessions) == []
    sessions.end_read("a")
    assert wakes == [1, 1] and due_ids(sessions) == ["a"]


def test_a_pin_outlives_abort_and_lease_until_confirmed_or_over(store) -> None:
    sessions, clock, _ = store
    assert sessions.pin("a", 30.0) == (3, 4)
    sessions.release("a", "aborted")
    clock.now = 115.0  # past the lease, inside the pin
    assert due_ids(sessions) == [] and sessions.seconds_until_due() == pytest.approx(5.0)  # "b" at 120
    clock.now = 130.0
    assert sorted(due_ids(sessions)) == ["a", "b"]


def test_a_confirmed_pull_ends_the_pin(store) -> None:
    sessions, _, _ = store
    sessions.pin("b", 30.0)
    assert sessions.release("b", "pulled", pulled=True, pinned=True)
    assert due_ids(sessions) == ["b"]


def test_release_all_and_unknown_ids(store) -> None:
    sessions, _, _ = store
    assert not sessions.release("nope", "aborted")
    with pytest.raises(KvSessionNotFound):
        sessions.pin("nope", 1.0)
    assert sessions.release_all("drain") == 2 and len(sessions) == 0
    assert sorted(due_ids(sessions)) == ["a", "b"] and sessions.seconds_until_due() is None


def test_releasing_an_expired_pinned_session_releases_nothing(store) -> None:
    """ENC6: only a live handle counts as released. A pin keeps an expired session's blocks for
    a read in flight, but the session is no longer offered; a confirmed pull still ends it."""
    sessions, clock, _ = store
    sessions.pin("a", 30.0)
    sessions.pin("b", 30.0)
    clock.now = 121.0  # both leases over, both pins running
    assert not sessions.release("a", "released") and due_ids(sessions) == []
    assert sessions.release("b", "pulled", pulled=True, pinned=True) and due_ids(sessions) == ["b"]
    clock.now = 131.0
    assert due_ids(sessions) == ["a"]
