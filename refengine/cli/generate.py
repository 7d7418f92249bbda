"""``refengine generate``: one prompt, in-process or through running servers."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from refengine.args import DefaultsHelpFormatter, add_engine_args, engine_config_from_args

if TYPE_CHECKING:
    from collections.abc import Iterator

    from refengine.client import OpenEngineClient, oe
    from refengine.types import GuidedSpec

__all__ = ["add_generate_parser", "run_generate"]

GUIDE_FLAGS = ("json_schema", "regex", "choice", "grammar")  # argparse dests; at most one per run
USAGE_ERROR = 2  # argparse's own exit status for a bad command line


class UsageError(ValueError):
    """A bad combination or value of ``generate`` flags (exit status 2)."""


def _schema_text(value: str) -> str:
    """``--json-schema``: a path to a file, else inline JSON text; either must parse as JSON."""
    path = Path(value)
    text = path.read_text() if value and path.is_file() else value
    try:
        json.loads(text)
    except ValueError as exc:
        raise UsageError(f"--json-schema {value!r} is neither a readable file nor JSON text ({exc})") from None
    return text


def _grammar_text(value: str) -> str:
    try:
        return Path(value).read_text()
    except OSError as exc:
        raise UsageError(f"--grammar {value!r}: cannot read the grammar file ({exc.strerror})") from None


def guided_spec(args: argparse.Namespace) -> GuidedSpec | None:
    """The ``GuidedSpec`` the guide flags describe (None: unguided); raises ``UsageError``."""
    from refengine.types import GuidedSpec

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


def _wire_request(args: argparse.Namespace, prompt: str, guided: GuidedSpec | None) -> oe.GenerateRequest:
    """``oe.GenerateRequest`` for ``--remote`` with a guide, or for ``--prefill``/``--decode``.
    The wire types come through the client module: the cli reaches the protocol only through it."""
    import uuid

    from refengine.client import oe

    request = oe.GenerateRequest(request_id=f"cli-{uuid.uuid4().hex}", model=args.model_name or "", prompt=prompt)
    request.stopping.max_tokens = args.max_tokens
    request.sampling.temperature = args.temperature
    if args.sampling_seed is not None:
        request.sampling.seed = args.sampling_seed
    if guided is None:
        return request
    if guided.mode == "choice":
        request.guided.choice.choices.extend(guided.choices)
    else:
        setattr(request.guided, guided.mode, guided.spec)
    if guided.backend:
        request.guided.backend = guided.backend
    return request


def _remote_events(args: argparse.Namespace, guided: GuidedSpec | None) -> int:
    """Through ``--remote``, or prefill on ``--prefill`` then decode on ``--decode`` (the
    two-hop flow of ``refengine.client.generate_disaggregated``)."""
    import grpc

    from refengine.client import GenerationError, OpenEngineClient, PrefillFailed, oe

    with OpenEngineClient(args.remote or args.decode) as client:
        prompt = args.prompt
        if args.chat:
            from refengine.model.chat import chat_prompt

            prompt = chat_prompt(args.model_name or client.server_info().supported_models[0], prompt)
        prefill_client = OpenEngineClient(args.prefill) if args.prefill else None
        encoder_client = OpenEngineClient(args.encoder) if args.encoder else None
        request = _wire_request(args, prompt, guided)
        for path in args.image:
            request.media.add(modality=oe.MODALITY_IMAGE, raw_bytes=Path(path).read_bytes())
        events = _events(client, prefill_client, encoder_client, request)
        try:
            for event in events:
                kind = event.WhichOneof("event")
                if kind == "token" and event.token.output_index == 0:
                    print(event.token.text, end="", flush=True)
                elif kind == "error":
                    raise GenerationError(event.error)
        except grpc.RpcError as exc:  # refused before acceptance, e.g. INVALID_ARGUMENT for a bad regex
            print(f"refengine generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        except (GenerationError, PrefillFailed) as exc:
            print(f"\nrefengine generate: {exc}", file=sys.stderr)
            return 1
        finally:
            for hop in (prefill_client, encoder_client):
                if hop is not None:
                    hop.close()
    print()
    return 0


def _events(client: OpenEngineClient, prefill_client: OpenEngineClient | None,
            encoder_client: OpenEngineClient | None, request: oe.GenerateRequest) -> Iterator[oe.GenerateResponse]:
    """The hops: [encode →] (aggregated on ``client`` | prefill → decode on ``client``)."""
    from refengine.client import generate_disaggregated

    if encoder_client is not None:
        from refengine.encoder_client import MediaClient, generate_epd

        if prefill_client is None:
            return generate_epd(MediaClient(encoder_client), client, None, request)
        return generate_epd(MediaClient(encoder_client), prefill_client, client, request)
    if prefill_client is None:
        return client.generate(request)
    return generate_disaggregated(prefill_client, client, request)


def run_generate(args: argparse.Namespace) -> int:
    from refengine.types import GenerationRequest, MediaInput, RequestError, SamplingParams, StoppingParams

    try:
        guided = guided_spec(args)
    except UsageError as exc:
        print(f"refengine generate: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    if bool(args.prefill) != bool(args.decode) or (args.prefill and args.remote):
        print("refengine generate: error: --prefill and --decode go together, without --remote", file=sys.stderr)
        return USAGE_ERROR
    if args.encoder and not (args.remote or args.prefill):
        print("refengine generate: error: --encoder needs --remote (aggregated) or --prefill/--decode",
              file=sys.stderr)
        return USAGE_ERROR
    if args.prefill or (args.remote and (guided is not None or args.image)):
        return _remote_events(args, guided)
    if args.remote:
        from refengine.client import stream_text
        from refengine.model.chat import chat_prompt

        for piece in stream_text(args.remote, args.prompt, model=args.model_name or "", max_tokens=args.max_tokens,
                                 temperature=args.temperature, chat=chat_prompt if args.chat else None):
            print(piece, end="", flush=True)
        print()
        return 0
    from refengine.engine.engine import Engine
    from refengine.runtime import apply_process_settings

    try:
        config = engine_config_from_args(args)
    except ValueError as exc:
        print(f"refengine generate: {exc}", file=sys.stderr)
        return 2
    apply_process_settings(config)
    engine = Engine.from_config(config)
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    request = GenerationRequest(
        request_id="cli",
        prompt=prompt,
        sampling=SamplingParams(temperature=args.temperature, seed=args.sampling_seed),
        stopping=StoppingParams(max_tokens=args.max_tokens),
        guided=guided,
        media=tuple(MediaInput("image", raw_bytes=Path(path).read_bytes()) for path in args.image),
    )
    try:
        stream = engine.add_request(request)
    except RequestError as exc:  # refused before acceptance, e.g. a regex that does not compile
        print(f"refengine generate: {exc}", file=sys.stderr)
        return 1
    start = time.perf_counter()
    while not stream.finished:
        engine.step()
        for out in stream.drain():
            for delta in out.deltas:
                print(delta.text, end="", flush=True)
    print(flush=True)
    usage = stream.result().usage
    elapsed = time.perf_counter() - start
    print(f"[{usage.completion_tokens} tokens in {elapsed:.2f} s, "
          f"{usage.completion_tokens / elapsed:.1f} tok/s]", file=sys.stderr)
    return 0


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    """The ``generate`` subcommand and its flags."""
    gen = sub.add_parser("generate", help="generate text for one prompt",
                         formatter_class=DefaultsHelpFormatter)
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--remote", metavar="HOST:PORT", help="generate through a running server")
    gen.add_argument("--model-name", default=None, help="model to ask a remote server for")
    gen.add_argument("--prefill", metavar="HOST:PORT",
                     help="disaggregated: prefill on this server (--role prefill) ...")
    gen.add_argument("--decode", metavar="HOST:PORT", help="... and decode on this one (--role decode)")
    gen.add_argument("--encoder", metavar="HOST:PORT",
                     help="encode the --image files on this server (--role encoder) and send embedding handles "
                     "to --remote or --prefill/--decode (draft profile encoder)")
    gen.add_argument("--image", action="append", default=[], metavar="FILE",
                     help="an image filling the prompt's next image placeholder (the model's marker, e.g. "
                     "<image>), repeatable")
    guide = gen.add_argument_group("guided decoding (at most one guide; also through --remote)")
    guide.add_argument("--json-schema", metavar="FILE|JSON", default=None,
                       help="the output is JSON valid against this schema (a file path, or inline JSON text)")
    guide.add_argument("--regex", default=None, help="the output matches this regular expression")
    guide.add_argument("--choice", action="append", default=None, metavar="TEXT",
                       help="the output is exactly one of these strings (repeat: --choice A --choice B)")
    guide.add_argument("--grammar", metavar="FILE", default=None,
                       help="the output follows the EBNF grammar in FILE (xgrammar GBNF: root ::= ...)")
    guide.add_argument("--guided-backend", metavar="NAME", default=None,
                       help="grammar backend for the guide (xgrammar, llguidance; default: the engine's)")
    add_engine_args(gen)
