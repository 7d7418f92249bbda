"""A client generated from the published release reads every value right (D1, D8, H3, X3, X4).

Every call here goes through :class:`tests.release_client.ReleaseClient`, whose message
classes are built from the release's wire shape alone, against the shared real server. A
field number the release gives to nothing, or an enum value outside the release, shows up
as an unknown field or an unknown value and fails the test.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from refengine.protocol import oe
from refengine.server.errors import DRAINED, ERROR_CODES, STALLED_CONSUMER, engine_error
from refengine.server.health import LIFECYCLE_STATE
from refengine.types import EngineFault
from tests.integration.conftest import MODEL, SHARED_ALIAS
from tests.release_client import ReleaseClient, unknown_field_paths

BSR_COMMIT = "768a93c7b44e40f28c692ad0b471a8f2"


@pytest.fixture(scope="module")
def release(server_address: str) -> Iterator[ReleaseClient]:
    with ReleaseClient(server_address) as client:
        yield client


def _generate(release: ReleaseClient, request_id: str, model: str = "", **extra: object) -> list:
    request = release.message("GenerateRequest", request_id=request_id, prompt="The capital of France is",
                              model=model, sampling={"temperature": 0.0}, stopping={"max_tokens": 6})
    request.extra.update(extra)
    events = list(release.stream("Inference", "Generate", request))
    for event in events:
        assert unknown_field_paths(event) == []
    return events


def test_server_info_reads_as_the_release(release: ReleaseClient) -> None:
    info = release.unary("Control", "GetServerInfo", release.message("GetServerInfoRequest"))
    assert unknown_field_paths(info) == []
    assert info.schema_release == BSR_COMMIT  # D1: the BSR commit, never a tag
    assert (info.schema_revision, info.minimum_client_revision) == (1, 1)
    assert release.enum_name("EngineRole", info.engine_role) == "ENGINE_ROLE_AGGREGATED"
    assert info.kv_connector.HasField("enabled") and not info.kv_connector.enabled
    assert not info.kv_connector.HasField("schema_version")  # field 8 in the release; not reported


def test_model_names_and_aliases(release: ReleaseClient) -> None:
    """D8: the primary name and every alias are accepted by GetModelInfo and Generate."""
    info = release.unary("Control", "GetModelInfo", release.message("GetModelInfoRequest", model=MODEL))
    assert unknown_field_paths(info) == []
    assert info.served_model_name == MODEL and list(info.served_model_aliases) == [SHARED_ALIAS]
    assert info.model_id == MODEL  # the canonical source: the manifest name it was loaded from
    by_alias = release.unary("Control", "GetModelInfo", release.message("GetModelInfoRequest", model=SHARED_ALIAS))
    assert by_alias.served_model_name == MODEL
    tokens = {}
    for name in (MODEL, SHARED_ALIAS):
        events = _generate(release, f"release-model-{name}", model=name)
        tokens[name] = [t.token_id for e in events if e.WhichOneof("event") == "token" for t in e.token.tokens]
    assert tokens[MODEL] and tokens[MODEL] == tokens[SHARED_ALIAS]


def test_health_state_is_a_release_value(release: ReleaseClient) -> None:
    health = release.unary("Control", "Health", release.message("HealthRequest"))
    assert unknown_field_paths(health) == []
    assert release.enum_name("HealthState", health.state) == "HEALTH_STATE_READY"
    assert all(release.enum_name("HealthState", c.state) is not None for c in health.checks)


def test_every_lifecycle_maps_to_a_release_health_state(release: ReleaseClient) -> None:
    """H3: whatever the server's own lifecycle, the wire value exists in the release (draining
    included: NOT_READY = 4)."""
    names = {lifecycle.name: release.enum_name("HealthState", state) for lifecycle, state in LIFECYCLE_STATE.items()}
    assert names == {"STARTING": "HEALTH_STATE_STARTING", "READY": "HEALTH_STATE_READY",
                     "DRAINING": "HEALTH_STATE_NOT_READY", "NOT_READY": "HEALTH_STATE_NOT_READY"}


@pytest.mark.parametrize("fault", [*(EngineFault(code, "x", retryable=False) for code in ERROR_CODES),
                                   STALLED_CONSUMER, DRAINED], ids=lambda f: f.code + ("/r" if f.retryable else ""))
def test_every_engine_error_code_is_a_release_value(release: ReleaseClient, fault: EngineFault) -> None:
    """X3/X4: each EngineError the server can send decodes to a known release code; the drain
    cut-off is CANCELLED + retryable (the release has no DRAINING)."""
    decoded = release.message("EngineError")
    decoded.MergeFromString(engine_error(fault).SerializeToString())
    name = release.enum_name("ErrorCode", decoded.code)
    assert name is not None and name != "ERROR_CODE_UNSPECIFIED", decoded.code
    assert decoded.retryable == fault.retryable
    if fault is DRAINED:
        assert name == "ERROR_CODE_CANCELLED" and "drain" in decoded.message
    if fault.code == "internal":
        assert name == "ERROR_CODE_INTERNAL" and decoded.code == 11


def test_generate_reads_as_the_release(release: ReleaseClient) -> None:
    events = _generate(release, "release-generate")
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[-1] == "finished" and "token" in kinds
    reason = release.enum_name("FinishReason", events[-1].finished.reason)
    assert reason == "FINISH_REASON_LENGTH"
    assert events[-1].usage.completion_tokens == 6


def test_detokenize_false_sends_token_ids_only(release: ReleaseClient) -> None:
    """``extra["detokenize"] = false``: the same token ids, no text anywhere."""
    with_text = _generate(release, "release-detok-on")
    ids_only = _generate(release, "release-detok-off", detokenize=False)

    def token_ids(events: list) -> list[int]:
        return [t.token_id for e in events if e.WhichOneof("event") == "token" for t in e.token.tokens]

    assert token_ids(ids_only) == token_ids(with_text) and token_ids(with_text)
    assert "".join(e.token.text for e in with_text if e.WhichOneof("event") == "token")
    for event in ids_only:
        if event.WhichOneof("event") == "token":
            assert event.token.text == "" and all(t.token == "" for t in event.token.tokens)


def test_error_code_numbers_match_the_release() -> None:
    """The project's own bindings agree with the release on the numbers that moved."""
    release_client = ReleaseClient("127.0.0.1:1")  # never connects: only the descriptors are used
    try:
        assert release_client.enum_name("ErrorCode", oe.ERROR_CODE_INTERNAL) == "ERROR_CODE_INTERNAL"
        assert release_client.enum_name("HealthState", oe.HEALTH_STATE_NOT_READY) == "HEALTH_STATE_NOT_READY"
        assert release_client.enum_name("ErrorCode", 12) is None and release_client.enum_name("HealthState", 5) is None
    finally:
        release_client.channel.close()
