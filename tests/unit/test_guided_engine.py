"""Grammar-constrained generation through the engine, on a tiny random Llama.

The tiny model's byte-fallback tokenizer (``tests/unit/tokenizer_fixture.py``) is one
xgrammar and llguidance both read; the oracles (``tests/guided_validators.py``) use the
xgrammar and llguidance libraries directly, never refengine's guided code. Checked here:
greedy identity whatever the batch, chunking or preemption; one matcher per output;
every refusal of bad input before anything is allocated; logprobs of the masked
distribution; ``max_tokens`` cuts; a matcher fault ending only its own request.
"""

from __future__ import annotations

import gc
import json
import random
import re
import threading
import time
import uuid
import weakref
from typing import get_args

import llguidance
import llguidance.hf
import pytest
import torch
import xgrammar

from refengine.config import CacheConfig, EngineConfig, GuidedConfig, SchedulerConfig
from refengine.engine.engine import Engine
from refengine.sampling.guided import GuideCompiler, GuidedSpecError, backend_modes
from refengine.sampling.guided.compiler import MAX_SCHEMA_DEPTH
from refengine.types import (
    CandidateSpec,
    FinishReason,
    GenerationRequest,
    GuidedMode,
    GuidedSpec,
    InvalidRequestError,
    LogprobParams,
    OverloadedError,
    SamplingParams,
    StoppingParams,
)
from tests.guided_validators import ARITHMETIC_GBNF, GrammarOracle, bitmask_to_ids, parse_arithmetic
from tests.tiny_models import hf_weights, make_tiny_hf_model, model_config_from_hf
from tests.unit.tokenizer_fixture import byte_fallback_tokenizer

TOKENIZER = byte_fallback_tokenizer()
VOCAB = len(TOKENIZER)
EOS = 2
MODES = backend_modes()
GUIDED_MODES = get_args(GuidedMode)  # every mode a request may name
BACKENDS = sorted(MODES)

# The tiny vocabulary spells a-e, h, i, l, n, o, r, s, t, w as whole tokens, the rest as bytes.
REGEX = r"[a-e]{2,5}(\.[a-e]{1,3}){1,3}"
CHOICES = ("alpha", "beta", "gamma", "delta", "epsilon")
SCHEMA = {"type": "object", "properties": {"k": {"enum": ["a", "bb", "ccc"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["k", "n"], "additionalProperties": False}


def supports(backend: str, mode: str) -> bool:
    return mode in MODES[backend]


def backends_for(mode: str) -> list[str]:
    return [b for b in BACKENDS if supports(b, mode)]


@pytest.fixture(scope="module")
def tiny():
    model = make_tiny_hf_model(vocab_size=VOCAB, max_position_embeddings=256)
    return model, model_config_from_hf(model), hf_weights(model)


@pytest.fixture(scope="module")
def oracle() -> GrammarOracle:
    return GrammarOracle(TOKENIZER, VOCAB)


def make_engine(tiny, num_blocks=256, budget=512, max_seqs=32, guided: GuidedConfig | None = None) -> Engine:
    _, config, weights = tiny
    return Engine(
        EngineConfig(max_model_len=256, max_sequences_per_request=min(16, max_seqs),
                     cache=CacheConfig(block_size=4, num_blocks=num_blocks),
                     scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs),
                     guided=guided or GuidedConfig()),
        config, weights, TOKENIZER, model_fingerprint="tiny")


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


def request(rid: str, guided: GuidedSpec | None, ids: list[int], max_tokens: int = 24, *,
            sampling: SamplingParams | None = None, logprobs: LogprobParams | None = None,
            priority: int = 0) -> GenerationRequest:
    """Guided requests stop at EOS (the grammar's end); unguided ones run to ``max_tokens``."""
    return GenerationRequest(
        rid, prompt_token_ids=ids, sampling=sampling or SamplingParams(temperature=0.0),
        stopping=StoppingParams(max_tokens=max_tokens, ignore_eos=guided is None),
        logprobs=logprobs or LogprobParams(), guided=guided, priority=priority)


def assert_idle(engine: Engine) -> None:
    engine.core.check_idle()
    assert engine.core.pool.num_used == 0, "KV blocks leaked"


def assert_ended_by_grammar(output) -> None:
    """The matcher terminated: STOP, matched by the EOS token, which is kept out of the output."""
    assert output.finish.reason is FinishReason.STOP, output.finish
    assert output.finish.eos_token_id == EOS and output.finish.stop_text is None, output.finish
    assert EOS not in output.token_ids


def specs(backend: str) -> dict[str, GuidedSpec]:
    return {
        "regex": GuidedSpec("regex", REGEX, backend=backend),
        "json_schema": GuidedSpec("json_schema", json.dumps(SCHEMA), backend=backend),
        "choice": GuidedSpec("choice", choices=CHOICES, backend=backend),
        "ebnf_grammar": GuidedSpec("ebnf_grammar", ARITHMETIC_GBNF, backend=backend),
    }


def compiled_for(oracle: GrammarOracle, spec: GuidedSpec) -> xgrammar.CompiledGrammar:
    if spec.mode == "regex":
        return oracle.regex(spec.spec)
    if spec.mode == "json_schema":
        return oracle.json_schema(spec.spec)
    if spec.mode == "choice":
        return oracle.regex("|".join(re.escape(c) for c in spec.choices))
    if spec.mode == "ebnf_grammar":
        return oracle.ebnf(spec.spec)
    raise AssertionError(spec.mode)


def check_output(oracle: GrammarOracle, spec: GuidedSpec, output) -> None:
    """A STOP output is a whole sentence of the grammar, a LENGTH one a prefix of one."""
    matcher = oracle.matcher_after(compiled_for(oracle, spec), output.token_ids)
    if output.finish.reason is FinishReason.LENGTH:
        return
    assert_ended_by_grammar(output)
    assert matcher.is_completed(), f"{output.text!r} ended before the grammar did"
    text = TOKENIZER.decode(output.token_ids)
    if spec.mode == "regex":
        assert re.fullmatch(spec.spec, text), text
    elif spec.mode == "choice":
        assert text in spec.choices, text
    elif spec.mode == "json_schema":
        value = json.loads(text)
        assert value["k"] in ("a", "bb", "ccc") and 0 <= value["n"] <= 9 and set(value) == {"k", "n"}
    elif spec.mode == "ebnf_grammar":
        assert parse_arithmetic(text), text


# ----------------------------------------------------------------------------- identity


def identity_requests(backend: str) -> list[GenerationRequest]:
    guided = [request(f"g-{mode}", spec, prompt(10 + i, 5 + 6 * i), max_tokens=32)
              for i, (mode, spec) in enumerate(specs(backend).items()) if supports(backend, mode)]
    plain = [request(f"u{i}", None, prompt(40 + i, 4 + 9 * i), max_tokens=24) for i in range(4)]
    # Interleaved, so guided and unguided rows sit side by side in every batch.
    guided += [None] * (len(plain) - len(guided))
    return [r for pair in zip(plain, guided, strict=True) for r in pair if r is not None]


@pytest.fixture(scope="module")
def alone_outputs(tiny):
    """Each identity request run alone in a fresh engine, once per backend."""
    cache = {}

    def get(backend: str) -> dict:
        if backend not in cache:
            cache[backend] = {}
            for r in identity_requests(backend):
                engine = make_engine(tiny)
                (result,) = engine.run_until_done([r])
                assert result.error_message is None, result.error_message
                cache[backend][r.request_id] = result.outputs[0]
                assert_idle(engine)
        return cache[backend]

    return get


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("setting", ["batched", "chunked", "preempting", "batch-of-one"])
def test_greedy_identity_alone_batched_chunked_preempted(tiny, oracle, alone_outputs, backend, setting) -> None:
    """Each request's greedy tokens alone (a fresh engine each) equal its tokens in a mixed
    batch, under chunked prefill, under forced preemption and one at a time; unguided
    rows next to guided ones are untouched by their masks."""
    requests = identity_requests(backend)
    if setting == "preempting":  # the latest arrivals are the victims: make them the guided ones
        requests = [r for r in requests if r.guided is None] + [r for r in requests if r.guided is not None]
    alone = alone_outputs(backend)
    kwargs = {"batched": {}, "chunked": dict(budget=5), "preempting": dict(num_blocks=28),
              "batch-of-one": dict(max_seqs=1)}[setting]
    engine = make_engine(tiny, **kwargs)
    preempted = []
    original_preempt = engine.core.scheduler._preempt

    def spy(seq) -> None:
        preempted.append(seq.request_id)
        original_preempt(seq)

    engine.core.scheduler._preempt = spy
    results = engine.run_until_done(requests)
    for r, result in zip(requests, results, strict=True):
        got, want = result.outputs[0], alone[r.request_id]
        assert result.error_message is None, result.error_message
        assert got.token_ids == want.token_ids, r.request_id
        assert got.finish == want.finish, r.request_id
        assert got.text == want.text, r.request_id
        if r.guided is not None:
            check_output(oracle, r.guided, got)
    if setting == "preempting":
        assert any(rid.startswith("g-") for rid in preempted), f"no guided request was preempted: {preempted}"
    assert_idle(engine)


@pytest.mark.parametrize("backend", BACKENDS)
def test_guided_outputs_follow_their_grammar(tiny, oracle, backend) -> None:
    """Greedy and seeded outputs of every mode this test can judge: STOP = a whole
    sentence of the grammar (by the oracle and by an independent check), ended by EOS."""
    engine = make_engine(tiny)
    requests = []
    for mode, spec in specs(backend).items():
        if not supports(backend, mode):
            continue
        for seed in (None, 1, 2):
            sampling = SamplingParams(temperature=0.0) if seed is None else SamplingParams(temperature=1.0, seed=seed)
            requests.append(request(f"{mode}-{seed}", spec, prompt(seed or 0, 7), max_tokens=48, sampling=sampling))
    results = engine.run_until_done(requests)
    stopped = 0
    for r, result in zip(requests, results, strict=True):
        assert result.error_message is None, result.error_message
        check_output(oracle, r.guided, result.outputs[0])
        stopped += result.outputs[0].finish.reason is FinishReason.STOP
    assert stopped >= len(requests) // 2, "most outputs of these bounded grammars should end by the grammar"
    assert_idle(engine)


@pytest.mark.parametrize("backend", backends_for("choice"))
def test_non_ascii_choices_come_out_whole(tiny, backend) -> None:
    """Choices outside ASCII (an emoji outside the BMP, CJK): the output is one of them, as
    text. xgrammar read the \\ud83d\\ude00 escapes of json.dumps as two broken characters and
    sent six tokens decoding to U+FFFD."""
    choices = ("😀", "日本", "😀😃")
    engine = make_engine(tiny)
    requests = [request(f"emoji-{seed}", GuidedSpec("choice", choices=choices, backend=backend), prompt(seed, 6),
                        sampling=SamplingParams(temperature=0.0) if seed == 0 else
                        SamplingParams(temperature=1.0, seed=seed)) for seed in range(4)]
    for result in engine.run_until_done(requests):
        output = result.outputs[0]
        assert output.text in choices and output.finish.reason is FinishReason.STOP, (output.text, output.finish)
    assert_idle(engine)


# ----------------------------------------------------------------------------- num_sequences


@pytest.mark.parametrize("backend", backends_for("choice"))
def test_num_sequences_each_have_their_own_matcher(tiny, oracle, backend) -> None:
    """Three sampled outputs of one choice request: each is one whole choice, ended by EOS;
    they differ, so no matcher was shared (a shared one would reject a sibling's token)."""
    engine = make_engine(tiny)
    spec = GuidedSpec("choice", choices=CHOICES, backend=backend)
    regex_spec = GuidedSpec("regex", REGEX, backend=backend)
    reqs = [request("choice3", spec, prompt(5, 9), sampling=SamplingParams(temperature=1.0, seed=11, num_sequences=3))]
    if supports(backend, "regex"):
        reqs.append(request("regex3", regex_spec, prompt(6, 9),
                            sampling=SamplingParams(temperature=1.0, seed=12, num_sequences=3)))
    results = engine.run_until_done(reqs)
    for r, result in zip(reqs, results, strict=True):
        assert result.error_message is None, result.error_message
        assert len(result.outputs) == 3
        for output in result.outputs:
            check_output(oracle, r.guided, output)
            assert_ended_by_grammar(output)
        assert len({o.text for o in result.outputs}) >= 2, [o.text for o in result.outputs]
    assert all(o.text in CHOICES for o in results[0].outputs)
    assert_idle(engine)


# ----------------------------------------------------------------------------- max_tokens


@pytest.mark.parametrize("backend", BACKENDS)
def test_max_tokens_cut_is_length_and_a_valid_prefix(tiny, oracle, backend) -> None:
    engine = make_engine(tiny)
    # Neither grammar can end within 2 tokens here (one character per token at most).
    cases = [(mode, spec) for mode, spec in specs(backend).items()
             if supports(backend, mode) and mode in ("regex", "json_schema")]
    reqs = [request(f"cut-{mode}", spec, prompt(3, 6), max_tokens=2) for mode, spec in cases]
    results = engine.run_until_done(reqs)
    for r, result in zip(reqs, results, strict=True):
        output = result.outputs[0]
        assert output.finish.reason is FinishReason.LENGTH, (r.request_id, output.finish)
        assert len(output.token_ids) == 2
        oracle.matcher_after(compiled_for(oracle, r.guided), output.token_ids)  # a prefix of the language
        assert result.usage.completion_tokens == 2
    assert_idle(engine)


@pytest.mark.parametrize("backend", backends_for("choice"))
@pytest.mark.parametrize("stopping", [dict(), dict(ignore_eos=True), dict(min_tokens=5), dict(stop_strings=("zz",))],
                         ids=["plain", "ignore_eos", "min_tokens", "stop_string"])
def test_grammar_end_is_a_stop_at_eos_kept_out(tiny, backend, stopping) -> None:
    """Once the matcher terminates the output ends, whatever else the stopping rules say:
    STOP matched by EOS, the EOS kept out of tokens and text (G14) as for any EOS stop."""
    engine = make_engine(tiny)
    spec = GuidedSpec("choice", choices=("ab", "cd"), backend=backend)
    r = GenerationRequest("end", prompt_token_ids=prompt(1, 5), sampling=SamplingParams(temperature=0.0),
                          stopping=StoppingParams(max_tokens=10, **stopping), guided=spec)
    (result,) = engine.run_until_done([r])
    output = result.outputs[0]
    assert result.error_message is None, result.error_message
    assert_ended_by_grammar(output)
    assert output.text in ("ab", "cd") and TOKENIZER.decode(output.token_ids) == output.text
    assert_idle(engine)


# ----------------------------------------------------------------------------- bad input


def unique_slow_schema() -> str:
    """Hundreds of bounded-repeat patterns: xgrammar takes ~0.7 s to compile it cold on this
    vocabulary (measured in the test). A fresh name per call defeats every compile cache."""
    tag = uuid.uuid4().hex[:8]
    props = {f"p{tag}_{i}": {"type": "string", "pattern": f"^[a-z]{{1,{i + 100}}}$"} for i in range(200)}
    return json.dumps({"type": "object", "properties": props, "required": list(props), "additionalProperties": False})


BAD_SPECS = [
    ("json_schema", dict(spec='{"type": "nope"}'), None),
    ("json_schema", dict(spec="not json {"), None),
    ("json_schema", dict(spec=""), None),
    ("regex", dict(spec="(ab"), None),
    ("regex", dict(spec="a{3,1}"), None),
    ("regex", dict(spec=r"[^\s\S]"), "admits no output"),  # an empty language: it failed after acceptance
    ("ebnf_grammar", dict(spec='root ::= ("a"'), None),
    ("ebnf_grammar", dict(spec="root ::= undefined_rule"), None),
    ("choice", dict(choices=()), "choice"),
    ("structural_tag", dict(spec='{"type": "structural_tag"}'), None),
    ("structural_tag", dict(spec="not json"), None),
    # structures / tags that are not objects (an AttributeError, INTERNAL, on xgrammar before)
    ("structural_tag", dict(spec='{"type": "structural_tag", "structures": ["x"], "triggers": ["<"]}'), None),
    ("structural_tag", dict(spec='{"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<"], '
                                 '"tags": ["x"]}}'), None),
    # Nesting deeper than Python's recursion limit: a RecursionError was INTERNAL on llguidance.
    ("json_schema", dict(spec="[" * 5000 + "]" * 5000), None),
    ("structural_tag", dict(spec='{"type": "structural_tag", "x": ' + "[" * 5000 + "]" * 5000 + "}"), None),
]


def assert_refused(engine: Engine, guided: GuidedSpec, match: str | None = None) -> InvalidRequestError:
    """``add_request`` refuses with InvalidRequestError; nothing is allocated or queued, while
    a request already running keeps its blocks and then finishes normally."""
    running = request("running", None, prompt(1, 9), max_tokens=6)
    stream = engine.add_request(running)
    engine.step()
    used = engine.core.pool.num_used
    assert used > 0
    with pytest.raises(InvalidRequestError, match=match) as caught:
        engine.add_request(request("bad", guided, prompt(2, 5)))
    assert str(caught.value).strip(), "the refusal must say what is wrong"
    assert engine.core.pool.num_used == used
    assert "bad" not in engine.core.requests and not engine.was_finished("bad")
    while engine.has_unfinished_requests:
        engine.step()
    assert stream.result(timeout=0).outputs[0].finish.reason is FinishReason.LENGTH
    assert_idle(engine)
    return caught.value


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode, fields, match", BAD_SPECS, ids=[f"{m}-{i}" for i, (m, _, _) in enumerate(BAD_SPECS)])
def test_bad_spec_refused_before_allocation(tiny, backend, mode, fields, match) -> None:
    """Invalid schema / regex / grammar / structural tag and an empty choice list, on every
    backend that takes the mode; a backend that does not take it refuses it too."""
    engine = make_engine(tiny)
    assert_refused(engine, GuidedSpec(mode, backend=backend, **fields), match)


@pytest.mark.skipif("llguidance" not in MODES, reason="llguidance is not installed")
def test_a_limit_the_grammar_engine_hits_midway_is_named(tiny) -> None:
    """llguidance builds its lexer lazily: this nest of repeats compiles, then a token some 29
    tokens in hits its limit. The request fails alone, and the error says why (it said only
    'rejected token 2'): INVALID_ARGUMENT, not retryable, since the spec is what exceeds the limit."""
    engine = make_engine(tiny)
    guided = GuidedSpec("regex", spec="((a{0,30}){0,30}){0,30}a{60}", backend="llguidance")
    result = engine.run_until_done([request("limit", guided, prompt(1, 5), max_tokens=64)])[0]
    assert result.error_message is not None and "too many expressions" in result.error_message, result.error_message
    assert result.error.code == "invalid_argument" and not result.error.retryable, result.error
    assert_idle(engine)


def test_unknown_backend_names_the_accepted_ones(tiny) -> None:
    engine = make_engine(tiny)
    error = assert_refused(engine, GuidedSpec("regex", "[a-c]+", backend="outlines"))
    assert "xgrammar" in str(error) and "llguidance" in str(error), str(error)


def test_backend_modes_advertised() -> None:
    """The default backend takes every mode; every backend's modes are known ones."""
    assert set(BACKENDS) == {"xgrammar", "llguidance"}
    assert set(MODES["xgrammar"]) == set(GUIDED_MODES)
    for modes in MODES.values():
        assert set(modes) <= set(GUIDED_MODES) and len(set(modes)) == len(modes)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unsupported_mode_refused_with_a_clear_message(tiny, backend) -> None:
    missing = [m for m in GUIDED_MODES if not supports(backend, m)]
    if not missing:
        pytest.skip(f"{backend} takes every mode")
    engine = make_engine(tiny)
    for mode in missing:
        spec = GuidedSpec(mode, "[a-c]+" if mode == "regex" else "{}", choices=("a",) if mode == "choice" else (),
                          backend=backend)
        error = assert_refused(engine, spec)
        assert mode in str(error) and backend in str(error), str(error)


@pytest.mark.parametrize("backend", ["", "xgrammar"])
def test_compile_past_the_time_limit_is_refused(tiny, backend) -> None:
    limit = 0.05
    # Precondition, measured: xgrammar itself needs well over the limit for such a schema, cold.
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(TOKENIZER, vocab_size=VOCAB),
                                        cache_enabled=False)
    start = time.perf_counter()
    compiler.compile_json_schema(unique_slow_schema())
    cold = time.perf_counter() - start
    assert cold > 4 * limit, f"the slow schema compiled in {cold:.3f} s: not slow enough to test a {limit} s limit"
    engine = make_engine(tiny, guided=GuidedConfig(compile_timeout_seconds=limit))
    error = assert_refused(engine, GuidedSpec("json_schema", unique_slow_schema(), backend=backend))
    assert re.search(r"(?i)time", str(error)), str(error)


def test_a_spec_that_only_waited_for_a_busy_worker_is_overloaded_not_blamed() -> None:
    """One worker, busy past the limit with a slow schema (its request refused for taking too
    long): a cheap regex that waited the whole limit for the worker is refused as overloaded
    (RESOURCE_EXHAUSTED, retry), not told to simplify itself, and its job is dropped; once the
    worker is free, the same regex compiles."""
    compiler = GuideCompiler(TOKENIZER, VOCAB, (EOS,), GuidedConfig(compile_timeout_seconds=0.05, compile_threads=1))
    try:
        with pytest.raises(GuidedSpecError, match="took longer"):
            compiler.compile(GuidedSpec("json_schema", unique_slow_schema(), backend="xgrammar"))
        with pytest.raises(OverloadedError, match="busy"):
            compiler.compile(GuidedSpec("regex", "[a-c]{1,4}", backend="xgrammar"))
        deadline = time.monotonic() + 30
        while True:  # the slow compile ends on its worker; then the cheap one gets a worker at once
            try:
                compiler.compile(GuidedSpec("regex", "[a-c]{1,4}", backend="xgrammar"))
                break
            except (OverloadedError, GuidedSpecError) as exc:
                # On a busy machine even this regex can outlast 0.05 s once it has a worker: its
                # compile runs on, is cached, and the next call takes it from the cache.
                assert isinstance(exc, OverloadedError) or "took longer" in str(exc), exc
                assert time.monotonic() < deadline, "the worker never became free"
    finally:
        compiler.close()


def compile_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("refengine-guide-compile")}


def wait_ended(threads: set[threading.Thread]) -> None:
    for thread in threads:
        thread.join(timeout=10)
    assert not any(t.is_alive() for t in threads), "guide-compile threads still running"


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_engine_dropped_or_shut_down_ends_its_compile_threads_and_is_freed(tiny, backend) -> None:
    """An engine that compiled a spec and refused one the backend rejected (the error's
    traceback runs through the engine's frames) is collected once dropped, and its worker
    threads end; ``shutdown`` ends them too. (The workers used to keep their last job, and so
    the compiler, and after a refusal the engine: in the test process, ~1 GB per golden engine.)"""
    before = compile_threads()
    engine = make_engine(tiny)
    engine.run_until_done([request("ok", specs(backend)["regex"], prompt(3, 5))])
    with pytest.raises(InvalidRequestError):
        engine.add_request(request("bad", GuidedSpec("regex", "(ab", backend=backend), prompt(2, 5)))
    threads = compile_threads() - before
    assert threads, "the engine started no compile threads"
    dropped = weakref.ref(engine)
    del engine
    gc.collect()
    assert dropped() is None, "the dropped engine is still referenced"
    wait_ended(threads)

    engine = make_engine(tiny)
    engine.run_until_done([request("ok", specs(backend)["regex"], prompt(3, 5))])
    threads = compile_threads() - before
    engine.shutdown()
    wait_ended(threads)


def test_spec_size_and_choice_count_limits(tiny) -> None:
    """GuidedConfig.max_spec_bytes and max_choices bound what a request may carry."""
    engine = make_engine(tiny, guided=GuidedConfig(max_spec_bytes=64, max_choices=3))
    assert_refused(engine, GuidedSpec("regex", "a" * 65))
    assert_refused(engine, GuidedSpec("choice", choices=("a", "b", "c", "d")))
    (ok,) = engine.run_until_done([request("ok", GuidedSpec("choice", choices=("a", "b", "c")), prompt(3, 4))])
    assert ok.outputs[0].text in ("a", "b", "c")
    assert_idle(engine)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_schema_nested_too_deep_is_refused_before_compiling(tiny, backend: str) -> None:
    """Found by review: 900 nested arrays (22 KB) compiled for 36 s, past the 5 s limit, on a
    worker that kept compiling; two such specs held both workers and refused every other guide.
    Now nesting past MAX_SCHEMA_DEPTH is refused at once; below it, it compiles (brackets inside
    strings do not count; llguidance's own parser stops near 100 levels)."""
    def nested(depth: int) -> str:
        schema: dict = {"type": "string", "description": "[[{"}
        for _ in range(depth - 1):
            schema = {"type": "array", "items": schema, "maxItems": 1}
        return json.dumps(schema)

    engine = make_engine(tiny)
    started = time.perf_counter()
    assert_refused(engine, GuidedSpec("json_schema", nested(900), backend=backend), "nests objects and arrays 900")
    assert time.perf_counter() - started < 1.0
    assert MAX_SCHEMA_DEPTH >= 64
    engine.guides.compile(GuidedSpec("json_schema", nested(64), backend=backend))
    assert_idle(engine)


# ----------------------------------------------------------------------------- structural tags

TAG_SCHEMA = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"],
              "additionalProperties": False}
ONE_CALL = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": ["<f="], "at_least_one": True, "stop_after_first": True,
    "tags": [{"type": "tag", "begin": "<f=t>", "content": {"type": "json_schema", "json_schema": TAG_SCHEMA},
              "end": "</f>"}]}}
LEGACY = {"type": "structural_tag", "triggers": ["<f="],
          "structures": [{"begin": "<f=t>", "schema": TAG_SCHEMA, "end": "</f>"}]}


@pytest.mark.parametrize("backend", backends_for("structural_tag"))
def test_structural_tag_forms_honoured_or_refused(tiny, oracle, backend) -> None:
    """The legacy form (free text with tagged segments) on every backend; xgrammar's
    at_least_one + stop_after_first form on xgrammar, and elsewhere either honoured or
    refused with a message naming structural tags. Outputs are replayed by the oracle."""
    engine = make_engine(tiny)
    one_call = GuidedSpec("structural_tag", json.dumps(ONE_CALL), backend=backend)
    reqs = [request(f"one-{seed}", one_call, prompt(seed, 6), max_tokens=40,
                    sampling=SamplingParams(temperature=1.0, seed=seed)) for seed in range(3)]
    try:
        engine.add_request(request("probe", one_call, prompt(9, 6), max_tokens=1))
    except InvalidRequestError as exc:
        assert backend != "xgrammar", str(exc)
        assert "structural tag" in str(exc) or "structural_tag" in str(exc), str(exc)
        reqs = []
    while engine.has_unfinished_requests:
        engine.step()
    legacy = GuidedSpec("structural_tag", json.dumps(LEGACY), backend=backend)
    reqs += [request(f"legacy-{seed}", legacy, prompt(seed, 6), max_tokens=24,
                     sampling=SamplingParams(temperature=1.0, seed=seed)) for seed in range(3)]
    one_call_grammar = oracle.structural_tag(json.dumps(ONE_CALL))
    legacy_grammar = oracle.structural_tag(json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<f="], "tags": ONE_CALL["format"]["tags"]}}))
    for r, result in zip(reqs, engine.run_until_done(reqs), strict=True):
        assert result.error_message is None, result.error_message
        output = result.outputs[0]
        is_one_call = r.request_id.startswith("one-")
        matcher = oracle.matcher_after(one_call_grammar if is_one_call else legacy_grammar, output.token_ids)
        if output.finish.reason is FinishReason.LENGTH:
            continue
        assert_ended_by_grammar(output)
        assert matcher.is_completed()
        text = TOKENIZER.decode(output.token_ids)
        segments = re.findall(r"<f=t>(.*?)</f>", text, re.S)
        assert text.count("<f=") == len(segments), text
        assert all(json.loads(seg)["k"] in ("a", "b") for seg in segments), text
        if is_one_call:
            assert re.fullmatch(r"<f=t>(.*?)</f>", text, re.S), text
    assert_idle(engine)


# ----------------------------------------------------------------------------- logprobs


def llguidance_allowed_sets(grammar: str, token_ids: list[int]) -> list[torch.Tensor]:
    """llguidance's allowed-token set before each token and after the last (its own oracle)."""
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(TOKENIZER), grammar)
    assert not matcher.is_error(), matcher.get_error()
    sets = []
    for token_id in [*token_ids, None]:
        mask = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32).unsqueeze(0)
        sets.append(bitmask_to_ids(mask, VOCAB))
        if token_id is not None:
            assert matcher.consume_token(token_id), matcher.get_error()
    return sets


@pytest.mark.parametrize("backend", backends_for("regex"))
def test_logprobs_are_of_the_masked_distribution(tiny, oracle, backend) -> None:
    """With ``all`` candidates, exactly the tokens the grammar forbids report -inf; the
    allowed ones carry a distribution that sums to 1; the chosen token is rank 1 (greedy).
    Sampled tokens' logprobs are finite."""
    engine = make_engine(tiny)
    spec = GuidedSpec("regex", REGEX, backend=backend)
    all_lp = LogprobParams(output_logprobs=True, output_candidates=CandidateSpec("all"))
    greedy_req = request("all", spec, prompt(8, 6), max_tokens=24, logprobs=all_lp)
    sampled = [request(f"s{seed}", spec, prompt(seed, 6), max_tokens=24, logprobs=LogprobParams(output_logprobs=True),
                       sampling=SamplingParams(temperature=1.0, seed=seed)) for seed in range(3)]
    results = engine.run_until_done([greedy_req, *sampled])
    output = results[0].outputs[0]
    assert output.tokens
    if backend == "llguidance":
        # The regex as llguidance writes it, with forcing off as the backend runs it.
        lark = json.loads(llguidance.grammar_from("regex", REGEX))["grammars"][0]["lark_grammar"]
        no_forcing = llguidance.grammar_from("lark", '%llguidance {"no_forcing": true}\n' + lark)
        allowed_sets = llguidance_allowed_sets(no_forcing, output.token_ids)
    else:
        allowed_sets = oracle.allowed_after(oracle.regex(REGEX), output.token_ids)
    for position, info in enumerate(output.tokens):
        assert info.logprob is not None and info.logprob > float("-inf"), (position, info.logprob)
        assert info.rank == 1
        assert len(info.candidates) == VOCAB
        finite = torch.zeros(VOCAB, dtype=torch.bool)
        total = 0.0
        for candidate in info.candidates:
            if candidate.logprob == float("-inf"):
                continue
            finite[candidate.token_id] = True
            total += torch.tensor(candidate.logprob, dtype=torch.float64).exp().item()
        assert torch.equal(finite, allowed_sets[position]), (
            f"position {position}: finite logprobs on {finite.nonzero().flatten().tolist()}, "
            f"the grammar allows {allowed_sets[position].nonzero().flatten().tolist()}")
        assert total == pytest.approx(1.0, abs=1e-3)
        by_id = {c.token_id: c for c in info.candidates}
        assert by_id[info.token_id].logprob == pytest.approx(info.logprob)
    for result in results[1:]:
        for info in result.outputs[0].tokens:
            assert info.logprob is not None and info.logprob > float("-inf"), info
    assert_idle(engine)


# ----------------------------------------------------------------------------- matcher fault


class RejectingMatcher:
    """Stands in for an output's matcher: everything as the real one, except that it
    rejects every token."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def accept_token(self, *args, **kwargs) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.mark.parametrize("backend", backends_for("regex"))
def test_matcher_rejecting_a_token_ends_only_that_request(tiny, backend) -> None:
    """A matcher that refuses the sampled token (output 0 of two) ends its whole request with
    one terminal error; concurrent requests, guided or not, finish normally; every KV block
    is freed."""
    engine = make_engine(tiny)
    spec = GuidedSpec("regex", "[a-e]{20,30}", backend=backend)
    victim = engine.add_request(request("victim", spec, prompt(1, 6), max_tokens=40,
                                        sampling=SamplingParams(temperature=1.0, seed=4, num_sequences=2)))
    bystander = engine.add_request(request("bystander", spec, prompt(2, 6), max_tokens=40))
    plain = engine.add_request(request("plain", None, prompt(3, 6), max_tokens=12))
    engine.step()
    state = engine.core.requests["victim"].outputs[0]
    state.matcher = RejectingMatcher(state.matcher)
    while engine.has_unfinished_requests:
        engine.step()
    outputs = victim.drain()
    assert sum(o.finished for o in outputs) == 1 and outputs[-1].finished
    assert outputs[-1].error is not None and [o.error is not None for o in outputs].count(True) == 1
    failed = victim.result(timeout=0)
    assert failed.error_message, "the failed request's stream must carry the error"
    done = bystander.result(timeout=0)
    assert done.error_message is None
    assert done.outputs[0].finish.reason is FinishReason.STOP and re.fullmatch("[a-e]{20,30}", done.outputs[0].text)
    other = plain.result(timeout=0)
    assert other.error_message is None and other.outputs[0].finish.reason is FinishReason.LENGTH
    assert len(other.outputs[0].token_ids) == 12
    assert_idle(engine)


@pytest.mark.parametrize("backend", backends_for("regex"))
def test_ignore_eos_keeps_eos_out_while_the_grammar_can_go_on(tiny, backend) -> None:
    """G15: ``ignore_eos`` never stops at EOS. A guided output that sampled EOS would end (its
    matcher terminates), so EOS is masked wherever the grammar allows another token: the EOS
    candidate reports -inf at every step and the output runs to ``max_tokens``."""
    engine = make_engine(tiny)
    spec = GuidedSpec("regex", "[a-e]+", backend=backend)
    r = GenerationRequest("ignore-eos", prompt_token_ids=prompt(7, 6),
                          sampling=SamplingParams(temperature=1.0, seed=3),
                          stopping=StoppingParams(max_tokens=12, ignore_eos=True), guided=spec,
                          logprobs=LogprobParams(output_candidates=CandidateSpec("token_ids", token_ids=(EOS,))))
    (result,) = engine.run_until_done([r])
    output = result.outputs[0]
    assert output.finish.reason is FinishReason.LENGTH, output.finish
    assert len(output.token_ids) == 12 and EOS not in output.token_ids
    assert all(t.candidates[0].logprob == float("-inf") for t in output.tokens)
    assert_idle(engine)
