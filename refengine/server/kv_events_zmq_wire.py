"""KV events in vLLM's ZMQ wire format, and the tcp endpoints the publisher binds.

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

Endpoints: both sockets always bind (vLLM connects when the host is not a wildcard). The
endpoint's host must be a wildcard (``*``, ``0.0.0.0``, ``::``) or an address of this machine,
and routers connect to what the publisher's ``describe`` reports. Port ``0`` or ``*`` binds a
free port.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgpack
import zmq

from refengine.kv.keys import block_hash_u64
from refengine.server.options import ServerOptions, is_wildcard_host
from refengine.types import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
SALT_PREFIX = "salt:"
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
def split_tcp(endpoint: str) -> tuple[str, str]:
    """``tcp://HOST:PORT`` → (host without brackets, port text)."""
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"KV event endpoint must be tcp://HOST:PORT, got {endpoint!r}")
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not (port == "*" or port.isdigit()):
        raise ValueError(f"KV event endpoint must be tcp://HOST:PORT, got {endpoint!r}")
    if port != "*" and int(port) > 65535:  # ZMQ bound port % 65536 and advertised that (found by review)
        raise ValueError(f"KV event endpoint port must be in 0..65535 (0 or *: a free port), got {endpoint!r}")
    return host.removeprefix("[").removesuffix("]"), port


def tcp_endpoint(host: str, port: int | str) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def check_endpoints(options: ServerOptions) -> None:
    """``ValueError`` naming the flag when a ZMQ endpoint of ``options`` is malformed, has the
    port of another (or of a gRPC listener), or cannot be bound now (in use, not this host's).
    Checked before the model loads, so that a busy port fails in seconds, not after a long load
    (found by review; the endpoints were bound one by one and released, so that two of the
    same port, or one on --port, passed and failed after the load). A port named twice is refused
    whatever the hosts: a port of its own for each socket."""
    taken = {port: flag for port, flag in ((options.port, "--port"), (options.control_port, "--control-port"))
             if port}
    for flag, endpoint in (("--kv-events-zmq", options.kv_events_zmq),
                           ("--kv-events-zmq-replay", options.kv_events_zmq_replay)):
        if endpoint is None:
            continue
        try:
            port = split_tcp(endpoint)[1]
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None
        if port not in ("0", "*"):
            if int(port) in taken:
                raise ValueError(f"{flag} {endpoint}: port {port} is {taken[int(port)]}'s; give each its own")
            taken[int(port)] = flag
        _check_bindable(endpoint, flag)


def _check_bindable(endpoint: str, flag: str) -> None:
    socket = zmq.Context.instance().socket(zmq.PUB)
    try:
        bind_endpoint(socket, endpoint)
    except zmq.ZMQError as exc:
        raise ValueError(f"{flag} {endpoint}: {exc}") from None
    finally:
        socket.close(linger=0)


def bind_endpoint(socket: zmq.Socket, endpoint: str) -> tuple[str, int]:
    """Bind ``endpoint`` (port 0 or * = a free port); returns (host as given, bound port)."""
    host, port = split_tcp(endpoint)
    if ":" in host:
        socket.setsockopt(zmq.IPV6, 1)
    # "*" with IPV6 on: every IPv4 and IPv6 address, for any spelling of "::" (or no host)
    address = "*" if host == "" or (":" in host and is_wildcard_host(host)) else host
    socket.bind(tcp_endpoint(address, "*" if port in ("0", "*") else port))
    bound = socket.getsockopt_string(zmq.LAST_ENDPOINT)
    return host, int(bound.rpartition(":")[2])


def advertised_host(host: str, advertise_host: str) -> str:
    return advertise_host if is_wildcard_host(host) else host
