"""``KvSessionStore`` when two decode engines pull one session with one-sided READs (NIXL): each
pins it, then confirms its own pull. The first confirmation must not end the other's pin: its
READ may still run, and a freed block can be reused by the next prefill under it (it ended
every pin, so the second decode read whatever the next prompt wrote, its pin having succeeded).
Nor may the confirmation of a pull that pinned nothing (gRPC's ``Release``) end a pin."""

from __future__ import annotations

from refengine.kv.transfer.sessions import KvSession, KvSessionStore


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_confirmed_pull_ends_only_its_own_pin() -> None:
    clock = Clock()
    sessions = KvSessionStore(clock=clock)
    sessions.add(KvSession("s", "r", (3, 4), expires_at=110.0))
    assert sessions.pin("s", 30.0) == (3, 4)  # decode A
    assert sessions.pin("s", 30.0) == (3, 4)  # decode B, its READ about to run
    assert sessions.release("s", "pulled", pulled=True, pinned=True)  # A confirms
    assert sessions.take_due() == [], "B's READ may still run: its blocks must stay"
    assert not sessions.release("s", "pulled", pulled=True, pinned=True), "released once (A2)"  # B confirms
    assert [s.session_id for s in sessions.take_due()] == ["s"]


def test_a_pin_whose_pull_never_confirms_still_ends_with_its_time() -> None:
    clock = Clock()
    sessions = KvSessionStore(clock=clock)
    sessions.add(KvSession("s", "r", (3,), expires_at=110.0))
    sessions.pin("s", 30.0)  # decode A: its READ failed, no confirmation comes
    sessions.pin("s", 30.0)  # decode B
    assert sessions.release("s", "pulled", pulled=True, pinned=True)  # B confirms
    clock.now = 129.0
    assert sessions.take_due() == [] and sessions.seconds_until_due() == 1.0
    clock.now = 130.0
    assert [s.session_id for s in sessions.take_due()] == ["s"]


def test_a_pull_that_pinned_nothing_ends_no_pin() -> None:
    clock = Clock()
    sessions = KvSessionStore(clock=clock)
    sessions.add(KvSession("s", "r", (3, 4), expires_at=110.0))
    sessions.pin("s", 30.0)  # decode A (NIXL), its READ running
    assert sessions.release("s", "pulled", pulled=True)  # decode B pulled over gRPC and confirms
    clock.now = 129.0
    assert sessions.take_due() == [], "A's READ may still run: its blocks must stay"
    assert not sessions.release("s", "pulled", pulled=True, pinned=True)  # A confirms: released already
    assert [s.session_id for s in sessions.take_due()] == ["s"]


def test_a_failed_pinned_pull_ends_its_pin_and_leaves_the_session_offered() -> None:
    """A READ or content check failed after the pin (the puller's unpin): its pin ends at once,
    another puller's pin stays, and the session is still offered for a pull that succeeds."""
    clock, wakes = Clock(), []
    sessions = KvSessionStore(on_change=lambda: wakes.append(1), clock=clock)
    sessions.add(KvSession("s", "r", (3, 4), expires_at=110.0))
    sessions.pin("s", 30.0)  # decode A, whose pull then fails
    sessions.pin("s", 30.0)  # decode B
    sessions.unpin("s")  # A's pin ends
    assert len(sessions) == 1 and sessions.begin_read("s") == (3, 4)  # still offered
    sessions.end_read("s")
    assert sessions.release("s", "pulled", pulled=True, pinned=True)  # B confirms: the last pin ends
    assert wakes and [s.session_id for s in sessions.take_due()] == ["s"]
    sessions.unpin("s")  # gone, or no pin counted: nothing happens
