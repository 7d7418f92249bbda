"""Readability limits the engine core keeps (a teaching implementation is read top to
bottom): no file of ``engine/`` over 300 lines, no function of the core (engine, scheduler, kv) over 50."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CORE = ("engine", "scheduler", "kv")  # the engine core and the bookkeeping it drives
MAX_FILE_LINES = {"engine": 300}
MAX_FUNCTION_LINES = 50


def test_engine_files_are_short() -> None:
    long = []
    for package, limit in MAX_FILE_LINES.items():
        for path in sorted((REPO / "refengine" / package).glob("*.py")):
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > limit:
                long.append(f"{path.relative_to(REPO)}: {lines} lines (limit {limit})")
    assert not long, "\n".join(long)


def test_core_functions_are_short() -> None:
    long = []
    for package in CORE:
        for path in sorted((REPO / "refengine" / package).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    length = node.end_lineno - node.lineno + 1
                    if length > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {length} lines")
    assert not long, "functions over the limit:\n" + "\n".join(long)
