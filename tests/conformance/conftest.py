"""A refengine server for the conformance suite (tests/conformance/test_conformance.py).

It is started with ``start_server`` of tests/integration/conftest.py, with engine flags
that make every rule observable quickly on CPU: a 1024-token context (G7 can fill it),
4 running sequences (M4 can fill every slot and queue behind them), a 256-token step
budget (G18 forces chunked prefill), one model alias (D8 checks that every listed
alias is accepted and serves the same model), and LoRA enabled with a temporary
``--lora-root`` into which the R checks write their adapters (``conformance_lora``). Set
``OECONF_TARGET=host:port`` to run the suite against an already running server instead (any
OpenEngine implementation; ``OECONF_LORA_DIR`` and ``OECONF_LORA_MODEL_CONFIG`` then give
the R checks a directory that server can read and its model's config.json).

The server lives for its module only, so that its memory goes back to the servers of later
modules (tests/conftest.py says why that matters on the test VM).

``refengine_server`` (imported from tests/integration/conftest.py) is the shared server with
LoRA disabled: the disabled side of R5 and R6 runs against it.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402

from refengine.model import resolve_model  # noqa: E402
from tests.integration.conftest import MODEL, ServerProcess, refengine_server, start_server  # noqa: E402, F401

#: 128 KV blocks of 16 = 2 x 1024 tokens: the checks' concurrent requests fit (four of them at
#: the full context would preempt, which refengine handles), and E3's eviction check fills the
#: prefix cache with ~2.5k prompt tokens (with the default 1 GiB cache, ~23k, it would skip).
#: 16 event batches retained: E1's and E5's expiry checks (which have 32 published first) see
#: batch 1 gone (with the default 10,000 they would skip). The ZMQ publisher on a free loopback
#: port gives GetKvEventSources a source, which E6 dials (without it refengine lists none).
SERVER_ARGS = ("--max-model-len", "1024", "--max-num-seqs", "4", "--max-num-batched-tokens", "256",
               "--num-kv-blocks", "128", "--served-model-alias", "oeconf-alias",
               "--kv-events-retained-batches", "16", "--kv-events-zmq", "tcp://127.0.0.1:0")


@pytest.fixture(scope="session")
def conformance_lora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Options ``lora_dir`` (the server's --lora-root) and ``lora_model_config`` (the model's
    config.json, the shapes of the adapters the R checks write)."""
    if os.environ.get("OECONF_TARGET"):
        return {"lora_dir": os.environ.get("OECONF_LORA_DIR", ""),
                "lora_model_config": os.environ.get("OECONF_LORA_MODEL_CONFIG", "")}
    config = resolve_model(MODEL).path / "config.json"
    assert config.is_file(), f"{config} not found: the R checks need the model's config.json"
    return {"lora_dir": str(tmp_path_factory.mktemp("lora-root")), "lora_model_config": str(config)}


@pytest.fixture(scope="module")
def conformance_server(tmp_path_factory: pytest.TempPathFactory,
                       conformance_lora: dict[str, str]) -> Iterator[ServerProcess | None]:
    """The server under test; None when OECONF_TARGET points at an external one."""
    if os.environ.get("OECONF_TARGET"):
        yield None
        return
    lora = ("--enable-lora", "--lora-root", conformance_lora["lora_dir"])
    server = start_server(tmp_path_factory.mktemp("conformance") / "server.log", *SERVER_ARGS, *lora)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def conformance_address(conformance_server: ServerProcess | None) -> str:
    return os.environ.get("OECONF_TARGET") or conformance_server.address
