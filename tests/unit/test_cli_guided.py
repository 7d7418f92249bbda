"""``refengine generate`` with a guide: --json-schema, --regex, --choice, --grammar, --guided-backend.

One subprocess run loads the embedded model (the local engine, ~25 s on 2 cores). The
remote runs call ``main`` in-process against the conformance suite's toy server (llguidance
over an ASCII vocabulary, no model), which shows that the flags reach
``GenerateRequest.guided`` on the wire; the usage errors never load a model.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from refengine.cli import main

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def generate(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """``refengine generate ARGS`` in this process: (exit status, stdout, stderr)."""
    code = main(["generate", *args])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)



def test_local_regex_is_followed() -> None:
    proc = subprocess.run([sys.executable, "-m", "refengine.cli", "generate", "The year the war ended was",
                           "--regex", "[0-9]{4}", "--max-tokens", "8"], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.fullmatch("[0-9]{4}", proc.stdout.rstrip("\n")), proc.stdout


@pytest.mark.parametrize(
    ("flags", "pattern"),
    [
        (["--regex", "[0-9]{1,3}"], "[0-9]{1,3}"),
        (["--choice", "yes", "--choice", "no"], "yes|no"),
        (["--choice", "maybe", "--guided-backend", "llguidance"], "maybe"),
        (["--json-schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                       "required": ["a"], "additionalProperties": False})], r'\{"a":-?\d+\}'),
        # longer than a file name may be (the OS refused to look it up: OSError, a traceback)
        (["--json-schema", json.dumps({"type": "object", "description": "x" * 600, "properties": {
            "a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False})], r'\{"a":-?\d+\}'),
    ],
    ids=["regex", "choice", "choice-backend", "inline-schema", "inline-schema-past-name-max"],
)
def test_remote_guide_on_the_wire(capsys: pytest.CaptureFixture[str], toy_address: str, flags: list[str],
                                  pattern: str) -> None:
    proc = generate(capsys, "Hello", "--remote", toy_address, "--model-name", "toy", "--max-tokens", "12", *flags)
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch(pattern, proc.stdout.rstrip("\n")), proc.stdout


def test_remote_schema_and_grammar_files(capsys: pytest.CaptureFixture[str], toy_address: str,
                                        tmp_path: Path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], '
                      '"additionalProperties": false}')
    grammar = tmp_path / "yes_no.gbnf"
    grammar.write_text('root ::= "yes" | "no"\n')
    common = ("Hello", "--remote", toy_address, "--model-name", "toy", "--max-tokens", "16")
    proc = generate(capsys, *common, "--json-schema", str(schema))
    assert proc.returncode == 0, proc.stderr
    assert isinstance(json.loads(proc.stdout)["ok"], bool), proc.stdout
    proc = generate(capsys, *common, "--grammar", str(grammar))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip("\n") in ("yes", "no"), proc.stdout


def test_remote_refusal_is_reported(capsys: pytest.CaptureFixture[str], toy_address: str) -> None:
    proc = generate(capsys, "Hello", "--remote", toy_address, "--model-name", "toy", "--regex", "(ab")
    assert proc.returncode == 1
    assert "INVALID_ARGUMENT" in proc.stderr, proc.stderr
    proc = generate(capsys, "Hello", "--remote", toy_address, "--model-name", "toy", "--regex", "a",
                    "--guided-backend", "no-such-backend")
    assert proc.returncode == 1 and "INVALID_ARGUMENT" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--regex", "a", "--choice", "b"], "at most one of"),
        (["--json-schema", "{}", "--grammar", "g.gbnf"], "at most one of"),
        (["--guided-backend", "xgrammar"], "needs a guide"),
        (["--json-schema", "{not json"], "neither a readable file nor JSON"),
        (["--grammar", "/nonexistent/g.gbnf"], "cannot read the grammar file"),
    ],
    ids=["regex-and-choice", "schema-and-grammar", "backend-alone", "schema-not-json", "grammar-missing"],
)
def test_usage_errors(capsys: pytest.CaptureFixture[str], flags: list[str], words: str) -> None:
    proc = generate(capsys, "Hello", *flags)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert words in proc.stderr and "refengine generate: error:" in proc.stderr, proc.stderr
    assert proc.stdout == ""
