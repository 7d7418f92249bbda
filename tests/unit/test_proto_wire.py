"""The committed protos and bindings are wire-identical to OpenEngine v0.1.0.

``tests/data/openengine-v0.1.0-wire.json`` describes the upstream release: for
every message its fields (name, number, real oneof, proto3 ``optional``,
repeated, type, type_name), every enum's values and every RPC. These tests
rebuild the same shape from the generated modules' descriptors and compare, so
any drift in ``proto/openengine/v1`` (a renumbered field, a lost ``optional``, a
renamed RPC) fails with the list of differences. They also check that the
committed bindings are exactly what ``scripts/gen_proto.py`` produces.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from refengine.protocol import oe

REPO = Path(__file__).resolve().parents[2]
WIRE_JSON = REPO / "tests" / "data" / "openengine-v0.1.0-wire.json"
# The contract's own copy, where this checkout has one.
CONTRACT_WIRE_JSONS = [
    REPO / "contract" / "openengine-v0.1.0-wire.json",
    Path("/work/shared/contract/openengine-v0.1.0-wire.json"),
]
PROTOCOL_DIR = REPO / "refengine" / "protocol"
BINDINGS_DIR = PROTOCOL_DIR / "openengine" / "v1"
BINDINGS_PACKAGE = "refengine.protocol.openengine.v1"

_FDP = descriptor_pb2.FieldDescriptorProto
_TYPE_NAMES = {number: name[len("TYPE_") :].lower() for name, number in _FDP.Type.items()}


# --- descriptor -> wire-shape JSON -------------------------------------------------------


def _field_shape(msg: descriptor_pb2.DescriptorProto, field: descriptor_pb2.FieldDescriptorProto) -> dict:
    # A proto3 `optional` field sits in a synthetic oneof: the JSON shows it as optional=true,
    # oneof=null. Only oneofs written in the .proto count as oneofs.
    in_real_oneof = field.HasField("oneof_index") and not field.proto3_optional
    return {
        "name": field.name,
        "number": field.number,
        "oneof": msg.oneof_decl[field.oneof_index].name if in_real_oneof else None,
        "optional": field.proto3_optional,
        "repeated": field.label == _FDP.LABEL_REPEATED,
        "type": _TYPE_NAMES[field.type],
        "type_name": field.type_name.lstrip(".") or None,
    }


def _walk_enum(prefix: str, enum: descriptor_pb2.EnumDescriptorProto, out: dict) -> None:
    out["enums"][f"{prefix}.{enum.name}"] = {v.name: v.number for v in enum.value}


def _walk_message(prefix: str, msg: descriptor_pb2.DescriptorProto, out: dict) -> None:
    full_name = f"{prefix}.{msg.name}"
    out["messages"][full_name] = [_field_shape(msg, f) for f in sorted(msg.field, key=lambda f: f.number)]
    for nested in msg.nested_type:
        _walk_message(full_name, nested, out)
    for enum in msg.enum_type:
        _walk_enum(full_name, enum, out)


def wire_shape(file_protos: list[descriptor_pb2.FileDescriptorProto]) -> dict:
    """The wire JSON's shape, built from FileDescriptorProtos."""
    packages = {fdp.package for fdp in file_protos}
    assert len(packages) == 1, f"bindings span several packages: {packages}"
    out: dict = {"enums": {}, "messages": {}, "package": packages.pop(), "services": {}}
    for fdp in file_protos:
        for msg in fdp.message_type:
            _walk_message(fdp.package, msg, out)
        for enum in fdp.enum_type:
            _walk_enum(fdp.package, enum, out)
        for service in fdp.service:
            out["services"][f"{fdp.package}.{service.name}"] = {
                m.name: {
                    "client_streaming": m.client_streaming,
                    "input": m.input_type.lstrip("."),
                    "output": m.output_type.lstrip("."),
                    "server_streaming": m.server_streaming,
                }
                for m in service.method
            }
    return out


def generated_modules() -> list:
    """Every committed *_pb2 module, found by file name (so a module missing from oe still counts)."""
    names = sorted(p.stem for p in BINDINGS_DIR.glob("*_pb2.py"))
    return [importlib.import_module(f"{BINDINGS_PACKAGE}.{name}") for name in names]


def file_protos() -> list[descriptor_pb2.FileDescriptorProto]:
    protos = []
    for module in generated_modules():
        fdp = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(fdp)
        protos.append(fdp)
    return protos


def shape_diff(expected: dict, actual: dict) -> list[str]:
    """Readable differences between two wire shapes ('-' = only expected, '+' = only actual)."""
    diffs = []
    if expected.get("package") != actual.get("package"):
        diffs.append(f"package: {expected.get('package')!r} != {actual.get('package')!r}")
    for section in ("enums", "messages", "services"):
        exp, act = expected.get(section, {}), actual.get(section, {})
        diffs += [f"- {section[:-1]} {k} missing" for k in sorted(exp.keys() - act.keys())]
        diffs += [f"+ {section[:-1]} {k} unexpected" for k in sorted(act.keys() - exp.keys())]
        for key in sorted(exp.keys() & act.keys()):
            if section == "messages":
                e_fields = {f["name"]: f for f in exp[key]}
                a_fields = {f["name"]: f for f in act[key]}
                found = [f"- field {key}.{n} missing" for n in sorted(e_fields.keys() - a_fields.keys())]
                found += [f"+ field {key}.{n} unexpected" for n in sorted(a_fields.keys() - e_fields.keys())]
                for name in sorted(e_fields.keys() & a_fields.keys()):
                    for attr in sorted(e_fields[name].keys() | a_fields[name].keys()):
                        e, a = e_fields[name].get(attr), a_fields[name].get(attr)
                        if e != a:
                            found.append(f"~ field {key}.{name}: {attr} expected {e!r}, got {a!r}")
                if not found and exp[key] != act[key]:
                    found.append(f"~ message {key}: field order differs")
                diffs += found
            else:  # enums: value -> number; services: rpc -> {streaming flags, types}
                for item in sorted(exp[key].keys() | act[key].keys()):
                    e, a = exp[key].get(item), act[key].get(item)
                    if e != a:
                        diffs.append(f"~ {section[:-1]} {key}.{item}: expected {e!r}, got {a!r}")
    return diffs


# --- tests ---------------------------------------------------------------------------------


def test_generated_descriptors_match_wire_json():
    expected = json.loads(WIRE_JSON.read_text(encoding="utf-8"))
    actual = wire_shape(file_protos())
    diffs = shape_diff(expected, actual)
    assert not diffs, "generated bindings drift from OpenEngine v0.1.0:\n" + "\n".join(diffs)
    assert actual == expected


def test_wire_json_shape_sanity():
    """Guards the reading of the JSON format itself, so the comparison above means something."""
    shape = json.loads(WIRE_JSON.read_text(encoding="utf-8"))
    assert shape["package"] == "openengine.v1"
    assert len(shape["messages"]) == 63 and len(shape["enums"]) == 9
    assert set(shape["services"]) == {"openengine.v1.Inference", "openengine.v1.Control"}
    sampling = {f["name"]: f for f in shape["messages"]["openengine.v1.SamplingParams"]}
    assert sampling["temperature"] == {
        "name": "temperature",
        "number": 1,
        "oneof": None,  # proto3 optional: synthetic oneof not shown
        "optional": True,
        "repeated": False,
        "type": "double",
        "type_name": None,
    }
    prompt = {f["name"]: f for f in shape["messages"]["openengine.v1.GenerateRequest"]}["prompt"]
    assert prompt["oneof"] == "input" and prompt["optional"] is False


def test_diff_is_readable():
    expected = json.loads(WIRE_JSON.read_text(encoding="utf-8"))
    drifted = json.loads(json.dumps(expected))
    drifted["messages"]["openengine.v1.Usage"][0]["number"] = 9
    del drifted["enums"]["openengine.v1.Modality"]["MODALITY_AUDIO"]
    drifted["services"]["openengine.v1.Inference"]["Generate"]["server_streaming"] = False
    assert shape_diff(expected, drifted) == [
        "~ enum openengine.v1.Modality.MODALITY_AUDIO: expected 3, got None",
        "~ field openengine.v1.Usage.prompt_tokens: number expected 1, got 9",
        "~ service openengine.v1.Inference.Generate: expected "
        + repr(expected["services"]["openengine.v1.Inference"]["Generate"])
        + ", got "
        + repr(drifted["services"]["openengine.v1.Inference"]["Generate"]),
    ]


# sha256 of each file's serialized FileDescriptorProto as protoc embeds it in *_pb2.py (no
# comments, no json_name). Computed (grpcio-tools 1.85.1) from the upstream ai-dynamo/openengine
# .proto files at commit 4def7c5 with the release's three documented wire changes applied
# (tests/data/RULES.md header: no ERROR_CODE_DRAINING and INTERNAL = 11, no HEALTH_STATE_DRAINING
# and NOT_READY = 4, no KvConnectorInfo.supports_drain and schema_version = 8), which is the
# release v0.1.0 (tag b5f2bd9, BSR commit 768a93c7b44e40f28c692ad0b471a8f2).
UPSTREAM_DESCRIPTOR_SHA256 = {
    "openengine/v1/error.proto": "c04ed9eb450b7f1b738bf3737ea12d557c0f3fefbd8fd9c7ee7dfc75d8164c6f",
    "openengine/v1/generation.proto": "347d596a996c21d120c68290d2b3c57c428598e384646c0cedc5cbbbc70d0578",
    "openengine/v1/kv.proto": "36e83d7043c658d7b5a991348d834b6c7ad54446be6b5d5667856ae7b47f73eb",
    "openengine/v1/lifecycle.proto": "7d0b21c958e0ab330203532be0512ef8f0af4979fa7a4eb466a90b7cc03eb122",
    "openengine/v1/lora.proto": "cfb2b9c5408e2623c5ccf7f0416d977fa882c393128de3add07fd6bb60706a46",
    "openengine/v1/model.proto": "7d095e6be46bc12493d4c15a65196adc7fc0e0a6420d50d95ca5b837352582f3",
    "openengine/v1/openengine.proto": "4db0ae370f0f1bbdd0d7394ef9573c8914c3794a038e21b65ad0491ad181fda9",
    "openengine/v1/server.proto": "46955633d51a966e661f3781a9dff201de0672dba0504dd21f8d125120388171",
}


def test_descriptors_identical_to_upstream_files():
    """Stricter than the wire JSON: same file names, imports, declaration order and options as
    upstream, so gRPC reflection serves the same descriptors. A failure here with the wire-JSON
    test passing means a harmless reshuffle (e.g. reordered messages), not a wire change."""
    actual = {
        m.DESCRIPTOR.name: hashlib.sha256(m.DESCRIPTOR.serialized_pb).hexdigest() for m in generated_modules()
    }
    assert actual == UPSTREAM_DESCRIPTOR_SHA256


@pytest.mark.parametrize("contract_json", CONTRACT_WIRE_JSONS, ids=lambda p: str(p.parent))
def test_test_data_copy_matches_contract(contract_json: Path):
    if not contract_json.exists():
        pytest.skip(f"{contract_json} not present in this checkout")
    assert json.loads(contract_json.read_text(encoding="utf-8")) == json.loads(
        WIRE_JSON.read_text(encoding="utf-8")
    ), f"{WIRE_JSON} differs from the contract's {contract_json}"


def _tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_regeneration_is_byte_identical(tmp_path: Path):
    pytest.importorskip("grpc_tools")
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_proto.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    fresh = _tree(tmp_path)
    committed = {
        name: data
        for name, data in _tree(PROTOCOL_DIR).items()
        if name.startswith(("openengine/", "kvpull/", "v1alpha1/")) or name == "oe.py"
    }
    assert sorted(fresh) == sorted(committed), "generated file set differs; rerun scripts/gen_proto.py"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"committed bindings are stale, rerun scripts/gen_proto.py: {stale}"


def test_bindings_import_without_path_hacks(tmp_path: Path):
    for path in BINDINGS_DIR.glob("*.py*"):
        for line in path.read_text(encoding="utf-8").splitlines():
            assert not line.startswith(("from openengine", "import openengine")), f"{path.name}: {line}"
    code = (
        "import sys\n"
        "from refengine.protocol import oe\n"
        "from refengine.protocol.openengine.v1 import generation_pb2, openengine_pb2_grpc\n"
        "assert oe.GenerateRequest is generation_pb2.GenerateRequest\n"
        "assert 'openengine' not in sys.modules, 'bare openengine package imported'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, env=env)


def test_oe_namespace_is_complete():
    assert {m.__name__ for m in oe.PROTO_MODULES} == {m.__name__ for m in generated_modules()}
    shape = json.loads(WIRE_JSON.read_text(encoding="utf-8"))
    for full_name in [*shape["messages"], *shape["enums"]]:
        short = full_name.rsplit(".", 1)[1]
        assert getattr(oe, short).DESCRIPTOR.full_name == full_name
    for full_name, values in shape["enums"].items():
        enum = getattr(oe, full_name.rsplit(".", 1)[1])
        for value_name, number in values.items():
            assert getattr(oe, value_name) == number == enum.Value(value_name)
    for service in ("Inference", "Control"):
        for suffix in ("Stub", "Servicer"):
            assert hasattr(oe, f"{service}{suffix}")
        assert callable(getattr(oe, f"add_{service}Servicer_to_server"))
    assert oe.SERVICE_NAMES == ("openengine.v1.Inference", "openengine.v1.Control")
    assert sorted(oe.__all__) == oe.__all__ and all(hasattr(oe, n) for n in oe.__all__)
    assert oe.GenerateRequest.__module__ == f"{BINDINGS_PACKAGE}.generation_pb2"


def test_generate_request_round_trips():
    req = oe.GenerateRequest(
        request_id="req-1",
        model="smollm2",
        token_ids=oe.TokenIds(ids=[1, 2, 3]),
        sampling=oe.SamplingParams(temperature=0.0, top_k=-1, seed=2**63, num_sequences=2),
        stopping=oe.StoppingOptions(
            max_tokens=16,
            conditions=[oe.StopCondition(stop_text="\n"), oe.StopCondition(stop_token_id=2)],
            include_stop_in_output=False,
        ),
        response=oe.ResponseOptions(
            return_output_logprobs=True, output_candidates=oe.CandidateTokenSelection(all=oe.AllCandidates())
        ),
        kv=oe.KvOptions(
            session=oe.KvSessionRef(session_id="s", transfer_backend="grpc", dp_rank=0),
            cache_salt="",
        ),
        guided=oe.GuidedDecoding(json_schema='{"type": "object"}'),
        media=[oe.MediaItem(modality=oe.MODALITY_IMAGE, raw_bytes=b"\x89PNG")],
        lora_name="adapter-a",
    )
    req.kv.session.attributes_struct.update({"remote_block_ids": [1, 2], "big": str(2**60), "ok": True})
    req.extra.update({"knob": 0.5})

    data = req.SerializeToString(deterministic=True)
    back = oe.GenerateRequest.FromString(data)
    assert back == req
    assert back.SerializeToString(deterministic=True) == data
    # Presence survives the wire: explicit zero / false / empty are not "unset" [D2, G5].
    assert back.sampling.HasField("temperature") and back.sampling.temperature == 0.0
    assert not back.sampling.HasField("top_p")
    assert back.stopping.HasField("include_stop_in_output") and not back.stopping.include_stop_in_output
    assert back.kv.HasField("cache_salt") and not back.kv.HasField("bypass_prefix_cache")
    assert back.WhichOneof("input") == "token_ids"
    assert back.response.output_candidates.WhichOneof("selection") == "all"
    assert back.kv.session.attributes_struct["big"] == str(2**60)  # [K9]
    # Output index 0 is carried explicitly [G10].
    event = oe.GenerateResponse(request_id="req-1", token=oe.TokenOutput(output_index=0, text="hi"))
    assert oe.GenerateResponse.FromString(event.SerializeToString()).token.HasField("output_index")


def test_generate_rpc_over_loopback():
    """The generated stub and servicer agree on the method path and streaming shape."""
    grpc = pytest.importorskip("grpc")

    class Echo(oe.InferenceServicer):
        def Generate(self, request, context):
            for i in range(2):
                yield oe.GenerateResponse(request_id=request.request_id, token=oe.TokenOutput(output_index=i))

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    oe.add_InferenceServicer_to_server(Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            responses = list(
                oe.InferenceStub(channel).Generate(oe.GenerateRequest(request_id="r"), timeout=10)
            )
        assert [(r.request_id, r.token.output_index) for r in responses] == [("r", 0), ("r", 1)]
    finally:
        server.stop(grace=None)
