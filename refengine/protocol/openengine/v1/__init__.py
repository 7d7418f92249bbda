"""Generated bindings of the OpenEngine v0.1.0 protos (package ``openengine.v1``).

Written by ``scripts/gen_proto.py``; do not edit. Most code imports the flat
namespace instead: ``from refengine.protocol import oe``.
"""
