"""KV transfer between engines (disaggregated prefill/decode).

``base``: the backend interface and plain data (no torch, no grpc: the server's gRPC
pull backend implements it too); ``attributes``: the session handle's documented
attributes; ``sessions``: sessions held under a lease by a prefill engine;
``nixl_backend``: NIXL (an optional extra), with ``nixl_source`` (the source its attributes
describe, checked) and ``nixl_read`` (waiting on a READ NIXL cannot abort).
"""
