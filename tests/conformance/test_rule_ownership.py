"""Each check owns the rule it names: a server that breaks one structural rule fails that rule
alone, however many other checks read its streams (before, omitting only ``output_index``
failed 33 rules)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc

from refengine.conformance import Status, run
from refengine.protocol import oe
from tests.conformance.fake_server import Control, Inference
from tests.conformance.toy_engine import Faults, ToyEngine


class _NoOutputIndex(Inference):
    """The toy, with ``output_index`` cleared on every TokenOutput and GenerationFinished."""

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:  # noqa: N802
        for event in super().Generate(request, context):
            kind = event.WhichOneof("event")
            if kind in ("token", "finished"):
                getattr(event, kind).ClearField("output_index")
            yield event


def test_omitting_output_index_fails_g10_alone() -> None:
    engine = ToyEngine(Faults())
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    oe.add_InferenceServicer_to_server(_NoOutputIndex(engine), server)
    oe.add_ControlServicer_to_server(Control(engine), server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        results = run(address)
    finally:
        server.stop(0)
        engine.running = False
    failed = {r.name: r.message for r in results if r.status is Status.FAIL}
    assert {name.split(":")[0] for name in failed} == {"G10"}, failed
    assert "has no output_index" in failed["G10:output_index"]
    unattributable = {r.name: r for r in results if "cannot be told apart" in r.message}
    assert unattributable and all(r.status is Status.SKIP for r in unattributable.values())
