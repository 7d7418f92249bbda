"""LoRA through a real server on loopback: discovery (R6, D6), the lifecycle statuses over
the wire (R1–R5), ``lora_name`` in Generate, and the adapter in KV events (E4, native stream
and vLLM's ZMQ encoding). The lifecycle's full matrix is the conformance suite's (section R);
PEFT equality is the golden tests'.

The adapters are the conformance suite's random ones (``lora_files.py``), PEFT's layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from refengine.client import OpenEngineClient
from refengine.conformance.kv_subscriber import KvSubscriber
from refengine.conformance.lora_files import ModelShape, write_random_adapter
from refengine.model import resolve_model
from refengine.protocol import oe
from refengine.server.kv_events_zmq_wire import encode_event
from refengine.types import BlockStored, LoraAdapterSpec
from tests.integration.conftest import MODEL, ServerProcess, greedy_request, running_server

PROMPT = ("Write one short sentence about the sea and the wind at night, the way an old sailor would tell it "
          "to a child who cannot sleep.")  # over two 16-token blocks: its KV events are BlockStored


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora-root")
    shape = ModelShape.from_model_config_json(resolve_model(MODEL).path / "config.json")
    write_random_adapter(root / "sea", shape, seed=1)
    write_random_adapter(root / "wind", shape, seed=2)
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, root: Path) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("lora") / "server.log", "--enable-lora", "--lora-root", str(root),
                        "--max-loras", "2", "--max-model-len", "512") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[OpenEngineClient]:
    with OpenEngineClient(server.address) as c:
        yield c


def load(client: OpenEngineClient, lora_id: int, name: str, path: Path | str) -> oe.LoadLoraResponse:
    adapter = oe.LoraAdapter(lora_id=lora_id, lora_name=name, source_path=str(path))
    return client.control.LoadLora(oe.LoadLoraRequest(adapter=adapter), timeout=60)


def status_of(call) -> grpc.StatusCode:  # noqa: ANN001
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def tokens_of(client: OpenEngineClient, request_id: str, lora_name: str = "") -> list[int]:
    request = greedy_request(request_id, PROMPT, max_tokens=12, ignore_eos=True)
    request.lora_name = lora_name
    events = list(client.generate(request, timeout=120))
    assert events[-1].WhichOneof("event") == "finished", events[-1]
    return [t.token_id for e in events if e.WhichOneof("event") == "token" for t in e.token.tokens]


def test_discovery_reports_lora(client: OpenEngineClient) -> None:
    assert client.model_info().supports_lora  # R6
    assert client.server_info().capacity.max_loras == 2  # D6


def test_lifecycle_statuses_over_the_wire(client: OpenEngineClient, root: Path) -> None:
    first = load(client, 11, "sea", root / "sea")
    assert not first.already_loaded and first.adapter.lora_name == "sea"
    assert load(client, 11, "sea", root / "sea").already_loaded  # R2
    assert status_of(lambda: load(client, 12, "sea", root / "wind")) == grpc.StatusCode.ALREADY_EXISTS  # R3
    assert status_of(lambda: load(client, 0, "x", root / "wind")) == grpc.StatusCode.INVALID_ARGUMENT  # R1
    assert status_of(lambda: load(client, 13, "x", "wind")) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_of(lambda: load(client, 13, "x", root.parent)) == grpc.StatusCode.INVALID_ARGUMENT  # outside
    assert status_of(lambda: client.control.LoadLora(oe.LoadLoraRequest(), timeout=10)) \
        == grpc.StatusCode.INVALID_ARGUMENT
    unload = oe.UnloadLoraRequest(lora_name="nope")
    assert status_of(lambda: client.control.UnloadLora(unload, timeout=10)) == grpc.StatusCode.NOT_FOUND  # R4
    listed = client.control.ListLoras(oe.ListLorasRequest(), timeout=10).adapters
    assert [(a.lora_id, a.lora_name, a.source_path) for a in listed] == [(11, "sea", str(root / "sea"))]


def test_generate_with_an_adapter_and_unknown_names(client: OpenEngineClient, root: Path) -> None:
    load(client, 11, "sea", root / "sea")
    base, sea = tokens_of(client, "base"), tokens_of(client, "sea", "sea")
    assert sea != base and tokens_of(client, "sea-again", "sea") == sea
    request = greedy_request("ghost", PROMPT)
    request.lora_name = "ghost"
    assert status_of(lambda: list(client.generate(request, timeout=30))) == grpc.StatusCode.NOT_FOUND  # R4


def test_kv_events_carry_the_adapter(client: OpenEngineClient, root: Path) -> None:
    load(client, 21, "wind", root / "wind")
    sub = KvSubscriber(client.control, oe.SubscribeKvEventsRequest(include_snapshot=True), timeout=120)
    try:
        assert sub.wait_responses(1), sub.describe()  # the snapshot: the subscription is live
        tokens_of(client, "wind-events", "wind")
        tokens_of(client, "base-events")

        def stored() -> list[oe.BlockStored]:
            return [e.block_stored for b in sub.batches for e in b.events if e.WhichOneof("event") == "block_stored"]

        assert sub.wait(lambda s: {b.lora_name for b in stored()} >= {"wind", ""}, 60), sub.describe()
    finally:
        sub.close()
    for block in stored():
        assert (block.lora_id, block.lora_name) in ((21, "wind"), (11, "sea"), (0, ""))  # E4


def test_zmq_encoding_names_the_adapter() -> None:
    adapter = LoraAdapterSpec(7, "sea", "/srv/loras/sea")
    event = BlockStored(b"\x01" * 32, None, (1, 2, 3, 4), 4, ("fp", "lora:abc"), adapter)
    encoded = encode_event(event, "GPU")
    assert (encoded["lora_id"], encoded["lora_name"]) == (7, "sea")
    base = encode_event(BlockStored(b"\x02" * 32, None, (1, 2, 3, 4), 4, ("fp",)), "GPU")
    assert (base["lora_id"], base["lora_name"]) == (None, None)
