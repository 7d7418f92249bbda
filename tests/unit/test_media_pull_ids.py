"""A consumer's embedding-handle pulls (``engine/media_pulls.py``) when a request id is reused
(G2: reusable once its stream ended) while the cancelled namesake's pull still waits for a
transfer thread: the new request gets its own pull's rows, and the old pull's end is dropped
(it deleted the new pull's entry, so the new pull's end raised on its thread and was lost,
and the core failed the new request with the old pull's "cancelled")."""

from __future__ import annotations

import threading
import time

import torch

from refengine.engine.media_pulls import MediaPulls
from refengine.kv.transfer.base import (
    BlockStore,
    Cancellation,
    KvTransferBackend,
    PullOrder,
    SessionConfirmed,
    TransferFailure,
)
from refengine.model.embedding_io import EmbeddingArena
from refengine.types import EmbeddingHandleSpec, EmbeddingTransferSpec, KvEndpointSpec

HIDDEN = 4


class GatedRows(KvTransferBackend):
    """Writes rows filled with the handle's number; a pull of a gated handle waits for its gate;
    a pull cancelled before it copies raises (as the real backends do)."""

    name = "grpc"
    protocol = "grpc"

    def __init__(self) -> None:
        self.store: BlockStore | None = None
        self.gates: dict[str, threading.Event] = {}
        self.started: set[str] = set()

    def bind(self, store: BlockStore, on_confirmed: SessionConfirmed) -> None:
        self.store = store

    def pull(self, order: PullOrder, cancelled: Cancellation) -> None:
        handle_id = order.session.session_id
        self.started.add(handle_id)
        if gate := self.gates.get(handle_id):
            assert gate.wait(30)
        if cancelled.is_set():
            raise TransferFailure("failed", "cancelled")
        value = float(handle_id.removeprefix("h"))
        rows = torch.full((len(order.dest_block_ids), HIDDEN), value)
        assert self.store is not None
        self.store.write(order.dest_block_ids, rows.view(torch.uint8).numpy().tobytes())

    def close(self) -> None:
        pass


def handle(number: int) -> EmbeddingHandleSpec:
    transfer = EmbeddingTransferSpec("grpc", (KvEndpointSpec("127.0.0.1", 1, "grpc"),))
    return EmbeddingHandleSpec(f"h{number}", f"{number:064x}", "refengine-rgb8-sha256", "image", (2, HIDDEN),
                               "float32", "test", "fp", (transfer,))


def one_thread_pulls(backend: GatedRows, num_rows: int = 16, timeout_seconds: float = 5.0) -> MediaPulls:
    """Pulls on one transfer thread (so one gated pull holds the rest back) into a fresh arena."""
    staging = EmbeddingArena(num_rows, HIDDEN, torch.float32)
    backend.bind(staging, lambda handle_id, pulled: None)
    return MediaPulls({"grpc": backend}, staging, num_threads=1, timeout_seconds=timeout_seconds,
                      on_done=lambda: None, dtype=torch.float32, device="cpu")


def test_a_reused_request_id_gets_its_own_pull_while_the_cancelled_one_waits() -> None:
    backend = GatedRows()
    pulls = one_thread_pulls(backend)
    try:
        backend.gates["h1"] = threading.Event()  # "busy" holds the only transfer thread
        pulls.start("busy", [handle(1)])
        deadline = time.monotonic() + 10
        while "h1" not in backend.started:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        pulls.start("r", [handle(2)])
        pulls.cancel("r")  # its request ended: the id is free again
        pulls.start("r", [handle(3)])  # a new request under the same id, other media
        backend.gates["h1"].set()
        finished: dict[str, list] = {}
        while len(finished) < 2 or len(finished.get("r", [])) < 1:
            assert time.monotonic() < deadline, finished
            for request_id, pulled, fault in pulls.take_finished():
                finished.setdefault(request_id, []).append((pulled, fault))
            time.sleep(0.01)
        time.sleep(0.2)  # anything else that would still come
        for request_id, pulled, fault in pulls.take_finished():
            finished.setdefault(request_id, []).append((pulled, fault))
    finally:
        pulls.shutdown()
    assert len(finished["r"]) == 1, finished["r"]
    pulled, fault = finished["r"][0]
    assert fault is None and pulled is not None and set(pulled) == {"h3"}, finished["r"]
    assert torch.equal(pulled["h3"], torch.full((2, HIDDEN), 3.0)), "the new request's own rows"
