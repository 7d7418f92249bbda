"""The request options of ``refengine generate``, read once from the flags.

``GenerateOptions`` is path-neutral plain data: ``generate_request`` turns it into the
engine's ``GenerationRequest`` (in-process) or an ``oe.GenerateRequest`` (``--remote`` and
the disaggregated hops), so that each flag is interpreted in one place. ``None`` (and
``False`` for the switches) means unset: the field is left out and the receiver's default
applies (proto3 presence), never a 0 sent in its place.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from refengine.types import GuidedSpec

__all__ = ["GUIDE_FLAGS", "SAMPLING_FIELDS", "USAGE_ERROR", "GenerateOptions", "UsageError", "guided_spec",
           "options_from_args"]

USAGE_ERROR = 2  # argparse's own exit status for a bad command line
GUIDE_FLAGS = ("json_schema", "regex", "choice", "grammar")  # argparse dests; at most one per run
#: ``GenerateOptions`` fields named as ``SamplingParams`` names them, in the engine and on the wire.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "seed", "num_sequences")


class UsageError(ValueError):
    """A bad combination or value of ``generate`` flags (exit status 2)."""


@dataclass(frozen=True)
class GenerateOptions:
    """Everything ``generate`` asks of one request, but the prompt and its request id."""

    model: str = ""  # "" = the server's default model
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    num_sequences: int | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop: bool = False
    logprobs: int | None = None  # output logprobs with this many top candidates (0: the token's own only)
    prompt_logprobs: int | None = None  # the same for prompt positions
    prompt_logprob_start: int | None = None
    priority: int | None = None
    cache_salt: str | None = None
    bypass_prefix_cache: bool = False
    lora_name: str | None = None
    guided: GuidedSpec | None = None
    images: tuple[bytes, ...] = ()


def options_from_args(args: argparse.Namespace) -> GenerateOptions:
    """The options the parsed flags describe; raises ``UsageError`` for a bad combination."""
    if args.min_tokens is not None and args.max_tokens is not None and args.min_tokens > args.max_tokens:
        raise UsageError(f"--min-tokens {args.min_tokens} is above --max-tokens {args.max_tokens}")
    if args.prompt_logprob_start is not None and args.prompt_logprobs is None:
        raise UsageError("--prompt-logprob-start needs --prompt-logprobs")
    return GenerateOptions(
        model=args.model_name or "",
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty, seed=args.sampling_seed, num_sequences=args.num_sequences,
        max_tokens=args.max_tokens, min_tokens=args.min_tokens,
        stop=tuple(args.stop), stop_token_ids=tuple(args.stop_token_ids),
        ignore_eos=args.ignore_eos, include_stop=args.include_stop,
        logprobs=args.logprobs, prompt_logprobs=args.prompt_logprobs,
        prompt_logprob_start=args.prompt_logprob_start,
        priority=args.priority, cache_salt=args.cache_salt, bypass_prefix_cache=args.no_prefix_cache,
        lora_name=args.lora_name,
        guided=guided_spec(args),
        images=tuple(_image_bytes(path) for path in args.image),
    )


def _image_bytes(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise UsageError(f"--image {path!r}: cannot read the file ({exc.strerror})") from None


def file_text(value: str) -> str | None:
    """The text of the file ``value`` names; None when it names none (inline JSON is often
    longer than a file name may be: the OS then refuses to look, which is "no file" here)."""
    try:
        path = Path(value)
        return path.read_text(encoding="utf-8") if value and path.is_file() else None
    except OSError:
        return None


def _schema_text(value: str) -> str:
    """``--json-schema``: a path to a file, else inline JSON text; either must parse as JSON."""
    try:
        text = file_text(value) or value
    except UnicodeDecodeError as exc:
        raise UsageError(f"--json-schema {value!r}: not UTF-8 text (byte {exc.start} of the file)") from None
    try:
        json.loads(text)
    except ValueError as exc:
        raise UsageError(f"--json-schema {value!r} is neither a readable file nor JSON text ({exc})") from None
    return text


def _grammar_text(value: str) -> str:
    try:
        return Path(value).read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"--grammar {value!r}: cannot read the grammar file ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"--grammar {value!r}: not UTF-8 text (byte {exc.start} of the file)") from None


def guided_spec(args: argparse.Namespace) -> GuidedSpec | None:
    """The ``GuidedSpec`` the guide flags describe (None: unguided); raises ``UsageError``."""
    given = [name for name in GUIDE_FLAGS if getattr(args, name) is not None]
    if len(given) > 1:
        raise UsageError("at most one of --json-schema, --regex, --choice, --grammar (got "
                         + ", ".join("--" + n.replace("_", "-") for n in given) + ")")
    if not given:
        if args.guided_backend is not None:
            raise UsageError("--guided-backend needs a guide: --json-schema, --regex, --choice or --grammar")
        return None
    backend = args.guided_backend or ""
    if args.json_schema is not None:
        return GuidedSpec("json_schema", spec=_schema_text(args.json_schema), backend=backend)
    if args.regex is not None:
        return GuidedSpec("regex", spec=args.regex, backend=backend)
    if args.choice is not None:
        return GuidedSpec("choice", choices=tuple(args.choice), backend=backend)
    return GuidedSpec("ebnf_grammar", spec=_grammar_text(args.grammar), backend=backend)
