"""Generated OpenEngine bindings (see ``v1``); written by scripts/gen_proto.py."""
