"""KV events in vLLM's ZMQ wire format, for routers written against vLLM (Dynamo's KV router).

The publisher follows one live engine subscription (``subscribe_kv_events``) and sends
each engine ``KvEventBatch`` that has events as one message; it never slows the step loop.

The wire format, and which endpoints the sockets bind, are in ``kv_events_zmq_wire``.

Choices of this publisher:

- the engine cuts off a subscriber that falls ``--kv-events-subscriber-buffer`` batches
  behind. Should that happen, the publisher logs it, sends what it had, resubscribes with a
  snapshot and publishes one message ``[AllBlocksCleared, BlockStored for every cached
  block (parents first)]``: a consumer that applies every message in order ends with the
  engine's cached set again, without a gap or a stale block.
- one daemon thread owns both sockets: it waits for ``on_ready`` (a ``threading.Event``;
  the step thread never blocks) and answers replay requests in between, polling the
  ROUTER with a short timeout.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

import zmq

from refengine.engine.interface import EngineClient
from refengine.engine.kv_events import KvEventSubscription
from refengine.server.kv_events_zmq_wire import (
    DATA_PARALLEL_RANK,
    END_OF_REPLAY,
    advertised_host,
    bind_endpoint,
    encode_batch,
    split_tcp,
    tcp_endpoint,
)
from refengine.types import AllBlocksCleared, BlockStored, KvEvent, KvEventBatch

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.005  # the longest a batch waits while the thread polls the replay socket
CLOSE_LINGER_MS = 1000  # what close() gives queued messages; within its 5 s join
RESUBSCRIBE_BACKOFF_SECONDS = 0.5


# -- the publisher ---------------------------------------------------------------
class ZmqKvEventPublisher:
    """Publishes the engine's KV events on a ZMQ PUB socket (and answers replays on a ROUTER)."""

    def __init__(self, engine: EngineClient, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000, medium: str | None = None) -> None:
        if buffer_steps < 1 or hwm < 0:
            raise ValueError(f"buffer_steps must be >= 1 and hwm >= 0, got {buffer_steps} and {hwm}")
        split_tcp(endpoint)
        if replay_endpoint is not None:
            split_tcp(replay_endpoint)
        self.engine = engine
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.buffer_steps = buffer_steps
        self.hwm = hwm
        self.medium = medium
        self.block_size = engine.info.kv_block_size
        self._topic = topic.encode()
        self._retained: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._ready = threading.Event()
        self._stop = threading.Event()
        # Its own context: terminating it is what makes the sockets' linger wait (a closed
        # socket's queue is sent in the background, and a process that exits first drops it).
        self._ctx = zmq.Context()
        self._pub: zmq.Socket | None = None
        self._router: zmq.Socket | None = None
        self._sub: KvEventSubscription | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards the counters read by other threads
        self._pub_addr: tuple[str, int] | None = None
        self._replay_addr: tuple[str, int] | None = None

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        """Bind the sockets, subscribe to the engine (live, no snapshot) and start the thread.
        Raises ``zmq.ZMQError`` (address in use…) or the engine's ``InvalidRequestError``
        (KV events disabled); nothing is left open then."""
        if self._thread is not None:
            return
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, self.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub_addr = bind_endpoint(self._pub, self.endpoint)
            if self.replay_endpoint is not None:
                self._router = self._ctx.socket(zmq.ROUTER)
                # A full replay is buffer_steps + 1 messages: never drop part of one.
                self._router.setsockopt(zmq.SNDHWM, max(self.hwm, 2 * (self.buffer_steps + 1)))
                self._router.setsockopt(zmq.LINGER, 0)
                self._replay_addr = bind_endpoint(self._router, self.replay_endpoint)
            self._sub = self.engine.subscribe_kv_events(self._ready.set)
        except BaseException:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="refengine-kv-events-zmq", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Publish what the engine already handed over, then close the sockets."""
        self._stop.set()
        self._ready.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the ZMQ KV event publisher did not stop within %.1f s", timeout)
                return  # its sockets belong to that thread
            self._thread = None
        else:
            self._close_sockets()

    def _close_sockets(self, linger_ms: int = 0) -> None:
        """Close the sockets, then the context: its term() waits up to ``linger_ms`` for what
        they still queue."""
        if self._sub is not None:
            self._sub.close()
            self._sub = None
        for socket in (self._pub, self._router):
            if socket is not None:
                socket.close(linger=linger_ms)
        self._pub = self._router = None
        if not self._ctx.closed:
            self._ctx.term()

    # -- what GetKvEventSources reports ----------------------------------------------
    def describe(self, advertise_host: str) -> dict:
        """The source as ``GetKvEventSources`` reports it; a wildcard host becomes
        ``advertise_host`` (never reported as a wildcard). Call after ``start``."""
        if self._pub_addr is None:
            raise RuntimeError("describe() needs a started publisher (the bound port)")
        host, port = self._pub_addr
        replay = ""
        if self._replay_addr is not None:
            replay = tcp_endpoint(advertised_host(self._replay_addr[0], advertise_host), self._replay_addr[1])
        config = getattr(self.engine, "config", None)
        queue = config.kv_events.subscriber_buffer if config is not None else 0
        return {
            "transport": "zmq",
            "host": advertised_host(host, advertise_host),
            "port": port,
            "topic": self.topic,
            "replay_endpoint": replay,
            "encoding": "msgpack",
            "buffer_steps": self.buffer_steps,
            "hwm": self.hwm,
            "max_queue_size": queue,  # batches the engine holds for this publisher before cutting it off
            "data_parallel_rank": DATA_PARALLEL_RANK,
        }

    @property
    def num_published(self) -> int:
        """Messages sent so far (the next sequence number)."""
        with self._lock:
            return self._next_seq

    # -- the thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._step()
                except Exception:  # a send or replay failed: keep serving, without a tight loop
                    logger.exception("ZMQ KV event publisher error")
                    self._stop.wait(RESUBSCRIBE_BACKOFF_SECONDS)
            self._drain()  # what the engine handed over before close()
        except Exception:
            logger.exception("ZMQ KV event publisher error while closing")
        finally:
            # Queued messages get CLOSE_LINGER_MS to reach subscribers a little behind: with no
            # linger they were dropped (found by review: 33 of 300 received after close()); the
            # context's term() waits for them, so a process exiting next loses nothing.
            self._close_sockets(linger_ms=CLOSE_LINGER_MS)

    def _step(self) -> None:
        if self._router is not None:
            if self._router.poll(int(POLL_SECONDS * 1000)):
                self._serve_replays()
            ready = self._ready.is_set()
        else:
            ready = self._ready.wait(0.5)
        if ready:
            self._ready.clear()
            self._drain()

    def _drain(self) -> None:
        if self._sub is None:
            self._resubscribe()
            return
        batches, failure = self._sub.take()
        for batch in batches:
            self._publish_batch(batch)
        if failure is not None:
            logger.warning("KV event subscription ended (%s); resending the cached blocks after AllBlocksCleared",
                           failure)
            self._sub.close()
            self._sub = None
            self._resubscribe()

    def _resubscribe(self) -> None:
        if self._stop.is_set():
            return
        try:
            self._sub = self.engine.subscribe_kv_events(self._ready.set, include_snapshot=True)
        except Exception:
            logger.exception("resubscribing to KV events failed; retrying")
            self._stop.wait(RESUBSCRIBE_BACKOFF_SECONDS)
            self._ready.set()
            return
        self._ready.set()  # the snapshot batch is already queued

    def _publish_batch(self, batch: KvEventBatch) -> None:
        events: list[KvEvent] = [e for e in batch.events if self._full_block(e)]
        if batch.snapshot:
            events.insert(0, AllBlocksCleared())
        if not events:
            return
        payload = encode_batch(batch.timestamp_unix_nanos, events, self.medium, DATA_PARALLEL_RANK)
        seq = self._next_seq
        assert self._pub is not None
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), copy=False)
        self._retained.append((seq, payload))
        with self._lock:
            self._next_seq = seq + 1

    def _full_block(self, event: KvEvent) -> bool:
        if isinstance(event, BlockStored) and not (event.block_size == len(event.token_ids) == self.block_size):
            logger.warning("KV event for a block of %d tokens (block size %d) not published",
                           len(event.token_ids), self.block_size)
            return False
        return True

    def _serve_replays(self) -> None:
        assert self._router is not None
        while self._router.poll(0):
            frames = self._router.recv_multipart()
            if len(frames) != 3 or frames[1] != b"":
                logger.warning("malformed KV event replay request (%d frames) ignored", len(frames))
                continue  # no envelope to answer to
            identity, _, start = frames
            start_seq = int.from_bytes(start, "big") if 1 <= len(start) <= 8 else None
            if start_seq is None:  # not a u64: the end marker alone, so the consumer is not left waiting
                logger.warning("KV event replay request with a %d-byte start: nothing replayed", len(start))
            for seq, payload in self._retained:
                if start_seq is not None and seq >= start_seq:
                    self._router.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload), copy=False)
            self._router.send_multipart((identity, b"", END_OF_REPLAY, b""))
