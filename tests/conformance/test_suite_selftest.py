"""The conformance suite checked against a toy server (fast, no model): it catches a server
that breaks a rule, and its parts (verifiers, D1's release check, the CLI, the encoder
profile's support) behave. The whole suite against the unbroken toy, and against one broken
toy per rule, is tests/conformance/test_negative_controls.py."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest

from refengine.conformance import Options, Result, Status, Target, run, run_check, select
from refengine.conformance.checks_errors import retryable_problem
from refengine.conformance.encoder_support import handle_problems, profile_problems, tampered
from refengine.conformance.guides import CASES
from refengine.conformance.json_prefix import json_prefix_problem
from refengine.conformance.registry import rule_key, rule_section
from refengine.conformance.release import RELEASE_BSR_COMMIT, RELEASE_GIT_COMMIT, schema_release_problem
from refengine.conformance.target import ConnectError
from refengine.protocol import oe
from refengine.protocol.v1alpha1 import media_pb2 as media
from tests.conformance import toy_engine
from tests.conformance.fake_server import Faults, serve
from tests.conformance.rule_ids import PROFILE_PAGES, profile_rules_in
from tests.conformance.test_conformance import REPO
from tests.conformance.test_negative_controls import GUIDED_CHECKS
from tests.refused_ports import refused_address


def test_guided_checks_skip_without_guided_decoding() -> None:
    """A server that does not support guided decoding: the guided checks skip, saying why,
    and D4 still checks that every mode is refused before acceptance."""
    server, address, engine = serve(Faults(guided=False))
    try:
        results = {r.name: r for r in run(address, ["D4", "G13", "G17", "G18", "L5", "L6", "X1"],
                                          Options(idle_timeout_s=1.0)) if "guided" in r.name}
    finally:
        server.stop(0)
        engine.running = False
    assert results["D4:caps_guided"].status is Status.PASS, results["D4:caps_guided"]
    assert results["D4:guided_backend_without_guide"].status is Status.PASS
    skipped = {n for n, r in results.items() if r.status is Status.NOT_CLAIMED and "not supported" in r.message}
    assert skipped == set(GUIDED_CHECKS) - {"D4:caps_guided", "D4:guided_backend_without_guide"}, results


@pytest.mark.parametrize(
    ("text", "ok"),
    [("", True), ('{"a": [1, -2.5e', True), ('{"a": "x\\u00', True), ('{"a": tr', True), ('{"a": {}} ', True),
     ("quick", False), ('{"a" 1', False), ('{"a": 01', False), ('{"a": nul,', False), ("{}}", False),
     ('{"a": "\\q"', False), ("[1]", False)],
)
def test_json_prefix(text: str, ok: bool) -> None:
    assert (json_prefix_problem(text, top="{") is None) is ok


def test_guide_verifiers() -> None:
    schema, obj = CASES[oe.GUIDED_DECODING_MODE_JSON_SCHEMA], CASES[oe.GUIDED_DECODING_MODE_JSON_OBJECT]
    assert schema.verify('{"answer": "yes"}', True) is None
    assert "schema" in schema.verify('{"answer": "maybe"}', True)
    assert schema.verify('{"answer": "ye', False) is None
    assert obj.verify("[1]", True) is not None and obj.verify('{"k": 1}', True) is None
    assert CASES[oe.GUIDED_DECODING_MODE_REGEX].verify("123", True) is None
    assert CASES[oe.GUIDED_DECODING_MODE_REGEX].verify("1234", True) is not None
    tag = CASES[oe.GUIDED_DECODING_MODE_STRUCTURAL_TAG]
    assert tag.verify("free text <oeconf-value>12</oeconf-value> more", True) is None
    assert tag.verify("<oeconf-value>twelve</oeconf-value>", True) is not None


@pytest.mark.parametrize(
    ("faults", "rules", "must_fail"),
    [
        (Faults(leak_stop=True), ["G14"], "G14:stop_string_held_back"),
        (Faults(usage_every_event=True), ["G16", "G13"], "G16:usage_accounting"),
        (Faults(ignore_disconnect=True), ["A5"], "A5:client_cancel"),
        (Faults(refuse_alias=True), ["D8"], "D8:model_aliases"),
        (Faults(ignore_media=True), ["G19"], "G19:media_refused_when_unsupported"),
        (Faults(ignore_media=True), ["G19"], "G19:media_source_required"),
        (Faults(ignore_media=True), ["D9"], "D9:multimodal_validated"),
        (Faults(load_defaults=True), ["H4"], "H4:load_presence"),
        (Faults(health_state=5), ["H3"], "H3:serving_state"),
        (Faults(health_state=5), ["X4"], "X4:release_enum_values"),
        (Faults(cancel_reason=4), ["A4", "X4"], "X4:release_enum_values"),
        (Faults(ignore_grammar=True), ["D4"], "D4:guided_modes_honoured"),
        (Faults(ignore_grammar=True), ["D4"], "D4:guided_backends_honoured"),
        (Faults(ignore_grammar=True), ["G13"], "G13:guided_finish_stop"),
        (Faults(accept_invalid_guide=True), ["X1"], "X1:guided_invalid_spec_refused"),
        (Faults(raw_guided_logprobs=True), ["L5"], "L5:guided_logprobs_finite"),
        (Faults(raw_guided_logprobs=True), ["L6"], "L6:guided_logprobs_after_mask"),
    ],
    ids=["stop-leak", "usage-everywhere", "ignores-disconnect", "alias-refused", "media-ignored",
         "source-less-media-ignored", "media-ignored-d9", "load-zero-defaults", "health-state-5-h3",
         "health-state-5-x4", "finish-reason-4", "grammar-ignored", "grammar-ignored-backends",
         "grammar-ignored-g13", "invalid-guide-accepted", "raw-guided-logprobs-l5", "raw-guided-logprobs-l6"],
)
def test_suite_catches_a_broken_server(faults: Faults, rules: list[str], must_fail: str) -> None:
    server, address, engine = serve(faults)
    try:
        results = run(address, rules, Options(idle_timeout_s=1.0))
    finally:
        server.stop(0)
        engine.running = False
    by_name = {r.name: r for r in results}
    assert by_name[must_fail].status is Status.FAIL, by_name[must_fail]


@pytest.mark.parametrize("name", ["A5:client_cancel", "A5:client_disconnect"])
def test_a5_fails_a_server_that_runs_a_cancelled_request_to_its_end(name: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """With the default idle timeout (20 s) the toy ignoring disconnects is idle again once its
    864-token request ends (4.3 s at 200 tokens/s): the check must still see that the work was not
    aborted."""
    monkeypatch.setattr(toy_engine, "STEP_S", 0.01)
    (chk,) = [c for c in select() if c.name == name]
    server, address, engine = serve(Faults(ignore_disconnect=True))
    try:
        with Target(address, Options()) as target:
            result = run_check(chk, target)
    finally:
        server.stop(0)
        engine.running = False
    assert result.status is Status.FAIL and "the engine work went on" in result.message, result


def _run_d1(schema_release: str) -> Result:
    server, address, engine = serve(Faults(schema_release=schema_release))
    try:
        (result,) = run(address, ["D1"])
    finally:
        server.stop(0)
        engine.running = False
    return result


@pytest.mark.parametrize(
    ("schema_release", "expected"),
    [
        (RELEASE_BSR_COMMIT, Status.PASS),
        (RELEASE_GIT_COMMIT, Status.PASS),  # an unpublished build may name its Git commit
        ("v0.1.0", Status.FAIL),
        ("main", Status.FAIL),
        ("buf.build/openengine/openengine:v0.1.0", Status.FAIL),
        ("4def7c5", Status.FAIL),
    ],
    ids=["bsr-commit", "git-commit", "tag", "branch", "bsr-label", "short-sha"],
)
def test_d1_schema_release(schema_release: str, expected: Status) -> None:
    result = _run_d1(schema_release)
    assert result.status is expected, result


@pytest.mark.parametrize(
    ("release", "words"),
    [
        ("v0.1.0", "is a tag"),
        ("main", "is a branch name"),
        ("refs/heads/release-0.1", "is a branch name"),
        ("buf.build/openengine/openengine:v0.1.0", "BSR label"),
        ("", "is empty"),
        ("4def7c5", "not a full commit id"),
        ("0" * 32, "not the one of v0.1.0"),
        (RELEASE_GIT_COMMIT.upper(), "upper-case"),
    ],
)
def test_schema_release_messages(release: str, words: str) -> None:
    problem = schema_release_problem(release)
    assert problem is not None and words in problem, problem
    assert RELEASE_BSR_COMMIT in problem  # every refusal says what is expected instead


@pytest.mark.parametrize(
    ("err", "words"),
    [
        (oe.EngineError(code=oe.ERROR_CODE_OVERLOADED, retryable=False), "retryable = false"),
        (oe.EngineError(code=oe.ERROR_CODE_INVALID_ARGUMENT, retryable=True), "retryable = true"),
        (oe.EngineError(code=oe.ERROR_CODE_CANCELLED, message="server draining", retryable=False), "drain cut-off"),
        (oe.EngineError(code=oe.ERROR_CODE_INTERNAL, message="draining", retryable=True), "pre-release"),
        (oe.EngineError(code=12, message="boom"), "pre-release INTERNAL"),
    ],
    ids=["overloaded-not-retryable", "invalid-retryable", "drain-not-retryable", "drain-as-internal", "code-12"],
)
def test_retryable_problems(err: object, words: str) -> None:
    problem = retryable_problem(err)
    assert problem is not None and words in problem, problem


@pytest.mark.parametrize(
    "err",
    [
        oe.EngineError(code=oe.ERROR_CODE_CANCELLED, message="cut off by the server drain", retryable=True),
        oe.EngineError(code=oe.ERROR_CODE_CANCELLED, message="aborted by an operator", retryable=False),
        oe.EngineError(code=oe.ERROR_CODE_KV_TRANSFER_FAILED, retryable=True),
        oe.EngineError(code=oe.ERROR_CODE_KV_TRANSFER_FAILED, message="session released", retryable=False),
        oe.EngineError(code=oe.ERROR_CODE_INTERNAL, message="engine fault", retryable=False),
        oe.EngineError(code=oe.ERROR_CODE_INTERNAL, message="worker crashed while draining its output queue"),
        oe.EngineError(code=oe.ERROR_CODE_CANCELLED, message="cancelled: the drainage pump stopped"),
    ],
    ids=["drain-cancelled-retryable", "operator-cancel", "kv-transfer", "kv-transfer-session-gone", "internal",
         "internal-naming-a-drain", "word-containing-drain"],
)
def test_retryable_fine(err: object) -> None:
    assert retryable_problem(err) is None


def test_cli_matrix_json_and_exit_code(toy_address: str, tmp_path) -> None:  # noqa: ANN001
    out = tmp_path / "matrix.json"
    proc = subprocess.run([sys.executable, "-m", "refengine.conformance", toy_address, "--rules", "D1,G1,A",
                           "--json", str(out), "--format", "markdown", "--quiet"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| D1 | pass |" in proc.stdout and "| A5 | pass |" in proc.stdout
    data = json.loads(out.read_text())
    assert {r["rule"] for r in data["results"]} == {"D1", "G1", "A1", "A2", "A3", "A4", "A5"}
    assert all(r["status"] == "pass" and r["evidence"] == [] for r in data["results"])


def test_cli_exits_nonzero_on_failure(tmp_path) -> None:  # noqa: ANN001
    server, address, engine = serve(Faults(leak_stop=True))
    try:
        proc = subprocess.run([sys.executable, "-m", "refengine.cli", "conformance", "--target", address,
                               "--rules", "G14", "--quiet"], cwd=REPO, capture_output=True, text=True, timeout=120)
    finally:
        server.stop(0)
        engine.running = False
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "[fail] profile core" in proc.stdout and "fail        G14:stop_string_held_back" in proc.stdout
    assert "evidence: {\"rpc\": \"Generate\"" in proc.stdout, proc.stdout  # what was sent, what came back


def test_registry_selection() -> None:
    assert {c.section for c in select(["L"])} == {"L"}
    assert {c.rule for c in select(["G14", "A1"])} == {"G14", "A1"}
    with pytest.raises(ValueError):
        select(["Z9"])
    with pytest.raises(ValueError):
        rule_section("G")


# -- draft profile "encoder" (section ENC, docs/profiles/encoder.md) -----------------------------
ENC_CHECKS = select(["ENC"])


def test_enc_checks_are_registered_for_the_profile_page() -> None:
    page = (REPO / PROFILE_PAGES["ENC"]).read_text()
    defined = profile_rules_in(page, "ENC")
    assert defined == [f"ENC{i}" for i in range(1, 16)], defined
    assert ENC_CHECKS and {c.section for c in ENC_CHECKS} == {"ENC"}
    assert {c.rule for c in ENC_CHECKS} <= set(defined)
    assert {c.rule for c in ENC_CHECKS} >= {"ENC1", "ENC2", "ENC3", "ENC4", "ENC5", "ENC6", "ENC7", "ENC10",
                                            "ENC11", "ENC13", "ENC15"}
    assert rule_section("ENC13") == "ENC" and rule_key("ENC2") < rule_key("ENC10")
    assert all(rule_key("X4") < rule_key(c.rule) for c in ENC_CHECKS)  # after RULES.md's sections
    assert [c.name for c in select(["ENC11"])] == ["ENC11:incompatible_handle_refused"]
    assert not {c.section for c in select(["E"])} & {"ENC"}


def test_enc_checks_skip_as_not_claimed(toy_address: str) -> None:
    """Against servers that do not list the profile (the toy server as target and as --encoder),
    every ENC check skips as "not claimed"; without --encoder the reason says how to name one."""
    other, other_address, other_engine = serve()
    try:
        for options in (Options(), Options(encoder_address=other_address, media_placeholder_token_id=5),
                        Options(encoder_address=toy_address)):
            results = run(toy_address, ["ENC"], options)
            assert [r.name for r in results] == [c.name for c in ENC_CHECKS]
            wrong = [f"{r.name}: {r.status.value} {r.message}" for r in results
                     if r.status is not Status.NOT_CLAIMED or "not claimed" not in r.message]
            assert not wrong, (options, wrong)
            hint = options.encoder_address or "--encoder HOST:PORT"  # the --encoder server, or how to name one
            assert hint in results[0].message, results[0].message
    finally:
        other.stop(0)
        other_engine.running = False


def test_a_run_closes_every_channel_it_opens(toy_address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The --encoder server's channel too, reachable or not. One left open kept reconnecting to a
    fault proxy after it stopped; the next proxy, given the same port, then could not be reached
    within the connect timeout (a flaky ENC4 control in tests/integration/test_encoder_conformance.py)."""
    real_channel = grpc.insecure_channel
    opened: list[str] = []
    closed: list[str] = []

    def tracked(address: str, options: object = None) -> grpc.Channel:
        channel = real_channel(address, options=options)
        opened.append(address)
        real_close = channel.close

        def close() -> None:
            closed.append(address)
            real_close()

        channel.close = close
        return channel

    monkeypatch.setattr(grpc, "insecure_channel", tracked)
    other, other_address, other_engine = serve()
    try:
        run(toy_address, ["ENC1", "ENC4"], Options(encoder_address=other_address, rpc_timeout_s=2.0))
        with refused_address() as unreachable, pytest.raises(ConnectError, match="--encoder"):  # before any check
            run(toy_address, ["ENC1", "ENC4"], Options(encoder_address=unreachable, rpc_timeout_s=2.0))
    finally:
        other.stop(0)
        other_engine.running = False
    assert other_address in opened and len(opened) >= 4
    assert sorted(closed) == sorted(opened)


def test_an_unreachable_encoder_is_a_connect_error_before_any_check(toy_address: str) -> None:
    with refused_address() as unreachable, pytest.raises(ConnectError, match="--encoder: cannot connect"):
        run(toy_address, ["ENC1", "ENC4"], Options(encoder_address=unreachable, rpc_timeout_s=0.5))


def test_cli_encoder_flag(toy_address: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "refengine.conformance", toy_address, "--rules", "ENC",
                           "--encoder", toy_address, "--media-placeholder-token-id", "7", "--quiet"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ENC1:profile_listed" in proc.stdout and "not claimed" in proc.stdout
    assert f"0 fail, {len(ENC_CHECKS)} not claimed" in proc.stdout, proc.stdout


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ({"name": "encoder"}, "not a list"),
        (["encoder"], "not an object"),
        ([{"name": "encoder", "version": "v1alpha1", "status": "draft", "sides": "encoder"}], "sides"),
        ([{"name": "encoder", "version": 1, "status": "draft", "sides": ["encoder"]}], "version"),
        ([{"name": "encoder", "version": "v1alpha1", "sides": ["encoder"]}], "status"),
        ([{"name": "encoder", "version": "v1alpha1", "status": "stable", "sides": ["encoder"]}], "not 'draft'"),
        ([{"name": "encoder", "version": "v1alpha1", "status": "draft", "sides": ["producer"]}], "each is one of"),
        ([{"name": "encoder", "version": "v1alpha1", "status": "draft", "sides": []}], "at least one"),
        ([{"name": "encoder", "version": "v1alpha1", "status": "draft", "sides": ["encoder", "consumer"]}],
         "both sides"),
        ([{"name": "encoder", "version": "v1alpha1", "status": "draft", "sides": ["consumer"]}] * 2, "twice"),
    ],
    ids=["not-a-list", "entry-not-object", "sides-string", "version-number", "no-status", "not-draft",
         "unknown-side", "no-side", "both-sides", "twice"],
)
def test_enc1_profile_problems(value: object, words: str) -> None:
    problems = profile_problems(value)
    assert any(words in p for p in problems), problems


def test_enc1_profile_fine() -> None:
    assert profile_problems([]) == []
    assert profile_problems([{"name": "encoder", "version": "v1alpha1", "status": "draft", "sides": ["consumer"]},
                             {"name": "other", "version": "v9", "status": "experimental", "sides": []}]) == []


def _good_handle() -> media.EmbeddingHandle:
    return media.EmbeddingHandle(
        handle_id="h-1", mm_hash="ab" * 32, mm_hash_algorithm="refengine-rgb8-sha256", modality=oe.MODALITY_IMAGE,
        shape=[16, 64], dtype="float32", num_tokens=16, layout="refengine-embeddings/1:row-major:64:float32",
        fingerprint="cd" * 32, lease_expires_unix_nanos=2_000,
        transfers=[media.EmbeddingTransfer(backend="grpc", endpoints=[oe.KvEndpoint(host="10.0.0.1", port=5000)])])


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"handle_id": ""}, "handle_id"),
        ({"mm_hash_algorithm": "md5"}, "mm_hash_algorithm"),
        ({"mm_hash": "xyz"}, "64 lowercase hex"),
        ({"num_tokens": 15}, "num_tokens"),
        ({"dtype": "int8"}, "dtype"),
        ({"layout": "rows"}, "layout"),
        ({"fingerprint": ""}, "fingerprint"),
        ({"lease_expires_unix_nanos": 1_000}, "not in the future"),
        ({"modality": oe.MODALITY_AUDIO}, "modality"),
    ],
)
def test_enc5_handle_problems(fields: dict, words: str) -> None:
    assert handle_problems(_good_handle(), 1_500) == []
    assert any(words in p for p in handle_problems(tampered(_good_handle(), **fields), 1_500))
    no_route = tampered(_good_handle(), transfers=[media.EmbeddingTransfer(
        backend="grpc", endpoints=[oe.KvEndpoint(host="0.0.0.0", port=5000)])])
    assert any("routable" in p for p in handle_problems(no_route, 1_500))
