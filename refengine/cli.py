"""Command line: ``refengine serve`` and ``refengine generate``."""

from __future__ import annotations

import argparse
import sys
import time

from refengine.args import DefaultsHelpFormatter, add_engine_args, engine_config_from_args

__all__ = ["build_parser", "main"]  # an entry point only: import the engine flags from refengine.args


def _generate(args: argparse.Namespace) -> int:
    from refengine.types import GenerationRequest, SamplingParams, StoppingParams

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
    )
    stream = engine.add_request(request)
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


def build_parser() -> argparse.ArgumentParser:
    """``refengine`` with its ``serve`` and ``generate`` subcommands."""
    parser = argparse.ArgumentParser(prog="refengine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve OpenEngine v0.1.0 over gRPC",
                           formatter_class=DefaultsHelpFormatter)
    add_engine_args(serve)
    try:
        from refengine.server.app import add_server_args
    except ImportError:  # the server package is optional for a core-only checkout
        add_server_args = None
    if add_server_args is not None:
        add_server_args(serve)

    gen = sub.add_parser("generate", help="generate text for one prompt",
                         formatter_class=DefaultsHelpFormatter)
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--remote", metavar="HOST:PORT", help="generate through a running server")
    gen.add_argument("--model-name", default=None, help="model to ask a remote server for")
    add_engine_args(gen)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        return _generate(args)
    from refengine.server.app import serve_from_args

    return serve_from_args(args)


if __name__ == "__main__":
    sys.exit(main())
