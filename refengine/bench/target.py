"""What the benchmark asks the server before it builds the workload: which model to name,
how large its vocabulary is (for random token ids) and whether it takes token ids at all.

Only a server that cannot be reached, a prefill or decode server (a prefill server answers each
request with a KV session that the run would leave held until its lease ends; a decode server
refuses requests without one), or, without ``--model``, a server that cannot name a model stops
the run. A failing ``GetModelInfo`` does not: the run goes on with defaults, so that a bad
``--model`` shows up as what the server answers Generate with (e.g. NOT_FOUND per request).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf import json_format

from refengine.client import OpenEngineClient
from refengine.protocol import oe
from refengine.protocol.reachability import not_ready_reason

__all__ = ["DEFAULT_VOCAB_SIZE", "Target", "TargetError", "discover"]

DEFAULT_VOCAB_SIZE = 1000  # when the server reports none: ids below it exist in every real vocabulary
#: Roles whose servers take no whole request (prompt to finish), which is what the run sends.
SPLIT_ROLES = {oe.ENGINE_ROLE_PREFILL: "prefill", oe.ENGINE_ROLE_DECODE: "decode"}


class TargetError(RuntimeError):
    """The server cannot be benchmarked: unreachable, or no model to name."""


@dataclass(frozen=True)
class Target:
    model: str
    vocab_size: int
    token_ids_input: bool  # False: the model said it takes no token ids, so prompts are text
    note: str = ""  # why defaults were used, for the user


def _rpc_failure(exc: grpc.RpcError) -> str:
    return f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.Call) else repr(exc)


def discover(client: OpenEngineClient, model: str = "", connect_timeout: float = 10.0) -> Target:
    """The model (``model``, else the server's first supported one) and its input facts;
    raises :class:`TargetError`."""
    if reason := not_ready_reason(client.channel, connect_timeout):
        raise TargetError(f"{client.address}: not reachable within {connect_timeout:g} s: {reason}")
    try:
        server = client.server_info()
    except grpc.RpcError as exc:
        if not model:
            raise TargetError(f"{client.address}: GetServerInfo failed ({_rpc_failure(exc)}); pass --model") from None
        server = oe.ServerInfo()  # a role the run cannot check; --model names the model
    if server.engine_role in SPLIT_ROLES:
        raise TargetError(f"{client.address} is a {SPLIT_ROLES[server.engine_role]} server: bench sends whole "
                          "requests; point it at an aggregated server")
    if not model:
        models = list(server.supported_models)
        if not models:
            raise TargetError(f"{client.address}: GetServerInfo lists no supported model; pass --model")
        model = models[0]
    try:
        info = client.model_info(model)
    except grpc.RpcError as exc:
        return Target(model, DEFAULT_VOCAB_SIZE, True, f"GetModelInfo({model!r}) failed ({_rpc_failure(exc)}); "
                      f"sending token ids below {DEFAULT_VOCAB_SIZE}")
    vocab = json_format.MessageToDict(info.extra).get("vocab_size")  # a refengine extra; others may share it
    has_vocab = isinstance(vocab, int | float) and vocab > 0
    token_ids = not info.HasField("supports_token_ids_input") or info.supports_token_ids_input
    return Target(model, int(vocab) if has_vocab else DEFAULT_VOCAB_SIZE, token_ids,
                  "" if has_vocab else f"no vocab_size in GetModelInfo.extra: token ids below {DEFAULT_VOCAB_SIZE}")
