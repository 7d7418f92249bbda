"""What a guide means, judged by oracles independent of the grammar engines: Python's ``re``
for regexes, strict ``json.loads`` plus ``jsonschema`` for JSON schemas, the tokenizer's own
list of special tokens. Both backends must agree with them (xgrammar 0.2.9 did not: its
``.`` matched a newline, its length-bounded JSON strings admitted a raw TAB and no escape,
and it let special tokens such as ``<unk>`` stand for their literal text).

Texts are fed to a matcher one UTF-8 byte at a time through the tiny tokenizer's byte
tokens (``<0xNN>``), so each text is judged exactly as written, whatever its tokenization.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from refengine.config import GuidedConfig
from refengine.sampling.guided import GuideCompiler, GuidedSpecError, backend_modes
from refengine.sampling.guided.bitmask import allocate_bitmask
from refengine.types import FinishReason, GuidedSpec, SamplingParams
from tests.guided_validators import bitmask_to_ids
from tests.unit.test_guided_engine import EOS, TOKENIZER, VOCAB, assert_idle, make_engine, prompt, request, tiny  # noqa: F401

BACKENDS = sorted(backend_modes())
BYTE_TOKENS = [TOKENIZER.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)]
SPECIAL = sorted(set(TOKENIZER.all_special_ids) - {EOS})  # <unk>, <s>


@pytest.fixture(scope="module")
def compiler() -> GuideCompiler:
    compiler = GuideCompiler(TOKENIZER, VOCAB, (EOS,), GuidedConfig())
    yield compiler
    compiler.close()


def accepts_whole(compiler: GuideCompiler, spec: GuidedSpec, text: str) -> bool:
    """The guide takes ``text`` byte by byte, then ends (accepts EOS)."""
    matcher = compiler.compile(spec).new_matcher()
    return all(matcher.accept_token(BYTE_TOKENS[b]) for b in text.encode()) and matcher.accept_token(EOS)


def valid_json(schema: dict, text: str) -> bool:
    try:
        value = json.loads(text)  # strict: a raw control character inside a string is invalid
    except ValueError:
        return False
    return jsonschema.Draft202012Validator(schema).is_valid(value)


# A bare string: no separators, whose spacing differs between the backends.
BOUNDED = {"type": "string", "minLength": 1, "maxLength": 3}
BOUNDED_TEXTS = ['"a\tb"', '"a\x01"', '"a\\tb"', '"a\\"b"', '"\\u00e9ab"', '"\\u00e9abc"', '"abc"', '"abcd"', '""',
                 '"é世"', '"a\\\\"']


@pytest.mark.parametrize("backend", BACKENDS)
def test_length_bounded_json_string_is_valid_json(compiler, backend) -> None:
    """A string with minLength/maxLength: every text the guide takes is valid JSON (no raw
    TAB or control character) that the schema accepts. A guide may be narrower than the
    schema (llguidance takes no ``\\u`` escape here), but takes plain in-bounds strings."""
    spec = GuidedSpec("json_schema", json.dumps(BOUNDED), backend=backend)
    unsound = [text for text in BOUNDED_TEXTS if accepts_whole(compiler, spec, text) and not valid_json(BOUNDED, text)]
    assert not unsound, f"the guide takes texts that json.loads + jsonschema refuse: {unsound}"
    for text in ('"abc"', '"é世"', '"a"'):
        assert accepts_whole(compiler, spec, text), text


REGEXES = ["a.b", ".{2,4}", r"x\.y.", "[.]z", r"[\].]+.", "(a|.)c"]
REGEX_TEXTS = ["a\nb", "axb", "a\rb", "a.b", "ab\n", "abcd", "x.yz", "x.y\n", ".z", "\nz", "]].!", "]]\n", "\nc", "ac"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_means_what_python_re_means(compiler, backend, pattern) -> None:
    """``.`` is any character but a newline, as in ``re`` (xgrammar's matched ``\\n``)."""
    spec = GuidedSpec("regex", pattern, backend=backend)
    wrong = [text for text in REGEX_TEXTS
             if accepts_whole(compiler, spec, text) != bool(re.fullmatch(pattern, text))]
    assert not wrong, f"{pattern!r}: the guide and re.fullmatch disagree on {wrong}"


@pytest.mark.parametrize(("pattern", "texts"), [(r"\Aab\Z", ["ab", "AabZ"]), (r"\Aa|b\z", ["a", "b", "Aa", "bz"])])
def test_xgrammar_regex_anchors_anchor(compiler, pattern: str, texts: list[str]) -> None:
    """``\\A``, ``\\Z`` and ``\\z`` at the ends are anchors (xgrammar matched the letters A, Z, z);
    the oracle is ``re`` with ``\\z`` read as ``\\Z`` (Python 3.11 lacks ``\\z``)."""
    spec = GuidedSpec("regex", pattern, backend="xgrammar")
    python = pattern.replace("\\z", "\\Z")
    wrong = [text for text in texts if accepts_whole(compiler, spec, text) != bool(re.fullmatch(python, text))]
    assert not wrong, f"{pattern!r}: the guide and re.fullmatch disagree on {wrong}"


@pytest.mark.parametrize("pattern", [r"a\y", r"\Gab", r"a\hb", r"[\q]", r"a\Ab", r"a\Zb"])
def test_xgrammar_refuses_letter_escapes_it_would_read_as_letters(compiler, pattern: str) -> None:
    with pytest.raises(GuidedSpecError, match="not supported by the xgrammar backend"):
        compiler.compile(GuidedSpec("regex", pattern, backend="xgrammar"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_guide_spelling_the_eos_text_spells_it(compiler, backend) -> None:
    """The regex ``</s>`` is the text "</s>", and EOS only ends it: xgrammar allowed EOS first
    (its text is "</s>"), and sampled outputs ended there, empty."""
    spec = GuidedSpec("regex", "</s>", backend=backend)
    matcher = compiler.compile(spec).new_matcher()
    mask = allocate_bitmask(1, VOCAB)
    matcher.fill_bitmask(mask, 0)
    assert not bitmask_to_ids(mask, VOCAB)[EOS], "EOS allowed before the text"
    assert accepts_whole(compiler, spec, "</s>")


SURROGATE_GUIDES = [(GuidedSpec("json_schema", json.dumps({"type": "string"})), '"', '"'),
                    (GuidedSpec("json_schema", json.dumps({"type": "string", "maxLength": 4})), '"', '"'),
                    (GuidedSpec("json_object"), '{"', '":1}'), (GuidedSpec("regex", "[^a]+"), "", ""),
                    (GuidedSpec("regex", ".+"), "", "")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("guide", "prefix", "suffix"), SURROGATE_GUIDES,
                         ids=lambda g: g.mode + ":" + g.spec if isinstance(g, GuidedSpec) else None)
def test_no_guide_lets_a_surrogate_through(compiler, backend, guide, prefix, suffix) -> None:
    """The bytes ED A0 80 (U+D800) are not UTF-8: after the lead byte ED, no token starting with
    A0-BF is allowed (xgrammar allowed them, and completed the guide after them); ED 9F BF
    (U+D7FF) and 'é' still are. Judged by Python's UTF-8 decoder."""
    spec = GuidedSpec(guide.mode, guide.spec, backend=backend)
    matcher = compiler.compile(spec).new_matcher()
    assert all(matcher.accept_token(BYTE_TOKENS[b]) for b in (prefix.encode() + b"\xed"))
    mask = allocate_bitmask(1, VOCAB)
    matcher.fill_bitmask(mask, 0)
    allowed = bitmask_to_ids(mask, VOCAB)
    assert not allowed[BYTE_TOKENS[0xA0:0xC0]].any(), "a surrogate's second byte is allowed after ED"
    assert allowed[BYTE_TOKENS[0x9F]]
    for text in ("\ud7ff", "é"):  # xgrammar's JSON object has a space after its ':'
        assert any(accepts_whole(compiler, spec, prefix + text + end) for end in (suffix, suffix.replace(":", ": ")))
    with pytest.raises(UnicodeDecodeError):
        b"\xed\xa0\x80".decode()


TEXT_GUIDES = [GuidedSpec("regex", "(.|\n)*"), GuidedSpec("regex", "[^x]{0,9}"), GuidedSpec("json_object"),
               GuidedSpec("json_schema", json.dumps({"type": "string"})),
               GuidedSpec("choice", choices=("<unk>", "<s>", "a"))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("guide", TEXT_GUIDES, ids=lambda g: g.mode + ":" + (g.spec or ",".join(g.choices)))
def test_text_guides_never_allow_special_tokens(compiler, backend, guide) -> None:
    """<unk> and <s> are control tokens, not the text "<unk>": no regex, JSON or choice guide
    allows them, at its start or inside a string (a choice spelling "<unk>" spells it in text)."""
    spec = GuidedSpec(guide.mode, guide.spec, guide.choices, backend=backend)
    matcher = compiler.compile(spec).new_matcher()
    prefix = {"json_object": '{"', "json_schema": '"'}.get(guide.mode, "")
    assert all(matcher.accept_token(BYTE_TOKENS[b]) for b in prefix.encode())
    mask = allocate_bitmask(1, VOCAB)
    matcher.fill_bitmask(mask, 0)
    allowed = bitmask_to_ids(mask, VOCAB)
    assert allowed.any(), "the guide allows nothing here"
    assert not allowed[SPECIAL].any(), f"special tokens allowed: {allowed[SPECIAL].nonzero().flatten().tolist()}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_sampled_json_and_regex_outputs_pass_the_oracles(tiny, backend) -> None:  # noqa: F811
    """Through the engine, sampled at temperature 1: every output ended by the grammar is
    valid JSON of its schema (strict json.loads) or fully matches its regex, and holds no
    special token. (On xgrammar, seed 3's JSON object held <unk> as text.)"""
    engine = make_engine(tiny)
    schema = BOUNDED
    guides = {"object": GuidedSpec("json_object", backend=backend),
              "bounded": GuidedSpec("json_schema", json.dumps(schema), backend=backend),
              "dot": GuidedSpec("regex", "[a-e].{1,6}", backend=backend)}
    reqs = [request(f"{name}-{seed}", guide, prompt(seed, 5), max_tokens=40,
                    sampling=SamplingParams(temperature=1.0, seed=seed))
            for name, guide in guides.items() for seed in range(1, 7)]
    for r, result in zip(reqs, engine.run_until_done(reqs), strict=True):
        assert result.error_message is None, result.error_message
        output = result.outputs[0]
        assert not set(output.token_ids) & set(SPECIAL), (r.request_id, output.text)
        if output.finish.reason is not FinishReason.STOP:
            continue
        if r.request_id.startswith("dot"):
            assert re.fullmatch("[a-e].{1,6}", output.text), (r.request_id, output.text)
        else:
            assert valid_json(schema if r.request_id.startswith("bounded") else {"type": "object"}, output.text), (
                r.request_id, output.text)
    assert_idle(engine)


def test_a_refusal_without_a_reason_still_says_what_failed(compiler) -> None:
    """xgrammar refuses a schema number past float range with an empty message."""
    with pytest.raises(GuidedSpecError, match=r"cannot compile this json_schema: \S"):
        compiler.compile(GuidedSpec("json_schema", '{"type": "integer", "minimum": 1e400}', backend="xgrammar"))


def test_the_surrogate_guard_on_a_vocabulary_with_merged_bytes() -> None:
    """Byte-level vocabularies merge bytes: a token may end on ED, start with a second byte, or
    (never in a trained one) hold a whole surrogate, which is then never allowed."""
    from refengine.sampling.guided.utf8_guard import SurrogateGuard

    vocab = [b"a", b"x\xed", b"\xa0b", b"\xed\xa0\x80", b"\x9f\xbf", b"\xbf"]
    guard = SurrogateGuard(vocab, len(vocab))
    assert guard.ends_on_lead == {1}
    for after_lead, allowed in ((False, [0, 1, 2, 4, 5]), (True, [0, 1, 4])):
        mask = allocate_bitmask(1, len(vocab))
        guard.restrict(mask[0], after_lead)
        assert bitmask_to_ids(mask, len(vocab)).nonzero().flatten().tolist() == allowed
