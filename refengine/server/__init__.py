"""The gRPC edge: OpenEngine v0.1.0 (``openengine.v1``) over grpc.aio.

Read in this order:

- ``app.py``          ``refengine serve``: listeners, signals, drain.
- ``args.py``         the serve flags of this layer → ``ServerOptions``.
- ``loading.py``      the engine, loaded on a worker thread (then ``gc.freeze``).
- ``options.py``      the server's own settings (ports, message sizes, grace, stall timeout).
- ``state.py``        lifecycle (STARTING → READY → DRAINING) shared by every servicer.
- ``metadata.py``     request metadata keys (RULES M1–M5).
- ``capabilities.py`` the one table of supported features (D4): discovery and validation read it.
- ``validation.py``   everything refused before acceptance (G1–G8, D4, D7, K5, K6, M3).
- ``convert.py``      proto → engine request types.
- ``responses.py``    engine outputs → ``GenerateResponse`` events (G9–G16, L1–L3, X1).
- ``stream_bridge.py`` engine thread → event loop hand-off, bounded, with stall detection.
- ``workers.py``      the slow-work thread pool (acceptance, Encode), apart from asyncio's default.
- ``inference.py``    ``Inference.Generate``.
- ``control.py``      ``Control``: discovery, load, abort, the LoRA lifecycle, KV-event discovery.
- ``health.py``       ``Control.Health``, the inference probe, grpc.health.v1 status.
- ``errors.py``       engine exceptions and faults → gRPC status codes / ``EngineError``.
- ``unary.py``        how every unary RPC reports failure (X2).
- ``wire.py``         servicer registration; unparseable request bytes → INVALID_ARGUMENT.
- ``profiles.py``     draft-profile discovery (``ServerInfo.extra["refengine.profiles"]``).

Beside the contract's two services:

- ``kv_events_service.py``, ``kv_events_wire.py``  SubscribeKvEvents, GetKvEventSources, the
  SIGUSR1 prefix-cache reset; ``kv_events_zmq.py``, ``kv_events_zmq_wire.py`` the same events in
  vLLM's ZMQ format.
- ``kv_pull_service.py``, ``kv_pull_client.py``  ``refengine.kvpull.v1.KvPull``: prefill servers
  hand KV sessions to decode servers (the ``grpc`` transfer backend).
- ``media_service.py``, ``media_wire.py``  the encoder profile's ``Media`` service and embedding
  handles on the wire.

Invariants: this package never touches tensors and never waits on model compute on
the event loop; the engine runs on its own thread and hands outputs over with
``loop.call_soon_threadsafe``.
"""
