"""KV events in vLLM's ZMQ wire format, for routers written against vLLM (Dynamo's KV router).

The publisher follows one live engine subscription (``subscribe_kv_events``) and sends
each engine ``KvEventBatch`` that has events as one message; it never slows the step loop.

Wire format (what a vLLM consumer reads unchanged): the layout of vLLM's current msgspec
types in ``vllm/distributed/kv_events.py`` -- ``EventBatch`` ``array_like`` (an array),
``KVCacheEvent`` a map tagged by ``"type"``. Older vLLM releases made the events
``array_like`` too; decoders written for those read neither this nor current vLLM's output.

- PUB socket, one multipart message per batch: ``[topic, seq, payload]``. ``topic`` is the
  UTF-8 topic (empty by default), ``seq`` an 8-byte big-endian unsigned integer counted by
  this publisher from 0 without gaps, ``payload`` msgpack.
- payload: the array ``[ts, events, data_parallel_rank]`` (``ts``: float seconds since the
  epoch, the engine batch's timestamp; rank 0).
- each event a map tagged by ``"type"`` (msgspec ``tag=True``, ``omit_defaults=True``):
  ``{"type": "BlockStored", "block_hashes": [h], "parent_block_hash": p | None,
  "token_ids": [...], "block_size": n, "lora_id": id, "medium": m, "lora_name": name}`` (the
  adapter its KV was computed under, None for the base model), plus ``"cache_salt"`` when
  the block's request had one; ``{"type": "BlockRemoved",
  "block_hashes": [h], "medium": m}``; ``{"type": "AllBlocksCleared"}``. Fields vLLM gives
  defaults (``extra_keys``, ``group_idx``, ``kv_cache_spec_*``) are left out. One block per
  ``BlockStored``, always a full block of the engine's block size.
- block hashes are unsigned 64-bit integers: ``block_hash_u64`` of the engine's 32-byte
  sha256 block key (``refengine/kv/keys.py``), never bytes.
- replay (optional ROUTER socket): a request ``[b"", start]`` (from a DEALER; the ROUTER
  sees ``[identity, b"", start]``, ``start`` 8 bytes big-endian) is answered with
  ``[b"", seq, payload]`` for every retained message with ``seq >= start``, oldest first,
  then the end marker ``[b"", (-1) as 8 signed big-endian bytes, b""]``. The newest
  ``buffer_steps`` messages are retained. As vLLM does, a shorter ``start`` (1-7 bytes) is
  read big-endian too; an empty or longer one replays nothing, but still gets the end
  marker (a choice: vLLM reads any length), so no consumer waits for an answer that never comes.

Choices of this publisher:

- both sockets always bind (vLLM connects when the host is not a wildcard): the endpoint's
  host must be a wildcard (``*``, ``0.0.0.0``, ``::``) or an address of this machine, and
  routers connect to what ``describe`` reports. Port ``0`` or ``*`` binds a free port.
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
from collections.abc import Iterable
from typing import Any

import msgpack
import zmq

from refengine.engine.interface import EngineClient
from refengine.engine.kv_events import KvEventSubscription
from refengine.kv.keys import block_hash_u64
from refengine.server.options import is_wildcard_host
from refengine.types import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
SALT_PREFIX = "salt:"
POLL_SECONDS = 0.005  # the longest a batch waits while the thread polls the replay socket
CLOSE_LINGER_MS = 1000  # what close() gives queued messages; within its 5 s join
RESUBSCRIBE_BACKOFF_SECONDS = 0.5
DATA_PARALLEL_RANK = 0


# -- encoding ------------------------------------------------------------------
def _cache_salt(extra_keys: tuple[str, ...]) -> str | None:
    for key in extra_keys[1:]:  # the model fingerprint comes first
        if key.startswith(SALT_PREFIX):
            return key[len(SALT_PREFIX):]
    return None


def encode_event(event: KvEvent, medium: str | None) -> dict[str, Any]:
    """One engine event as vLLM's tagged map."""
    if isinstance(event, BlockStored):
        stored: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": [block_hash_u64(event.block_hash)],
            "parent_block_hash": None if event.parent_hash is None else block_hash_u64(event.parent_hash),
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None if event.lora is None else event.lora.lora_id,
            "medium": medium,
            "lora_name": None if event.lora is None else event.lora.lora_name,
        }
        salt = _cache_salt(event.extra_keys)
        if salt is not None:
            stored["cache_salt"] = salt
        return stored
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": [block_hash_u64(event.block_hash)], "medium": medium}
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(timestamp_unix_nanos: int, events: Iterable[KvEvent], medium: str | None,
                 data_parallel_rank: int = DATA_PARALLEL_RANK) -> bytes:
    """The msgpack payload ``[ts, events, data_parallel_rank]``."""
    return msgpack.packb([timestamp_unix_nanos / 1e9, [encode_event(e, medium) for e in events],
                          data_parallel_rank], use_bin_type=True)


# -- endpoints -----------------------------------------------------------------
def _split_tcp(endpoint: str) -> tuple[str, str]:
    """``tcp://HOST:PORT`` → (host without brackets, port text)."""
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"KV event endpoint must be tcp://HOST:PORT, got {endpoint!r}")
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not (port == "*" or port.isdigit()):
        raise ValueError(f"KV event endpoint must be tcp://HOST:PORT, got {endpoint!r}")
    return host.removeprefix("[").removesuffix("]"), port


def _tcp(host: str, port: int | str) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def check_bindable(endpoint: str, flag: str) -> None:
    """``ValueError`` naming ``flag`` when ``endpoint`` cannot be bound now (address in use, not
    this host's): checked before the model loads, so a busy port fails in seconds, not after a
    long load with a traceback (found by review)."""
    socket = zmq.Context.instance().socket(zmq.PUB)
    try:
        _bind(socket, endpoint)
    except zmq.ZMQError as exc:
        raise ValueError(f"{flag} {endpoint}: {exc}") from None
    finally:
        socket.close(linger=0)


def _bind(socket: zmq.Socket, endpoint: str) -> tuple[str, int]:
    """Bind ``endpoint`` (port 0 or * = a free port); returns (host as given, bound port)."""
    host, port = _split_tcp(endpoint)
    if ":" in host:
        socket.setsockopt(zmq.IPV6, 1)
    # "*" with IPV6 on: every IPv4 and IPv6 address, for any spelling of "::" (or no host)
    address = "*" if host == "" or (":" in host and is_wildcard_host(host)) else host
    socket.bind(_tcp(address, "*" if port in ("0", "*") else port))
    bound = socket.getsockopt_string(zmq.LAST_ENDPOINT)
    return host, int(bound.rpartition(":")[2])


def _advertised(host: str, advertise_host: str) -> str:
    return advertise_host if is_wildcard_host(host) else host


# -- the publisher ---------------------------------------------------------------
class ZmqKvEventPublisher:
    """Publishes the engine's KV events on a ZMQ PUB socket (and answers replays on a ROUTER)."""

    def __init__(self, engine: EngineClient, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000, medium: str | None = None) -> None:
        if buffer_steps < 1 or hwm < 0:
            raise ValueError(f"buffer_steps must be >= 1 and hwm >= 0, got {buffer_steps} and {hwm}")
        _split_tcp(endpoint)
        if replay_endpoint is not None:
            _split_tcp(replay_endpoint)
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
        self.resyncs = 0  # times the engine cut the subscription off and a snapshot was sent

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
            self._pub_addr = _bind(self._pub, self.endpoint)
            if self.replay_endpoint is not None:
                self._router = self._ctx.socket(zmq.ROUTER)
                # A full replay is buffer_steps + 1 messages: never drop part of one.
                self._router.setsockopt(zmq.SNDHWM, max(self.hwm, 2 * (self.buffer_steps + 1)))
                self._router.setsockopt(zmq.LINGER, 0)
                self._replay_addr = _bind(self._router, self.replay_endpoint)
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
            replay = _tcp(_advertised(self._replay_addr[0], advertise_host), self._replay_addr[1])
        config = getattr(self.engine, "config", None)
        queue = config.kv_events.subscriber_buffer if config is not None else 0
        return {
            "transport": "zmq",
            "host": _advertised(host, advertise_host),
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
        self.resyncs += 1
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
