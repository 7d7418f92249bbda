"""``refengine generate``: every flag reaches the request, on both paths.

The remote path runs ``main`` in this process against recording fake servers (a few
gRPC services on 127.0.0.1 that keep each request and its metadata and answer a tiny
valid stream). ``test_every_flag_has_a_case`` derives the flags from the parser, so a new
flag without a case fails. The in-process path is checked without an engine (loading the
embedded model is slow): the flag → ``GenerationRequest`` mapping directly, and its
agreement with the wire request as the server reads it back (``to_engine_request``).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from refengine.args import add_engine_args
from refengine.cli import build_parser, main
from refengine.commands.generate_options import options_from_args
from refengine.commands.generate_output import JsonPrinter, TextPrinter
from refengine.commands.generate_request import PRIORITY_KEY, engine_request, wire_metadata, wire_request
from refengine.protocol import oe
from refengine.protocol.v1alpha1 import media_pb2 as media
from refengine.protocol.v1alpha1 import media_pb2_grpc as media_grpc
from refengine.server.convert import to_engine_request
from refengine.server.metadata import read_inference_metadata
from refengine.types import (
    CandidateSpec,
    FinishInfo,
    FinishReason,
    GenerationRequest,
    GuidedSpec,
    MediaInput,
    RequestOutput,
    SamplingParams,
    SequenceDelta,
    StoppingParams,
    TokenInfo,
    Usage,
)

IMAGE = b"\x89PNG not really an image"
REFUSE, FAIL = "refuse me", "fail me"  # prompts the recording server refuses / fails after acceptance
CUT, ODD_CODE = "cut me", "odd code"  # it ends the stream without Finished / fails with an unnamed code
BREAK = "break me"  # one TokenOutput, then the call fails with UNAVAILABLE (the server went away)
HANDLES_KEY = "refengine.v1alpha1.media_handles"


class Recorder(oe.InferenceServicer, oe.ControlServicer):
    """Keeps every request and its metadata; answers a minimal stream per output (G10-G16):
    a ``TokenOutput`` ("ok" for output 0, "ok<i>" else), then a ``GenerationFinished`` LENGTH,
    usage on the last. ``prefill``: answers ``PrefillReady`` instead (K4)."""

    def __init__(self, prefill: bool = False) -> None:
        self.prefill = prefill
        self.requests: list[oe.GenerateRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.aborted_sessions: list[str] = []

    def Generate(self, request: oe.GenerateRequest, context: grpc.ServicerContext) -> Iterator[Any]:  # noqa: N802
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        rid, usage = request.request_id, oe.Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2)
        if request.prompt == REFUSE:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "refused on purpose")
        if self.prefill:
            session = oe.KvSessionRef(session_id="s1", transfer_backend="grpc")
            yield oe.GenerateResponse(request_id=rid, prefill_ready=oe.PrefillReady(kv_session=session), usage=usage)
            return
        count = request.sampling.num_sequences or 1
        for index in range(count):
            yield oe.GenerateResponse(request_id=rid, token=oe.TokenOutput(
                output_index=index, text="ok" if index == 0 else f"ok{index}", tokens=_tokens(request)))
        if request.prompt in (FAIL, ODD_CODE):
            code = oe.ERROR_CODE_INTERNAL if request.prompt == FAIL else 999  # X4: a code from a newer release
            yield oe.GenerateResponse(request_id=rid, error=oe.EngineError(code=code, message="failed on purpose"))
            return
        if request.prompt == CUT:
            return
        if request.prompt == BREAK:
            context.abort(grpc.StatusCode.UNAVAILABLE, "server going away")
        for index in range(count):
            yield oe.GenerateResponse(
                request_id=rid, finished=oe.GenerationFinished(output_index=index, reason=oe.FINISH_REASON_LENGTH),
                usage=usage if index == count - 1 else None)

    def GetServerInfo(self, request: Any, context: grpc.ServicerContext) -> oe.ServerInfo:  # noqa: N802
        return oe.ServerInfo(supported_models=["toy"])

    def Health(self, request: Any, context: grpc.ServicerContext) -> oe.HealthResponse:  # noqa: N802
        return oe.HealthResponse(state=77)  # a state from a newer release (X4)

    def Abort(self, request: oe.AbortRequest, context: grpc.ServicerContext) -> oe.AbortResponse:  # noqa: N802
        self.aborted_sessions.append(request.kv_session.session_id)
        return oe.AbortResponse(status=oe.ABORT_STATUS_ABORTED)


def _tokens(request: oe.GenerateRequest) -> list[oe.TokenInfo]:
    if not request.response.return_output_logprobs:
        return []
    candidates = [oe.LogProb(token_id=2, token="no", logprob=-1.5, rank=2)]
    return [oe.TokenInfo(token_id=1, token="ok", logprob=-0.5, rank=1, candidates=candidates)]


class MediaRecorder(media_grpc.MediaServicer):
    """An encoder (draft profile ``encoder``): one handle per item, releases recorded."""

    def __init__(self) -> None:
        self.encoded: list[media.EncodeRequest] = []
        self.released: list[str] = []

    def Encode(self, request: media.EncodeRequest, context: grpc.ServicerContext) -> Any:  # noqa: N802
        self.encoded.append(request)
        return media.EncodeResponse(handles=[media.EmbeddingHandle(handle_id=f"h{i}", num_tokens=1)
                                             for i in range(len(request.items))])

    def Release(self, request: media.ReleaseRequest, context: grpc.ServicerContext) -> Any:  # noqa: N802
        self.released.extend(request.handle_ids)
        return media.ReleaseResponse(released=len(request.handle_ids))


@dataclass
class Servers:
    remote: Recorder
    prefill: Recorder
    encoder: MediaRecorder
    addresses: dict[str, str]  # placeholder -> replacement in a case's flags


@pytest.fixture(scope="module")
def module_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    remote, prefill, encoder = Recorder(), Recorder(prefill=True), MediaRecorder()
    started, addresses = [], {}
    for name, servicers in (("@remote", (remote, encoder)), ("@prefill", (prefill,))):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        for servicer in servicers:
            if isinstance(servicer, Recorder):
                oe.add_InferenceServicer_to_server(servicer, server)
                oe.add_ControlServicer_to_server(servicer, server)
            else:
                media_grpc.add_MediaServicer_to_server(servicer, server)
        addresses[name] = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        server.start()
        started.append(server)
    files = tmp_path_factory.mktemp("generate")
    (files / "image.png").write_bytes(IMAGE)
    (files / "g.gbnf").write_text('root ::= "ok"\n')
    addresses.update({"@image": str(files / "image.png"), "@grammar": str(files / "g.gbnf")})
    yield Servers(remote, prefill, encoder, addresses)
    for server in started:
        server.stop(0)


@pytest.fixture
def servers(module_servers: Servers) -> Servers:
    for recorder in (module_servers.remote, module_servers.prefill):
        recorder.requests.clear()
        recorder.metadata.clear()
        recorder.aborted_sessions.clear()
    module_servers.encoder.encoded.clear()
    module_servers.encoder.released.clear()
    return module_servers


@dataclass
class Sent:
    """What one ``generate`` run sent to the server that generated, and printed."""

    request: oe.GenerateRequest
    metadata: dict[str, str]
    servers: Servers
    out: str
    err: str


@dataclass(frozen=True)
class Case:
    id: str
    flags: tuple[str, ...]
    check: Callable[[Sent], bool]


def _fields(message: Any) -> set[str]:
    return {field.name for field, _ in message.ListFields()}


def _defaults_leave_fields_unset(s: Sent) -> bool:
    r = s.request
    return (_fields(r) == {"request_id", "prompt", "sampling", "stopping"} and r.prompt == "hi"
            and _fields(r.sampling) == {"temperature"} and r.sampling.temperature == 0.0
            and _fields(r.stopping) == {"max_tokens"} and r.stopping.max_tokens == 128
            and PRIORITY_KEY not in s.metadata and s.out == "ok\n")


def _json_events(s: Sent) -> bool:
    events = [json.loads(line) for line in s.out.splitlines()]
    return ([sorted(set(e) - {"requestId", "usage"}) for e in events] == [["token"], ["finished"]]
            and all(e["requestId"] == s.request.request_id for e in events)
            and events[0]["token"] == {"outputIndex": 0, "text": "ok"}
            and events[1]["finished"]["reason"] == "FINISH_REASON_LENGTH" and events[1]["usage"]["totalTokens"] == 2)


def _disaggregated(s: Sent) -> bool:
    (first,) = s.servers.prefill.requests
    return (not first.kv.HasField("session") and s.request.kv.session.session_id == "s1"
            and s.request.request_id == first.request_id and s.out == "ok\n")


def _encoded(s: Sent) -> bool:
    (encode,) = s.servers.encoder.encoded
    return (encode.items[0].raw_bytes == IMAGE and not s.request.media and HANDLES_KEY in s.request.extra.fields
            and s.servers.encoder.released == ["h0"])


def _conditions(s: Sent) -> list[tuple[str, Any]]:
    return [(c.WhichOneof("condition"), getattr(c, c.WhichOneof("condition"))) for c in s.request.stopping.conditions]


CASES = [
    Case("defaults", (), _defaults_leave_fields_unset),
    Case("model-name", ("--model-name", "m1"), lambda s: s.request.model == "m1"),
    Case("chat", ("--chat",), lambda s: s.request.prompt == "<chat toy>hi"),  # the model named by GetServerInfo
    Case("chat-model", ("--chat", "--model-name", "m2"), lambda s: s.request.prompt == "<chat m2>hi"),
    Case("json", ("--json",), _json_events),
    Case("temperature", ("--temperature", "0.5"), lambda s: s.request.sampling.temperature == 0.5),
    Case("top-p", ("--top-p", "0.9"), lambda s: s.request.sampling.top_p == 0.9),
    Case("top-k", ("--top-k", "-1"), lambda s: s.request.sampling.top_k == -1),
    Case("top-k-0", ("--top-k", "0"), lambda s: s.request.sampling.HasField("top_k")),  # set, though 0
    Case("min-p", ("--min-p", "0.05"), lambda s: s.request.sampling.min_p == 0.05),
    Case("presence-penalty", ("--presence-penalty", "0.5"), lambda s: s.request.sampling.presence_penalty == 0.5),
    Case("frequency-penalty", ("--frequency-penalty", "-0.25"),
         lambda s: s.request.sampling.frequency_penalty == -0.25),
    Case("repetition-penalty", ("--repetition-penalty", "1.1"),
         lambda s: s.request.sampling.repetition_penalty == 1.1),
    Case("seed", ("--seed", str((1 << 64) - 1)), lambda s: s.request.sampling.seed == (1 << 64) - 1),
    Case("seed-0", ("--seed", "0"), lambda s: s.request.sampling.HasField("seed")),
    Case("sampling-seed", ("--sampling-seed", "9"),
         lambda s: s.request.sampling.seed == 9 and "--sampling-seed is deprecated; use --seed" in s.err),
    Case("num-sequences", ("--num-sequences", "2"),
         lambda s: s.request.sampling.num_sequences == 2 and s.out == "[0] ok\n[1] ok1\n"),
    Case("max-tokens", ("--max-tokens", "5"), lambda s: s.request.stopping.max_tokens == 5),
    Case("min-tokens", ("--min-tokens", "3"), lambda s: s.request.stopping.min_tokens == 3),
    Case("min-tokens-0", ("--min-tokens", "0"), lambda s: s.request.stopping.HasField("min_tokens")),
    Case("stop", ("--stop", "a", "--stop", "b c"), lambda s: _conditions(s) == [("stop_text", "a"),
                                                                                  ("stop_text", "b c")]),
    Case("stop-token-id", ("--stop-token-id", "3", "--stop-token-id", "0"),
         lambda s: _conditions(s) == [("stop_token_id", 3), ("stop_token_id", 0)]),
    Case("ignore-eos", ("--ignore-eos",), lambda s: s.request.stopping.ignore_eos),
    Case("include-stop", ("--include-stop",), lambda s: s.request.stopping.include_stop_in_output),
    Case("logprobs", ("--logprobs", "3"),
         lambda s: s.request.response.return_output_logprobs and s.request.response.output_candidates.top_n == 3
         and "output 0 logprobs:" in s.err and "'ok'" in s.err and "-0.5000" in s.err and "'no' -1.500" in s.err),
    Case("logprobs-0", ("--logprobs", "0"), lambda s: _fields(s.request.response) == {"return_output_logprobs"}),
    Case("prompt-logprobs", ("--prompt-logprobs", "2"),
         lambda s: s.request.response.return_prompt_logprobs and s.request.response.prompt_candidates.top_n == 2),
    Case("prompt-logprob-start", ("--prompt-logprobs", "0", "--prompt-logprob-start", "1"),
         lambda s: _fields(s.request.response) == {"return_prompt_logprobs", "prompt_logprob_start"}
         and s.request.response.prompt_logprob_start == 1),
    Case("priority", ("--priority", "-3"), lambda s: s.metadata[PRIORITY_KEY] == "-3"),
    Case("cache-salt", ("--cache-salt", "tenant-a"), lambda s: s.request.kv.cache_salt == "tenant-a"),
    Case("no-prefix-cache", ("--no-prefix-cache",), lambda s: _fields(s.request.kv) == {"bypass_prefix_cache"}),
    Case("lora-name", ("--lora-name", "adapter"), lambda s: s.request.lora_name == "adapter"),
    Case("image", ("--image", "@image", "--image", "@image"),
         lambda s: [(m.modality, m.raw_bytes) for m in s.request.media] == [(oe.MODALITY_IMAGE, IMAGE)] * 2),
    Case("json-schema", ("--json-schema", '{"type": "string"}'),
         lambda s: s.request.guided.json_schema == '{"type": "string"}'),
    Case("regex", ("--regex", "[0-9]+"), lambda s: _fields(s.request.guided) == {"regex"}),
    Case("choice", ("--choice", "yes", "--choice", "no"), lambda s: list(s.request.guided.choice.choices) == ["yes",
                                                                                                            "no"]),
    Case("grammar", ("--grammar", "@grammar"), lambda s: s.request.guided.ebnf_grammar == 'root ::= "ok"\n'),
    Case("guided-backend", ("--regex", "a", "--guided-backend", "llguidance"),
         lambda s: s.request.guided.backend == "llguidance"),
    Case("remote", ("--remote", "@remote"), lambda s: s.out == "ok\n"),
    Case("prefill-decode", ("--prefill", "@prefill", "--decode", "@remote"), _disaggregated),
    Case("encoder", ("--encoder", "@remote", "--remote", "@remote", "--image", "@image"), _encoded),
]

#: Flags of ``generate`` that no case sets, and why.
NOT_REQUEST_FLAGS = {"-h": "argparse's help", "--help": "argparse's help"}


def _fake_chat(model: str, message: str) -> str:
    return f"<chat {model}>{message}"


def _argv(servers: Servers, flags: tuple[str, ...]) -> list[str]:
    argv = [servers.addresses.get(flag, flag) for flag in flags]
    route = [] if {"--remote", "--prefill"} & set(flags) else ["--remote", servers.addresses["@remote"]]
    return ["generate", "hi", *route, *argv]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_flag_reaches_the_request(case: Case, servers: Servers, capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # --chat applies the model's template here, from a tokenizer this machine would load: a fake one
    monkeypatch.setattr("refengine.model.chat.chat_prompt", _fake_chat)
    code = main(_argv(servers, case.flags))
    out = capsys.readouterr()
    assert code == 0, out.err
    (request,) = servers.remote.requests
    sent = Sent(request, servers.remote.metadata[-1], servers, out.out, out.err)
    assert case.check(sent), f"{case.flags} sent:\n{request}\nmetadata {sent.metadata}\nout {out.out!r}\nerr {out.err}"


def _generate_parser() -> argparse.ArgumentParser:
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices["generate"]


def test_every_flag_has_a_case() -> None:
    engine = argparse.ArgumentParser(add_help=False)
    add_engine_args(engine)
    # the in-process engine's flags configure no request; generate's --seed replaces the engine's
    engine_flags = {flag for action in engine._actions for flag in action.option_strings} - {"--seed"}
    flags = {flag for action in _generate_parser()._actions for flag in action.option_strings}
    covered = {flag for case in CASES for flag in case.flags if flag.startswith("--")}
    assert covered == flags - engine_flags - set(NOT_REQUEST_FLAGS)
    seed = next(a for a in _generate_parser()._actions if "--seed" in a.option_strings)
    assert seed.dest == "sampling_seed" and "per-request" in seed.help


def test_every_flag_has_help_with_its_default() -> None:
    for action in _generate_parser()._actions:
        if action.option_strings and action.help != argparse.SUPPRESS and "-h" not in action.option_strings:
            assert action.help, action.option_strings
    text = " ".join(_generate_parser().format_help().split())
    for words in ("--temperature T 0 = greedy (default: 0.0)", "--max-tokens N most tokens per output (default: 128)",
                  "--top-p P", "(default: unset = 1.0, off)", "--seed SEED"):
        assert words in text, words
    assert "--sampling-seed" not in text  # the deprecated alias is hidden


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--min-tokens", "9", "--max-tokens", "4"], "--min-tokens 9 is above --max-tokens 4"),
        (["--prompt-logprob-start", "2"], "--prompt-logprob-start needs --prompt-logprobs"),
        (["--image", "/nonexistent/x.png"], "--image '/nonexistent/x.png': cannot read the file"),
        (["--regex", "a", "--choice", "b"], "at most one of"),
        (["--json-schema", "LATIN1"], "latin1.txt': not UTF-8 text (byte 14 of the file)"),  # a traceback
        (["--grammar", "LATIN1"], "latin1.txt': not UTF-8 text (byte 14 of the file)"),
    ],
    ids=["min-above-max", "start-alone", "image-missing", "two-guides", "schema-not-utf8", "grammar-not-utf8"],
)
def test_usage_errors(flags: list[str], words: str, servers: Servers, capsys: pytest.CaptureFixture[str],
                     tmp_path: Path) -> None:
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes('{"title": "caf\u00e9"}'.encode("latin-1"))
    flags = [str(latin1) if flag == "LATIN1" else flag for flag in flags]
    assert main(_argv(servers, tuple(flags))) == 2
    err = capsys.readouterr().err
    assert err.startswith("refengine generate: error: ") and words in err and "Traceback" not in err, err
    assert not servers.remote.requests


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--num-sequences", "0"], "argument --num-sequences: must be in [1, 4294967295], got 0"),
        (["--seed", "-1"], "argument --seed: must be in [0, 18446744073709551615], got -1"),
        (["--priority", str(1 << 31)], "argument --priority: must be in [-2147483648, 2147483647]"),
        (["--logprobs", "x"], "argument --logprobs: invalid integer value: 'x'"),
        (["--top-p", "x"], "argument --top-p: invalid float value: 'x'"),
    ],
    ids=["num-sequences-0", "seed-negative", "priority-int32", "logprobs-not-int", "top-p-not-float"],
)
def test_bad_values_exit_2(flags: list[str], words: str, servers: Servers, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(_argv(servers, tuple(flags)))
    assert exit_info.value.code == 2
    assert words in capsys.readouterr().err
    assert not servers.remote.requests


def test_route_errors(servers: Servers, capsys: pytest.CaptureFixture[str]) -> None:
    address = servers.addresses["@remote"]
    assert main(["generate", "hi", "--prefill", address]) == 2
    assert "--prefill and --decode go together" in capsys.readouterr().err
    assert main(["generate", "hi", "--encoder", address]) == 2
    assert "--encoder needs --remote" in capsys.readouterr().err
    assert not servers.remote.requests


def test_server_refusal_and_failure_exit_1(servers: Servers, capsys: pytest.CaptureFixture[str]) -> None:
    remote = servers.addresses["@remote"]
    assert main(["generate", REFUSE, "--remote", remote]) == 1
    assert "refengine generate: INVALID_ARGUMENT: refused on purpose" in capsys.readouterr().err
    assert main(["generate", FAIL, "--remote", remote, "--json"]) == 1
    out = capsys.readouterr()
    assert "refengine generate: ERROR_CODE_INTERNAL: failed on purpose" in out.err
    assert json.loads(out.out.splitlines()[-1])["error"]["message"] == "failed on purpose"  # printed first


def test_a_prefill_server_named_by_remote_exit_1_and_its_session_is_released(
        servers: Servers, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by review: --remote naming a prefill server said only "the stream ended before
    output(s) [0] finished", and its KV session stayed held until its lease ended."""
    prefill = servers.addresses["@prefill"]
    assert main(["generate", "hi", "--remote", prefill]) == 1
    assert f"is a prefill server (it answered PrefillReady, K4): use --prefill {prefill}" in capsys.readouterr().err
    assert servers.prefill.aborted_sessions == ["s1"]


def test_an_unnamed_error_code_and_a_cut_stream_exit_1(servers: Servers, capsys: pytest.CaptureFixture[str]) -> None:
    """X4: an ErrorCode this release does not name is printed by number (it raised ValueError);
    a stream that ends before its outputs finished is a failure, not a success."""
    remote = servers.addresses["@remote"]
    assert main(["generate", ODD_CODE, "--remote", remote]) == 1
    assert "refengine generate: ErrorCode(999): failed on purpose" in capsys.readouterr().err
    assert main(["generate", ODD_CODE, "--remote", remote, "--json"]) == 1  # every JSON line is whole: no blank one
    assert capsys.readouterr().err.startswith("refengine generate: ErrorCode(999): failed on purpose")
    assert main(["generate", CUT, "--remote", remote, "--num-sequences", "2"]) == 1
    assert "the stream ended before output(s) [0, 1] finished" in capsys.readouterr().err


def test_a_broken_stream_s_message_starts_its_own_line(servers: Servers, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by review: after streamed text the status message was glued to it ("okrefengine
    generate: ..."); a request refused before any output left a dangling "[0] " label."""
    remote = servers.addresses["@remote"]
    assert main(["generate", BREAK, "--remote", remote]) == 1
    out = capsys.readouterr()
    assert out.out == "ok" and out.err == "\nrefengine generate: UNAVAILABLE: server going away\n"
    assert main(["generate", REFUSE, "--remote", remote, "--num-sequences", "2"]) == 1
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("refengine generate: INVALID_ARGUMENT")
    assert main(["generate", "fine", "--remote", remote, "--num-sequences", "2"]) == 0
    assert capsys.readouterr().out == "[0] ok\n[1] ok1\n"


def test_the_client_names_a_health_state_it_does_not_know(servers: Servers) -> None:
    from refengine.client import OpenEngineClient

    with OpenEngineClient(servers.addresses["@remote"]) as client:
        with pytest.raises(TimeoutError, match=r"HealthState\(77\)"):
            client.wait_until_ready(timeout=0.3, poll=0.05)


def test_an_unservable_model_in_process_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A --model that does not resolve or cannot be served is a one-line usage error, not a traceback."""
    assert main(["generate", "hi", "--model", str(tmp_path / "nowhere")]) == 2
    assert "refengine generate: " in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{broken")
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text("")
    assert main(["generate", "hi", "--model", str(tmp_path)]) == 2
    assert "config.json is not valid UTF-8 JSON" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "says"), [
    (["--role", "prefill"], "generate runs the aggregated role in-process"),  # was a traceback, then a late refusal
    (["--media-max-mib", "inf"], "--media-max-mib: must be a finite number of MiB, got inf"),  # OverflowError
    (["--media-cache-mib", "nan"], "--media-cache-mib: must be a finite number of MiB, got nan"),
])
def test_engine_flags_that_cannot_build_an_engine_exit_2(flags: list[str], says: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "hi", "--max-tokens", "1", *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err



@pytest.mark.parametrize("template", [None, "{% for m in messages %}{{ m['content'] }", "{{ 1 / 0 }}"],
                         ids=["none", "syntax-error", "raises"])  # raises: not a TemplateError (found by review)
def test_a_missing_or_broken_chat_template_is_a_usage_error(template: str | None, tmp_path: Path, servers: Servers,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """--chat with a model that has no chat template, or one that does not render, is a one-line
    usage error (exit 2) naming the model, in process and with --remote, not a traceback."""
    from tests.unit.test_loader import save_model, tiny_model

    directory = save_model(tiny_model(), tmp_path / "m")
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if template is not None:
        (directory / "chat_template.jinja").write_text(template)
    capsys.readouterr()  # the save's progress bar
    for argv in (["generate", "hi", "--chat", "--max-tokens", "1", "--num-kv-blocks", "8", "--model", str(directory)],
                 _argv(servers, ("--chat", "--model-name", str(directory)))):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("refengine generate: error: model ") and "chat template" in err, err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not servers.remote.requests

# -- the in-process path, without an engine ---------------------------------------------

def _options(*flags: str) -> Any:
    return options_from_args(build_parser().parse_args(["generate", "hi", *flags]))


def test_engine_request_maps_the_flags(tmp_path: Path) -> None:
    image = tmp_path / "i.png"
    image.write_bytes(IMAGE)
    request = engine_request(_options(
        "--temperature", "0.7", "--top-p", "0.8", "--top-k", "4", "--seed", "5", "--num-sequences", "2",
        "--max-tokens", "9", "--min-tokens", "2", "--stop", "x", "--stop-token-id", "7", "--include-stop",
        "--logprobs", "3", "--prompt-logprobs", "0", "--priority", "4", "--cache-salt", "s", "--no-prefix-cache",
        "--lora-name", "l", "--image", str(image), "--choice", "a"), "hi", "cli")
    assert request.sampling == SamplingParams(temperature=0.7, top_p=0.8, top_k=4, seed=5, num_sequences=2)
    assert request.stopping == StoppingParams(max_tokens=9, min_tokens=2, stop_strings=("x",), stop_token_ids=(7,),
                                              include_stop_in_output=True)
    assert request.logprobs.output_logprobs and request.logprobs.output_candidates == CandidateSpec("top_n", 3)
    assert request.logprobs.prompt_logprobs and request.logprobs.prompt_candidates is None
    assert (request.priority, request.kv.cache_salt, request.kv.bypass_prefix_cache) == (4, "s", True)
    assert request.lora_name == "l" and request.media == (MediaInput("image", raw_bytes=IMAGE),)
    assert request.guided == GuidedSpec("choice", choices=("a",))


def test_engine_request_defaults() -> None:
    """Unset flags keep the engine's defaults; only the CLI's own two defaults differ."""
    assert engine_request(_options(), "hi", "cli") == GenerationRequest(
        request_id="cli", prompt="hi", sampling=SamplingParams(temperature=0.0),
        stopping=StoppingParams(max_tokens=128))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_the_two_adapters_agree(case: Case, module_servers: Servers) -> None:
    """The in-process request equals what the server makes of the wire request."""
    options = _options(*[module_servers.addresses.get(flag, flag) for flag in case.flags])
    wire = to_engine_request(wire_request(options, "hi", "cli"), read_inference_metadata(wire_metadata(options)))
    assert engine_request(options, "hi", "cli") == wire


def _engine_outputs() -> list[RequestOutput]:
    ok = TokenInfo(token_id=1, text="ok", logprob=-0.5, rank=1)
    return [
        RequestOutput("cli", deltas=(SequenceDelta(0, (ok,), "ok"), SequenceDelta(1, (ok,), "ok1"))),
        RequestOutput("cli", deltas=(SequenceDelta(0, finish=FinishInfo(FinishReason.LENGTH)),
                                     SequenceDelta(1, finish=FinishInfo(FinishReason.LENGTH))),
                      finished=True, usage=Usage(prompt_tokens=1, completion_tokens=2, cached_prompt_tokens=0)),
    ]


def test_in_process_text_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    text = TextPrinter(num_sequences=2, output_tables=True)
    for out in _engine_outputs():
        text.engine(out)
    text.close()
    printed = capsys.readouterr()
    assert printed.out == "[0] ok\n[1] ok1\n"
    assert "output 0 logprobs:" in printed.err and "output 1 logprobs:" in printed.err and "[2 tokens in" in printed.err
    lines = JsonPrinter()
    for out in _engine_outputs():
        lines.engine(out)
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert events[0] == {"request_id": "cli", "finished": False, "deltas": [
        {"index": 0, "text": "ok", "tokens": [{"token_id": 1, "text": "ok", "logprob": -0.5, "rank": 1}]},
        {"index": 1, "text": "ok1", "tokens": [{"token_id": 1, "text": "ok", "logprob": -0.5, "rank": 1}]}]}
    assert events[1]["deltas"][1] == {"index": 1, "text": "", "finish": {"reason": "length", "message": ""}}
    assert events[1]["usage"] == {"prompt_tokens": 1, "completion_tokens": 2, "cached_prompt_tokens": 0}
