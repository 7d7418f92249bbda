"""The judgement helpers of E2 (a snapshot against what a live subscriber saw) and E6 (dialling
an advertised source), on hand-made inputs: each passes what the rule allows and fails what it
forbids, including the cases a toy server does not produce (a reset between the subscriptions)."""

from __future__ import annotations

import socket

import pytest

from refengine.conformance import checks_kv_sources
from refengine.conformance.checks_kv_events import _expect_same_blocks
from refengine.conformance.checks_kv_sources import _connectable
from refengine.conformance.kv_subscriber import _key
from refengine.conformance.registry import CheckFailed
from refengine.protocol import oe
from tests.refused_ports import refused_port


def _hash(n: int) -> oe.KvBlockHash:
    return oe.KvBlockHash(value=n.to_bytes(8, "big"), encoding="test")


def _batch(number: int, *events: oe.KvEvent) -> oe.KvEventBatch:
    return oe.KvEventBatch(sequence_number=number, events=list(events))


def _stored(*numbers: int) -> oe.KvEvent:
    return oe.KvEvent(block_stored=oe.BlockStored(block_hashes=[_hash(n) for n in numbers]))


def _removed(*numbers: int) -> oe.KvEvent:
    return oe.KvEvent(block_removed=oe.BlockRemoved(block_hashes=[_hash(n) for n in numbers]))


def _listed(*numbers: int) -> set:
    return {_key(_hash(n)) for n in numbers}


LIVE = [_batch(5, _stored(1, 2, 3)), _batch(6, _removed(2)), _batch(7, _stored(4))]


def test_a_snapshot_listing_what_the_live_subscriber_knows_passes() -> None:
    _expect_same_blocks(LIVE, 7, _listed(1, 3, 4, 99))  # 99: cached before the live subscriber came


def test_a_snapshot_is_compared_up_to_its_own_number_only() -> None:
    _expect_same_blocks(LIVE, 6, _listed(1, 3))  # block 4 came in batch 7, after the snapshot


@pytest.mark.parametrize(("listed", "says"), [
    ((1, 3), "leaves out 1 of the 3 blocks"),
    ((1, 2, 3, 4), "lists 1 blocks a live subscriber saw removed"),
])
def test_a_snapshot_missing_or_keeping_blocks_fails(listed: tuple[int, ...], says: str) -> None:
    with pytest.raises(CheckFailed, match=says):
        _expect_same_blocks(LIVE, 7, _listed(*listed))


def test_after_a_reset_only_blocks_stored_since_may_be_listed() -> None:
    live = [*LIVE, _batch(8, oe.KvEvent(all_blocks_cleared=oe.AllBlocksCleared())), _batch(9, _stored(7))]
    _expect_same_blocks(live, 9, _listed(7))
    with pytest.raises(CheckFailed, match="saw removed"):
        _expect_same_blocks(live, 9, _listed(7, 99))


def _source(port: int, host: str = "127.0.0.1", protocol: str = "tcp") -> oe.KvEventSource:
    return oe.KvEventSource(transport="zmq", data_parallel_rank=0,
                            endpoint_addr=oe.KvEndpoint(host=host, port=port, protocol=protocol))


def test_a_listening_source_is_connectable_and_a_closed_port_is_not() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        assert _connectable([_source(listener.getsockname()[1])], "127.0.0.1") == ([], [])
    with refused_port() as port:
        for target_host in ("127.0.0.1", "other.example"):  # a loopback source is judged wherever the target is
            problems, notes = _connectable([_source(port)], target_host)
            assert len(problems) == 1 and "connection refused" in problems[0] and not notes
        problems, notes = _connectable([_source(port, host="localhost")], "127.0.0.1")
        assert len(problems) == 1 and "connection refused" in problems[0] and not notes


def test_unreachable_from_here_is_noted_not_failed_and_other_protocols_are_not_dialled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checks_kv_sources, "CONNECT_TIMEOUT_S", 0.3)
    # TEST-NET-1: no host answers (here a firewall may refuse it): not the target's host, so not judged
    problems, notes = _connectable([_source(5557, host="192.0.2.1")], "127.0.0.1")
    assert not problems and len(notes) == 1 and "not reachable from here" in notes[0]
    assert _connectable([_source(1, protocol="ipc")], "127.0.0.1") == ([], [])
