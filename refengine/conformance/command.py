"""The conformance command line, shared by ``refengine conformance`` and
``python -m refengine.conformance``.

    refengine conformance --target HOST:PORT [--control HOST:PORT] [--profile P ...] [--rules G1,L]
                          [--format text|markdown|json]
                          [--prefill HOST:PORT --decode HOST:PORT] [--encoder HOST:PORT] [--load N --duration S]

Exit status (:data:`EPILOG`): 0 when nothing failed, 1 when a check (or the load run) failed,
2 on a bad command line or when the target cannot be tested.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

from refengine.conformance.load import LoadOptions, run_load
from refengine.conformance.options import EVENT_WAIT_S, MAX_DEADLINE_SECONDS
from refengine.conformance.profiles import BY_NAME, checks_of, profile_of
from refengine.conformance.registry import Check, select
from refengine.conformance.release import RELEASE
from refengine.conformance.report import FORMATS, render
from refengine.conformance.runner import Report, Result, TargetLost, run_report
from refengine.conformance.target import ConnectError, Options
from refengine.protocol.addresses import check_address

DESCRIPTION = (f"Check an {RELEASE} server against the contract's numbered rules (tests/data/RULES.md) and the "
               "draft profiles of docs/profiles/; "
               "print a support matrix per profile and per rule.")
EPILOG = ("exit status: 0 when nothing failed, 1 when a check (or the load run) failed, 2 on a bad command line "
          "or when the target cannot be tested (unreachable, its discovery fails, or it does not generate and the "
          "core profile is selected without --rules)")


def add_arguments(parser: argparse.ArgumentParser, positional: bool = False) -> None:
    if positional:  # python -m refengine.conformance HOST:PORT (the older form)
        parser.add_argument("address", nargs="?", default="", help="HOST:PORT of the server (or --target)")
    parser.add_argument("--target", default="", metavar="HOST:PORT", help="the server under test")
    parser.add_argument("--control", default="", metavar="HOST:PORT",
                        help="the target's Control service, when it listens apart from Inference (refengine: "
                        "--control-port); default: the --target address")
    parser.add_argument("--profile", action="append", default=[], choices=list(BY_NAME),
                        help="run only this profile's checks (repeatable; default: every profile)")
    parser.add_argument("--rules", default="", help="comma-separated rule ids or sections (e.g. G1,G14,L,ENC)")
    parser.add_argument("--format", choices=FORMATS, default="text", help="report format on stdout")
    parser.add_argument("--json", metavar="PATH", help="also write the JSON report to PATH")
    parser.add_argument("--model", default="", help="model to test (default: the first supported model)")
    parser.add_argument("--timeout", type=float, default=60.0, help="deadline of one Generate stream, s")
    parser.add_argument("--rpc-timeout", type=float, default=10.0, help="deadline of one unary RPC, s")
    parser.add_argument("--event-wait", type=float, default=EVENT_WAIT_S,
                        help="E: how long a wait for KV events lasts with nothing arriving, s (raise it for a "
                        "loaded server)")
    _add_target_arguments(parser)
    load = parser.add_argument_group("load mode (off unless --load is given)")
    load.add_argument("--load", type=int, default=0, metavar="N",
                      help="after the checks, N concurrent streams with random cancellations and malformed "
                      "requests; then the target must be idle with no used KV block")
    load.add_argument("--duration", type=float, default=10.0, metavar="S", help="how long the load runs, s")
    load.add_argument("--seed", type=int, default=0, help="seed of the load's random choices")
    parser.add_argument("--quiet", action="store_true", help="no per-check progress lines on stderr")


def _add_target_arguments(parser: argparse.ArgumentParser) -> None:
    named = parser.add_argument_group("named targets and knobs of particular checks")
    named.add_argument("--prefill", default="", metavar="HOST:PORT",
                       help="profiles prefill/decode (K4-K10): a PREFILL server, with --decode")
    named.add_argument("--decode", default="", metavar="HOST:PORT", help="a DECODE server (with --prefill)")
    named.add_argument("--encoder", default="", metavar="HOST:PORT",
                       help="profile encoder (ENC1-ENC15): an encoder server whose embedding handles the target "
                       "consumes (default: the target itself when it is an encoder)")
    named.add_argument("--lora-dir", default="", metavar="DIR",
                       help="profile lora: a directory inside the target's LoRA root where the checks write small "
                       "PEFT adapters")
    named.add_argument("--lora-model-config", default="", metavar="FILE",
                       help="profile lora: the served model's Hugging Face config.json (the adapters' shapes)")
    named.add_argument("--media-placeholder-token-id", type=int, default=None, metavar="N",
                       help="profiles multimodal/encoder: the model's image placeholder token id")
    named.add_argument("--slow-reader-seconds", type=float, default=0.0,
                       help="X1/X3: stall one stream this long (above the server's stall timeout) to provoke a "
                       "failure after acceptance (default %(default)s: not tried)")
    named.add_argument("--slow-reader-extra", default="{}", metavar="JSON",
                       help="GenerateRequest.extra (a JSON object) of the stalled stream")
    named.add_argument("--eviction-budget-tokens", type=int, default=16384, metavar="N",
                       help="E3: fill the prefix cache to see evictions only when it holds at most N tokens (the "
                       "check sends up to 2N prompt tokens; default %(default)s)")
    named.add_argument("--replay-budget-batches", type=int, default=32, metavar="N",
                       help="E1: have the target publish KV event batches up to number N (fresh requests) before "
                       "replaying from batch 1, which a server retaining fewer than N has dropped (default "
                       "%(default)s)")
    named.add_argument("--known-extra-keys", default="{}", metavar="JSON",
                       help='G8: known extra keys and their JSON types, e.g. {"my.knob": "number"}')


def _json_object(option: str, text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{option}: not JSON ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{option}: a JSON object is needed, got {type(value).__name__}")
    return value


def options_from_args(args: argparse.Namespace) -> Options:
    """The run's options; ValueError names a bad one."""
    return Options(model=args.model, stream_timeout_s=args.timeout, rpc_timeout_s=args.rpc_timeout,
                   event_wait_s=args.event_wait,
                   slow_reader_s=args.slow_reader_seconds,
                   slow_reader_extra=_json_object("--slow-reader-extra", args.slow_reader_extra),
                   known_extra_keys=_json_object("--known-extra-keys", args.known_extra_keys),
                   prefill_address=args.prefill, control_address=args.control,
                   decode_address=args.decode, lora_dir=args.lora_dir, lora_model_config=args.lora_model_config,
                   media_placeholder_token_id=args.media_placeholder_token_id, encoder_address=args.encoder,
                   eviction_budget_tokens=args.eviction_budget_tokens,
                   replay_budget_batches=args.replay_budget_batches)


def _selected(args: argparse.Namespace) -> list[Check]:
    """The checks --rules and --profile select together; ValueError when none or a bad id."""
    rules = [r for r in args.rules.split(",") if r.strip()]
    if args.rules and not rules:  # found by review: --rules ",," ran the whole suite
        raise ValueError(f"--rules {args.rules!r} names no rule")
    checks = select(rules or None)
    if args.profile:
        wanted = {c.name for c in checks_of(args.profile)}
        checks = [c for c in checks if c.name in wanted]
    if not checks:
        raise ValueError(f"no check is both in --rules {args.rules} and in --profile {' '.join(args.profile)}")
    return checks


def _check_writable(path: str) -> None:
    """``--json PATH`` can be written (checked before the run, not after it): opened for append,
    and removed again when this made it."""
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise ValueError(f"--json {path}: cannot be written ({exc.strerror})") from None
    if not existed:
        os.remove(path)


def _check_arguments(args: argparse.Namespace) -> tuple[str, list[Check], Options, LoadOptions | None]:
    """Everything the command line says, checked before connecting: a mistake is reported at
    once (exit 2), not after a whole run."""
    address = args.target or getattr(args, "address", "")
    if not address:
        raise ValueError("name the server with --target HOST:PORT")
    for flag, value in (("--target", address), ("--control", args.control), ("--prefill", args.prefill),
                        ("--decode", args.decode), ("--encoder", args.encoder)):
        if value:
            try:
                check_address(value)
            except ValueError as exc:
                raise ValueError(f"{flag}: {exc}") from None
    if bool(args.prefill) != bool(args.decode):  # a half pair claims a profile it cannot check
        raise ValueError("--prefill and --decode name a disaggregated pair: give both, or neither")
    if not 0 <= args.slow_reader_seconds < math.inf:
        raise ValueError(f"--slow-reader-seconds must be a number >= 0, got {args.slow_reader_seconds}")
    token = args.media_placeholder_token_id
    if token is not None and not 0 <= token < 1 << 32:  # a token id (uint32): else every media check "fails"
        raise ValueError(f"--media-placeholder-token-id must be a token id in 0..{(1 << 32) - 1}, got {token}")
    for flag, value in (("--eviction-budget-tokens", args.eviction_budget_tokens),
                        ("--replay-budget-batches", args.replay_budget_batches)):
        if value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    for flag, seconds in (("--timeout", args.timeout), ("--rpc-timeout", args.rpc_timeout),
                          ("--event-wait", args.event_wait)):
        if not 0 < seconds <= MAX_DEADLINE_SECONDS:  # also refuses nan and inf
            raise ValueError(f"{flag} must be in (0, {MAX_DEADLINE_SECONDS:g}] seconds, got {seconds:g}")
    load = LoadOptions(args.load, args.duration, args.seed) if args.load else None
    if args.json:
        _check_writable(args.json)
    return address, _selected(args), options_from_args(args), load


def run_command(args: argparse.Namespace) -> int:
    try:
        address, checks, options, load = _check_arguments(args)
    except ValueError as err:
        print(f"conformance: error: {err}", file=sys.stderr)
        return 2

    def progress(r: Result) -> None:
        if not args.quiet:
            print(f"{r.status.value:11} {r.name:45} {r.seconds:6.2f}s  {r.message[:90]}", file=sys.stderr, flush=True)

    try:
        core_run = not args.rules.strip() and any(profile_of(c).name == "core" for c in checks)
        report = run_report(address, checks, options, on_result=progress, core_run=core_run)
        if load is not None:
            report = run_load(report, address, options, load)
    except TargetLost as err:  # the verdicts so far are still reported, "stopped" saying why they end
        _emit(args, err.report)
        print(f"conformance: error: {err}", file=sys.stderr)
        return 2
    except ConnectError as err:
        print(f"conformance: error: {err}", file=sys.stderr)
        return 2
    _emit(args, report)
    return 1 if report.failed else 0


def _emit(args: argparse.Namespace, report: Report) -> None:
    print(render(report, args.format))
    if args.json:
        with open(args.json, "w") as f:
            f.write(render(report, "json") + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m refengine.conformance", description=DESCRIPTION, epilog=EPILOG)
    add_arguments(parser, positional=True)
    try:
        return run_command(parser.parse_args(argv))
    except KeyboardInterrupt:  # as `refengine conformance` does (cli.py): no traceback
        print("conformance: interrupted", file=sys.stderr)
        return 130
