"""The docs name tests by node id (``tests/...py::test_name``) for readers to run; each must
exist (found by review: a renamed test left benchmarks/README.md naming one that did not)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def test_every_test_node_id_the_docs_name_exists() -> None:
    missing, named = [], 0
    for doc in DOCS:
        for path, name in re.findall(r"(tests/[\w/]+\.py)::(\w+)", doc.read_text()):
            named += 1
            source = REPO / path
            tree = ast.parse(source.read_text()) if source.is_file() else ast.Module(body=[], type_ignores=[])
            if name not in {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.ClassDef)}:
                missing.append(f"{doc.relative_to(REPO)}: {path}::{name}")
    assert named > 0, "the docs name no test: the pattern no longer matches them"
    assert not missing, missing
