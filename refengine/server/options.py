"""The server's own settings, one frozen dataclass; every default is documented here and
shown by ``refengine serve --help``. Engine settings live in ``refengine.config``."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from refengine.config_checks import MAX_SECONDS, is_host

MIB = 1 << 20
MAX_MESSAGE_BYTES = 2047 * MIB  # gRPC keeps message limits in a C int (2^31 - 1 bytes)
REQUEST_ROOM_BYTES = 1 * MIB  # what a media request holds besides one item's data URI
ROLES = ("aggregated", "prefill", "decode", "encoder")


def host_port(host: str, port: int | str) -> str:
    """``host:port`` as gRPC parses it: an IPv6 literal in brackets (``[::1]:50051``). Unbracketed,
    ``::`` and ``::1`` failed to bind, blamed on the port (found by review)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def is_wildcard_host(host: str) -> bool:
    """A bind address meaning "every interface", never a host a client can be told to connect
    to (E6): empty, ``*``, or any spelling of an unspecified IP -- ``0.0.0.0``, ``::``, ``[::]``,
    ``::0``, ``0:0:0:0:0:0:0:0``, ``::ffff:0.0.0.0``."""
    host = host.strip()
    if host in ("", "*"):
        return True
    try:
        ip = ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:  # a name, not an IP literal
        return False
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return ip.is_unspecified or (mapped is not None and mapped.is_unspecified)


@dataclass(frozen=True)
class ServerOptions:
    """How ``refengine serve`` listens and streams.

    - ``host``/``port``: the Inference listener (also Control unless ``control_port`` is set).
      ``port`` 0 picks a free port (logged at start).
    - ``control_host``/``control_port``: put Control on its own listener (``None`` = share).
      grpc.health.v1 and server reflection are on every listener.
    - ``max_send_message_bytes``/``max_receive_message_bytes``: gRPC message limits. A response
      that could not fit (e.g. ``all`` candidates over a long prompt) is refused before acceptance.
      The receive limit should carry one media item of ``--media-max-mib`` as a data URI
      (``media_item_problem``, a start-up warning): 32 MiB by default, for the default 20 MiB item.
    - ``shutdown_grace_seconds``: on SIGTERM/SIGINT, running streams get this long to finish;
      the rest end with ``EngineError(CANCELLED, retryable)`` naming the drain.
    - ``stream_buffer``: engine outputs one stream may hold undelivered before its stall clock
      starts. The engine thread never blocks: outputs past the buffer still queue, but only
      for ``stall_timeout_seconds``.
    - ``stream_buffer_bytes``: the same bound on the outputs' estimated memory
      (``stream_bridge.held_bytes``: logprob candidates dominate, ~9 MiB a token for ``all`` over
      SmolLM2's vocabulary). When what waits behind the next output to send passes
      ``stream_bridge.OVERFLOW_FACTOR`` times it, the stream ends at once with
      ``EngineError(OVERLOADED, retryable)``: its client reads slower than the engine produces, and
      the stall clock, restarted by every write, would let the backlog grow to the end of the request.
    - ``stall_timeout_seconds``: a full buffer with no write completing for this long aborts
      the request and ends the stream with ``EngineError(OVERLOADED, retryable)``. A client that
      takes nothing for this long + 15 s (``ABORT_CONFIRM_SECONDS``) after its stream's end (a stall,
      the drain, or the engine finished) is disconnected (status RESOURCE_EXHAUSTED).
    - ``health_probe_timeout_seconds``: bound of ``Health(include_inference_probe)``.
    - ``kv_events_zmq``: ``tcp://HOST:PORT`` to publish KV events in vLLM's ZMQ format (a PUB
      socket, bound); ``kv_events_zmq_replay`` the ROUTER replay socket; ``kv_events_zmq_topic``
      its topic. ``None`` = no compatibility source (the native SubscribeKvEvents still works).
    - ``advertise_host``: the host clients can reach this server at, reported where a bind
      address would be a wildcard (``GetKvEventSources``, a prefill server's ``KvSessionRef``);
      ``None`` = the machine's host name; a wildcard itself is refused.
    """

    role: str = "aggregated"
    host: str = "0.0.0.0"
    port: int = 50051
    control_host: str | None = None
    control_port: int | None = None
    instance_id: str | None = None  # None = a random id per process
    max_send_message_bytes: int = 16 * MIB
    max_receive_message_bytes: int = 32 * MIB
    shutdown_grace_seconds: float = 30.0
    stream_buffer: int = 64
    stream_buffer_bytes: int = 32 * MIB
    stall_timeout_seconds: float = 30.0
    health_probe_timeout_seconds: float = 10.0
    kv_events_zmq: str | None = None
    kv_events_zmq_replay: str | None = None
    kv_events_zmq_topic: str = ""
    advertise_host: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        for name in ("port", "control_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port <= 65535:  # gRPC would bind port % 65536 (another server's)
                raise ValueError(f"{_flag(name)} must be in 0..65535 (0: a free port), got {port}")
        if self.instance_id is not None and (not self.instance_id or self.instance_id != self.instance_id.strip()):
            # "" was replaced by a random id without a word (found by review)
            raise ValueError(f"--instance-id must be a non-empty name without white space around it, got "
                             f"{self.instance_id!r} (leave it out for a random id per process)")
        for name in ("host", "control_host"):
            if (host := getattr(self, name)) is not None and not is_host(host):
                # Found by review: an empty or malformed --host failed to bind, blamed on --port.
                raise ValueError(f"{_flag(name)} must be a host name or an IP address, got {host!r}")
        if self.port and self.control_port == self.port and (self.control_host or self.host) == self.host:
            raise ValueError(f"--control-port {self.control_port} is --port: give Control its own port, or leave "
                             "--control-port out to serve it on --port")
        # Flags that only qualify another are refused without it (found by review: accepted, then ignored).
        if self.control_host is not None and self.control_port is None:
            raise ValueError("--control-host needs --control-port (without it, Control is served on --port)")
        if self.kv_events_zmq is None and (self.kv_events_zmq_replay is not None or self.kv_events_zmq_topic):
            raise ValueError("--kv-events-zmq-replay and --kv-events-zmq-topic need --kv-events-zmq")
        if self.advertise_host is not None and is_wildcard_host(self.advertise_host):
            raise ValueError(f"--advertise-host {self.advertise_host!r} is a bind wildcard; name a host clients "
                             "can connect to (E6)")
        if self.advertise_host is not None and not is_host(self.advertise_host):
            raise ValueError(f"--advertise-host must be a host name or an IP address, got {self.advertise_host!r}")
        # Messages name the flag the operator typed (found by review: they named the fields).
        if self.stream_buffer < 1:
            raise ValueError(f"--stream-buffer must be >= 1, got {self.stream_buffer}")
        if not MIB <= self.stream_buffer_bytes <= MAX_MESSAGE_BYTES:
            raise ValueError(f"--stream-buffer-mib must be in 1..{MAX_MESSAGE_BYTES // MIB}, "
                             f"got {self.stream_buffer_bytes / MIB:g}")
        for name in ("shutdown_grace_seconds", "stall_timeout_seconds", "health_probe_timeout_seconds"):
            if not 0 < getattr(self, name) <= MAX_SECONDS:  # see MAX_SECONDS: inf overflows waits
                raise ValueError(f"{_flag(name)} must be in (0, {MAX_SECONDS:g}] seconds, got {getattr(self, name)}")
        for name in ("max_send_message_bytes", "max_receive_message_bytes"):
            if not MIB <= getattr(self, name) <= MAX_MESSAGE_BYTES:  # gRPC holds the limit in a C int
                raise ValueError(f"{_flag(name).replace('-bytes', '-mib')} must be in 1..{MAX_MESSAGE_BYTES // MIB} "
                                 f"(MiB), got {getattr(self, name) / MIB:g}")

    def media_item_problem(self, media_max_bytes: int) -> str | None:
        """Why one media item of ``media_max_bytes`` may not fit a request, or None: as a data
        URI (base64, 4 characters per 3 bytes) with ``REQUEST_ROOM_BYTES`` for the rest. Such an
        item never reaches the media checks: gRPC refuses the message first, with
        RESOURCE_EXHAUSTED (read as "overloaded, retry"), not INVALID_ARGUMENT (found by review).
        A warning, not a refusal: clients that send media by URL never meet it."""
        needed = -(-media_max_bytes * 4 // 3) + REQUEST_ROOM_BYTES
        if needed <= self.max_receive_message_bytes:
            return None
        return (f"a media item of --media-max-mib {media_max_bytes / MIB:g} needs a {-(-needed // MIB)} MiB request "
                f"as a data URI, more than --max-receive-message-mib {self.max_receive_message_bytes // MIB}: such "
                "requests are refused by gRPC with RESOURCE_EXHAUSTED; raise it or lower --media-max-mib")

    def grpc_options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.max_send_message_length", self.max_send_message_bytes),
            ("grpc.max_receive_message_length", self.max_receive_message_bytes),
            ("grpc.so_reuseport", 0),  # two servers must never silently share a port
        ]


def _flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")
