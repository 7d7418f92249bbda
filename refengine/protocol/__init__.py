"""The OpenEngine wire protocol: generated protobuf/gRPC bindings, nothing else.

- ``proto/openengine/v1/*.proto`` is the canonical OpenEngine v0.1.0 schema,
  wire-identical to upstream (checked by ``tests/unit/test_proto_wire.py``).
- ``openengine/v1/`` holds the bindings generated from it by
  ``scripts/gen_proto.py`` (never edit them; rerun the script).
- ``oe`` re-exports every message, enum, stub and servicer in one namespace::

      from refengine.protocol import oe

Only the gRPC edge (``refengine.server``), clients and the conformance suite
import this package; the engine core never does.
"""
