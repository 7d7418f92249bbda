"""Generate through a real server on loopback (RULES G1–G18, L1–L5, A5, X1).

Outputs are compared with an in-process Engine loaded with the same flags: greedy decoding
is deterministic, so the tokens that cross gRPC must be exactly the engine's.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time

import grpc
import pytest
import torch
from google.protobuf import struct_pb2

from refengine.client import OpenEngineClient, stream_text
from refengine.config import CacheConfig, EngineConfig
from refengine.engine.engine import Engine
from refengine.model.chat import chat_prompt as chat_prompt_of
from refengine.protocol import oe
from refengine.server.stream_bridge import ABORT_CONFIRM_SECONDS
from refengine.types import GenerationRequest, SamplingParams, StoppingParams
from tests.integration.conftest import REPO, check_stream, collect, greedy_request, wait_idle

PROMPT = "The capital of France is"
LONG = 400  # max_tokens of streams that are cut short by the test


@pytest.fixture(scope="module")
def reference() -> Engine:
    """The same model and engine flags as the shared server, in this process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like the server (OMP_NUM_THREADS=1): same kernels, same bits
    try:
        yield Engine.from_config(EngineConfig(max_model_len=2048, cache=CacheConfig(num_blocks=128)))
    finally:
        torch.set_num_threads(threads)


def reference_greedy(engine: Engine, prompt: str, max_tokens: int):  # noqa: ANN201 - CompletedOutput
    request = GenerationRequest("ref", prompt=prompt, sampling=SamplingParams(temperature=0.0),
                                stopping=StoppingParams(max_tokens=max_tokens))
    return engine.run_until_done([request])[0].outputs[0]


def _long_request(request_id: str) -> oe.GenerateRequest:
    request = greedy_request(request_id, PROMPT, max_tokens=LONG)
    request.stopping.ignore_eos = True
    return request


def _stalling_request(request_id: str, stall_timeout: float) -> oe.GenerateRequest:
    """A long request whose every TokenOutput is ~1.3 MB (all-vocabulary candidates), so the
    transport windows fill after a few tokens, with a stream buffer of 1 and ``stall_timeout``."""
    request = _long_request(request_id)
    request.response.output_candidates.all.SetInParent()
    request.extra.update({"refengine.stream_buffer": 1, "refengine.stall_timeout_seconds": stall_timeout})
    return request


def _own_connection(client: OpenEngineClient) -> OpenEngineClient:
    """A client on a connection of its own: a stalled stream also holds the connection-level window."""
    return OpenEngineClient(client.address, channel_options=[("grpc.use_local_subchannel_pool", 1)])


def _read_tokens(events, count: int) -> None:  # noqa: ANN001 - an iterator of GenerateResponse
    seen = 0
    for event in events:
        if event.WhichOneof("event") == "token":
            seen += 1
            if seen == count:
                return
    raise AssertionError("the stream ended early")


def test_text_and_token_input_equal_in_process_engine(client: OpenEngineClient, reference: Engine) -> None:
    expected = reference_greedy(reference, PROMPT, 12)
    request = greedy_request("text-1", PROMPT, max_tokens=12)
    request.extra.update({"some.unknown.key": "ignored", "another": [1, 2]})  # G8: unknown keys ignored
    metadata = (("openengine-priority", "5"), ("openengine-routing-key", "tenant-a"),
                ("openengine-target-dp-rank", "0"),
                ("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"))
    stream = collect(client, request, metadata=metadata)
    check_stream(stream, request)
    assert stream.tokens() == expected.token_ids  # G18 across the wire
    assert stream.text() == expected.text  # G11: deltas concatenate to the whole text
    assert all(len(out.tokens) >= 1 for out in stream.of("token"))
    prompt_ids = reference.tokenizer.encode(PROMPT, add_special_tokens=False)
    assert stream.events[-1].usage.prompt_tokens == len(prompt_ids)

    by_ids = oe.GenerateRequest(request_id="ids-1", token_ids=oe.TokenIds(ids=prompt_ids))
    by_ids.sampling.temperature, by_ids.stopping.max_tokens = 0.0, 12
    ids_stream = collect(client, by_ids)
    check_stream(ids_stream, by_ids)
    assert ids_stream.tokens() == expected.token_ids
    assert ids_stream.text() == expected.text


def test_three_sequences_each_finish_once_and_seed_reproduces(client: OpenEngineClient) -> None:
    def run(request_id: str) -> list[list[int]]:
        request = oe.GenerateRequest(request_id=request_id, prompt="Once upon a time")
        request.sampling.temperature, request.sampling.seed, request.sampling.num_sequences = 0.9, 1234, 3
        request.stopping.max_tokens = 6
        stream = collect(client, request)
        check_stream(stream, request)  # exactly one GenerationFinished per output, usage on the last only
        usage = stream.events[-1].usage
        assert usage.completion_tokens == sum(len(stream.tokens(i)) for i in range(3))  # G16 cumulative
        return [stream.tokens(i) for i in range(3)]

    first = run("n3-a")
    assert run("n3-b") == first  # G17: same seed, same request → same outputs


def _spanning_stop(engine: Engine, prompt: str, max_tokens: int) -> tuple[str, int, object]:
    """A stop string made of output tokens k and k+1 (so it spans two deltas), whose first
    occurrence in the greedy text is at those tokens. Returns (stop, k, reference output)."""
    out = reference_greedy(engine, prompt, max_tokens)
    texts = [t.text for t in out.tokens]
    assert "".join(texts) == out.text
    for k in range(1, len(texts) - 1):
        stop = texts[k] + texts[k + 1]
        if stop.strip() and texts[k] and out.text.find(stop) == len("".join(texts[:k])):
            return stop, k, out
    raise AssertionError(f"no spanning stop string in {out.text!r}")


def _stop_stream(client: OpenEngineClient, reference: Engine, include: bool):  # noqa: ANN202
    stop, k, expected = _spanning_stop(reference, PROMPT, 16)
    request = greedy_request(f"stop-{include}", PROMPT, max_tokens=16, include_stop_in_output=include)
    request.stopping.conditions.add(stop_text=stop)
    stream = collect(client, request)
    check_stream(stream, request)
    return stream, stop, k, expected


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_held_back_across_deltas(client: OpenEngineClient, reference: Engine,
                                             include: bool) -> None:
    stream, stop, k, expected = _stop_stream(client, reference, include)
    finished = stream.finished(0)
    assert finished.reason == oe.FINISH_REASON_STOP and finished.stop_match.stop_text == stop  # G13
    end = len("".join(t.text for t in expected.tokens[: k + 2 if include else k]))
    assert stream.text() == expected.text[:end]  # G14: never a piece of the stop string
    accumulated = ""
    for out in stream.of("token"):
        accumulated += out.text
        assert accumulated == expected.text[: len(accumulated)]


def test_stop_string_tokens_are_not_emitted(client: OpenEngineClient, reference: Engine) -> None:
    stream, _, k, expected = _stop_stream(client, reference, include=False)
    assert stream.tokens() == expected.token_ids[:k]


def test_prompt_logprobs_come_first(client: OpenEngineClient, reference: Engine) -> None:
    request = greedy_request("plp-1", PROMPT, max_tokens=3)
    request.response.return_prompt_logprobs = True
    request.response.prompt_candidates.top_n = 3
    request.response.return_output_logprobs = True
    request.response.output_candidates.top_n = 2
    stream = collect(client, request)
    check_stream(stream, request)
    assert stream.events[0].WhichOneof("event") == "prompt"  # L1
    prompt_tokens = stream.events[0].prompt.tokens
    assert [t.token_id for t in prompt_tokens] == reference.tokenizer.encode(PROMPT, add_special_tokens=False)
    first = prompt_tokens[0]
    assert not first.HasField("logprob") and not first.HasField("rank") and not first.candidates  # L2
    for info in list(prompt_tokens[1:]) + [t for out in stream.of("token") for t in out.tokens]:
        assert info.HasField("logprob") and math.isfinite(info.logprob) and info.logprob <= 0  # L5
        assert info.HasField("rank") and info.rank >= 1
        ranks = [c.rank for c in info.candidates]
        assert ranks == sorted(ranks) and len(ranks) <= 3  # L4
    for out in stream.of("token"):
        assert all(t.rank == 1 for t in out.tokens)  # greedy picks the most likely token


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_prompt_logprob_start_skips_positions(client: OpenEngineClient, max_tokens: int) -> None:
    request = greedy_request(f"plp-start-{max_tokens}", PROMPT, max_tokens=max_tokens)
    request.response.return_prompt_logprobs = True
    request.response.prompt_logprob_start = 2
    stream = collect(client, request)
    check_stream(stream, request)
    prompt_tokens = stream.events[0].prompt.tokens
    assert len(prompt_tokens) == stream.events[-1].usage.prompt_tokens - 2
    assert all(t.HasField("logprob") for t in prompt_tokens)


def test_cancel_mid_stream_frees_kv(client: OpenEngineClient) -> None:
    wait_idle(client)
    events = client.generate(_long_request("cancel-1"), timeout=120)
    _read_tokens(events, 3)
    assert client.load().used_kv_blocks > 0
    events.close()  # cancels the RPC (A5)
    wait_idle(client)  # every KV block is back
    assert client.abort("cancel-1").status == oe.ABORT_STATUS_ALREADY_FINISHED


def test_duplicate_request_id_is_refused_then_reusable(client: OpenEngineClient) -> None:
    running = client.generate(_long_request("dup-1"), timeout=120)
    _read_tokens(running, 1)
    duplicate = collect(client, greedy_request("dup-1", PROMPT, max_tokens=2))
    assert duplicate.code == grpc.StatusCode.ALREADY_EXISTS and not duplicate.events  # G2
    running.close()
    wait_idle(client)
    again = greedy_request("dup-1", PROMPT, max_tokens=2)
    check_stream(collect(client, again), again)  # G2: reusable once the stream ended


def test_an_id_is_reusable_as_soon_as_its_cancelled_stream_ended(client: OpenEngineClient) -> None:
    """G2: the client cancels during a long prefill, whose step keeps the engine busy for a
    while yet; the same id sent right away is accepted (it waits for the engine to retire the
    old one) instead of ALREADY_EXISTS until the step ends. The wait lasts the rest of the step,
    within the new request's deadline; 700 tokens keep the step short (1,800 took 4.5 s alone on a
    2-core AMD EPYC, one thread), so the test stays quick."""
    wait_idle(client)
    prompt = oe.GenerateRequest(request_id="reuse-1", token_ids=oe.TokenIds(ids=[(7 * i) % 4000 + 100
                                                                                for i in range(700)]))
    prompt.stopping.max_tokens = 4
    call = client.inference.Generate(prompt, timeout=120)  # sent at once; its prefill runs
    time.sleep(0.2)
    call.cancel()
    time.sleep(0.05)  # the server saw the cancel; the engine is still inside the prefill step
    again = greedy_request("reuse-1", PROMPT, max_tokens=2)
    check_stream(collect(client, again), again)
    wait_idle(client)


def _invalid_cases() -> list:
    def req(**changes: object) -> oe.GenerateRequest:
        request = greedy_request("bad-1", PROMPT, max_tokens=4)
        for path, value in changes.items():
            target = request
            *parents, name = path.split("__")
            for parent in parents:
                target = getattr(target, parent)
            setattr(target, name, value)
        return request

    def ids(token_ids: list[int]) -> oe.GenerateRequest:
        return oe.GenerateRequest(request_id="bad-1", token_ids=oe.TokenIds(ids=token_ids))

    def empty_stop() -> oe.GenerateRequest:
        request = req()
        request.stopping.conditions.add()
        return request

    def with_(setup) -> oe.GenerateRequest:  # noqa: ANN001
        request = req()
        setup(request)
        return request

    invalid, not_found, precondition = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                                        grpc.StatusCode.FAILED_PRECONDITION)
    bad_extra = struct_pb2.Struct()
    bad_extra.update({"refengine.stall_timeout_seconds": "soon"})
    return [
        ("no input", oe.GenerateRequest(request_id="bad-1"), (), invalid),  # G1
        ("empty request_id", req(request_id=""), (), invalid),  # G2
        ("request_id over 1,024 bytes", req(request_id="é" * 513), (), invalid),  # ref: a bound, as on lora_name
        ("stop strings over 16,384 characters in all", with_(lambda r: [
            r.stopping.conditions.add(stop_text=f"{i:04d}" + "x" * 1020) for i in range(17)]), (), invalid),
        ("unknown model", req(model="no-such-model"), (), not_found),  # G3
        ("num_sequences 0", req(sampling__num_sequences=0), (), invalid),  # G4
        ("num_sequences over max", req(sampling__num_sequences=17), (), invalid),
        ("temperature < 0", req(sampling__temperature=-1.0), (), invalid),  # G5
        ("top_p 0", req(sampling__top_p=0.0), (), invalid),
        ("top_k -2", req(sampling__top_k=-2), (), invalid),
        ("min_p > 1", req(sampling__min_p=1.5), (), invalid),
        ("penalty nan", req(sampling__presence_penalty=float("nan")), (), invalid),
        ("repetition_penalty 0", req(sampling__repetition_penalty=0.0), (), invalid),
        ("empty stop condition", empty_stop(), (), invalid),  # G6
        ("min_tokens > max_tokens", req(stopping__min_tokens=9), (), invalid),
        ("max_tokens past context", req(stopping__max_tokens=5000), (), invalid),  # G7
        ("prompt past context", ids([42] * 2048), (), invalid),
        ("token id out of vocab", ids([10**6]), (), invalid),
        ("empty token_ids", ids([]), (), invalid),
        ("extra wrong type", with_(lambda r: r.extra.CopyFrom(bad_extra)), (), invalid),  # G8
        ("top_n over max", with_(lambda r: setattr(r.response.output_candidates, "top_n", 21)), (), invalid),
        ("invalid guided regex", with_(lambda r: setattr(r.guided, "regex", "(ab")), (), invalid),  # X1
        ("unknown guided backend", with_(lambda r: (setattr(r.guided, "regex", "[a-z]+"),
                                                    setattr(r.guided, "backend", "outlines"))), (), invalid),
        ("guided backend without a guide", with_(lambda r: setattr(r.guided, "backend", "xgrammar")), (), invalid),
        ("media", with_(lambda r: r.media.add(url="https://example.com/cat.png")), (), invalid),
        ("lora_name", req(lora_name="adapter"), (), not_found),  # R4: no adapter is loaded
        ("kv.session on aggregated", with_(lambda r: setattr(r.kv.session, "session_id", "s1")), (),
         precondition),  # K6
        ("all prompt candidates too large", with_(lambda r: (r.token_ids.ids.extend([42] * 20),
                                                             r.response.prompt_candidates.all.SetInParent())),
         (), invalid),
        ("priority not a number", req(), (("openengine-priority", "high"),), invalid),  # M2
        ("target rank malformed", req(), (("openengine-target-dp-rank", "-1"),), invalid),
        ("target rank absent here", req(), (("openengine-target-dp-rank", "3"),), invalid),
        ("empty routing key", req(), (("openengine-routing-key", ""),), invalid),
        ("repeated openengine key", req(), (("openengine-priority", "1"),) * 2, invalid),
    ]


INVALID_CASES = _invalid_cases()


@pytest.mark.parametrize("name,request_,metadata,code", INVALID_CASES, ids=[c[0] for c in INVALID_CASES])
def test_refused_before_acceptance(client: OpenEngineClient, name: str, request_: oe.GenerateRequest,
                                   metadata: tuple, code: grpc.StatusCode) -> None:
    stream = collect(client, request_, metadata=metadata)
    assert stream.code == code, f"{name}: {stream.code} {stream.details}"
    assert not stream.events  # X1: no events before acceptance
    assert stream.details  # the message says what is wrong


def test_stalled_consumer_gets_overloaded_and_kv_is_freed(client: OpenEngineClient) -> None:
    """The transport windows fill after a few tokens (``_stalling_request``); the stream's buffer
    (1) then fills and its clock (1 s) runs out."""
    wait_idle(client)
    with _own_connection(client) as own:
        events = own.generate(_stalling_request("stall-1", 1.0), timeout=120)
        first = next(events)
        assert first.WhichOneof("event") == "token"
        wait_idle(client, timeout=60)  # aborted while we do not read: KV back to idle
        rest = list(events)
    assert rest and all(e.WhichOneof("event") == "token" for e in rest[:-1])
    final = rest[-1]
    assert final.WhichOneof("event") == "error", final.WhichOneof("event")
    assert final.error.code == oe.ERROR_CODE_OVERLOADED and final.error.retryable  # X3
    assert final.HasField("usage") and final.usage.completion_tokens < LONG  # G16
    received = sum(len(e.token.tokens) for e in [first, *rest[:-1]])
    assert final.usage.completion_tokens >= received


def test_a_stalled_client_that_never_reads_again_is_disconnected(client: OpenEngineClient) -> None:
    """A stalled stream whose client keeps the connection but reads nothing more: its write is stuck,
    so its terminal EngineError can never go out. It was held open forever (every drain then waited
    the grace period and the flush for it); it is now disconnected with RESOURCE_EXHAUSTED, once the
    stream's end is stall timeout + ABORT_CONFIRM_SECONDS old."""
    wait_idle(client)
    with _own_connection(client) as own:
        events = own.generate(_stalling_request("stall-forever-1", 0.5), timeout=120)
        assert next(events).WhichOneof("event") == "token"
        wait_idle(client, timeout=60)  # stalled and aborted
        time.sleep(ABORT_CONFIRM_SECONDS + 2.5)  # the server gives up on the write meanwhile
        with pytest.raises(grpc.RpcError) as info:
            for event in events:
                assert event.WhichOneof("event") == "token"  # what was in flight; never the EngineError
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    assert "read nothing" in info.value.details()


def test_a_client_outrun_by_the_engine_is_ended_before_its_stall_timeout(client: OpenEngineClient) -> None:
    """Found by review: a client asking for all-vocabulary candidates (~9 MiB of Python objects a
    token here) that read nothing grew the server by 2.5 GB before its stall timeout ended it, and
    one that read slowly restarted the stall clock with every output. Past 4x --stream-buffer-mib
    (32 MiB: ~14 tokens) waiting, the stream now ends at once: EngineError(OVERLOADED, retryable)
    saying why, the request aborted and its KV freed, long before the 20 s stall timeout."""
    wait_idle(client)
    request = _long_request("outrun-1")
    request.response.output_candidates.all.SetInParent()
    started = time.monotonic()
    with _own_connection(client) as own:
        events = own.generate(request, timeout=120)
        assert next(events).WhichOneof("event") == "token"  # then read nothing
        wait_idle(client, timeout=60)
        assert time.monotonic() - started < 15, "aborted by the stall timeout, not by the backlog"
        rest = list(events)  # read again: what was waiting, then the terminal error
    assert [e.WhichOneof("event") for e in rest[:-1]] == ["token"] * (len(rest) - 1)
    final = rest[-1]
    assert final.WhichOneof("event") == "error" and final.error.code == oe.ERROR_CODE_OVERLOADED, final
    assert final.error.retryable and "slower than the engine produced" in final.error.message
    assert len(rest) - 1 < LONG // 4 and final.usage.completion_tokens == len(rest)  # G16: what was sent


def test_deadline_exceeded_aborts_engine_work(client: OpenEngineClient) -> None:
    """A client deadline is a transport-level end: non-OK status, no EngineError, KV freed."""
    wait_idle(client)
    started = time.monotonic()
    stream = collect(client, _long_request("deadline-1"), timeout=1.5)
    assert stream.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert not stream.of("error")
    assert time.monotonic() - started < 10
    wait_idle(client)


def test_client_stream_text_and_cli_remote(server_address: str, reference: Engine) -> None:
    expected = reference_greedy(reference, PROMPT, 6)
    assert "".join(stream_text(server_address, PROMPT, max_tokens=6)) == expected.text
    chat_prompt = reference.tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}], tokenize=False,
                                                          add_generation_prompt=True)
    chat_expected = reference_greedy(reference, chat_prompt, 6)
    assert "".join(stream_text(server_address, "Hi!", max_tokens=6, chat=chat_prompt_of)) == chat_expected.text
    cli = subprocess.run([sys.executable, "-m", "refengine.cli", "generate", PROMPT, "--remote", server_address,
                          "--max-tokens", "6"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout == expected.text + "\n"


@pytest.mark.parametrize("payload", [b"\x0a\x02\xff\xfe", b"\x1a\x05ab", b"\xff\xff\xff"],
                         ids=["invalid utf-8 request_id", "truncated prompt", "garbage"])
def test_unparseable_request_is_invalid_argument(client: OpenEngineClient, payload: bytes) -> None:
    generate = client.channel.unary_stream("/openengine.v1.Inference/Generate", request_serializer=None,
                                           response_deserializer=oe.GenerateResponse.FromString)
    with pytest.raises(grpc.RpcError) as info:
        list(generate(payload, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "openengine.v1.GenerateRequest" in info.value.details()


def test_a_huge_prompt_is_refused_in_bounded_time_beside_other_streams(client: OpenEngineClient) -> None:
    """A 2.4 MB prompt of 600,000 emoji (under the character bound, 2,048 tokens x 81 characters x
    4: ``input_processor.max_prompt_chars``) is 1.8 million tokens. Tokenizing it whole to refuse
    it took seconds and 480 MiB; it is now counted in pieces and refused after the first (G7), while
    another stream keeps streaming. (That acceptance runs off the event loop at all is
    ``tests/unit/test_server_slow_work.py``'s.)"""
    wait_idle(client)
    huge = greedy_request("huge-prompt", "\U0001f600" * 600_000, max_tokens=1)
    with _own_connection(client) as own:
        events = own.generate(_long_request("beside-huge"), timeout=120)
        _read_tokens(events, 3)
        started = time.monotonic()
        refused = collect(client, huge)
        seconds = time.monotonic() - started
        _read_tokens(events, 3)  # the other stream goes on
        events.close()
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and "more than 2048 tokens" in refused.details, refused
    assert seconds < 1.0, f"refusing it took {seconds:.2f} s: tokenized whole?"
    wait_idle(client)
