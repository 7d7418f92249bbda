"""Golden tests of grammar-constrained generation: SmolLM2-135M-Instruct, its real
tokenizer and chat template, sampled at temperature 1.0, on both grammar backends.

Every mode is judged by an oracle independent of refengine: ``jsonschema`` for JSON
Schema and ``json_object`` outputs, ``re.fullmatch`` for regexes, the choice list, a
recursive-descent parser for the arithmetic grammar, and JSON Schema again inside the
structural tag's segments. An output ended by the grammar (STOP, matched by EOS) must be
a whole valid sentence; one cut by ``max_tokens`` (LENGTH) must be a prefix of one: a
fresh xgrammar matcher (the library, used directly) accepts its tokens, completes them
by the grammar alone, and the completed text must pass the same oracle.

All ~107 requests of a backend are submitted at once and stepped to the end as one batch
(up to 64 running); only the three greedy identity checks run again, each alone.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from refengine.config import CacheConfig, EngineConfig, SchedulerConfig
from refengine.engine.engine import Engine
from refengine.model.loader import load_model_config, load_tokenizer, load_weights, model_fingerprint
from refengine.sampling.guided import backend_modes
from refengine.types import (
    FinishReason,
    GenerationRequest,
    GuidedSpec,
    InvalidRequestError,
    SamplingParams,
    StoppingParams,
)
from tests.guided_validators import ARITHMETIC_GBNF, GrammarOracle, json_validator, parse_arithmetic

pytestmark = pytest.mark.golden

VOCAB = 49152  # SmolLM2's embedding rows (= its tokenizer's size)
MODES = backend_modes()
BACKENDS = ["xgrammar", "llguidance"]
SEEDS = (0, 1, 2)
MAX_TOKENS = 128
CUT_TOKENS = 10  # the max_tokens of the requests meant to end by LENGTH


def obj(properties: dict, required: list[str] | None = None, **extra) -> dict:
    """An object schema that admits no other keys, so every backend reads it alike."""
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required,
            "additionalProperties": False, **extra}


# Strings are bounded with patterns, not minLength/maxLength: xgrammar 0.2.9 compiles a
# length-bounded string to [^"\\\r\n]{m,n}, which admits raw control characters (invalid
# JSON) and no escapes. Formats: only uuid and email, whose grammars match what jsonschema
# checks (xgrammar's "date" admits 2023-02-31 and its "ipv4" leading zeros, which
# jsonschema's checkers reject).
SCHEMAS = {
    "person": obj({"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "nested": obj({"user": obj({"id": {"type": "integer", "minimum": 1},
                                "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,10}$"},
                                         "minItems": 1, "maxItems": 3}})}),
    "enums": obj({"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L"]}}),
    "optional": obj({"title": {"type": "string", "pattern": "^[A-Za-z ]{1,30}$"}, "subtitle": {"type": "string"},
                     "rating": {"type": "number", "minimum": 0, "maximum": 5}}, required=["title", "rating"]),
    "int_array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                  "minItems": 2, "maxItems": 4},
    "uuid": obj({"id": {"type": "string", "format": "uuid"}}),
    "email": obj({"email": {"type": "string", "format": "email"}, "verified": {"type": "boolean"}}),
    "patterns": obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                     "day": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])$"}}),
    "refs": {"$defs": {"point": obj({"x": {"type": "integer"}, "y": {"type": "integer"}})},
             **obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}})},
    "any_of_scalar": obj({"value": {"anyOf": [{"type": "integer"}, {"type": "string", "pattern": "^[a-z]{0,10}$"},
                                              {"type": "null"}]}}),
    "any_of_objects": obj({"shape": {"anyOf": [
        obj({"kind": {"const": "circle"}, "radius": {"type": "number", "minimum": 0, "maximum": 100}}),
        obj({"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1, "maximum": 100}})]}}),
    "object_array": obj({"items": {"type": "array", "minItems": 1, "maxItems": 2,
                                   "items": obj({"name": {"type": "string", "pattern": "^[a-z]{1,12}$"},
                                                 "qty": {"type": "integer", "minimum": 1, "maximum": 10}})}}),
    "bool_null": obj({"active": {"type": "boolean"}, "deleted": {"type": "null"}}),
    "matrix": obj({"rows": {"type": "array", "minItems": 1, "maxItems": 2,
                            "items": {"type": "array", "minItems": 2, "maxItems": 2,
                                      "items": {"type": "integer", "minimum": -9, "maximum": 9}}}}),
    "word": obj({"word": {"type": "string", "pattern": "^[a-z]{3,8}$"}}),
    "recursive": {"$defs": {"node": obj({"value": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "children": {"type": "array", "maxItems": 2,
                                                      "items": {"$ref": "#/$defs/node"}}})},
                  "$ref": "#/$defs/node"},
    "mixed_enum": obj({"level": {"enum": [1, 2, 3, "high", None]}}),
    "temperature": obj({"celsius": {"type": "number", "minimum": -50, "maximum": 50},
                        "unit": {"type": "string", "enum": ["C", "F"]}}),
    "const_version": obj({"version": {"const": 2}, "name": {"type": "string", "pattern": "^[a-z][a-z0-9_]{0,15}$"},
                          "build": {"type": "integer", "minimum": 0, "maximum": 999}}, required=["version", "name"]),
    "top_any_of": {"anyOf": [obj({"ok": {"const": True}}), obj({"error": {"type": "string"}})]},
}

REGEXES = {
    "phone": (r"\(\d{3}\) \d{3}-\d{4}", "Write a US phone number, like (555) 123-4567."),
    "date": (r"20\d{2}-(0[1-9]|1[0-2])-(0[1-9]|1\d|2[0-8])", "What is today's date? Answer as YYYY-MM-DD."),
    "answer": (r"(Yes|No), because [a-z ]{5,40}\.", "Is the sky blue? Answer yes or no, with a short reason."),
}
CHOICES = ("Paris", "London", "Berlin", "Madrid", "Rome")

WEATHER = obj({"city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"}, "unit": {"enum": ["celsius", "fahrenheit"]}})
TIME = obj({"timezone": {"type": "string", "pattern": "^[A-Za-z/_]{1,30}$"}})
TOOL_SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
# The form vLLM and xgrammar's legacy API use; both backends take it (free text in which
# "<function=" starts a tagged segment).
STRUCTURAL_TAG_LEGACY = {
    "type": "structural_tag",
    "structures": [{"begin": f"<function={name}>", "schema": schema, "end": "</function>"}
                   for name, schema in TOOL_SCHEMAS.items()],
    "triggers": ["<function="],
}


def triggered_tags(**options) -> dict:
    """xgrammar 0.2.9's own structural-tag format (``{"type": "structural_tag", "format": ...}``)."""
    tags = [{"type": "tag", "begin": f"<function={name}>", "content": {"type": "json_schema", "json_schema": schema},
             "end": "</function>"} for name, schema in TOOL_SCHEMAS.items()]
    return {"type": "structural_tag",
            "format": {"type": "triggered_tags", "triggers": ["<function="], "tags": tags, **options}}


# Exactly one call, nothing around it: a triggered_tags option llguidance's structural tags lack.
STRUCTURAL_TAG_ONE_CALL = triggered_tags(at_least_one=True, stop_after_first=True)
# A few-shot chat, so that the free-text form's outputs call tools too.
TOOL_CHAT = [
    {"role": "system", "content": "You call tools by writing <function=NAME>{JSON arguments}</function>. Tools: "
                                  'get_weather with {"city": string, "unit": "celsius" or "fahrenheit"}; '
                                  'get_time with {"timezone": string}.'},
    {"role": "user", "content": "What time is it in Tokyo?"},
    {"role": "assistant", "content": '<function=get_time>{"timezone": "Asia/Tokyo"}</function>'},
    {"role": "user", "content": "What is the weather in Paris right now?"},
]
SEGMENT = re.compile(r"<function=(get_weather|get_time)>(.*?)</function>", re.S)


@pytest.fixture(scope="module")
def model_parts(smollm2_dir):
    return (load_model_config(smollm2_dir), load_weights(smollm2_dir), load_tokenizer(smollm2_dir),
            model_fingerprint(smollm2_dir))


@pytest.fixture(scope="module")
def oracle(model_parts) -> GrammarOracle:
    return GrammarOracle(model_parts[2], VOCAB)


def chat(tokenizer, text: str | list[dict]) -> list[int]:
    messages = [{"role": "user", "content": text}] if isinstance(text, str) else text
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False)


def build_requests(tokenizer, backend: str) -> list[tuple[str, GenerationRequest]]:
    """(kind, request) for every case of one backend; kinds key the checks below."""
    cases = []

    def add(kind: str, rid: str, text: str | list[dict], guided: GuidedSpec | None, max_tokens: int, seed: int,
            num_sequences: int = 1, greedy: bool = False) -> None:
        sampling = SamplingParams(temperature=0.0) if greedy else SamplingParams(temperature=1.0, seed=seed,
                                                                                  num_sequences=num_sequences)
        cases.append((kind, GenerationRequest(
            f"{backend}/{rid}", prompt_token_ids=chat(tokenizer, text), sampling=sampling,
            stopping=StoppingParams(max_tokens=max_tokens, ignore_eos=guided is None), guided=guided)))

    # Short prompts (the grammar, not the prompt, carries the schema): prefill is half the work.
    # The cut requests first: they end within a few steps and free their slots.
    for name, schema in SCHEMAS.items():
        text = f"Reply with JSON only: {name.replace('_', ' ')}."
        add(f"json_schema:{name}", f"cut-{name}", text, GuidedSpec("json_schema", json.dumps(schema), backend=backend),
            CUT_TOKENS, 7)
    # Greedy, to compare with the same requests alone: unguided rows beside ~60 guided ones
    # are untouched by their masks, and a guided row is the same in the batch as alone.
    add("identity:plain", "plain-0", "Name three colors.", None, 32, 0, greedy=True)
    add("identity:plain", "plain-1", "Write a haiku about the sea.", None, 32, 0, greedy=True)
    add("identity:guided", "greedy-person", "Reply with JSON only: person.",
        GuidedSpec("json_schema", json.dumps(SCHEMAS["person"]), backend=backend), 48, 0, greedy=True)
    for name, schema in SCHEMAS.items():
        text = f"Reply with JSON only: {name.replace('_', ' ')}."
        for seed in SEEDS:
            add(f"json_schema:{name}", f"{name}-{seed}", text,
                GuidedSpec("json_schema", json.dumps(schema), backend=backend), MAX_TOKENS, seed)
    for name, (pattern, text) in REGEXES.items():
        for seed in SEEDS[:2]:
            add(f"regex:{name}", f"regex-{name}-{seed}", text, GuidedSpec("regex", pattern, backend=backend), 40, seed)
    # Three outputs of one request, each with its own matcher.
    add("choice", "choice-n3", "Name a European capital city.", GuidedSpec("choice", choices=CHOICES, backend=backend),
        16, 5, num_sequences=3)
    add("regex:date", "regex-date-n3", REGEXES["date"][1], GuidedSpec("regex", REGEXES["date"][0], backend=backend),
        40, 5, num_sequences=3)
    for seed in SEEDS:
        add("choice", f"choice-{seed}", "What is the capital of France? Answer with one city name.",
            GuidedSpec("choice", choices=CHOICES, backend=backend), 16, seed)
        add("json_object", f"object-{seed}", "Describe a book (title, author, year) as a JSON object.",
            GuidedSpec("json_object", backend=backend), MAX_TOKENS, seed)
        add("ebnf_grammar", f"ebnf-{seed}", "Write an arithmetic expression that equals 10, such as (2+3)*2.",
            GuidedSpec("ebnf_grammar", ARITHMETIC_GBNF, backend=backend), 48, seed)
    for seed in range(5):
        add("structural_tag:legacy", f"tag-legacy-{seed}", TOOL_CHAT,
            GuidedSpec("structural_tag", json.dumps(STRUCTURAL_TAG_LEGACY), backend=backend), 128, seed)
    for seed in SEEDS[:2]:
        add("structural_tag:one_call", f"tag-one-{seed}", TOOL_CHAT,
            GuidedSpec("structural_tag", json.dumps(STRUCTURAL_TAG_ONE_CALL), backend=backend), 128, seed)
    return cases


class BackendRun:
    """One backend's whole batch: every result, and every refusal, by request id."""

    def __init__(self, backend: str, cases, results: dict, refusals: dict[str, str], alone: dict) -> None:
        self.backend = backend
        self.cases = cases
        self.results = results
        self.refusals = refusals
        self.alone = alone  # the identity cases, each run alone in a fresh engine

    def of(self, prefix: str):
        """(kind, request, completion) of the accepted cases whose kind starts with ``prefix``."""
        return [(kind, r, self.results[r.request_id]) for kind, r in self.cases
                if kind.startswith(prefix) and r.request_id in self.results]

    def refused(self, prefix: str) -> dict[str, str]:
        return {r.request_id: self.refusals[r.request_id] for kind, r in self.cases
                if kind.startswith(prefix) and r.request_id in self.refusals}


@pytest.fixture(scope="module", params=BACKENDS)
def run(request, model_parts) -> BackendRun:
    backend = request.param
    config, weights, tokenizer, fingerprint = model_parts
    engine = Engine(EngineConfig(cache=CacheConfig(block_size=16, num_blocks=1536),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64)),
                    config, weights, tokenizer, model_fingerprint=fingerprint)
    cases = build_requests(tokenizer, backend)
    streams, refusals = {}, {}
    for _, r in cases:
        try:
            streams[r.request_id] = engine.add_request(r)
        except InvalidRequestError as exc:
            refusals[r.request_id] = str(exc)
    while engine.has_unfinished_requests:
        engine.step()
    engine.core.check_idle()
    assert engine.core.pool.num_used == 0
    results = {rid: s.result(timeout=0) for rid, s in streams.items()}
    alone = {}
    for kind, r in cases:
        if kind.startswith("identity:"):
            fresh = Engine(EngineConfig(cache=CacheConfig(block_size=16, num_blocks=64)), config, weights, tokenizer,
                           model_fingerprint=fingerprint)
            (alone[r.request_id],) = fresh.run_until_done([r])
    return BackendRun(backend, cases, results, refusals, alone)


# ----------------------------------------------------------------------------- checks


def expect_mode(run: BackendRun, prefix: str, mode: str) -> list:
    """The accepted cases of ``prefix``; a backend that does not advertise ``mode`` must have
    refused them all (InvalidRequestError naming the mode and the backend)."""
    cases = run.of(prefix)
    if mode in MODES[run.backend]:
        assert not run.refused(prefix), run.refused(prefix)
        assert cases
    else:
        assert not cases and run.refused(prefix)
        for message in run.refused(prefix).values():
            assert mode in message and run.backend in message, message
    return cases


def ended_by_grammar(completion, output) -> bool:
    """STOP by EOS (True), or LENGTH (False); anything else is a failure (raised)."""
    assert completion.error_message is None, completion.error_message
    if output.finish.reason is FinishReason.LENGTH:
        return False
    assert output.finish.reason is FinishReason.STOP, output.finish
    assert output.finish.eos_token_id is not None and output.finish.stop_text is None, output.finish
    assert output.finish.stop_token_id is None, output.finish
    return True


def judge(oracle: GrammarOracle, compiled, completion, output, max_tokens: int, check) -> str:
    """Checks one output; returns "stop" or "length". ``check(text)`` raises on invalid text."""
    if ended_by_grammar(completion, output):
        matcher = oracle.matcher_after(compiled, output.token_ids)
        assert matcher.is_completed(), f"ended before the grammar did: {output.text!r}"
        check(output.text)
        return "stop"
    assert len(output.token_ids) == max_tokens, (len(output.token_ids), max_tokens)
    oracle.complete(compiled, output.token_ids, check)  # some completion by the grammar passes ``check``
    return "length"


def run_checks(cases, judge_one) -> dict[str, int]:
    """Judges every output of every case, collecting every failure (with its request and
    text) before failing. ``judge_one(kind, request, completion, output)`` -> "stop" | "length"."""
    counts = {"stop": 0, "length": 0}
    failures = []
    for kind, r, completion in cases:
        assert len(completion.outputs) == r.sampling.num_sequences
        for output in completion.outputs:
            try:
                counts[judge_one(kind, r, completion, output)] += 1
            except AssertionError as exc:
                failures.append(f"{r.request_id}[{output.index}] ({kind}): {exc}\n    output: {output.text!r}")
            except (ValueError, KeyError, jsonschema.ValidationError) as exc:  # json.loads, jsonschema, ...
                failures.append(f"{r.request_id}[{output.index}] ({kind}): {type(exc).__name__}: {exc}\n"
                                f"    output: {output.text!r}")
    assert not failures, f"{len(failures)} outputs are wrong:\n" + "\n".join(failures)
    return counts


def json_check(schema: dict):
    validator = json_validator(schema)

    def check(text: str) -> None:
        validator.validate(json.loads(text))

    return check


def test_greedy_rows_same_in_the_batch_as_alone(run) -> None:
    cases = run.of("identity:")
    assert len(cases) == 3, run.refused("identity:")
    for _, r, completion in cases:
        alone = run.alone[r.request_id]
        assert completion.error_message is None and alone.error_message is None
        assert completion.outputs[0].token_ids == alone.outputs[0].token_ids, r.request_id
        assert completion.outputs[0].finish == alone.outputs[0].finish, r.request_id


def test_json_schema_outputs_validate(run, oracle) -> None:
    cases = expect_mode(run, "json_schema:", "json_schema")
    compiled = {name: oracle.json_schema(schema, relax_number_bounds=True) for name, schema in SCHEMAS.items()}

    def judge_one(kind, r, completion, output):
        name = kind.split(":", 1)[1]
        return judge(oracle, compiled[name], completion, output, r.stopping.max_tokens, json_check(SCHEMAS[name]))

    counts = run_checks(cases, judge_one)
    assert len(cases) == len(SCHEMAS) * (len(SEEDS) + 1)
    assert counts["stop"] >= len(SCHEMAS), f"too few outputs ended by their schema: {counts}"
    assert counts["length"] >= len(SCHEMAS) // 2, f"too few cut outputs to check as prefixes: {counts}"


def test_regex_outputs_fullmatch(run, oracle) -> None:
    cases = expect_mode(run, "regex:", "regex")

    def judge_one(kind, r, completion, output):
        pattern = REGEXES[kind.split(":", 1)[1]][0]

        def check(text: str) -> None:
            assert re.fullmatch(pattern, text), f"{text!r} does not match {pattern}"

        return judge(oracle, oracle.regex(pattern), completion, output, r.stopping.max_tokens, check)

    counts = run_checks(cases, judge_one)
    assert counts["stop"] >= len(cases) // 2, counts  # all these patterns are short


def test_choice_outputs_are_one_choice(run, oracle) -> None:
    cases = expect_mode(run, "choice", "choice")
    compiled = oracle.regex("|".join(re.escape(c) for c in CHOICES))

    def judge_one(kind, r, completion, output):
        def check(text: str) -> None:
            assert text in CHOICES, text

        return judge(oracle, compiled, completion, output, r.stopping.max_tokens, check)

    # 16 tokens spell any choice: every output ends by the grammar.
    assert run_checks(cases, judge_one)["stop"] == sum(r.sampling.num_sequences for _, r, _ in cases)


def test_json_object_outputs_are_objects(run, oracle) -> None:
    cases = expect_mode(run, "json_object", "json_object")
    values = []

    def judge_one(kind, r, completion, output):
        def check(text: str) -> None:
            value = json.loads(text)
            assert isinstance(value, dict), f"not an object: {text!r}"
            values.append(value)

        return judge(oracle, oracle.json_object(), completion, output, r.stopping.max_tokens, check)

    run_checks(cases, judge_one)
    # Any object, not only {}: the model was asked for keys and must be allowed to write them.
    assert any(values), values


def test_ebnf_outputs_parse(run, oracle) -> None:
    cases = expect_mode(run, "ebnf_grammar", "ebnf_grammar")
    compiled = oracle.ebnf(ARITHMETIC_GBNF)

    def judge_one(kind, r, completion, output):
        def check(text: str) -> None:
            assert parse_arithmetic(text), f"not an arithmetic expression: {text!r}"

        return judge(oracle, compiled, completion, output, r.stopping.max_tokens, check)

    run_checks(cases, judge_one)


def tagged_segments_check(require_one_call: bool):
    def check(text: str) -> None:
        if require_one_call:
            assert SEGMENT.fullmatch(text), f"not exactly one call: {text!r}"
        # Every trigger opens a complete segment whose content is valid for its tool.
        assert text.count("<function=") == len(SEGMENT.findall(text)), f"a trigger without its segment: {text!r}"
        for name, content in SEGMENT.findall(text):
            json_validator(TOOL_SCHEMAS[name]).validate(json.loads(content))

    return check


def test_structural_tag_segments_hold_valid_json(run, oracle) -> None:
    """The legacy form (free text with tagged calls), on every backend that takes structural
    tags; the few-shot prompt makes some outputs call a tool."""
    cases = expect_mode(run, "structural_tag:legacy", "structural_tag")
    compiled = oracle.structural_tag(json.dumps(triggered_tags()))

    def judge_one(kind, r, completion, output):
        return judge(oracle, compiled, completion, output, r.stopping.max_tokens, tagged_segments_check(False))

    run_checks(cases, judge_one)
    calls = sum(len(SEGMENT.findall(c.outputs[0].text)) for _, _, c in cases)
    assert calls >= 1, [c.outputs[0].text for _, _, c in cases]


def test_structural_tag_exactly_one_call(run, oracle) -> None:
    """xgrammar's at_least_one + stop_after_first: one call, nothing else. A backend that
    cannot express it refuses the request with a message saying so."""
    if "structural_tag" not in MODES[run.backend]:
        expect_mode(run, "structural_tag:one_call", "structural_tag")
        return
    refused = run.refused("structural_tag:one_call")
    if refused:
        assert run.backend != "xgrammar", refused  # the default backend takes every format
        assert not run.of("structural_tag:one_call")
        for message in refused.values():
            assert "structural tag" in message or "structural_tag" in message, message
        return
    cases = run.of("structural_tag:one_call")
    compiled = oracle.structural_tag(json.dumps(STRUCTURAL_TAG_ONE_CALL))

    def judge_one(kind, r, completion, output):
        return judge(oracle, compiled, completion, output, r.stopping.max_tokens, tagged_segments_check(True))

    run_checks(cases, judge_one)


def test_every_request_was_accepted_or_refused_as_advertised(run) -> None:
    """Nothing refused that the backend advertises, except the one-call structural tag
    llguidance may lack; every accepted request ended with a finish on its output."""
    allowed_refusals = {r.request_id for kind, r in run.cases if kind == "structural_tag:one_call"}
    for _, r in run.cases:
        if (r.guided is None or r.guided.mode in MODES[run.backend]) and r.request_id not in allowed_refusals:
            assert r.request_id in run.results, (r.request_id, run.refusals.get(r.request_id))
    for completion in run.results.values():
        assert all(o.finish is not None for o in completion.outputs) and completion.error_message is None
