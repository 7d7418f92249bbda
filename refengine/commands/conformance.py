"""``refengine conformance --target HOST:PORT``: the conformance suite (refengine.conformance.command)."""

from __future__ import annotations

import argparse

from refengine.args import DefaultsHelpFormatter
from refengine.conformance.command import DESCRIPTION, EPILOG, add_arguments, run_command

__all__ = ["add_conformance_parser", "run_conformance"]


def add_conformance_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("conformance", help="check any OpenEngine server against the contract",
                            description=DESCRIPTION, epilog=EPILOG, formatter_class=DefaultsHelpFormatter)
    add_arguments(parser)


def run_conformance(args: argparse.Namespace) -> int:
    return run_command(args)
