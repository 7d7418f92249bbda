"""Fuzzing Generate against a real ``refengine serve`` on loopback.

Random and malformed field combinations (hypothesis), plus hand-built raw protobuf
bytes (invalid UTF-8, both inputs, out-of-range varints, garbage) and oversize
messages. Every call must end in one of two ways:

- refused before acceptance: a documented non-OK status (INVALID_ARGUMENT,
  NOT_FOUND, ALREADY_EXISTS; RESOURCE_EXHAUSTED for an oversize message) and no event;
- accepted: a structurally valid stream (conformance ``stream_violations``) with
  exactly one terminal event per output, ending OK.

The server must never crash or hang (every call has a deadline, Health is asked after
each example), and afterwards GetLoad shows nothing running or queued and the used KV
blocks back at their idle value.
"""

from __future__ import annotations

import math
import os
import struct
import time
from collections.abc import Iterator

os.environ["HF_HUB_OFFLINE"] = "1"

import grpc  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from refengine.conformance.assertions import stream_violations  # noqa: E402
from refengine.conformance.streams import StreamResult  # noqa: E402
from refengine.protocol import oe  # noqa: E402

GENERATE = "/openengine.v1.Inference/Generate"
#: Documented refusals before acceptance: malformed (G*), unknown model/adapter (G3, R4), duplicate id
#: (G2), LoRA disabled (R5), admission/capacity or a response too large to send.
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS,
            grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED}
CALL_TIMEOUT_S = 30.0
MAX_EVENTS = 24  # accepted streams are cut (client cancel) after this many events: above the 22 of
#                   the longest bounded request (3 outputs x 6 tokens, 3 finishes, the prompt's output)
MAX_EXAMPLES = int(os.environ.get("REFENGINE_FUZZ_EXAMPLES", "80"))


@pytest.fixture(scope="module")
def fuzz_address(request: pytest.FixtureRequest) -> str:
    """The loopback server of tests/integration/conftest.py (``server_address``), or
    ``REFENGINE_FUZZ_TARGET=host:port``."""
    return os.environ.get("REFENGINE_FUZZ_TARGET") or request.getfixturevalue("server_address")


@pytest.fixture(scope="module")
def channel(fuzz_address: str) -> Iterator[grpc.Channel]:
    ch = grpc.insecure_channel(fuzz_address, options=[("grpc.max_send_message_length", -1),
                                                      ("grpc.max_receive_message_length", -1)])
    grpc.channel_ready_future(ch).result(timeout=60)
    yield ch
    ch.close()


@pytest.fixture(scope="module", autouse=True)
def idle_kv(channel: grpc.Channel) -> int:
    """used_kv_blocks of the idle server, taken before the first fuzz test runs."""
    load = wait_idle(oe.ControlStub(channel), require_kv=None)
    return load.used_kv_blocks


def wait_idle(control: oe.ControlStub, require_kv: int | None, timeout: float = 30.0) -> oe.LoadInfo:
    deadline = time.monotonic() + timeout
    while True:
        load = control.GetLoad(oe.GetLoadRequest(), timeout=5)
        idle = load.running_requests == 0 and load.queued_requests == 0
        if require_kv is not None:
            idle = idle and load.used_kv_blocks <= require_kv
        if idle or time.monotonic() > deadline:
            return load
        time.sleep(0.05)


def call_raw(channel: grpc.Channel, payload: bytes, request_id: str = "") -> StreamResult:
    """Send pre-serialized request bytes; collect events until the end or MAX_EVENTS."""
    method = channel.unary_stream(GENERATE, request_serializer=None,
                                  response_deserializer=oe.GenerateResponse.FromString)
    result = StreamResult(request_id=request_id)
    call = method(payload, timeout=CALL_TIMEOUT_S)
    try:
        for event in call:
            result.events.append(event)
            if len(result.events) >= MAX_EVENTS:
                call.cancel()
                result.code = grpc.StatusCode.CANCELLED
                return result
        result.code, result.details = call.code(), call.details() or ""
    except grpc.RpcError as err:
        result.code, result.details = err.code(), err.details() or ""
    return result


def check_outcome(res: StreamResult, num_sequences: int, extra_refusals: frozenset = frozenset()) -> None:
    """Refused before acceptance with a documented status, or a valid stream."""
    assert res.code != grpc.StatusCode.DEADLINE_EXCEEDED, f"call hung past {CALL_TIMEOUT_S} s: {res.describe()}"
    if not res.events:
        assert res.code in REFUSALS | extra_refusals, f"undocumented refusal {res.describe()}"
        return
    cut = res.code == grpc.StatusCode.CANCELLED and len(res.events) >= MAX_EVENTS
    assert res.ok or cut, f"accepted stream failed by status: {res.describe()}"
    problems = stream_violations(res, num_sequences=max(1, num_sequences), cancelled_ok=cut)
    if cut:  # cut short by us: no terminal events expected yet
        problems = [p for p in problems if not p.startswith(("G12: stream ended", "G16: the final"))]
    assert not problems, problems


def assert_alive(channel: grpc.Channel) -> None:
    resp = oe.ControlStub(channel).Health(oe.HealthRequest(), timeout=10)
    assert resp.state == oe.HEALTH_STATE_READY, resp


# -- hypothesis strategies ---------------------------------------------------------------
wild_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                        st.sampled_from([-1.0, 0.0, 1e300, math.nan, math.inf, -math.inf, -1e-300]))
unit = (st.floats(0.05, 1.0), wild_floats)
penalty = (st.floats(-2.0, 2.0), wild_floats)
small_uint = (st.integers(1, 6), st.sampled_from([0, 2**31, 2**32 - 1]))
token_ids = (st.integers(0, 30000), st.sampled_from([49151, 49152, 2**31, 2**32 - 1]))
texts = st.text(max_size=24)
ID_COUNTER = iter(range(10**9))


@st.composite
def requests(draw: st.DrawFn) -> oe.GenerateRequest:
    """Half the requests are well-formed (and run); the other half draw each field from a
    wild range one time in four."""
    chaos = draw(st.booleans())

    def mostly(valid: st.SearchStrategy, wild: st.SearchStrategy) -> st.SearchStrategy:
        return st.integers(0, 3).flatmap(lambda k: wild if chaos and k == 0 else valid)

    unit_s, penalty_s, small_uint_s = mostly(*unit), mostly(*penalty), mostly(*small_uint)
    token_id = mostly(*token_ids)
    req = oe.GenerateRequest(request_id=draw(mostly(st.just("fz"), st.just(""))) and f"fz-{next(ID_COUNTER)}",
                             model=draw(mostly(st.sampled_from(["", "smollm2-135m-instruct"]),
                                               st.sampled_from(["no-such-model", " ", "SMOLLM2"]))))
    match draw(st.sampled_from(["prompt", "ids", "none"] if chaos else ["prompt", "ids"])):
        case "prompt":
            req.prompt = draw(st.text(min_size=0 if chaos else 1, max_size=48))
        case "ids":
            req.token_ids.ids.extend(draw(st.lists(token_id, min_size=0 if chaos else 1, max_size=12)))
    s = req.sampling
    for name, values in (("temperature", mostly(st.floats(0.0, 2.0), wild_floats)), ("top_p", unit_s),
                         ("min_p", unit_s), ("frequency_penalty", penalty_s), ("presence_penalty", penalty_s),
                         ("repetition_penalty", mostly(st.floats(0.5, 2.0), wild_floats))):
        if draw(st.booleans()):
            setattr(s, name, draw(values))
    if draw(st.booleans()):
        s.top_k = draw(mostly(st.integers(-1, 50), st.integers(-(2**31), 2**31 - 1)))
    if draw(st.booleans()):
        s.seed = draw(st.integers(0, 2**64 - 1))
    if draw(st.booleans()):
        s.num_sequences = draw(mostly(st.integers(1, 3), st.sampled_from([0, 17, 2**32 - 1])))
    stop = req.stopping
    if draw(st.integers(0, 9)):  # mostly bounded; sometimes unset (= up to the context limit)
        stop.max_tokens = draw(small_uint_s)
    if draw(st.booleans()):
        stop.min_tokens = draw(mostly(st.integers(0, 3), st.sampled_from([7, 2**32 - 1])))
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["text", "token", "empty"] if chaos else ["text", "token"]))
        cond = stop.conditions.add()
        if kind == "text":
            cond.stop_text = draw(st.text(min_size=0 if chaos else 1, max_size=24))
        elif kind == "token":
            cond.stop_token_id = draw(token_id)
    if draw(st.booleans()):
        stop.ignore_eos = draw(st.booleans())
    if draw(st.booleans()):
        stop.include_stop_in_output = draw(st.booleans())
    r = req.response
    if draw(st.booleans()):
        r.return_prompt_logprobs = draw(st.booleans())
        r.return_output_logprobs = draw(st.booleans())
        if draw(st.booleans()):
            r.prompt_logprob_start = draw(mostly(st.integers(0, 3), st.sampled_from([100, 2**32 - 1])))
        for spec in (r.prompt_candidates, r.output_candidates):
            match draw(st.sampled_from(["none", "none", "top_n", "ids", "all"])):
                case "top_n":
                    spec.top_n = draw(mostly(st.integers(0, 20), st.sampled_from([21, 2**32 - 1])))
                case "ids":
                    spec.token_ids.ids.extend(draw(st.lists(token_id, max_size=4)))
                case "all" if draw(st.integers(0, 3)) == 0:
                    spec.all.SetInParent()
    if draw(st.booleans()):
        req.kv.bypass_prefix_cache = draw(st.booleans())
        if draw(st.booleans()):
            req.kv.cache_salt = draw(texts)
    if chaos and draw(st.integers(0, 5)) == 0:
        req.guided.regex = "[0-9]+"
    if chaos and draw(st.integers(0, 5)) == 0:
        req.lora_name = draw(texts)
    if draw(st.booleans()):
        req.extra.update(draw(st.dictionaries(st.text(max_size=6), st.one_of(st.integers(-5, 5), texts,
                                                                             st.booleans()), max_size=3)))
    return req


@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(req=requests())
def test_fuzz_generate_fields(channel: grpc.Channel, req: oe.GenerateRequest) -> None:
    res = call_raw(channel, req.SerializeToString(), req.request_id)
    n = req.sampling.num_sequences if req.sampling.HasField("num_sequences") else 1
    event("accepted" if res.events else f"refused {res.code.name}")
    check_outcome(res, n)
    assert_alive(channel)


# -- raw bytes ----------------------------------------------------------------------------
def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field(number: int, wire: int, payload: bytes | int) -> bytes:
    key = varint(number << 3 | wire)
    if wire == 0:
        return key + varint(payload)
    if wire == 1:
        return key + payload
    return key + varint(len(payload)) + payload


def rid(tag: str) -> bytes:
    return field(1, 2, f"fz-raw-{tag}-{time.monotonic_ns()}".encode())


MAX_TOKENS_4 = field(6, 2, field(1, 0, 4))  # stopping { max_tokens: 4 }
RAW_CASES = {
    "invalid utf-8 prompt": rid("u8") + field(3, 2, b"Hello \xff\xfe world") + MAX_TOKENS_4,
    "invalid utf-8 request_id": field(1, 2, b"\xc3\x28") + field(3, 2, b"Hello") + MAX_TOKENS_4,
    "invalid utf-8 stop string": rid("u8s") + field(3, 2, b"Hello") + field(6, 2, field(1, 0, 4) + field(
        3, 2, field(1, 2, b"\xed\xa0\x80"))),
    "both inputs (prompt then token_ids)": rid("both") + field(3, 2, b"Hello") + field(4, 2, field(
        1, 2, varint(100) + varint(200))) + MAX_TOKENS_4,
    "both inputs (token_ids then prompt)": rid("both2") + field(4, 2, field(1, 2, varint(100))) + field(
        3, 2, b"Hello") + MAX_TOKENS_4,
    "token id > 2^32 as a varint": rid("big") + field(4, 2, field(1, 2, varint(2**40 + 5))) + MAX_TOKENS_4,
    "token id 2^31": rid("2p31") + field(4, 2, field(1, 2, varint(2**31))) + MAX_TOKENS_4,
    "max_tokens 2^40 varint": rid("mt") + field(3, 2, b"Hi") + field(6, 2, field(1, 0, 2**40)),
    "NaN temperature as raw double": rid("nan") + field(3, 2, b"Hi") + field(5, 2, field(
        1, 1, struct.pack("<d", math.nan))) + MAX_TOKENS_4,
    "unknown fields": rid("unk") + field(3, 2, b"Hi") + field(99, 2, b"junk") + field(77, 0, 5) + MAX_TOKENS_4,
    "truncated message": (rid("trunc") + field(3, 2, b"Hello world"))[:-4],
    "garbage bytes": b"\xff\xff\xff\xff\x0f\x00\x01garbage",
    "empty message": b"",
    "wrong wire type for prompt": rid("wt") + field(3, 0, 7) + MAX_TOKENS_4,
}
PARSE_FAILURES = {"invalid utf-8 prompt", "invalid utf-8 request_id", "invalid utf-8 stop string",
                  "truncated message", "garbage bytes", "wrong wire type for prompt"}


@pytest.mark.parametrize("name", list(RAW_CASES))
def test_raw_bytes(channel: grpc.Channel, name: str) -> None:
    try:
        request_id = oe.GenerateRequest.FromString(RAW_CASES[name]).request_id
    except Exception:  # noqa: BLE001 - unparsable on purpose
        request_id = ""
    res = call_raw(channel, RAW_CASES[name], request_id)
    if name in PARSE_FAILURES:
        # A request that does not parse is the client's fault: INVALID_ARGUMENT, not INTERNAL.
        assert not res.events and res.code == grpc.StatusCode.INVALID_ARGUMENT, res.describe()
    else:
        check_outcome(res, 1)
    assert_alive(channel)


def test_thousands_of_stop_strings(channel: grpc.Channel) -> None:
    req = oe.GenerateRequest(request_id=f"fz-stops-{time.monotonic_ns()}", prompt="Once upon a time")
    req.stopping.max_tokens = 4
    for i in range(5000):
        req.stopping.conditions.add(stop_text=f"zz{i}q")
    res = call_raw(channel, req.SerializeToString(), req.request_id)
    check_outcome(res, 1)
    req.ClearField("stopping")
    req.stopping.max_tokens = 4
    req.stopping.conditions.add(stop_text="x" * 200_000)
    req.request_id += "-long"
    check_outcome(call_raw(channel, req.SerializeToString(), req.request_id), 1)
    assert_alive(channel)


def test_oversize_messages(channel: grpc.Channel) -> None:
    """Beyond the server's receive limit: RESOURCE_EXHAUSTED (or INVALID_ARGUMENT: too long)."""
    for size in (17 << 20, 65 << 20):
        req = oe.GenerateRequest(request_id=f"fz-big-{size}", prompt="a " * (size // 2))
        req.stopping.max_tokens = 1
        res = call_raw(channel, req.SerializeToString(), req.request_id)
        assert not res.events, res.describe()
        assert res.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT), res.describe()
    ids = oe.GenerateRequest(request_id="fz-big-ids")
    ids.token_ids.ids.extend([100] * (5 << 20))  # 5 M token ids, ~10 MB
    ids.stopping.max_tokens = 1
    res = call_raw(channel, ids.SerializeToString(), ids.request_id)
    assert not res.events and res.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT), \
        res.describe()
    assert_alive(channel)


def test_zz_server_back_to_idle(channel: grpc.Channel, idle_kv: int) -> None:
    """Runs last (file order): nothing left running or queued, KV back to its idle value."""
    load = wait_idle(oe.ControlStub(channel), require_kv=idle_kv)
    assert load.running_requests == 0 and load.queued_requests == 0, load
    assert load.used_kv_blocks <= idle_kv, f"used_kv_blocks {load.used_kv_blocks}, idle value {idle_kv}"
    assert_alive(channel)
