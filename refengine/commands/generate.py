"""``refengine generate``: one prompt, in-process or through running servers.

Every ``GenerateRequest`` option has a flag named as the contract names it; the same
flags reach both paths (``generate_options`` reads them once, ``generate_request`` maps
them to the engine's or the wire's request). How the stream is shown: ``generate_output``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from refengine.args import DefaultsHelpFormatter, _DeprecatedAlias, add_engine_args
from refengine.client import address_arg
from refengine.commands.generate_options import USAGE_ERROR, UsageError, options_from_args
from refengine.commands.generate_run import run_local, run_remote
from refengine.config import EngineConfig

__all__ = ["add_generate_parser", "run_generate"]

UINT32_MAX, UINT64_MAX, INT32_MIN, INT32_MAX = (1 << 32) - 1, (1 << 64) - 1, -(1 << 31), (1 << 31) - 1
EPILOG = ("The flags from the 'engine' group on configure the in-process engine; through servers "
          "they are not used. Exit status: 2 for a bad command line, 1 when a server or the engine refused "
          "or failed the request.")


def _int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type for an integer the wire field can hold (a protobuf setter would
    raise on anything else): a bad value is a usage error, exit status 2."""

    def parse(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {value}")
        return value

    parse.__name__ = "integer"  # argparse's message: "invalid integer value: 'x'"
    return parse


def _check_route(args: argparse.Namespace) -> None:
    if bool(args.prefill) != bool(args.decode) or (args.prefill and args.remote):
        raise UsageError("--prefill and --decode go together, without --remote")
    if args.encoder and not (args.remote or args.prefill):
        raise UsageError("--encoder needs --remote (aggregated) or --prefill/--decode")


def run_generate(args: argparse.Namespace) -> int:
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:  # a console that cannot show a character gets "?", not a traceback
        reconfigure(errors="replace")
    try:
        _check_route(args)
        options = options_from_args(args)
    except UsageError as exc:
        print(f"refengine generate: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    if args.remote or args.prefill:
        return run_remote(args, options)
    return run_local(args, options)


def _add_route_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--remote", metavar="HOST:PORT", type=address_arg,
                   help="generate through a running server (default: in-process)")
    g.add_argument("--prefill", metavar="HOST:PORT", type=address_arg,
                   help="disaggregated: prefill on this server (--role prefill) ... (default: none)")
    g.add_argument("--decode", metavar="HOST:PORT", type=address_arg,
                   help="... and decode on this one (--role decode) (default: none)")
    g.add_argument("--encoder", metavar="HOST:PORT", type=address_arg,
                   help="encode the --image files on this server (--role encoder) and send embedding handles "
                   "to --remote or --prefill/--decode (draft profile encoder) (default: none)")


def _add_sampling_flags(g: argparse._ArgumentGroup) -> None:
    unset = "(default: unset = %s)"
    g.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy")
    g.add_argument("--top-p", type=float, metavar="P", help="keep the most likely tokens up to this total probability, "
                   "0 < P <= 1 " + unset % "1.0, off")
    g.add_argument("--top-k", type=_int_in(INT32_MIN, INT32_MAX), metavar="K",
                   help="keep the K most likely tokens " + unset % "0, off; -1 is off too")
    g.add_argument("--min-p", type=float, metavar="P", help="drop tokens less likely than P times the most likely one "
                   + unset % "0.0, off")
    g.add_argument("--presence-penalty", type=float, metavar="X",
                   help="subtracted from the logit of every token already generated " + unset % "0.0")
    g.add_argument("--frequency-penalty", type=float, metavar="X", help="subtracted per occurrence of a token already "
                   "generated " + unset % "0.0")
    g.add_argument("--repetition-penalty", type=float, metavar="X",
                   help="divides the positive (multiplies the negative) logits of prompt and generated tokens, "
                   "> 0 " + unset % "1.0, off")
    g.add_argument("--num-sequences", type=_int_in(1, UINT32_MAX), metavar="N",
                   help="outputs for the prompt; in text, output 0 streams after a '[0] ' label and each other "
                   "output prints as '[i] text' once the stream ended " + unset % "1")


def _add_seed_flags(g: argparse._ArgumentGroup) -> None:
    # generate runs one request, so its --seed is that request's sampling.seed (G17); it replaces
    # (conflict_handler "resolve") the engine's --seed of the shared generator, which only
    # requests without a seed draw from, and which keeps its default (set_defaults below).
    g.add_argument("--seed", type=_int_in(0, UINT64_MAX), dest="sampling_seed", metavar="SEED",
                   help="a per-request generator: the same output whatever else is batched "
                   "(default: unset, the engine's shared generator)")
    g.add_argument("--sampling-seed", type=_int_in(0, UINT64_MAX), dest="sampling_seed",
                   action=_DeprecatedAlias, replacement="--seed")


def _add_stopping_flags(g: argparse._ArgumentGroup) -> None:
    count = _int_in(0, UINT32_MAX)
    g.add_argument("--max-tokens", type=count, default=128, metavar="N", help="most tokens per output")
    g.add_argument("--min-tokens", type=count, metavar="N", help="EOS and stop tokens cannot end an output before this "
                   "many tokens, at most --max-tokens (default: unset = 0)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end an output at this text, repeatable (stopping.conditions stop_text) (default: none)")
    g.add_argument("--stop-token-id", action="append", default=[], type=count, dest="stop_token_ids",
                   metavar="ID", help="end an output at this token, repeatable (stopping.conditions "
                   "stop_token_id) (default: none)")
    g.add_argument("--ignore-eos", action="store_true", help="never stop at the model's EOS token (default: off)")
    g.add_argument("--include-stop", action="store_true",
                   help="keep the matched stop text or token in the output (include_stop_in_output) "
                   "(default: off, left out)")


def _add_logprob_flags(g: argparse._ArgumentGroup) -> None:
    count = _int_in(0, UINT32_MAX)
    g.add_argument("--logprobs", type=count, metavar="N",
                   help="each output token's logprob and rank, with its N most likely candidates (0: none); "
                   "in text a per-token table follows on stderr, in --json the events carry them "
                   "(default: off)")
    g.add_argument("--prompt-logprobs", type=count, metavar="N",
                   help="the same for the prompt's positions; in text a table on stderr (default: off)")
    g.add_argument("--prompt-logprob-start", type=count, metavar="POS",
                   help="prompt positions before POS get no logprob; needs --prompt-logprobs "
                   "(default: unset = 0)")


def _add_request_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--priority", type=_int_in(INT32_MIN, INT32_MAX), metavar="P",
                   help="higher runs sooner: the openengine-priority metadata key through servers (M1), "
                   "GenerationRequest.priority in-process (default: unset, 0)")
    g.add_argument("--cache-salt", metavar="TEXT", help="namespace this request's prefix-cache blocks: only "
                   "requests with the same salt share them (kv.cache_salt) (default: unset, no salt)")
    g.add_argument("--no-prefix-cache", action="store_true",
                   help="this request reuses no cached prefix (kv.bypass_prefix_cache); unlike the engine's "
                   "--no-prefix-caching the cache stays on (default: off, cached blocks reused)")
    g.add_argument("--lora-name", metavar="NAME",
                   help="generate with this loaded LoRA adapter (lora_name) (default: unset, the base model)")
    g.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="an image filling the prompt's next image placeholder (the model's marker, e.g. "
                   "<image>), repeatable (default: none)")


def _add_guide_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--json-schema", metavar="FILE|JSON",
                   help="the output is JSON valid against this schema (a file path, or inline JSON text) "
                   "(default: none)")
    g.add_argument("--regex", help="the output matches this regular expression (default: none)")
    g.add_argument("--choice", action="append", metavar="TEXT",
                   help="the output is exactly one of these strings (repeat: --choice A --choice B) (default: none)")
    g.add_argument("--grammar", metavar="FILE",
                   help="the output follows the EBNF grammar in FILE (xgrammar GBNF: root ::= ...) (default: none)")
    g.add_argument("--guided-backend", metavar="NAME",
                   help="grammar backend for the guide (xgrammar, llguidance) (default: the engine's)")


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    """The ``generate`` subcommand and its flags: the request's, then the in-process engine's."""
    gen = sub.add_parser("generate", help="generate text for one prompt", epilog=EPILOG,
                         formatter_class=DefaultsHelpFormatter)
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt in the model's chat template (through servers: applied here, for a "
                     "model this machine can resolve by name) (default: off)")
    gen.add_argument("--json", action="store_true",
                     help="print the events, one JSON object per line, instead of the text: a server's "
                     "GenerateResponse in proto3 JSON, in-process each engine RequestOutput (refengine.types "
                     "field names, unset fields left out) (default: off)")
    gen.add_argument("--model-name", help="model to ask a server for (default: the server's default model)")
    _add_route_flags(gen.add_argument_group("servers (without them: in-process)"))
    sampling = gen.add_argument_group("sampling (GenerateRequest.sampling)", conflict_handler="resolve")
    _add_sampling_flags(sampling)
    _add_stopping_flags(gen.add_argument_group("stopping (GenerateRequest.stopping)"))
    _add_logprob_flags(gen.add_argument_group("logprobs (GenerateRequest.response)"))
    _add_request_flags(gen.add_argument_group("priority, prefix cache, LoRA, media"))
    _add_guide_flags(gen.add_argument_group("guided decoding (GenerateRequest.guided, at most one guide)"))
    add_engine_args(gen)
    _add_seed_flags(sampling)
    gen.set_defaults(seed=EngineConfig().seed)
