"""Disaggregated prefill/decode between two in-process engines (``engine/disagg.py``).

The transfer here is an in-process backend (it reads the prefill engine's session
blocks and writes them into the decode engine's store), so these tests check the
engine's half: K10 (prefill → decode equals aggregated, greedy and seeded, with and
without prefix hits), the session lifecycle (pull, abort, lease expiry), failure
handling (the source lost the session, a cancelled pull) and that every block is freed.
The gRPC and NIXL backends between real server processes are integration tests.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import replace
from functools import partial

import pytest

from refengine.config import CacheConfig, EngineConfig, KvTransferConfig, SchedulerConfig
from refengine.engine.disagg import first_sampled_token
from refengine.engine.engine import Engine
from refengine.engine.first_token_options import first_token_options
from refengine.kv.transfer.base import (
    BlockStore,
    Cancellation,
    KvTransferBackend,
    PullOrder,
    SessionConfirmed,
    TransferFailure,
)
from refengine.types import (
    CandidateSpec,
    GenerationRequest,
    GuidedSpec,
    InvalidRequestError,
    KvParams,
    KvSessionNotFound,
    KvSessionSpec,
    LogprobParams,
    SamplingParams,
    StoppingParams,
)
from tests.tiny_models import hf_weights, make_tiny_hf_model, model_config_from_hf
from tests.unit.tokenizer_fixture import byte_fallback_tokenizer

TOKENIZER = byte_fallback_tokenizer()
VOCAB = len(TOKENIZER)
BLOCK = 4


class InProcessPull(KvTransferBackend):
    """Pulls from another in-process engine (named "grpc", the backend a prefill engine offers)."""

    name = "grpc"
    protocol = "grpc"

    def __init__(self, source: Engine | None = None, delay: float = 0.0) -> None:
        self.source = source
        self.delay = delay
        self.store: BlockStore | None = None
        self.num_pulls = 0

    def bind(self, store: BlockStore, on_confirmed: SessionConfirmed) -> None:
        self.store = store

    def pull(self, order: PullOrder, cancelled: Cancellation) -> None:
        assert self.source is not None and self.store is not None
        self.num_pulls += 1
        deadline = time.monotonic() + self.delay
        while time.monotonic() < deadline:
            if cancelled.is_set():
                raise TransferFailure("failed", "cancelled")
            time.sleep(0.005)
        sid = order.session.session_id
        try:
            data = self.source.read_kv_session(sid, order.first_block_index, len(order.dest_block_ids))
        except KvSessionNotFound as exc:
            raise TransferFailure("not_found", str(exc)) from None
        self.store.write(order.dest_block_ids, data)
        self.source.confirm_kv_session(sid)

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def tiny():
    model = make_tiny_hf_model(vocab_size=VOCAB, max_position_embeddings=256)
    return model_config_from_hf(model), hf_weights(model)


def make_engine(tiny, role: str = "aggregated", backend: KvTransferBackend | None = None, ttl: float = 30.0,
                num_blocks: int = 64) -> Engine:
    config, weights = tiny
    engine_config = EngineConfig(max_model_len=256, role=role, debug_kv_integrity=True, max_sequences_per_request=4,
                                 cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
                                 kv_transfer=KvTransferConfig(session_ttl_seconds=ttl))
    return Engine(engine_config, config, weights, TOKENIZER, model_fingerprint="tiny",
                  transfer_backends=[backend or InProcessPull()])


@pytest.fixture()
def trio(tiny):
    aggregated = make_engine(tiny)
    prefill = make_engine(tiny, "prefill")
    pull = InProcessPull(prefill)
    decode = make_engine(tiny, "decode", pull)
    for engine in (aggregated, prefill, decode):
        engine.start()
    yield aggregated, prefill, decode, pull
    for engine in (aggregated, prefill, decode):
        engine.shutdown()


def request(rid: str, prompt: list[int], seed: int | None, temperature: float, max_tokens: int = 12,
            session: KvSessionSpec | None = None, logprobs: bool = True) -> GenerationRequest:
    return GenerationRequest(rid, prompt_token_ids=prompt,
                             sampling=SamplingParams(temperature=temperature, seed=seed),
                             stopping=StoppingParams(max_tokens=max_tokens, ignore_eos=True),
                             logprobs=LogprobParams(output_logprobs=logprobs,
                                                     output_candidates=CandidateSpec("top_n", 2) if logprobs else None),
                             kv=KvParams(session=session))


def run(engine: Engine, params: GenerationRequest, timeout: float = 60.0):
    return engine.add_request(params).result(timeout)


def wait_idle(engine: Engine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.stats().used_kv_blocks or engine.stats().active_kv_sessions or engine.has_unfinished_requests:
        assert time.monotonic() < deadline, f"not idle: {engine.stats()}"
        time.sleep(0.01)


def disaggregated(prefill: Engine, decode: Engine, params: GenerationRequest):
    handoff = run(prefill, params)
    assert handoff.prefill is not None and handoff.error is None, handoff
    assert all(not o.token_ids for o in handoff.outputs), "K4: no token leaks from a prefill engine"
    return run(decode, replace(params, kv=KvParams(session=handoff.prefill)))


def add_disaggregated(prefill: Engine, decode: Engine, rid: str, prompt: list[int], max_tokens: int):  # noqa: ANN201
    """Prefill greedy ``prompt`` on ``prefill``, then add its decode to ``decode``: the decode's future."""
    params = request(rid, prompt, None, 0.0, max_tokens=max_tokens)
    return decode.add_request(replace(params, kv=KvParams(session=run(prefill, params).prefill)))


PROMPTS = [[random.Random(i).randrange(3, VOCAB) for _ in range(3 + 5 * i)] for i in range(6)]


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, None), (0.8, 1234)])
def test_prefill_then_decode_equals_aggregated(trio, temperature: float, seed: int | None) -> None:
    """K10, twice over each prompt: the second time both sides have prefix-cache hits."""
    aggregated, prefill, decode, pull = trio
    for attempt in range(2):
        for i, prompt in enumerate(PROMPTS):
            params = request(f"r{attempt}-{i}", prompt, seed, temperature)
            want = run(aggregated, params)
            got = disaggregated(prefill, decode, params)
            assert got.error is None, got.error
            assert got.outputs[0].tokens == want.outputs[0].tokens, f"prompt {i}, attempt {attempt}"
            assert got.outputs[0].finish == want.outputs[0].finish
            assert got.usage.completion_tokens == want.usage.completion_tokens
    assert pull.num_pulls == 2 * len(PROMPTS)
    assert decode.stats().cached_kv_blocks > 0, "received blocks are published in the decode prefix cache"
    for engine in (prefill, decode):
        wait_idle(engine)
        engine.core.check_idle()


def test_handoff_attributes_and_usage(trio) -> None:
    _, prefill, _, _ = trio
    prompt = PROMPTS[3]
    handoff = run(prefill, request("h", prompt, None, 0.0))
    attrs = handoff.prefill.attributes
    assert attrs["num_prompt_tokens"] == len(prompt) and attrs["block_size"] == BLOCK
    assert attrs["num_blocks"] == -(-len(prompt) // BLOCK)
    assert isinstance(attrs["prompt_hash"], str) and isinstance(attrs["lease_expires_unix_nanos"], str)
    assert handoff.usage.prompt_tokens == len(prompt) and handoff.usage.completion_tokens == 0
    assert prefill.stats().active_kv_sessions == 1
    assert prefill.abort_kv_session(handoff.prefill.session_id)
    assert not prefill.abort_kv_session(handoff.prefill.session_id), "A2: released once"
    wait_idle(prefill)


def test_a_session_expires_and_a_late_decode_gets_not_found(tiny) -> None:
    prefill = make_engine(tiny, "prefill", ttl=0.3)
    pull = InProcessPull(prefill)
    decode = make_engine(tiny, "decode", pull)
    prefill.start()
    decode.start()
    try:
        params = request("late", PROMPTS[4], None, 0.0)
        handoff = run(prefill, params)
        assert prefill.stats().used_kv_blocks > 0
        wait_idle(prefill, timeout=5)  # the lease alone frees it
        got = run(decode, replace(params, kv=KvParams(session=handoff.prefill)))
        assert got.error is not None and got.error.code == "kv_session_not_found" and not got.error.retryable
        wait_idle(decode)
        decode.core.check_idle()
    finally:
        prefill.shutdown()
        decode.shutdown()


class KeepsConfirmation(InProcessPull):
    """A prefill engine's backend that keeps its ``on_confirmed``, which NIXL's calls after a
    READ that pinned the session."""

    def bind(self, store: BlockStore, on_confirmed: SessionConfirmed) -> None:
        super().bind(store, on_confirmed)
        self.on_confirmed = on_confirmed


def test_a_pull_that_pinned_nothing_ends_no_other_engines_pin(tiny) -> None:
    """Decode A pins a session for a one-sided READ; decode B pulls it over gRPC and releases
    it. B's release must not end A's pin: the blocks stay until A's own confirmation."""
    source = KeepsConfirmation()
    prefill = make_engine(tiny, "prefill", source)
    prefill.start()
    try:
        session_id = run(prefill, request("pins", PROMPTS[3], None, 0.0)).prefill.session_id
        held = prefill.stats().used_kv_blocks
        assert prefill.pin_kv_session(session_id, 30.0)  # A's READ may run for 30 s
        assert prefill.confirm_kv_session(session_id)  # B's Release
        time.sleep(0.3)  # a due session is freed at the step loop's wake, at once
        assert prefill.stats().used_kv_blocks == held, "A's READ may still run"
        source.on_confirmed(session_id, True)  # A's confirmation ends its pin
        wait_idle(prefill)
    finally:
        prefill.shutdown()


def test_a_decode_cancelled_mid_pull_frees_its_blocks(tiny) -> None:
    prefill = make_engine(tiny, "prefill")
    pull = InProcessPull(prefill, delay=1.0)
    decode = make_engine(tiny, "decode", pull)
    prefill.start()
    decode.start()
    try:
        params = request("cancel", PROMPTS[5], None, 0.0)
        handoff = run(prefill, params)
        stream = decode.add_request(replace(params, kv=KvParams(session=handoff.prefill)))
        time.sleep(0.2)
        assert decode.stats().used_kv_blocks > 0
        decode.abort("cancel")
        got = stream.result(10)
        assert got.outputs[0].finish.reason.value == "cancelled"
        wait_idle(decode)
        decode.core.check_idle()
        assert prefill.stats().active_kv_sessions == 1, "the session is still there for a retry"
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.parametrize("change", ["model_fingerprint", "block_size", "kv_dtype", "kv_layout", "prompt_hash",
                                    "backend", "no_session", "two_outputs", "prompt_logprobs"])
def test_an_incompatible_session_is_refused_before_acceptance(trio, change: str) -> None:
    _, prefill, decode, _ = trio
    params = request("bad", PROMPTS[2], None, 0.0)
    session = run(prefill, params).prefill
    attrs = dict(session.attributes)
    if change in attrs:
        attrs[change] = "12345" if change == "prompt_hash" else ("other" if isinstance(attrs[change], str) else 99)
    bad = replace(params, kv=KvParams(session=replace(session, attributes=attrs)))
    if change == "backend":
        bad = replace(params, kv=KvParams(session=replace(session, transfer_backend="carrier-pigeon")))
    elif change == "no_session":
        bad = params
    elif change == "two_outputs":
        bad = replace(bad, sampling=SamplingParams(num_sequences=2))
    elif change == "prompt_logprobs":
        bad = replace(bad, logprobs=LogprobParams(prompt_logprobs=True))
    with pytest.raises(InvalidRequestError) as err:
        decode.add_request(bad)
    print(f"\n{change}: {err.value}")
    assert decode.stats().used_kv_blocks == 0 and not decode.has_unfinished_requests
    prefill.abort_kv_session(session.session_id)


def test_a_kv_dtype_mismatch_is_named_as_such(trio) -> None:
    """A prefill engine with another KV dtype also has another fingerprint (loader.model_fingerprint
    covers --kv-cache-dtype): the refusal names kv_dtype, the difference the operator can fix."""
    _, prefill, decode, _ = trio
    params = request("dtype", PROMPTS[2], None, 0.0)
    session = run(prefill, params).prefill
    attrs = {**session.attributes, "kv_dtype": "bfloat16", "model_fingerprint": "tiny-bf16-kv"}
    with pytest.raises(InvalidRequestError, match=r"attributes_struct\.kv_dtype is 'bfloat16'"):
        decode.add_request(replace(params, kv=KvParams(session=replace(session, attributes=attrs))))
    prefill.abort_kv_session(session.session_id)


def test_role_mismatch_is_refused(trio) -> None:
    aggregated, prefill, _, _ = trio
    session = run(prefill, request("s", PROMPTS[1], None, 0.0)).prefill
    for engine in (aggregated, prefill):
        with pytest.raises(InvalidRequestError, match="role mismatch"):
            engine.add_request(request("m", PROMPTS[1], None, 0.0, session=session))
    with pytest.raises(InvalidRequestError, match="num_sequences"):
        prefill.add_request(replace(request("n", PROMPTS[1], None, 0.0), sampling=SamplingParams(num_sequences=2)))
    prefill.abort_kv_session(session.session_id)
    wait_idle(prefill)


class UnstoppablePull(InProcessPull):
    """A pull whose write could not be stopped (a NIXL READ past its drain)."""

    def pull(self, order: PullOrder, cancelled: Cancellation) -> None:
        raise TransferFailure("failed", "timed out: the READ still runs", dest_may_change=True)


def test_blocks_a_pull_may_still_write_are_never_reused(tiny) -> None:
    prefill = make_engine(tiny, "prefill")
    decode = make_engine(tiny, "decode", UnstoppablePull(prefill))
    prefill.start()
    decode.start()
    try:
        params = request("stuck", PROMPTS[5], None, 0.0)
        handoff = run(prefill, params)
        got = run(decode, replace(params, kv=KvParams(session=handoff.prefill)))
        assert got.error is not None and got.error.code == "kv_transfer_failed" and not got.error.retryable
        time.sleep(0.1)
        held = -(-len(PROMPTS[5]) // BLOCK)
        assert decode.stats().used_kv_blocks == held, "the blocks stay out of the pool"
        assert decode.core.kv.owners == ("quarantine:stuck",)
        decode.core.check_idle()  # accounted for: held by their owner
    finally:
        prefill.shutdown()
        decode.shutdown()


class SecondPullUnstoppable(InProcessPull):
    def pull(self, order: PullOrder, cancelled: Cancellation) -> None:
        if self.num_pulls == 1:
            self.num_pulls += 1
            raise TransferFailure("failed", "timed out: the READ still runs", dest_may_change=True)
        super().pull(order, cancelled)


def test_after_a_quarantine_a_request_too_long_for_the_rest_ends_retryable(tiny) -> None:
    """Only the pulled blocks are withheld (the prefix-cache head is not written by the pull),
    and a request longer than the pool's remaining blocks (max_model_len 40 on 10 blocks, 4 of
    them withheld) ends with a retryable ``overloaded`` fault; before, it waited at the head of
    the queue forever, and every request behind it too."""
    prefill = make_engine(tiny, "prefill")
    decode = make_engine(tiny, "decode", SecondPullUnstoppable(prefill), num_blocks=10)
    prefill.start()
    decode.start()
    rng = random.Random(7)
    head = [rng.randrange(3, VOCAB) for _ in range(3 * BLOCK)]
    try:
        disaggregated = partial(add_disaggregated, prefill, decode)

        assert disaggregated("cached", head, 2).result(30).error is None  # its 3 blocks stay cached
        tail = [rng.randrange(3, VOCAB) for _ in range(4 * BLOCK)]
        stuck = disaggregated("stuck", head + tail, 2).result(30)
        assert stuck.error is not None and stuck.error.code == "kv_transfer_failed"
        assert stuck.usage.cached_prompt_tokens == 3 * BLOCK, "the head was a prefix-cache hit"
        time.sleep(0.1)
        assert decode.core.kv.owners == ("quarantine:stuck",)
        assert decode.stats().used_kv_blocks == 4, "the 4 pulled blocks are withheld, the head is not"
        too_long = disaggregated("long", [rng.randrange(3, VOCAB) for _ in range(30)], 8)  # 38 of 40
        behind = disaggregated("behind", [rng.randrange(3, VOCAB) for _ in range(8)], 4)
        ended = too_long.result(10)
        assert ended.error is not None and ended.error.code == "overloaded" and ended.error.retryable, ended
        assert "withheld until restart" in ended.error.message
        assert behind.result(10).error is None
        decode.core.check_idle()
    finally:
        prefill.shutdown()
        decode.shutdown()


GUIDED_REGEX = r"[a-e]{2,5}(\.[a-e]{1,3}){1,3}"


def test_a_guided_request_decodes_as_aggregated(trio) -> None:
    """K10 with a grammar: the decode engine's matcher takes the prefill's first token as its own,
    so the output is the aggregated one and follows the regex (oracle: ``re``). Before, the decode
    side's grammar started over after that token and two of these four prompts broke the regex."""
    aggregated, prefill, decode, _ = trio
    for i, prompt in enumerate(PROMPTS[:4]):
        params = replace(request(f"g{i}", prompt, None, 0.0, max_tokens=24, logprobs=False),
                         guided=GuidedSpec("regex", GUIDED_REGEX))
        want, got = run(aggregated, params), disaggregated(prefill, decode, params)
        assert got.error is None, got.error
        text = TOKENIZER.decode(got.outputs[0].token_ids)
        assert re.fullmatch(GUIDED_REGEX, text), f"prompt {i}: {text!r}"
        assert got.outputs[0].tokens == want.outputs[0].tokens, f"prompt {i}"
    for engine in (prefill, decode):
        wait_idle(engine)
        engine.core.check_idle()


def test_a_first_token_the_grammar_forbids_fails_only_that_request(trio) -> None:
    """A session whose first token the decode request's grammar forbids (a prefill that did not
    follow the grammar its session claims: the options are forged to match, as the decode engine
    refuses other options before acceptance): the decode request fails with a fault naming the
    grammar, and frees every block."""
    _, prefill, decode, _ = trio
    plain = request("f", PROMPTS[2], None, 0.0, logprobs=False)
    handoff = run(prefill, plain)
    first_text = TOKENIZER.decode([first_sampled_token(handoff.prefill).token_id])
    forbidden = next(c for c in "xyz" if not first_text.startswith(c)) * 3  # a choice that token cannot begin
    guided = replace(plain, guided=GuidedSpec("choice", choices=(forbidden,)))
    forged = replace(handoff.prefill, attributes={**handoff.prefill.attributes,
                                                  "first_token_options": first_token_options(guided, "xgrammar")})
    result = run(decode, replace(guided, kv=KvParams(session=forged)))
    assert result.error is not None and "grammar rejected token" in result.error.message, result
    for engine in (prefill, decode):
        wait_idle(engine)
        engine.core.check_idle()


@pytest.mark.parametrize("change", ["logprobs", "top_n", "guided", "temperature", "seed", "min_tokens"])
def test_a_decode_request_asking_another_first_token_is_refused_before_acceptance(trio, change: str) -> None:
    """The session's first token, logprob and candidates were sampled under the prefill request's
    options; a decode request with other ones would get them as its own (found by review: no
    logprob though it asked for one, 5 candidates for its top_n 1, an INTERNAL error after
    acceptance for a grammar). It is refused, naming the option; the session stays for a decode
    request with the same options."""
    _, prefill, decode, _ = trio
    asked = request(f"o-{change}", PROMPTS[2], 7, 0.3 if change == "seed" else 0.0, max_tokens=3)  # top_n 2
    handoff = run(prefill, asked)
    other = {"logprobs": replace(asked, logprobs=LogprobParams(output_logprobs=False)),
             "top_n": replace(asked, logprobs=LogprobParams(output_logprobs=True,
                                                            output_candidates=CandidateSpec("top_n", 1))),
             "guided": replace(asked, guided=GuidedSpec("choice", choices=("xxx",))),
             "temperature": replace(asked, sampling=SamplingParams(temperature=0.5, seed=7)),
             "seed": replace(asked, sampling=SamplingParams(temperature=0.3, seed=8)),
             "min_tokens": replace(asked, stopping=StoppingParams(max_tokens=3, min_tokens=2, ignore_eos=True))}[change]
    with pytest.raises(InvalidRequestError, match="kv.session.attributes_struct.first_token_options"):
        run(decode, replace(other, kv=KvParams(session=handoff.prefill)))
    same = run(decode, replace(asked, request_id=f"o-{change}-same", kv=KvParams(session=handoff.prefill)))
    assert same.error is None and len(same.outputs[0].tokens[0].candidates) == 2
    for engine in (prefill, decode):
        wait_idle(engine)


def test_a_greedy_decode_request_may_name_another_seed(trio) -> None:
    """A greedy first token is the same under any seed: the seed is compared only where it draws."""
    _, prefill, decode, _ = trio
    asked = request("greedy-seed", PROMPTS[2], 7, 0.0, max_tokens=3)
    handoff = run(prefill, asked)
    other_seed = replace(asked, sampling=SamplingParams(temperature=0.0, seed=8), kv=KvParams(session=handoff.prefill))
    assert run(decode, other_seed).error is None
    for engine in (prefill, decode):
        wait_idle(engine)
