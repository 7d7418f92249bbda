"""``refengine bench``: load any OpenEngine server and report vllm-style serving metrics.

The flags are those of ``vllm bench serve`` where it has them, so that a run reads the
same against refengine, a vllm adapter or any other OpenEngine server.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from refengine.args import DefaultsHelpFormatter
from refengine.bench import SLO_METRICS, UINT32_MAX
from refengine.client import MAX_DEADLINE_SECONDS, address_arg
from refengine.commands.generate_options import file_text

__all__ = ["add_bench_parser", "run_bench"]

USAGE_ERROR, UNREACHABLE = 2, 1  # 2: argparse's own status for a bad command line
T = TypeVar("T")


def _arg_type(convert: Callable[[str], T], accepts: Callable[[T], bool], expected: str) -> Callable[[str], T]:
    """An argparse type that refuses with what it ``expected`` (argparse would name the
    function instead when ``convert`` fails: "invalid parse value")."""
    def parse(text: str) -> T:
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not accepts(value):
            raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}")
        return value

    return parse


_positive_int = _arg_type(int, lambda v: v >= 1, "an integer >= 1")
_token_count = _arg_type(int, lambda v: 1 <= v <= UINT32_MAX, f"an integer in [1, {UINT32_MAX}]")  # a uint32 field
_top_n = _arg_type(int, lambda v: 0 <= v <= UINT32_MAX, f"an integer in [0, {UINT32_MAX}]")
_positive_float = _arg_type(float, lambda v: v > 0, "a number > 0")  # also refuses nan
_deadline = _arg_type(float, lambda v: 0 < v <= MAX_DEADLINE_SECONDS, f"seconds in (0, {MAX_DEADLINE_SECONDS:g}]")
_ratio = _arg_type(float, lambda v: 0 <= v < 1, "a number in [0, 1)")


def _slo(text: str) -> tuple[str, float]:
    """``--goodput``: one ``METRIC:MS`` objective."""
    metric, _, limit = text.partition(":")
    try:
        limit_ms = float(limit)
    except ValueError:
        limit_ms = math.nan
    if metric not in SLO_METRICS or not 0 < limit_ms < math.inf:
        raise argparse.ArgumentTypeError(f"must be METRIC:MS with METRIC one of {', '.join(SLO_METRICS)} and MS > 0, "
                                         f"got {text!r}")
    return metric, limit_ms


def _json_text(value: str) -> str:
    """``--guided-json``: a path to a schema file, else the schema as inline JSON."""
    try:
        text = file_text(value) or value
    except UnicodeDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{value}: not UTF-8 text (byte {exc.start} of the file)") from None
    try:
        json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"neither a readable file nor JSON text ({exc})") from None
    return text


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark any OpenEngine server (vllm bench serve's metrics)",
                       description="Load any OpenEngine server and report vllm-style serving metrics.",
                       formatter_class=DefaultsHelpFormatter)
    p.add_argument("--target", required=True, default=argparse.SUPPRESS, metavar="HOST:PORT", type=address_arg,
                   help="the OpenEngine server")
    p.add_argument("--model", default="", help="model to name (default: the server's first supported model)")
    p.add_argument("--num-prompts", type=_positive_int, default=100, help="requests to send")
    p.add_argument("--input-len", "--random-input-len", type=_positive_int, default=256,
                   help="random prompts: tokens per prompt")
    p.add_argument("--output-len", "--random-output-len", type=_token_count, default=128,
                   help="max_tokens of each request (a dataset line may set its own)")
    p.add_argument("--range-ratio", "--random-range-ratio", type=_ratio, default=0.0,
                   help="random lengths uniform in [len*(1-R), len*(1+R)]")
    p.add_argument("--max-concurrency", type=_positive_int, default=None,
                   help="requests in flight at most (default: unlimited)")
    p.add_argument("--request-rate", type=_positive_float, default=math.inf,
                   help="arrivals per second (Poisson at --burstiness 1); inf sends all at once")
    p.add_argument("--burstiness", type=_positive_float, default=1.0,
                   help="shape of the gamma-distributed gaps between arrivals: 1 = Poisson, < 1 burstier, "
                        "> 1 more even (their mean stays 1 / --request-rate)")
    p.add_argument("--goodput", nargs="+", type=_slo, default=None, metavar="METRIC:MS",
                   help=f"service-level objectives, METRIC one of {', '.join(SLO_METRICS)}: also report the rate "
                        "of completed requests that met them all (default: none)")
    p.add_argument("--dataset", type=Path, default=None, metavar="FILE.jsonl",
                   help='one object a line: "prompt" (text) or "token_ids", optionally "output_len"/"max_tokens" '
                        "(default: random token ids)")
    p.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals")
    p.add_argument("--ignore-eos", action="store_true", help="generate max_tokens whatever the model says")
    p.add_argument("--temperature", type=_arg_type(float, lambda v: 0 <= v < math.inf, "a number >= 0"), default=0.0,
                   help="sampling temperature (0: greedy)")
    guide = p.add_mutually_exclusive_group()
    guide.add_argument("--guided-regex", default=None, help="constrain outputs to a regex (default: unguided)")
    guide.add_argument("--guided-json", type=_json_text, default=None, metavar="FILE|JSON",
                       help="constrain outputs to a JSON schema (default: unguided)")
    guide.add_argument("--guided-choice", action="append", default=None, metavar="TEXT",
                       help="one allowed output; repeat for each (default: unguided)")
    p.add_argument("--logprobs", type=_top_n, default=None, metavar="N",
                   help="ask for output logprobs with the top N candidates (default: none)")
    p.add_argument("--lora-name", default="", help="LoRA adapter to name in every request (default: none)")
    p.add_argument("--request-id-prefix", default=None, metavar="TEXT",
                   help="request ids are TEXT followed by the request's index (default: bench-<8 random hex>-, "
                        "new for every run, so that runs can share a server)")
    p.add_argument("--timeout", type=_deadline, default=None,
                   help="deadline of each request, s (default: none)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the results as JSON to PATH; without PATH, print JSON instead of the table "
                        "(default: table only)")
    p.add_argument("--no-progress", "--disable-tqdm", action="store_true", help="no progress bar on stderr")


def _unwritable(path: Path) -> str | None:
    """Why the results could not be written to ``path``, asked before the run rather than
    found after it; a file created to ask is removed."""
    existed = path.exists()
    try:
        with path.open("a", encoding="utf-8"):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    if not existed:
        path.unlink()
    return None


def run_bench(args: argparse.Namespace) -> int:
    """0 when the run completed (whatever its requests' outcomes), 2 on a bad workload or --json PATH,
    1 when the target cannot be benchmarked."""
    from refengine.bench import report, runner, target, workload
    from refengine.bench.progress import Progress
    from refengine.client import OpenEngineClient

    slos_ms = dict(args.goodput or ())
    if len(slos_ms) < len(args.goodput or ()):
        print(f"refengine bench: --goodput names a metric twice: {' '.join(f'{m}:{v:g}' for m, v in args.goodput)}",
              file=sys.stderr)
        return USAGE_ERROR
    why = _unwritable(Path(args.json)) if args.json not in (None, "-") else None
    if why is not None:
        print(f"refengine bench: --json {args.json}: {why}", file=sys.stderr)
        return USAGE_ERROR
    try:  # a dataset needs no server: check it before connecting
        requests = (workload.dataset_requests(args.dataset, args.num_prompts, args.output_len)
                    if args.dataset is not None else None)
    except workload.WorkloadError as exc:
        print(f"refengine bench: {exc}", file=sys.stderr)
        return USAGE_ERROR
    with OpenEngineClient(args.target) as client:
        try:
            found = target.discover(client, args.model)
        except target.TargetError as exc:
            print(f"refengine bench: {exc}", file=sys.stderr)
            return UNREACHABLE
        if found.note and requests is None:
            print(f"refengine bench: {found.note}", file=sys.stderr)
        if requests is None:
            try:
                requests = workload.random_requests(args.num_prompts, args.input_len, args.output_len,
                                                    args.range_ratio, args.seed, found.vocab_size,
                                                    text=not found.token_ids_input)
            except workload.WorkloadError as exc:  # the server's vocabulary is too small for random ids
                print(f"refengine bench: {exc}", file=sys.stderr)
                return UNREACHABLE
        prefix = workload.random_request_id_prefix() if args.request_id_prefix is None else args.request_id_prefix
        options = workload.RequestOptions(
            model=found.model, request_id_prefix=prefix, temperature=args.temperature, ignore_eos=args.ignore_eos,
            guided_regex=args.guided_regex, guided_json=args.guided_json,
            guided_choice=tuple(args.guided_choice or ()), logprobs=args.logprobs, lora_name=args.lora_name)
        progress = Progress(len(requests)) if not args.no_progress and sys.stderr.isatty() else None
        send = runner.GrpcSender(client, options, args.timeout)
        arrivals = workload.arrival_times(len(requests), args.request_rate, args.seed, args.burstiness)
        result = runner.run(requests, arrivals, send, args.max_concurrency, progress, cancel=send.cancel)
    summary = report.summarize(result, {"target": args.target, "model": found.model, "num_prompts": len(requests),
                                        "seed": args.seed, "max_concurrency": args.max_concurrency,
                                        "request_rate": args.request_rate, "burstiness": args.burstiness}, slos_ms)
    if args.json == "-":
        print(json.dumps(summary, indent=2))
        return 0
    if args.json is not None:  # first: a reader of stdout that left early (| head, a pager) loses the table only
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print(report.format_table(summary))
    return 0
