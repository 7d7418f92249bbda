"""Disaggregated prefill/decode between real ``refengine serve`` processes (RULES K4–K10,
D7, M3, A2, X1, X3): a prefill server (grpc backend, a short lease), a prefill server
offering NIXL, a decode server, and the shared aggregated server as the baseline.

A small in-test gRPC proxy in front of the prefill server can corrupt or slow the KV
stream, so a checksum failure and a cancel mid-transfer are real network events, with
no test hook in the engine.
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from google.protobuf import json_format

from refengine.client import OpenEngineClient, generate_disaggregated, prefill
from refengine.conformance.kv_subscriber import KvSubscriber, KvView
from refengine.conformance.registry import Status, select
from refengine.conformance.report import format_matrix
from refengine.conformance.runner import run, run_report
from refengine.conformance.target import ConnectError, Options
from refengine.kv.transfer.base import KvRegion
from refengine.kv.transfer.nixl_backend import NixlKvTransfer, nixl_available
from refengine.protocol import oe
from refengine.protocol.kvpull.v1 import kv_pull_pb2_grpc as pb_grpc
from refengine.server.validation import CANDIDATE_BYTES, TOKEN_INFO_BYTES
from tests.integration.conftest import ServerProcess, Stream, start_server, wait_ready
from tests.integration.test_server_message_limits import _longest_tokens
from tests.support_matrix import observe

pytestmark = pytest.mark.timeout(900)
SESSION_TTL_S = 6.0
COMMON = ("--max-model-len", "2048", "--num-kv-blocks", "128", "--max-num-seqs", "16")
# A prefill server's grace period waits for its sessions to be pulled: kept short, so that a stop
# with sessions left (the drain test's, the teardown's) ends soon.
GRACE_S = 8.0
PREFILL = ("--role", "prefill", "--shutdown-grace-seconds", str(GRACE_S))
WORDS = "the a river mountain quiet light over under city small bright stone old new green song".split()


def prompt_text(i: int) -> str:
    rng = random.Random(i)
    return " ".join(rng.choice(WORDS) for _ in range(5 + 9 * i))  # 5 … 140 words: 1 … ~12 blocks


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, server_address: str) -> Iterator[dict[str, ServerProcess]]:
    tmp = tmp_path_factory.mktemp("disagg")
    procs = {
        # Chunks of 8 MiB under a 2 MiB message limit: every pull longer than the limit failed
        # with RESOURCE_EXHAUSTED until chunks kept within it.
        "prefill": start_server(tmp / "prefill.log", *PREFILL, "--kv-session-ttl", str(SESSION_TTL_S),
                                "--kv-pull-chunk-kib", "8192", "--max-send-message-mib", "2", *COMMON,
                                wait_ready=False),
        "decode": start_server(tmp / "decode.log", "--role", "decode", *COMMON, wait_ready=False),
    }
    if nixl_available()[0]:
        procs["prefill_nixl"] = start_server(tmp / "prefill_nixl.log", *PREFILL,
                                             "--kv-transfer-backend", "nixl", *COMMON, wait_ready=False)
    try:
        for proc in procs.values():
            wait_ready(proc)
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


@pytest.fixture(scope="module")
def clients(servers: dict[str, ServerProcess], server_address: str) -> Iterator[dict[str, OpenEngineClient]]:
    made = {name: OpenEngineClient(proc.address) for name, proc in servers.items()}
    made["aggregated"] = OpenEngineClient(server_address)
    yield made
    for client in made.values():
        client.close()


def request(rid: str, prompt: str, temperature: float = 0.0, seed: int | None = None,
            max_tokens: int = 8) -> oe.GenerateRequest:
    req = oe.GenerateRequest(request_id=rid, prompt=prompt)
    req.stopping.max_tokens = max_tokens
    req.sampling.temperature = temperature
    if seed is not None:
        req.sampling.seed = seed
    req.response.return_output_logprobs = True
    req.response.output_candidates.top_n = 2
    return req


def collect(events: Iterator[oe.GenerateResponse]) -> Stream:
    stream = Stream()
    try:
        stream.events = list(events)
    except grpc.RpcError as err:
        stream.code, stream.details = err.code(), err.details()
    return stream


def wait_idle(client: OpenEngineClient, timeout: float = 15.0) -> oe.LoadInfo:
    deadline = time.monotonic() + timeout
    while True:
        load = client.load()
        if load.used_kv_blocks == 0 and load.active_kv_sessions == 0 and load.running_requests == 0:
            return load
        assert time.monotonic() < deadline, f"not idle: {load}"
        time.sleep(0.1)


@pytest.mark.parametrize("backend", ["grpc", "nixl"])
def test_eight_prompts_equal_aggregated_greedy_and_seeded(clients, backend: str) -> None:
    """K10 over real processes, 8 prompts of 1 to ~12 blocks × (greedy, temperature 0.8
    seeded), in parallel; then half of them again: prefix-cache hits on both sides."""
    prefill_name = "prefill" if backend == "grpc" else "prefill_nixl"
    if prefill_name not in clients:
        pytest.skip(f"nixl: {nixl_available()[1]}")
    jobs = [(i, t, s) for i in range(0, 16, 2) for t, s in ((0.0, None), (0.8, 1000 + i))]
    jobs += [(i, t, s) for i, t, s in jobs if i % 4 == 0]

    def one(job: tuple[int, float, int | None], k: int) -> tuple[Stream, Stream]:
        i, temperature, seed = job
        req = request(f"{backend}-{k}", prompt_text(i), temperature, seed)
        return (collect(generate_disaggregated(clients[prefill_name], clients["decode"], req, timeout=120)),
                collect(clients["aggregated"].generate(req, timeout=120)))

    with futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, jobs, range(len(jobs))))
    for (i, temperature, _), (dis, agg) in zip(jobs, results, strict=True):
        assert dis.code == grpc.StatusCode.OK and not dis.of("error"), (i, dis.details, dis.of("error"))
        assert dis.tokens() == agg.tokens(), f"prompt {i}, temperature {temperature}"
        # logprobs agree to float32 noise: rows differ by ~1e-5 with the batch they ran in
        assert [t.logprob for o in dis.of("token") for t in o.tokens] == pytest.approx(
            [t.logprob for o in agg.of("token") for t in o.tokens], abs=1e-3)
        assert dis.of("finished")[-1].reason == agg.of("finished")[-1].reason
    assert clients["decode"].load().attributes["cached_kv_blocks"] > 0, "received blocks are prefix-cache hits"
    for name in (prefill_name, "decode"):
        wait_idle(clients[name])


def stored_blocks(batches: list) -> list[tuple[bytes, bytes | None, tuple[int, ...]]]:
    """(hash, parent hash, token ids) of every block the batches store, in order."""
    blocks = []
    for batch in batches:
        for event in batch.events:
            if event.WhichOneof("event") != "block_stored":
                continue
            stored = event.block_stored
            parent = bytes(stored.parent_block_hash.value) if stored.HasField("parent_block_hash") else None
            size = len(stored.token_ids) // len(stored.block_hashes)
            for i, block_hash in enumerate(stored.block_hashes):
                blocks.append((bytes(block_hash.value), parent, tuple(stored.token_ids[i * size:(i + 1) * size])))
                parent = bytes(block_hash.value)
    return blocks


@pytest.mark.parametrize("backend", ["grpc", "nixl"])
def test_the_pair_announces_one_block_chain(clients, backend: str) -> None:
    """E3/E4 across a pair. refengine's block keys are the same in every process (kv/keys.py),
    so a KV-aware router can match a request's blocks across workers: the prefill server stores
    the prompt's full blocks; the decode server stores the blocks it received under the same
    hashes, parents and tokens, then the blocks its decoding fills, ending at
    (prompt + output - 1) // block_size full blocks (the last token's KV is never computed).
    Both views, snapshot then live, stay valid chains."""
    prefill_name = "prefill" if backend == "grpc" else "prefill_nixl"
    if prefill_name not in clients:
        pytest.skip(f"nixl: {nixl_available()[1]}")
    subs = {name: KvSubscriber(clients[name].control, oe.SubscribeKvEventsRequest(include_snapshot=True), 60)
            for name in (prefill_name, "decode")}
    try:
        for sub in subs.values():
            assert sub.wait_responses(1), sub.describe()
        req = request(f"chain-{backend}", f"chain {backend} {prompt_text(11)}", max_tokens=24)
        stream = collect(generate_disaggregated(clients[prefill_name], clients["decode"], req, timeout=120))
        assert stream.code == grpc.StatusCode.OK and not stream.of("error"), (stream.details, stream.of("error"))
        usage = stream.events[-1].usage
        full = {prefill_name: usage.prompt_tokens // 16,
                "decode": (usage.prompt_tokens + usage.completion_tokens - 1) // 16}
        assert usage.completion_tokens == 24 and full["decode"] > full[prefill_name] >= 4, usage
        for name, sub in subs.items():
            sub.wait(lambda s, n=full[name]: len(stored_blocks(s.batches[1:])) >= n, 10.0)
        new = {name: stored_blocks(sub.batches[1:]) for name, sub in subs.items()}
        views = {name: KvView() for name in subs}
        for name, sub in subs.items():
            for batch in sub.batches:
                views[name].apply(batch)
    finally:
        for sub in subs.values():
            sub.close()
    for name in subs:
        assert len(new[name]) == full[name], (name, len(new[name]), full[name])
        assert new[name][0][1] is None, f"{name}: the fresh prompt's first block has a parent"
        assert not views[name].problems, (name, views[name].problems)
    assert new["decode"][:full[prefill_name]] == new[prefill_name], "the pair names the prompt's blocks differently"
    for name in (prefill_name, "decode"):
        wait_idle(clients[name])


@pytest.mark.parametrize("name", ["prefill", "decode"])
def test_the_inference_probe_is_role_appropriate_and_leaves_nothing_held(clients, name: str) -> None:
    """H2 on each role, three probes at once: READY. The prefill server prefills the probe into
    a KV session and releases it at once (nobody pulls it; held, it would keep its blocks for
    the whole lease); the decode server computes the probe itself (it takes sessions only from
    a prefill server, so a plain probe was refused and every probe said DEGRADED)."""
    with futures.ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: clients[name].health(include_inference_probe=True), range(3)))
    for health in answers:
        probe = [c for c in health.checks if c.name == "inference_probe"]
        assert health.state == oe.HEALTH_STATE_READY and len(probe) == 1, health
        assert probe[0].state == oe.HEALTH_STATE_READY and "1 token" in probe[0].message, probe
    assert wait_idle(clients[name], timeout=5.0).active_kv_sessions == 0


def test_prefill_server_streams_only_prefill_ready(clients) -> None:
    """K4, K9, D7: no TokenOutput, PrefillReady + Usage, attributes with their JSON types."""
    stream = collect(clients["prefill"].generate(request("k4", prompt_text(3))))
    kinds = [e.WhichOneof("event") for e in stream.events]
    assert kinds == ["prefill_ready"], kinds
    ready = stream.events[-1]
    session = ready.prefill_ready.kv_session
    assert session.session_id and session.transfer_backend == "grpc" and session.endpoints[0].host == "127.0.0.1"
    attrs = session.attributes_struct
    assert attrs["prompt_hash"].isdigit() and attrs["lease_expires_unix_nanos"].isdigit()  # > 2^53: strings
    assert int(attrs["lease_expires_unix_nanos"]) > 2**53 and attrs["block_size"] == 16.0
    assert ready.usage.prompt_tokens == attrs["num_prompt_tokens"] and ready.usage.completion_tokens == 0
    info = clients["prefill"].server_info()
    assert info.engine_role == oe.ENGINE_ROLE_PREFILL and info.kv_connector.supports_remote_prefill
    assert clients["prefill"].load().active_kv_sessions >= 1
    aborted = clients["prefill"].control.Abort(oe.AbortRequest(kv_session=session), timeout=10)
    assert aborted.status == oe.ABORT_STATUS_ABORTED
    with pytest.raises(grpc.RpcError) as err:  # A2: released, so unknown now
        clients["prefill"].control.Abort(oe.AbortRequest(kv_session=session), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    wait_idle(clients["prefill"])


def test_capabilities_are_role_correct_and_prefill_sends_prompt_logprobs(clients) -> None:
    """D4 per role (ref choices in engine/role_check.py): one output per request on both
    halves; prompt logprobs from the prefill server (PromptOutput, then PrefillReady), refused
    by the decode server, as advertised."""
    for name in ("prefill", "decode"):
        caps = clients[name].model_info().generation
        assert caps.max_num_sequences == 1, name
        assert caps.prompt_logprobs.supported == (name == "prefill"), name
        two = request(f"n2-{name}", prompt_text(2))
        two.sampling.num_sequences = 2
        if name == "decode":
            two.kv.session.CopyFrom(ready_for(clients, "n2-session").prefill_ready.kv_session)
        refused = collect(clients[name].generate(two))
        assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and not refused.events, (name, refused.details)
    req = request("plp", prompt_text(2))
    req.response.return_prompt_logprobs = True
    stream = collect(clients["prefill"].generate(req))
    assert [e.WhichOneof("event") for e in stream.events] == ["prompt", "prefill_ready"], stream.events
    assert len(stream.of("prompt")[0].tokens) == stream.events[-1].usage.prompt_tokens
    session = stream.events[-1].prefill_ready.kv_session
    refused = decode_with(clients, req, session)
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and "prompt logprobs" in refused.details
    req.response.ClearField("return_prompt_logprobs")
    assert decode_with(clients, req, session).of("finished"), "without them the same session decodes"
    wait_idle(clients["decode"])


def test_the_two_hop_client_streams_prompt_logprobs_and_aborts_a_refused_session(clients) -> None:
    """generate_disaggregated yields what one aggregated server would: the prefill's PromptOutput
    (the decode request drops the prompt-logprob options, which a decode server refuses, D4),
    then the decode's events -- the same prompt logprobs and tokens as the aggregated server.
    A refused decode aborts the session on the prefill server at once, not at lease expiry.
    Before, every two-hop request with prompt logprobs was refused and left its session held."""
    req = request("two-hop-plp", prompt_text(3))
    req.response.return_prompt_logprobs = True
    req.response.prompt_candidates.top_n = 2
    req.response.prompt_logprob_start = 2
    two_hop = collect(generate_disaggregated(clients["prefill"], clients["decode"], req))
    req.request_id = "two-hop-plp-aggregated"
    aggregated = collect(clients["aggregated"].generate(req))
    assert two_hop.code == grpc.StatusCode.OK, two_hop.details
    kinds = [e.WhichOneof("event") for e in two_hop.events]
    assert kinds[0] == "prompt" and kinds.count("prompt") == 1 and kinds[-1] == "finished", kinds
    ours, theirs = two_hop.of("prompt")[0].tokens, aggregated.of("prompt")[0].tokens
    assert [t.token_id for t in ours] == [t.token_id for t in theirs] and len(ours) > 2
    assert [t.logprob for t in ours] == pytest.approx([t.logprob for t in theirs], abs=1e-4)
    assert [len(t.candidates) for t in ours] == [len(t.candidates) for t in theirs]
    assert two_hop.tokens() == aggregated.tokens()
    wait_idle(clients["prefill"])
    wait_idle(clients["decode"])

    refused = collect(generate_disaggregated(clients["prefill"], clients["aggregated"],
                                             request("two-hop-refused", prompt_text(4))))
    assert refused.code != grpc.StatusCode.OK and not refused.events, "K6: not a decode server"
    wait_idle(clients["prefill"], timeout=SESSION_TTL_S / 3)


def ready_for(clients, rid: str, i: int = 5) -> oe.GenerateResponse:
    return prefill(clients["prefill"], request(rid, prompt_text(i)))


def decode_with(clients, req: oe.GenerateRequest, session: oe.KvSessionRef,
                metadata: tuple = ()) -> Stream:
    req.kv.session.CopyFrom(session)
    return collect(clients["decode"].generate(req, metadata=metadata, timeout=60))


@pytest.mark.parametrize("change", ["model_fingerprint", "block_size", "kv_dtype", "kv_layout", "backend",
                                    "nixl_without_its_attributes", "no_endpoint", "wildcard_endpoint", "dp_rank",
                                    "prompt"])
def test_an_incompatible_session_is_refused_before_acceptance(clients, change: str) -> None:
    """K5, M3: INVALID_ARGUMENT, no events, nothing allocated; the session stays for a good decode."""
    ready = ready_for(clients, f"bad-{change}")
    session = oe.KvSessionRef()
    session.CopyFrom(ready.prefill_ready.kv_session)
    req, metadata = request(f"bad-{change}-d", prompt_text(5)), ()
    if change in ("model_fingerprint", "kv_dtype", "kv_layout"):
        session.attributes_struct[change] = "something-else"
    elif change == "block_size":
        session.attributes_struct["block_size"] = 32
    elif change == "backend":
        session.transfer_backend = "carrier-pigeon"
    elif change == "nixl_without_its_attributes":  # a backend the decode server has, but no agent to read from
        if not nixl_available()[0]:
            pytest.skip(f"nixl: {nixl_available()[1]}")
        session.transfer_backend = "nixl"
    elif change == "no_endpoint":
        del session.endpoints[:]
    elif change == "wildcard_endpoint":
        session.endpoints[0].host = "0.0.0.0"
    elif change == "dp_rank":
        metadata = (("openengine-target-dp-rank", "1"),)
    else:
        req.prompt = prompt_text(6)
    stream = decode_with(clients, req, session, metadata)
    assert stream.code == grpc.StatusCode.INVALID_ARGUMENT and not stream.events, (stream.code, stream.details)
    assert change != "nixl_without_its_attributes" or "nixl_agent_name" in stream.details, stream.details
    print(f"\n{change}: {stream.details}")
    good = decode_with(clients, request(f"good-{change}", prompt_text(5)), ready.prefill_ready.kv_session)
    assert good.code == grpc.StatusCode.OK and good.of("finished"), good.details
    wait_idle(clients["decode"])


class _ForgedMemory:
    """Memory of a NIXL agent the client runs, laid out like the source's regions (all zeros)."""

    layout, dtype = "forged", "float32"

    def __init__(self, regions: list[list]) -> None:
        self.buffers = [bytearray(int(n) * int(size)) for _, n, size in regions]
        self.regions = tuple(KvRegion(ctypes.addressof((ctypes.c_char * len(b)).from_buffer(b)), int(n), int(size))
                             for b, (_, n, size) in zip(self.buffers, regions, strict=True))
        self.block_nbytes = sum(r.block_nbytes for r in self.regions)


def _forged_agent(transfer: dict) -> tuple[NixlKvTransfer, dict]:
    """The session's NIXL attributes naming the client's own agent, whose memory has the source's layout."""
    agent = NixlKvTransfer(None)
    agent.bind(_ForgedMemory(transfer["nixl_regions"]), lambda *_: None)
    forged = agent.source_attributes("forged", transfer["nixl_block_ids"])
    return agent, {**transfer, **{k: forged[k] for k in ("nixl_agent_name", "nixl_agent_metadata", "nixl_regions")}}


@pytest.mark.parametrize("backend", ["grpc", "nixl", "nixl-agent"])
def test_a_session_of_another_prompt_fails_the_pull_and_poisons_nothing(clients, backend: str) -> None:
    """K10 (found by review): prompts A and B of the same length; A's session with B's session
    id (gRPC), or with B's block ids (NIXL: the decode engine READs the ids the attributes name).
    The decode engine checks the attributes against its prompt, but the blocks were B's: it
    decoded on them and cached them under A's block hashes, so A's own session then reused them.
    Now the source says what it holds (the prompt, and for a pin the blocks) and the pull fails.
    ``nixl-agent``: A's session naming an agent the client runs, whose memory holds zeros; the
    pin at the real source succeeded and the READ took the zeros. Now a pin also says which
    agent and regions it holds the blocks in."""
    prefill_name = "prefill" if backend == "grpc" else "prefill_nixl"
    if prefill_name not in clients:
        pytest.skip(f"nixl: {nixl_available()[1]}")
    rng = random.Random(7)
    prompts = [[rng.randrange(100, 5000) for _ in range(40)] for _ in range(2)]
    reqs = []
    for name, ids in zip("ab", prompts, strict=True):
        req = request(f"swap-{backend}-{name}", "")
        req.token_ids.ids.extend(ids)
        reqs.append(req)
    want = collect(clients["aggregated"].generate(reqs[0], timeout=120)).tokens()
    a_session, b_session = (prefill(clients[prefill_name], req, timeout=60).prefill_ready.kv_session for req in reqs)
    edited = oe.KvSessionRef()
    edited.CopyFrom(a_session)
    forged_agent = None
    if backend == "grpc":
        edited.session_id = b_session.session_id
    else:
        attributes = json_format.MessageToDict(a_session.attributes_struct)
        if backend == "nixl":
            attributes["transfer"]["nixl_block_ids"] = json_format.MessageToDict(
                b_session.attributes_struct)["transfer"]["nixl_block_ids"]
        else:
            forged_agent, attributes["transfer"] = _forged_agent(attributes["transfer"])
        edited.attributes_struct.Clear()
        edited.attributes_struct.update(attributes)
    decode_req = oe.GenerateRequest()
    decode_req.CopyFrom(reqs[0])
    decode_req.request_id += "-edited"
    stream = decode_with(clients, decode_req, edited)
    errors = stream.of("error")
    assert stream.code == grpc.StatusCode.OK and len(errors) == 1 and not stream.of("token"), stream.events
    assert errors[0].code == oe.ERROR_CODE_KV_TRANSFER_FAILED and "holds another item" in errors[0].message
    decode_req.request_id = reqs[0].request_id + "-own"
    good = decode_with(clients, decode_req, a_session)
    assert good.code == grpc.StatusCode.OK and good.tokens() == want, (good.details, good.tokens(), want)
    clients[prefill_name].control.Abort(oe.AbortRequest(kv_session=b_session), timeout=10)
    for name in (prefill_name, "decode"):
        wait_idle(clients[name])
    if forged_agent is not None:
        forged_agent.close()


def test_role_mismatch_is_refused(clients) -> None:
    """K6, D7: a session on the aggregated or prefill server; a decode request without one."""
    session = ready_for(clients, "mismatch").prefill_ready.kv_session
    for name in ("aggregated", "prefill"):
        req = request(f"mm-{name}", prompt_text(5))
        req.kv.session.CopyFrom(session)
        stream = collect(clients[name].generate(req))
        assert stream.code != grpc.StatusCode.OK and not stream.events, name
    stream = collect(clients["decode"].generate(request("mm-decode", prompt_text(5))))
    assert stream.code == grpc.StatusCode.INVALID_ARGUMENT and not stream.events
    clients["prefill"].control.Abort(oe.AbortRequest(kv_session=session), timeout=10)


def test_a_lease_expires_and_a_late_decode_gets_session_not_found(clients) -> None:
    """K7, K8, X3: a decode that never comes frees the KV at lease end; a late one fails,
    not retryable, and frees every block it had allocated."""
    ready = ready_for(clients, "late", 7)
    assert clients["prefill"].load().used_kv_blocks > 0
    load = wait_idle(clients["prefill"], timeout=SESSION_TTL_S + 10)
    assert load.active_kv_sessions == 0
    stream = decode_with(clients, request("late-d", prompt_text(7)), ready.prefill_ready.kv_session)
    errors = stream.of("error")
    assert stream.code == grpc.StatusCode.OK and len(errors) == 1 and stream.events[-1].HasField("error")
    assert errors[0].code == oe.ERROR_CODE_KV_SESSION_NOT_FOUND and not errors[0].retryable
    assert not stream.of("token")
    wait_idle(clients["decode"])


class FaultyProxy(pb_grpc.KvPullServicer):
    """A KvPull in front of the real one: flips a byte of the first chunk (``corrupt``) or
    sleeps before each chunk (``delay``); ``seen`` holds each call's name and metadata."""

    def __init__(self, upstream: str, corrupt: bool = False, delay: float = 0.0) -> None:
        self.stub = pb_grpc.KvPullStub(grpc.insecure_channel(upstream))
        self.corrupt, self.delay = corrupt, delay
        self.cancelled = threading.Event()
        self.seen: list[tuple[str, dict[str, str]]] = []

    def Pull(self, request, context):  # noqa: ANN001, ANN201, N802
        self.seen.append(("Pull", dict(context.invocation_metadata())))
        context.add_callback(self.cancelled.set)
        upstream = self.stub.Pull(request)
        context.send_initial_metadata(upstream.initial_metadata())  # what the session holds, as a proxy passes it
        for i, chunk in enumerate(upstream):
            time.sleep(self.delay)
            if self.corrupt and i == 0:
                chunk.data = bytes([chunk.data[0] ^ 0xFF]) + chunk.data[1:]
            yield chunk

    def Release(self, request, context):  # noqa: ANN001, ANN201, N802
        self.seen.append(("Release", dict(context.invocation_metadata())))
        return self.stub.Release(request)


def proxied(upstream: str, **faults: object) -> tuple[grpc.Server, int]:
    server, port, _ = proxied_with(upstream, **faults)
    return server, port


def proxied_with(upstream: str, **faults: object) -> tuple[grpc.Server, int, FaultyProxy]:
    proxy = FaultyProxy(upstream, **faults)
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_KvPullServicer_to_server(proxy, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port, proxy


def test_the_trace_context_goes_with_the_kv_transfer(clients, servers) -> None:
    """M5 (ref): a decode request's traceparent and tracestate are sent on its KV pull and on
    the release that follows it."""
    server, port, proxy = proxied_with(servers["prefill"].address)
    trace = (("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"), ("tracestate", "ref=1"))
    try:
        ready = ready_for(clients, "traced", 4)
        session = oe.KvSessionRef()
        session.CopyFrom(ready.prefill_ready.kv_session)
        session.endpoints[0].port = port
        stream = decode_with(clients, request("traced-d", prompt_text(4)), session, metadata=trace)
        assert stream.of("finished") and not stream.of("error"), stream.events
        deadline = time.monotonic() + 5
        while len(proxy.seen) < 2 and time.monotonic() < deadline:  # the release is not waited for
            time.sleep(0.05)
    finally:
        server.stop(0)
    assert [name for name, _ in proxy.seen] == ["Pull", "Release"], proxy.seen
    for name, metadata in proxy.seen:
        assert {key: metadata.get(key) for key, _ in trace} == dict(trace), (name, metadata)
    wait_idle(clients["prefill"])


def test_a_corrupted_chunk_fails_the_transfer_cleanly(clients, servers) -> None:
    proxy, port = proxied(servers["prefill"].address, corrupt=True)
    try:
        ready = ready_for(clients, "corrupt", 9)
        session = oe.KvSessionRef()
        session.CopyFrom(ready.prefill_ready.kv_session)
        session.endpoints[0].port = port
        stream = decode_with(clients, request("corrupt-d", prompt_text(9)), session)
        errors = stream.of("error")
        assert len(errors) == 1 and errors[0].code == oe.ERROR_CODE_KV_TRANSFER_FAILED, stream.events
        assert "checksum" in errors[0].message and errors[0].retryable  # the session is still held
        wait_idle(clients["decode"])
        retry = decode_with(clients, request("corrupt-retry", prompt_text(9)), ready.prefill_ready.kv_session)
        assert retry.of("finished") and not retry.of("error"), "the unchanged request succeeds on retry (X3)"
    finally:
        proxy.stop(0)
    wait_idle(clients["prefill"])


def test_a_decode_cancelled_mid_transfer_frees_its_blocks(clients, servers) -> None:
    proxy, port = proxied(servers["prefill"].address, delay=3.0)  # each chunk waits 3 s
    try:
        ready = ready_for(clients, "slow", 15)
        session = oe.KvSessionRef()
        session.CopyFrom(ready.prefill_ready.kv_session)
        session.endpoints[0].port = port
        req = request("slow-d", prompt_text(15))
        req.kv.session.CopyFrom(session)
        call = clients["decode"].inference.Generate(req, timeout=60)
        deadline = time.monotonic() + 2.5
        while clients["decode"].load().used_kv_blocks == 0:  # admitted: its blocks wait for the pull
            assert time.monotonic() < deadline, "the decode request never allocated its blocks"
            time.sleep(0.05)
        call.cancel()
        wait_idle(clients["decode"])
    finally:
        proxy.stop(0)
    wait_idle(clients["prefill"], timeout=SESSION_TTL_S + 10)  # the unpulled session: its lease frees it


def test_thirty_two_concurrent_disaggregated_requests_leak_nothing(clients) -> None:
    def one(k: int) -> Stream:
        req = request(f"c32-{k}", prompt_text(k % 16), 0.8, k, max_tokens=4)
        return collect(generate_disaggregated(clients["prefill"], clients["decode"], req, timeout=180))

    with futures.ThreadPoolExecutor(32) as pool:
        streams = list(pool.map(one, range(32)))
    assert all(s.code == grpc.StatusCode.OK and s.of("finished") and not s.of("error") for s in streams)
    wait_idle(clients["prefill"])
    wait_idle(clients["decode"])


def test_cli_generate_through_prefill_and_decode(servers, server_address: str) -> None:
    def cli(*flags: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "refengine.cli", "generate", prompt_text(4), "--max-tokens", "8",
                               *flags], capture_output=True, text=True, timeout=120, env={**os.environ,
                               "HF_HUB_OFFLINE": "1"})
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout

    disaggregated = cli("--prefill", servers["prefill"].address, "--decode", servers["decode"].address)
    assert disaggregated.strip() and disaggregated == cli("--remote", server_address)
    with_prompt_logprobs = subprocess.run(
        [sys.executable, "-m", "refengine.cli", "generate", prompt_text(4), "--max-tokens", "8", "--prompt-logprobs",
         "1", "--prompt-logprob-start", "3", "--prefill", servers["prefill"].address, "--decode",
         servers["decode"].address], capture_output=True, text=True, timeout=120, env={**os.environ,
         "HF_HUB_OFFLINE": "1"})
    assert with_prompt_logprobs.returncode == 0, with_prompt_logprobs.stderr[-2000:]
    assert with_prompt_logprobs.stdout == disaggregated
    table = with_prompt_logprobs.stderr.split("prompt logprobs:\n")[1].splitlines()
    assert table[1].split()[0] == "3", "positions start at --prompt-logprob-start"
    assert "output 0 logprobs" not in with_prompt_logprobs.stderr, "no output table without --logprobs"
    half = subprocess.run([sys.executable, "-m", "refengine.cli", "generate", "x", "--prefill",
                           servers["prefill"].address], capture_output=True, text=True, timeout=60)
    assert half.returncode != 0 and "--decode" in half.stderr


def test_conformance_section_k_passes_on_the_pair(servers, server_address: str) -> None:
    """refengine is the golden target of its own K checks (the aggregated server for K10), of
    H2's probes on the named servers and of M3 on the DECODE server."""
    options = Options(prefill_address=servers["prefill"].address, decode_address=servers["decode"].address)
    results = run(server_address, ["H2", "K4", "K5", "K6", "K7", "K8", "K9", "K10", "K11", "M3"], options)
    print("\n" + format_matrix(results))
    for result in results:
        observe("prefill+decode", result)
    assert len(results) == 13 and all(r.status is Status.PASS for r in results), format_matrix(results)


def test_the_conformance_claims_on_a_prefill_and_a_decode_target(servers, clients) -> None:
    """Found by a review run of ``refengine conformance``: the prefix-cache claim's one-token
    Generate left a KV session on a PREFILL target until its lease ended (one more each run), and
    a DECODE target was said to give no usage; a server of the wrong role named with --decode
    failed the nine K and M3 checks, exit 1, with no word on the flag."""
    prefill, decode = servers["prefill"].address, servers["decode"].address
    before = clients["prefill"].load().active_kv_sessions
    report = run_report(prefill, select(["D1"]), Options())
    assert [r.status for r in report.results] == [Status.PASS]
    deadline = time.monotonic() + 2.0  # GetLoad shows a release a step later; the lease is SESSION_TTL_S
    while clients["prefill"].load().active_kv_sessions > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert clients["prefill"].load().active_kv_sessions <= before  # the probe's session was aborted at once
    claims = {p.name: p for p in run_report(decode, select(["D1"]), Options()).profiles}
    assert not claims["prefix-cache"].claimed and "DECODE server" in claims["prefix-cache"].why
    with pytest.raises(ConnectError, match="--decode: .* reports engine_role ENGINE_ROLE_PREFILL, not "
                                           "ENGINE_ROLE_DECODE"):
        run_report(prefill, select(["D1"]), Options(prefill_address=prefill, decode_address=prefill))


def test_a_prefill_cancelled_during_its_last_step_leaves_no_session(clients) -> None:
    """K7 (found by review): the client cancels while its prompt's only prefill step runs. The
    step still hands the blocks over to a KV session, but its PrefillReady has no stream left:
    the session is released at once, not held by an id nobody knows until its lease ends (then
    94 of 128 blocks for the lease of 30 s)."""
    prefill = clients["prefill"]
    req = oe.GenerateRequest(request_id="cancelled-in-step")
    req.token_ids.ids.extend(random.Random(5).randrange(100, 20000) for _ in range(1500))
    req.stopping.max_tokens = 8
    call = prefill.inference.Generate(req, timeout=60)
    deadline = time.monotonic() + 30
    while prefill.load().running_requests == 0 and time.monotonic() < deadline:
        time.sleep(0.01)  # until its prefill step runs
    call.cancel()
    with pytest.raises(grpc.RpcError) as cancelled:
        list(call)
    assert cancelled.value.code() == grpc.StatusCode.CANCELLED
    while prefill.load().running_requests and time.monotonic() < deadline:
        time.sleep(0.05)
    ended = time.monotonic()
    load = wait_idle(prefill, timeout=SESSION_TTL_S / 3)  # well within the lease: not its expiry
    assert load.active_kv_sessions == 0 and time.monotonic() - ended < SESSION_TTL_S / 2, load


def test_a_prompt_output_too_large_for_a_message_leaves_no_session(clients) -> None:
    """K7, X1 (found by review): the PromptOutput and PrefillReady of a prefill come in one final
    output; when the PromptOutput cannot fit the server's 2 MiB message limit, both give way to one
    EngineError, and the session whose PrefillReady was never sent is released at once, not
    held until its lease ends."""
    prefill = clients["prefill"]
    ids = _longest_tokens(300)
    positions = (2 << 20) // (TOKEN_INFO_BYTES + CANDIDATE_BYTES * len(ids))  # what validation lets through
    req = oe.GenerateRequest(request_id="prompt-output-too-large", token_ids=oe.TokenIds(ids=[504] * positions))
    req.stopping.max_tokens = 1
    req.response.return_prompt_logprobs = True
    req.response.prompt_candidates.token_ids.ids.extend(ids)
    stream = collect(prefill.generate(req, timeout=120))
    assert stream.code == grpc.StatusCode.OK and [e.WhichOneof("event") for e in stream.events] == ["error"], stream
    assert stream.events[0].error.code == oe.ERROR_CODE_INVALID_ARGUMENT
    ended = time.monotonic()
    wait_idle(prefill, timeout=SESSION_TTL_S / 3)
    assert time.monotonic() - ended < SESSION_TTL_S / 2


def test_a_prefill_server_whose_block_exceeds_its_message_limit_does_not_start(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """No chunk of whole blocks could carry its KV to a puller: every pull would fail."""
    server = start_server(tmp_path_factory.mktemp("big-block") / "prefill.log", *PREFILL,
                          "--block-size", "64", "--max-send-message-mib", "1", *COMMON, wait_ready=False)
    try:
        assert server.proc.wait(timeout=240) == 1
    finally:
        server.stop()
    assert "more than a 1 MiB message (--max-send-message-mib)" in server.log_tail(20_000)


def test_a_drain_waits_for_pulls_then_releases_sessions_and_a_dead_prefill_fails_the_decode(
        clients, servers) -> None:
    """K7 on drain (the NIXL prefill server, or the grpc one when NIXL is missing, goes last): the
    grace period waits for its sessions to be pulled, and one pulled then decodes as aggregated
    (found by review: every session was dropped at once, failing its decode for good); the one
    left at the grace period's end is freed, then K8: it cannot be pulled any more."""
    name = "prefill_nixl" if "prefill_nixl" in servers else "prefill"
    pulled_req, left_req = request("drain-pulled", prompt_text(11)), request("drain-left", prompt_text(10))
    pulled, left = prefill(clients[name], pulled_req), prefill(clients[name], left_req)
    want = collect(clients["aggregated"].generate(request("drain-agg", prompt_text(11)), timeout=120)).tokens()
    servers[name].signal(signal.SIGTERM)
    time.sleep(0.5)  # draining: Health NOT_READY, the KV pull service still answering
    assert clients[name].health().state != oe.HEALTH_STATE_READY
    pulled_stream = decode_with(clients, request("drain-pulled-d", prompt_text(11)), pulled.prefill_ready.kv_session)
    assert pulled_stream.code == grpc.StatusCode.OK and not pulled_stream.of("error"), pulled_stream.events
    assert pulled_stream.tokens() == want
    deadline = time.monotonic() + 3  # the pulled session is gone from the count the drain waits on
    while clients[name].load().active_kv_sessions != 1:
        assert time.monotonic() < deadline, clients[name].load()
        time.sleep(0.05)
    started = time.monotonic()
    assert servers[name].proc.wait(timeout=60) == 0
    assert time.monotonic() - started < GRACE_S + 3  # the grace period, not the session's lease
    log = servers[name].log_tail(20_000)
    assert "KV pool at exit: 0 used" in log and "drain: released 1 KV sessions" in log, log[-2000:]
    stream = decode_with(clients, request("drain-d", prompt_text(10)), left.prefill_ready.kv_session)
    errors = stream.of("error")
    assert len(errors) == 1 and errors[0].code in (oe.ERROR_CODE_KV_TRANSFER_FAILED,
                                                   oe.ERROR_CODE_KV_SESSION_NOT_FOUND), stream.events
    assert not errors[0].retryable
    wait_idle(clients["decode"])


def test_a_killed_prefill_server_fails_the_decode_cleanly(clients, servers) -> None:
    """K8, X3: the prefill process dies (SIGKILL) after PrefillReady: one KV_TRANSFER_FAILED
    (unreachable: not retryable), and the decode server's pool is back to idle."""
    if servers["prefill"].proc.poll() is not None:
        pytest.skip("the grpc prefill server was already stopped by the drain test (no NIXL)")
    ready = ready_for(clients, "killed", 12)
    servers["prefill"].proc.kill()
    servers["prefill"].proc.wait(timeout=30)
    stream = decode_with(clients, request("killed-d", prompt_text(12)), ready.prefill_ready.kv_session)
    errors = stream.of("error")
    assert stream.code == grpc.StatusCode.OK and len(errors) == 1, stream.events
    assert errors[0].code == oe.ERROR_CODE_KV_TRANSFER_FAILED and not errors[0].retryable, errors[0]
    wait_idle(clients["decode"])

