"""The ``refengine serve`` flags of the server layer, and the ``ServerOptions`` they make.

The engine's flags (model, KV cache, scheduler...) are in ``refengine/args.py``. Values are
checked by ``ServerOptions`` (``options.py``), so an option given in code and one given on the
command line are refused alike, the message naming the flag.
"""

from __future__ import annotations

import argparse

from refengine.server.options import MIB, ServerOptions
from refengine.server.stream_bridge import OVERFLOW_FACTOR

LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    d = ServerOptions()
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=d.host, help="address of the Inference listener")
    g.add_argument("--port", type=int, default=d.port,
                   help="port of the Inference listener (0 = any free port)")
    g.add_argument("--control-host", default=None,
                   help="address of the Control listener opened by --control-port (default: --host)")
    g.add_argument("--control-port", type=int, default=None,
                   help="serve Control on its own listener at this port (None: share the Inference listener)")
    g.add_argument("--instance-id", default=None, help="ServerInfo.instance_id (None: random per process)")
    g.add_argument("--max-send-message-mib", type=int, default=d.max_send_message_bytes // MIB,
                   help="largest gRPC message the server sends, MiB")
    g.add_argument("--max-receive-message-mib", type=int, default=d.max_receive_message_bytes // MIB,
                   help="largest gRPC message the server accepts, MiB")
    g.add_argument("--shutdown-grace-seconds", type=float, default=d.shutdown_grace_seconds,
                   help="on SIGTERM/SIGINT, how long running streams may take to finish")
    g.add_argument("--stream-buffer", type=int, default=d.stream_buffer,
                   help="engine outputs a stream may hold undelivered before its stall clock starts")
    g.add_argument("--stream-buffer-mib", type=int, default=d.stream_buffer_bytes // MIB,
                   help="estimated memory a stream's undelivered outputs may hold before its stall clock starts, "
                   f"MiB; at {OVERFLOW_FACTOR}x it the stream ends at once (EngineError OVERLOADED, retryable)")
    g.add_argument("--stall-timeout-seconds", type=float, default=d.stall_timeout_seconds,
                   help="a stream whose client reads nothing this long while its buffer is full is aborted "
                   "(EngineError OVERLOADED, retryable)")
    g.add_argument("--health-probe-timeout-seconds", type=float, default=d.health_probe_timeout_seconds,
                   help="bound of Health(include_inference_probe)")
    g.add_argument("--kv-events-zmq", default=None, metavar="tcp://HOST:PORT",
                   help="also publish KV events in vLLM's ZMQ wire format here (default: None = not published)")
    g.add_argument("--kv-events-zmq-replay", default=None, metavar="tcp://HOST:PORT",
                   help="the ZMQ replay (ROUTER) socket for --kv-events-zmq (default: None = no replay)")
    g.add_argument("--kv-events-zmq-topic", default=d.kv_events_zmq_topic, help="ZMQ topic (default: empty)")
    g.add_argument("--advertise-host", "--kv-advertise-host", dest="advertise_host", default=None,
                   help="host clients reach this server at, reported instead of a bind wildcard: in a prefill "
                   "server's KvSessionRef endpoints and in GetKvEventSources (default: None = the machine's "
                   "host name)")
    g.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                   help="logging level (default: INFO)")


def options_from_args(args: argparse.Namespace) -> ServerOptions:
    return ServerOptions(
        role=args.role,
        host=args.host,
        port=args.port,
        control_host=args.control_host,
        control_port=args.control_port,
        instance_id=args.instance_id,
        max_send_message_bytes=args.max_send_message_mib * MIB,
        max_receive_message_bytes=args.max_receive_message_mib * MIB,
        shutdown_grace_seconds=args.shutdown_grace_seconds,
        stream_buffer=args.stream_buffer,
        stream_buffer_bytes=args.stream_buffer_mib * MIB,
        stall_timeout_seconds=args.stall_timeout_seconds,
        health_probe_timeout_seconds=args.health_probe_timeout_seconds,
        kv_events_zmq=args.kv_events_zmq,
        kv_events_zmq_replay=args.kv_events_zmq_replay,
        kv_events_zmq_topic=args.kv_events_zmq_topic,
        advertise_host=args.advertise_host,
    )
