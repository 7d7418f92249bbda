"""A refengine server for the conformance suite, started once per session.

It is started with ``start_server`` of tests/integration/conftest.py, with engine flags
that make every rule observable quickly on CPU: a 1024-token context (G7 can fill it),
4 running sequences (M4 can fill every slot and queue behind them), a 256-token step
budget (G18 forces chunked prefill), and one model alias (D8 checks that every listed
alias is accepted and serves the same model). Set ``OECONF_TARGET=host:port`` to run the suite
against an already running server instead (any OpenEngine implementation).
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402

from tests.integration.conftest import ServerProcess, start_server  # noqa: E402

SERVER_ARGS = ("--max-model-len", "1024", "--max-num-seqs", "4", "--max-num-batched-tokens", "256",
               "--served-model-alias", "oeconf-alias")


@pytest.fixture(scope="session")
def conformance_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess | None]:
    """The server under test; None when OECONF_TARGET points at an external one."""
    if os.environ.get("OECONF_TARGET"):
        yield None
        return
    server = start_server(tmp_path_factory.mktemp("conformance") / "server.log", *SERVER_ARGS)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def conformance_address(conformance_server: ServerProcess | None) -> str:
    return os.environ.get("OECONF_TARGET") or conformance_server.address
