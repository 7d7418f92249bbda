"""The engine end to end on a tiny random Llama, with transformers as the oracle."""

from __future__ import annotations

import math
import random
import threading
from dataclasses import replace

import pytest
import torch

from refengine.config import CacheConfig, EngineConfig, SchedulerConfig
from refengine.engine.engine import Engine
from refengine.types import (
    CandidateSpec,
    DuplicateRequestError,
    FinishReason,
    GenerationRequest,
    InvalidRequestError,
    KvParams,
    LogprobParams,
    SamplingParams,
    StoppingParams,
)
from tests.tiny_models import hf_weights, make_tiny_hf_model, model_config_from_hf
from tests.unit.tokenizer_fixture import byte_fallback_tokenizer

TOKENIZER = byte_fallback_tokenizer()
VOCAB = len(TOKENIZER)
EOS = 2


@pytest.fixture(scope="module")
def tiny():
    model = make_tiny_hf_model(vocab_size=VOCAB, max_position_embeddings=256)
    return model, model_config_from_hf(model), hf_weights(model)


def make_engine(tiny, num_blocks=256, budget=512, max_seqs=32, block_size=4, caching=True) -> Engine:
    _, config, weights = tiny
    return Engine(
        EngineConfig(max_model_len=256, max_sequences_per_request=min(16, max_seqs),
                     cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching),
                     scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs)),
        config, weights, TOKENIZER, model_fingerprint="tiny")


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


def greedy(rid: str, ids: list[int], max_tokens: int = 16, **stopping) -> GenerationRequest:
    return GenerationRequest(rid, prompt_token_ids=ids, sampling=SamplingParams(temperature=0.0),
                             stopping=StoppingParams(max_tokens=max_tokens, ignore_eos=True, **stopping))


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = []
    with torch.no_grad():
        seq = torch.tensor([ids])
        for _ in range(n):
            token = int(model(seq).logits[0, -1].argmax())
            out.append(token)
            seq = torch.cat([seq, torch.tensor([[token]])], dim=1)
    return out


def assert_idle(engine: Engine) -> None:
    engine.core.check_idle()
    assert engine.core.pool.num_used == 0, "KV blocks leaked"


def test_greedy_matches_transformers(tiny) -> None:
    engine = make_engine(tiny)
    prompts = [prompt(i, 5 + 7 * i) for i in range(4)]
    results = engine.run_until_done([greedy(f"r{i}", p) for i, p in enumerate(prompts)])
    for p, r in zip(prompts, results, strict=True):
        assert r.outputs[0].token_ids == hf_greedy(tiny[0], p, 16)
    assert_idle(engine)


@pytest.mark.parametrize("setting", ["chunked", "preempting", "no-cache", "batch-of-one"])
def test_greedy_is_batch_and_schedule_invariant(tiny, setting) -> None:
    prompts = [prompt(100 + i, 3 + 9 * i) for i in range(6)]
    reference = make_engine(tiny).run_until_done([greedy(f"r{i}", p, 24) for i, p in enumerate(prompts)])
    kwargs = {"chunked": dict(budget=5), "preempting": dict(num_blocks=24),
              "no-cache": dict(caching=False), "batch-of-one": dict(max_seqs=1)}[setting]
    engine = make_engine(tiny, **kwargs)
    results = engine.run_until_done([greedy(f"r{i}", p, 24) for i, p in enumerate(prompts)])
    assert [r.outputs[0].token_ids for r in results] == [r.outputs[0].token_ids for r in reference]
    assert_idle(engine)


def test_prefix_cache_hit_reported_and_salted(tiny) -> None:
    engine = make_engine(tiny)
    ids = prompt(7, 30)
    first = engine.run_until_done([greedy("a", ids)])[0]
    second = engine.run_until_done([greedy("b", ids)])[0]
    assert first.usage.cached_prompt_tokens == 0
    assert second.usage.cached_prompt_tokens == 28  # 7 full blocks of 4; the last token is recomputed
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    salted = GenerationRequest("c", prompt_token_ids=ids, sampling=SamplingParams(temperature=0),
                               stopping=StoppingParams(max_tokens=4), kv=KvParams(cache_salt="tenant"))
    bypass = GenerationRequest("d", prompt_token_ids=ids, sampling=SamplingParams(temperature=0),
                               stopping=StoppingParams(max_tokens=4), kv=KvParams(bypass_prefix_cache=True))
    assert engine.run_until_done([salted])[0].usage.cached_prompt_tokens == 0
    assert engine.run_until_done([bypass])[0].usage.cached_prompt_tokens == 0
    assert_idle(engine)


def test_num_sequences_share_prompt_and_finish_once_each(tiny) -> None:
    engine = make_engine(tiny, block_size=4)
    ids = prompt(9, 10)  # a partial last block: forks must copy it on write
    single = engine.run_until_done([greedy("one", ids, 12)])[0].outputs[0].token_ids
    many = engine.run_until_done([GenerationRequest(
        "many", prompt_token_ids=ids, sampling=SamplingParams(temperature=0, num_sequences=3),
        stopping=StoppingParams(max_tokens=12, ignore_eos=True))])[0]
    assert [o.token_ids for o in many.outputs] == [single] * 3
    sampled = engine.run_until_done([GenerationRequest(
        "sampled", prompt_token_ids=ids, sampling=SamplingParams(temperature=1.0, seed=3, num_sequences=4),
        stopping=StoppingParams(max_tokens=12, ignore_eos=True))])[0]
    assert len({tuple(o.token_ids) for o in sampled.outputs}) == 4
    assert all(o.finish.reason is FinishReason.LENGTH for o in sampled.outputs)
    assert sampled.usage.completion_tokens == 48
    assert_idle(engine)


def test_seeded_sampling_reproducible_in_any_batch(tiny) -> None:
    engine = make_engine(tiny)

    def req(rid, seed, p=None):
        p = p or prompt(11, 12)
        return GenerationRequest(rid, prompt_token_ids=p, sampling=SamplingParams(temperature=0.9, top_k=40,
                                 seed=seed), stopping=StoppingParams(max_tokens=20, ignore_eos=True))

    alone = engine.run_until_done([req("alone", 5)])[0].outputs[0].token_ids
    batch = engine.run_until_done([req(f"x{i}", 50 + i, prompt(i, 4 + i)) for i in range(7)] + [req("in", 5)])
    assert batch[-1].outputs[0].token_ids == alone
    assert engine.run_until_done([req("other", 6)])[0].outputs[0].token_ids != alone


def test_overflowing_penalties_leave_the_batch_untouched(tiny) -> None:
    """G5 accepts any finite penalty and any positive repetition penalty; ones whose float32
    arithmetic overflows must still give in-vocabulary tokens with finite logprobs, and must not
    fail the step for the other requests in it (the review saw an id equal to V, then an
    INTERNAL error that ended every running request)."""
    engine = make_engine(tiny)
    ids = prompt(23, 10)
    alone = engine.run_until_done([greedy("alone", ids)])[0].outputs[0].token_ids
    extreme = [SamplingParams(temperature=1.0, seed=2, repetition_penalty=1e-300),
               SamplingParams(temperature=0.0, presence_penalty=-1e39),
               SamplingParams(temperature=0.5, seed=3, frequency_penalty=-1e308, repetition_penalty=1e300)]
    requests = [GenerationRequest(f"x{i}", prompt_token_ids=prompt(30 + i, 8), sampling=sampling,
                                  stopping=StoppingParams(max_tokens=12, ignore_eos=True),
                                  logprobs=LogprobParams(output_logprobs=True))
                for i, sampling in enumerate(extreme)]
    results = engine.run_until_done([*requests, greedy("victim", ids)])
    for result in results:
        assert result.error is None, result.error
        tokens = result.outputs[0].tokens
        assert len(tokens) == (16 if result.request_id == "victim" else 12)
        assert all(0 <= t.token_id < VOCAB for t in tokens)
        assert result.request_id == "victim" or all(t.logprob is not None and math.isfinite(t.logprob) for t in tokens)
    assert results[-1].outputs[0].token_ids == alone
    assert_idle(engine)


def test_load_during_a_step_describes_the_step(tiny) -> None:
    """H4: GetLoad read while a step's model runs (a long prefill takes seconds) counts that
    step's requests and blocks; it read the snapshot of the step before, an idle engine, since
    the step had emptied the inbox. Requests enqueued meanwhile count as waiting."""
    engine = make_engine(tiny)
    seen = []
    execute = engine.core.runner.execute

    def observed(*args, **kwargs):  # the model running: what would GetLoad say now?
        if not seen:
            engine.add_request(greedy("late", prompt(2, 6), max_tokens=2))
        seen.append(engine.stats())
        return execute(*args, **kwargs)

    engine.core.runner.execute = observed
    engine.run_until_done([greedy("long", prompt(1, 40), max_tokens=2)])
    first = seen[0]
    assert (first.running_requests, first.waiting_requests, first.prefill_batch_size) == (1, 1, 1), first
    assert first.used_kv_blocks == 10 and first.running_tokens == 40, first  # 40 tokens, blocks of 4
    assert_idle(engine)


def test_load_batch_sizes_count_requests_by_phase(tiny) -> None:
    """H4: LoadInfo's batch sizes are "requests in the last step": a request with three outputs
    decoding counts once; a prompt fed one token per step (budget 1) is prefilling, not decoding;
    once nothing runs, both are 0."""
    engine = make_engine(tiny, budget=1)
    seen = []
    execute = engine.core.runner.execute

    def observed(*args, **kwargs):
        seen.append(engine.stats())
        return execute(*args, **kwargs)

    engine.core.runner.execute = observed
    three = replace(greedy("three", prompt(3, 3), max_tokens=3), sampling=SamplingParams(temperature=0.5, seed=1,
                                                                                           num_sequences=3))
    engine.run_until_done([three])
    phases = [(s.prefill_batch_size, s.decode_batch_size) for s in seen]
    assert phases[:3] == [(1, 0)] * 3, phases  # three 1-token chunks of the prompt
    assert all(sum(p) == 1 for p in phases) and phases[-1] == (0, 1), phases  # one request, three outputs
    idle = engine.stats()
    assert (idle.prefill_batch_size, idle.decode_batch_size) == (0, 0)
    assert_idle(engine)


def test_stop_conditions(tiny) -> None:
    engine = make_engine(tiny)
    ids = prompt(13, 8)
    free_run = engine.run_until_done([greedy("free", ids, 20)])[0].outputs[0]
    stop_id = free_run.token_ids[5]
    first_at = free_run.token_ids.index(stop_id)
    by_token = engine.run_until_done([greedy("tok", ids, 20, stop_token_ids=(stop_id,))])[0].outputs[0]
    assert by_token.finish.reason is FinishReason.STOP and by_token.finish.stop_token_id == stop_id
    assert by_token.token_ids == free_run.token_ids[:first_at]  # the stop token is kept out (G14)
    kept = engine.run_until_done([greedy("kept", ids, 20, stop_token_ids=(stop_id,),
                                         include_stop_in_output=True)])[0].outputs[0]
    assert kept.token_ids == free_run.token_ids[: first_at + 1]
    # A random tiny model emits mostly byte tokens: find a prompt whose output has plain text.
    for seed in range(100):
        ids = prompt(seed, 8)
        text = engine.run_until_done([greedy(f"scan{seed}", ids, 20)])[0].outputs[0].text
        plain = [i for i in range(1, len(text) - 1) if text[i : i + 2].isascii() and text[i : i + 2].strip()]
        if plain:
            break
    free_run = engine.run_until_done([greedy("free2", ids, 20)])[0].outputs[0]
    stop_text = text[plain[0] : plain[0] + 2]
    by_text = engine.run_until_done([greedy("txt", ids, 20, stop_strings=(stop_text,))])[0].outputs[0]
    assert by_text.finish.stop_text == stop_text and by_text.text == text[: text.find(stop_text)]
    # Tokens follow their text: none whose text reaches into the excluded stop string (G14).
    assert stop_text not in TOKENIZER.decode(by_text.token_ids)
    assert by_text.token_ids == free_run.token_ids[: len(by_text.token_ids)]
    with_stop = engine.run_until_done([greedy("txt2", ids, 20, stop_strings=(stop_text,),
                                              include_stop_in_output=True)])[0].outputs[0]
    assert with_stop.text == text[: text.find(stop_text) + len(stop_text)]
    assert stop_text in TOKENIZER.decode(with_stop.token_ids)
    length = engine.run_until_done([greedy("len", ids, 3)])[0].outputs[0]
    assert length.finish.reason is FinishReason.LENGTH and len(length.token_ids) == 3
    assert_idle(engine)


def test_detokenize_false_sends_ids_only_and_still_matches_stop_strings(tiny) -> None:
    """``detokenize = false`` (Dynamo-style clients): the same token ids, no text in the
    deltas or token infos; stop strings still end the output where they would with text."""
    engine = make_engine(tiny)
    for seed in range(100):  # a prompt whose greedy output contains plain two-char text
        ids = prompt(seed, 8)
        text = engine.run_until_done([greedy(f"scan{seed}", ids, 20)])[0].outputs[0].text
        plain = [i for i in range(1, len(text) - 1) if text[i : i + 2].isascii() and text[i : i + 2].strip()]
        if plain:
            break
    stop_text = text[plain[0] : plain[0] + 2]
    cases = {"free": {}, "stop": {"stop_strings": (stop_text,)}}
    for name, stopping in cases.items():
        with_text = engine.run_until_done([greedy(f"{name}-text", ids, 20, **stopping)])[0].outputs[0]
        ids_only_request = greedy(f"{name}-ids", ids, 20, **stopping)
        ids_only_request.detokenize = False
        stream = engine.add_request(ids_only_request)
        while engine.has_unfinished_requests:
            engine.step()
        ids_only = stream.result().outputs[0]
        assert ids_only.token_ids == with_text.token_ids, name
        assert ids_only.finish == with_text.finish, name
        assert ids_only.text == "" and all(t.text == "" for t in ids_only.tokens), name
    assert with_text.finish.stop_text == stop_text
    assert_idle(engine)


def test_min_tokens_suppresses_eos(tiny) -> None:
    engine = make_engine(tiny)
    ids = prompt(17, 6)
    eos_request = GenerationRequest("eos", prompt_token_ids=ids, sampling=SamplingParams(temperature=0),
                                    stopping=StoppingParams(max_tokens=10, stop_token_ids=(), min_tokens=0))
    engine.core.eos_token_ids = tuple(engine.run_until_done([greedy("probe", ids, 1)])[0].outputs[0].token_ids)
    assert engine.run_until_done([eos_request])[0].outputs[0].finish.eos_token_id is not None
    with_min = GenerationRequest("min", prompt_token_ids=ids, sampling=SamplingParams(temperature=0),
                                 stopping=StoppingParams(max_tokens=10, min_tokens=4))
    out = engine.run_until_done([with_min])[0].outputs[0]
    assert len(out.token_ids) >= 4 and engine.core.eos_token_ids[0] not in out.token_ids[:4]


def test_prompt_logprobs_match_transformers(tiny) -> None:
    engine = make_engine(tiny, budget=7)  # chunked: logprobs are gathered across chunks
    ids = prompt(19, 20)
    request = GenerationRequest("lp", prompt_token_ids=ids, sampling=SamplingParams(temperature=0),
                                stopping=StoppingParams(max_tokens=2),
                                logprobs=LogprobParams(prompt_logprobs=True, output_logprobs=True,
                                                       prompt_candidates=CandidateSpec("top_n", top_n=3)))
    result = engine.run_until_done([request])[0]
    with torch.no_grad():
        reference = torch.log_softmax(tiny[0](torch.tensor([ids])).logits[0].float(), -1)
    assert [t.token_id for t in result.prompt_tokens] == ids
    assert result.prompt_tokens[0].logprob is None
    for pos in range(1, len(ids)):
        info = result.prompt_tokens[pos]
        assert info.logprob == pytest.approx(reference[pos - 1, ids[pos]].item(), abs=1e-4)
        assert [c.token_id for c in info.candidates] == reference[pos - 1].topk(3).indices.tolist()
    ended_at_prompt = engine.run_until_done([GenerationRequest(
        "lp1", prompt_token_ids=ids, stopping=StoppingParams(max_tokens=1),
        logprobs=LogprobParams(prompt_logprobs=True, prompt_logprob_start=5))])[0]
    assert [t.token_id for t in ended_at_prompt.prompt_tokens] == ids[5:]
    # A start past the prompt is refused only when prompt logprobs are asked for (ref): it selects nothing else.
    start_alone = engine.run_until_done([GenerationRequest(
        "lp2", prompt_token_ids=ids, stopping=StoppingParams(max_tokens=1),
        logprobs=LogprobParams(prompt_logprob_start=2**32 - 1))])[0]
    assert start_alone.error is None and start_alone.prompt_tokens is None and len(start_alone.outputs[0].tokens) == 1
    with pytest.raises(InvalidRequestError, match=r"prompt_logprob_start \(4294967295\) must be < the prompt length"):
        engine.add_request(GenerationRequest("lp3", prompt_token_ids=ids, logprobs=LogprobParams(
            prompt_logprobs=True, prompt_logprob_start=2**32 - 1)))
    for start in (len(ids), 99):  # candidates alone ask for a PromptOutput too (accepted, then none was sent)
        with pytest.raises(InvalidRequestError, match=rf"prompt_logprob_start \({start}\) must be < the prompt"):
            engine.add_request(GenerationRequest("lp4", prompt_token_ids=ids, logprobs=LogprobParams(
                prompt_candidates=CandidateSpec("top_n", top_n=2), prompt_logprob_start=start)))
    first = result.outputs[0].tokens[0]
    assert first.rank == 1 and first.logprob == pytest.approx(reference[-1].max().item(), abs=1e-4)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(prompt_token_ids=[]), "empty"),
        (dict(prompt_token_ids=[VOCAB + 5]), "vocabulary"),
        (dict(prompt_token_ids=None), "exactly one"),
        (dict(stopping=StoppingParams(max_tokens=-1)), "max_tokens"),
        (dict(stopping=StoppingParams(max_tokens=2, min_tokens=3)), "min_tokens"),
        (dict(sampling=SamplingParams(top_p=0.0)), "top_p"),
        (dict(sampling=SamplingParams(temperature=-1)), "temperature"),
        (dict(sampling=SamplingParams(num_sequences=0)), "num_sequences"),
        (dict(sampling=SamplingParams(repetition_penalty=float("nan"))), "repetition_penalty"),
        (dict(prompt_token_ids=[5] * 300), "context limit"),
        (dict(stopping=StoppingParams(max_tokens=254)), "context limit"),
        # G6 with max_tokens unset: the context leaves 256 - 3 = 253 tokens, min_tokens could never be met
        (dict(stopping=StoppingParams(min_tokens=254)), "min_tokens .254. exceeds what the context leaves"),
    ],
)
def test_bad_input_raises_typed_error_and_allocates_nothing(tiny, change, message) -> None:
    engine = make_engine(tiny)
    fields = dict(prompt_token_ids=[5, 6, 7], stopping=StoppingParams(max_tokens=4))
    fields.update(change)
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request(GenerationRequest("bad", **fields))
    assert not engine.has_unfinished_requests
    assert_idle(engine)


def test_the_context_is_bounded_by_the_kv_pool(tiny) -> None:
    """A pool smaller than max_model_len (256) bounds the context served (and advertised): a
    request that could never hold its KV is refused; an unset max_tokens runs to the pool's end."""
    engine = make_engine(tiny, num_blocks=4)  # 16 tokens in all
    assert engine.info.max_model_len == 16
    with pytest.raises(InvalidRequestError, match="exceeds the context limit of 16"):
        engine.add_request(greedy("huge", prompt(1, 10), 10))
    unset = replace(greedy("to-the-end", prompt(1, 10)), stopping=StoppingParams(ignore_eos=True))
    done = engine.run_until_done([unset])[0]
    assert len(done.outputs[0].token_ids) == 6 and done.outputs[0].finish.reason is FinishReason.LENGTH
    assert_idle(engine)


def test_duplicate_request_id_until_finished(tiny) -> None:
    engine = make_engine(tiny)
    engine.add_request(greedy("dup", prompt(1, 5)))
    with pytest.raises(DuplicateRequestError):
        engine.add_request(greedy("dup", prompt(2, 5)))
    while engine.has_unfinished_requests:
        engine.step()
    engine.run_until_done([greedy("dup", prompt(2, 5))])  # reusable once ended (G2)
    assert engine.was_finished("dup")


def test_hundreds_of_random_requests_with_aborts_leak_nothing(tiny) -> None:
    rng = random.Random(1234)
    engine = make_engine(tiny, num_blocks=40, budget=24, max_seqs=12)
    streams = {}
    for i in range(300):
        n = rng.choice([1, 1, 1, 2, 3])
        request = GenerationRequest(
            f"q{i}",
            prompt_token_ids=prompt(i, rng.randint(1, 40)),
            sampling=SamplingParams(temperature=rng.choice([0.0, 0.7, 1.2]), num_sequences=n,
                                    seed=rng.choice([None, i]), top_k=rng.choice([0, 5])),
            stopping=StoppingParams(max_tokens=rng.randint(1, 30), stop_strings=rng.choice([(), ("e",), ("th",)])),
            logprobs=LogprobParams(prompt_logprobs=rng.random() < 0.2, output_logprobs=rng.random() < 0.3),
            kv=KvParams(cache_salt=rng.choice([None, "s"])),
            priority=rng.randint(-1, 1),
        )
        streams[request.request_id] = (request, engine.add_request(request))
        for _ in range(rng.randint(0, 3)):
            engine.step()
        if rng.random() < 0.25:
            engine.abort(rng.choice(list(streams)))
    while engine.has_unfinished_requests:
        engine.step()
    assert_idle(engine)
    for request, stream in streams.values():
        completion = stream.result(timeout=0)
        assert all(o.finish is not None for o in completion.outputs)
        assert completion.usage.completion_tokens == sum(len(o.tokens) for o in completion.outputs)
        assert completion.usage.prompt_tokens == len(request.prompt_token_ids)


def test_abort_cancels_every_output(tiny) -> None:
    engine = make_engine(tiny)
    stream = engine.add_request(GenerationRequest("ab", prompt_token_ids=prompt(3, 9),
                                sampling=SamplingParams(num_sequences=3, temperature=1.0),
                                stopping=StoppingParams(max_tokens=200, ignore_eos=True)))
    for _ in range(3):
        engine.step()
    assert engine.abort("ab") and not engine.abort("missing")
    engine.step()
    completion = stream.result(timeout=0)
    assert [o.finish.reason for o in completion.outputs] == [FinishReason.CANCELLED] * 3
    assert_idle(engine)


def test_background_loop_serves_concurrent_threads(tiny) -> None:
    engine = make_engine(tiny)
    engine.start()
    try:
        results = {}

        def worker(i: int) -> None:
            stream = engine.add_request(greedy(f"t{i}", prompt(i, 6), 8))
            results[i] = stream.result(timeout=60).outputs[0].token_ids

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i in range(8):
            assert results[i] == hf_greedy(tiny[0], prompt(i, 6), 8)
    finally:
        engine.shutdown()
    assert_idle(engine)


@pytest.mark.parametrize("dtype, backend", [("float32", "torch"), ("bfloat16", "auto")])
def test_torch_paths_match_the_native_engine(tiny, dtype, backend) -> None:
    """The torch fallbacks (reference attention; bf16 also unpacked projections and torch
    elementwise ops) drive the same engine: greedy output of the float32 torch path equals
    the default (native) path's; the bf16 path runs end to end and frees every block."""
    _, config, weights = tiny
    engine = Engine(EngineConfig(max_model_len=256, dtype=dtype, attention_backend=backend,
                                 cache=CacheConfig(block_size=4, num_blocks=256)),
                    config, weights, TOKENIZER, model_fingerprint="tiny")
    requests = [greedy(f"p{i}", prompt(i, 5 + 9 * i), max_tokens=12) for i in range(6)]
    got = [r.outputs[0].token_ids for r in engine.run_until_done(requests)]
    assert all(len(ids) == 12 for ids in got)
    assert engine.core.pool.num_used == 0
    if dtype == "float32":
        default = make_engine(tiny)
        assert got == [r.outputs[0].token_ids for r in default.run_until_done(requests)]
