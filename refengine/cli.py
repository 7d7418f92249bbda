"""Command line: ``refengine serve``, ``generate``, ``conformance`` and ``bench``.

Each subcommand but ``serve`` lives in its own module of ``refengine.commands`` with an
``add_*_parser`` and a ``run_*``; this module only assembles the parser and dispatches.
Nothing imports the CLI; ``python -m refengine.cli`` runs it as a script.

Ctrl-C and a closed stdout (``refengine bench ... | head -1``) end any subcommand with the
shell's status for them and no traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

from refengine.args import DefaultsHelpFormatter, add_engine_args
from refengine.commands.bench import add_bench_parser, run_bench
from refengine.commands.conformance import add_conformance_parser, run_conformance
from refengine.commands.generate import add_generate_parser, run_generate

__all__ = ["build_parser", "main"]  # an entry point only: import the engine flags from refengine.args

# 128 + the signal's number, as a shell reports a command that the signal ended. A broken pipe
# is reported as such (141, like `yes | head -1`) rather than as success: the output was cut,
# and `set -o pipefail` scripts can tell.
INTERRUPTED, BROKEN_PIPE = 130, 141


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="serve OpenEngine v0.1.0 over gRPC", formatter_class=DefaultsHelpFormatter)
    add_engine_args(serve)
    try:
        from refengine.server.args import add_server_args
    except ImportError:  # the server package is optional for a core-only checkout
        return
    add_server_args(serve)


def build_parser() -> argparse.ArgumentParser:
    """``refengine`` with its subcommands."""
    parser = argparse.ArgumentParser(prog="refengine", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve_parser(sub)
    add_generate_parser(sub)
    add_bench_parser(sub)
    add_conformance_parser(sub)
    return parser


def _run(args: argparse.Namespace) -> int:
    if args.command == "generate":
        return run_generate(args)
    if args.command == "bench":
        return run_bench(args)
    if args.command == "conformance":
        return run_conformance(args)
    from refengine.commands.serve_model import model_problem
    from refengine.server.app import serve_from_args

    problem = model_problem(args.model)
    if problem:
        print(f"refengine serve: --model: {problem}", file=sys.stderr)
        return 2
    return serve_from_args(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        status = _run(args)
        sys.stdout.flush()  # inside the try: a pipe closed early fails here, not at interpreter exit
        return status
    except KeyboardInterrupt:  # the subcommand has cancelled what it had started (bench: its streams)
        return INTERRUPTED
    except BrokenPipeError:
        # Python's recipe: point stdout at devnull, or the flush at exit fails again and prints
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return BROKEN_PIPE


if __name__ == "__main__":  # ``python -m refengine.cli`` = the ``refengine`` command
    raise SystemExit(main())
