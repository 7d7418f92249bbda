"""No dead code and no test-only API in ``refengine/``, checked statically (``ast``; nothing is imported
but a few stdlib modules).

A production definition -- a module-level function, class or UPPER_CASE constant, a method, or an
attribute a method assigns on ``self`` -- must be used by the package or by the tools shipped beside
it (``benchmarks/``, ``scripts/``, the entry points of pyproject.toml). Use is matched by name, as
vulture does: any load of ``name`` or ``x.name`` outside the definition itself counts, whatever
object it is on, so an override is alive when its base's method is called. A definition nothing uses
is dead; one only ``tests/`` mention is test-only API and belongs in a tests/ helper module
(tests/unit/kernel_helpers.py, tests/conformance/rule_ids.py).

What is reached without a load of its name is handled by rule (see ``is_exempt``); what no rule
covers is in ``ALLOWLIST``, each entry with its reason. A name in ``__all__`` is not a use: that is
how test-only API hid before; a genuine public API is documented and allowlisted instead.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
import tomllib
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "refengine"
#: Written by scripts/gen_proto.py, not by hand: read for references, never judged.
GENERATED = ("protocol/openengine", "protocol/kvpull", "protocol/v1alpha1", "protocol/oe.py")
#: Shipped tools beside the package: what they use is used.
TOOLS = ("benchmarks", "scripts")

#: Decorators that store the function in a registry it is later run from, never named again.
REGISTERING_DECORATORS = {
    "check": "refengine/conformance/registry.py: the suite runs every registered check",
}
#: Builtins that read an attribute named in a string: ``getattr(x, "name")`` uses ``name``.
REFLECTION = ("getattr", "hasattr")
#: Method name prefixes a dispatcher builds with getattr (ast.NodeVisitor, pytest's hook lookup).
DISPATCH_PREFIXES = ("visit_", "pytest_")

#: "path:qualified name" -> why it stays although nothing in the package or its tools names it.
ALLOWLIST: dict[str, str] = {
    "refengine/multimodal/url_fetch.py:_DeadlineResponse.fp": "http.client.HTTPResponse reads it (an instance "
    "attribute its __init__ sets, so the stdlib-base rule cannot see it on the class)",
    "refengine/kv/keys.py:block_keys": "public API: routers compute the engine's block keys offline (README, "
    "'Block keys are a deterministic function of content')",
    "refengine/conformance/report.py:format_matrix": "public API: the suite's Python API prints a run's results "
    "with it (refengine/conformance/__init__.py's docstring)",
    "refengine/client.py:stream_text": "public API: the Python client's one-call text stream (README, Quick start)",
    "refengine/encoder_client.py:supports_profile": "public API: a client asks whether a server takes a side of the "
    "encoder profile (README, Encoder role)",
}


@dataclass(frozen=True)
class Definition:
    path: Path
    kind: str  # function, class, method, constant, attribute
    name: str
    owner: str | None  # the class of a method or attribute
    first: int
    last: int  # lines of the definition; a use inside it (recursion) does not count
    exempt: bool  # a rule says something reaches it without naming it

    @property
    def key(self) -> str:
        return f"{shown(self.path)}:{self.owner + '.' if self.owner else ''}{self.name}"

    def label(self) -> str:
        return f"{shown(self.path)}:{self.first} {self.kind} {self.key.partition(':')[2]}"


def shown(path: Path) -> str:
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.name


def is_generated(path: Path) -> bool:
    if not path.is_relative_to(PACKAGE):
        return False
    rel = path.relative_to(PACKAGE).as_posix()
    return any(rel == g or rel.startswith(g + "/") for g in GENERATED)


def rpc_names() -> set[str]:
    """Methods of the generated ``*Servicer`` classes: the server registers its implementations by the
    proto's method names (server/wire.py: ``getattr(servicer, method.name)``)."""
    names = set()
    for path in PACKAGE.joinpath("protocol").rglob("*_pb2_grpc.py"):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef) and node.name.endswith("Servicer"):
                names |= {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
    return names


def import_names(tree: ast.Module) -> dict[str, str]:
    """Local name -> the dotted path a module-level import gave it, for resolving base classes."""
    names = {}
    top = (stmt for stmt in tree.body if isinstance(stmt, ast.Import | ast.ImportFrom | ast.If | ast.Try))
    for node in (node for stmt in top for node in ast.walk(stmt)):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0]: a.name if a.asname else a.name.split(".")[0]
                      for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names |= {a.asname or a.name: f"{node.module}.{a.name}" for a in node.names}
    return names


def stdlib_bases(cls: ast.ClassDef, imported: dict[str, str]) -> list[type]:
    """The class's bases that are stdlib classes (importing a stdlib module is cheap and safe)."""
    found = []
    for base in cls.bases:
        dotted = ast.unparse(base)
        head, _, rest = dotted.partition(".")
        path = f"{imported.get(head, head)}.{rest}".rstrip(".")
        if path.split(".")[0] not in sys.stdlib_module_names:
            continue
        module, _, attr = path.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):
            continue
    return found


def is_exempt(name: str, bases: list[type], rpcs: set[str]) -> bool:
    """Reached without a load of its name: a dunder (Python calls it), an override of a stdlib base
    class's method or attribute (the stdlib calls it), a gRPC method, a getattr-dispatched method."""
    return ((name.startswith("__") and name.endswith("__")) or name in rpcs or name.startswith(DISPATCH_PREFIXES)
            or any(hasattr(base, name) for base in bases))


def self_attributes(method: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[tuple[str, ast.stmt]]:
    """Attributes the method assigns on ``self`` (``self.x = ...``; ``+=`` reads it too, so it defines nothing)."""
    for node in ast.walk(method):
        if isinstance(node, ast.Assign | ast.AnnAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                        yield sub.attr, node


def class_members(path: Path, cls: ast.ClassDef, bases: list[type], rpcs: set[str]) -> Iterator[Definition]:
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield Definition(path, "method", node.name, cls.name, node.lineno, node.end_lineno,
                             is_exempt(node.name, bases, rpcs))
            for attr, stmt in self_attributes(node):
                yield Definition(path, "attribute", attr, cls.name, stmt.lineno, stmt.end_lineno,
                                 is_exempt(attr, bases, rpcs))


def definitions(path: Path, tree: ast.Module, rpcs: set[str]) -> Iterator[Definition]:
    imported = import_names(tree)

    def walk(body: Iterable[ast.stmt]) -> Iterator[Definition]:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                registered = any(_callee(d) in REGISTERING_DECORATORS for d in node.decorator_list)
                yield Definition(path, "function", node.name, None, node.lineno, node.end_lineno,
                                 registered or is_exempt(node.name, [], rpcs))
            elif isinstance(node, ast.ClassDef):
                yield Definition(path, "class", node.name, None, node.lineno, node.end_lineno, False)
                yield from class_members(path, node, stdlib_bases(node, imported), rpcs)
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name) and name.id.isupper():
                            yield Definition(path, "constant", name.id, None, node.lineno, node.end_lineno,
                                             is_exempt(name.id, [], rpcs))
            elif isinstance(node, ast.If | ast.Try):  # TYPE_CHECKING blocks, optional imports
                yield from walk([*node.body, *getattr(node, "handlers", []), *node.orelse])
            elif isinstance(node, ast.ExceptHandler):
                yield from walk(node.body)

    yield from walk(tree.body)


def _callee(decorator: ast.expr) -> str:
    """``check`` for ``@check(...)``, ``@check`` or ``@registry.check(...)``."""
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")


def references(tree: ast.Module) -> Iterator[tuple[str, int]]:
    """(name, line) of every use: loads of a name or attribute, the original name of an aliased import,
    getattr/hasattr with a literal name, string annotations."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store):
            yield node.id, node.lineno
        elif isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Store):
            yield node.attr, node.lineno
        elif isinstance(node, ast.ImportFrom):
            yield from ((a.name, node.lineno) for a in node.names if a.asname)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in REFLECTION and len(node.args) > 1:
            if isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                yield node.args[1].value, node.lineno
        elif isinstance(node, ast.arg | ast.FunctionDef | ast.AsyncFunctionDef | ast.AnnAssign):
            note = node.returns if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else node.annotation
            if isinstance(note, ast.Constant) and isinstance(note.value, str):
                yield from references(ast.parse(note.value, mode="eval"))  # type: ignore[arg-type]


def entry_points() -> Iterator[str]:
    """The functions pyproject.toml's scripts and entry points name (``refengine.cli:main`` -> ``main``)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    groups = [project.get("scripts", {}), project.get("gui-scripts", {}), *project.get("entry-points", {}).values()]
    for group in groups:
        yield from (target.partition(":")[2].split(".")[-1] for target in group.values())


def scan(production: list[Path], tools: list[Path], tests: list[Path]) -> dict[str, tuple[str, str]]:
    """Production definitions with no use outside themselves: key -> (label, "dead" or "test-only").
    ``production`` files are judged and use; ``tools`` only use; ``tests`` only tell the test-only
    apart (any word of theirs will do: faster than parsing them)."""
    rpcs = rpc_names()
    uses: dict[str, list[tuple[Path, int]]] = defaultdict(list)
    judged: list[Definition] = []
    for path in production:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        if not is_generated(path):
            judged += definitions(path, tree, rpcs)
        for name, line in references(tree):
            uses[name].append((path, line))
    for path in tools:
        for name, _ in references(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            uses[name].append((path, 0))
    for name in entry_points():
        uses[name].append((REPO / "pyproject.toml", 0))
    test_words = {word for path in tests for word in re.findall(r"\w+", path.read_text(encoding="utf-8"))}
    unused = {}
    for d in judged:
        if not d.exempt and all(path == d.path and d.first <= line <= d.last for path, line in uses[d.name]):
            unused[d.key] = (d.label(), "test-only" if d.name in test_words else "dead")
    return unused


@cache
def repo_findings() -> dict[str, tuple[str, str]]:
    return scan(sorted(PACKAGE.rglob("*.py")), sorted(p for tool in TOOLS for p in (REPO / tool).rglob("*.py")),
                sorted((REPO / "tests").rglob("*.py")))


def test_no_dead_or_test_only_code() -> None:
    problems = [f"{verdict}: {label}" for key, (label, verdict) in repo_findings().items() if key not in ALLOWLIST]
    assert not problems, ("production definitions nothing in refengine/, benchmarks/ or scripts/ uses (remove the "
                          "dead; move the test-only to a tests/ helper):\n" + "\n".join(problems))


def test_every_allowlist_entry_is_still_needed() -> None:
    stale = sorted(set(ALLOWLIST) - set(repo_findings()))
    assert not stale, f"allowlisted but used now, or gone: {stale}"


PROBE = """
import ast
import io
from refengine.conformance.registry import check

LIMIT = 3
USED = 4


def dead_function() -> int:
    return USED


def recursive(n: int) -> int:
    return recursive(n - 1) if n else 0


def helper_for_tests() -> None:
    pass


class Stream(io.RawIOBase):
    def readable(self) -> bool:
        return True

    def __len__(self) -> int:
        return 0

    def unused_method(self) -> None:
        self.counter = 1


class Finder(ast.NodeVisitor):
    def visit_Call(self, node: ast.Call) -> None:
        pass


class Control:
    async def GetLoad(self, request, context):
        pass


@check("A1", "registered")
def registered(t) -> None:
    pass


print(len(Stream()), Finder, Control)
"""


def test_the_scan_reports_the_dead_and_the_test_only(tmp_path: Path) -> None:
    """A scratch module posing as production code: its dead definitions (one only calling itself) and its
    test-only one are reported; what the rules exempt (a stdlib override, a dunder, a visit_ method, an RPC
    method, a registered check) and what is used are not."""
    probe = tmp_path / "_dead_probe.py"
    probe.write_text(PROBE)
    user = tmp_path / "test_probe.py"
    user.write_text("from _dead_probe import helper_for_tests\nhelper_for_tests()\n")
    found = {key.partition(":")[2]: verdict for key, (_, verdict) in scan([probe], [], [user]).items()}
    assert found == {"LIMIT": "dead", "dead_function": "dead", "recursive": "dead", "Stream.unused_method": "dead",
                     "Stream.counter": "dead", "helper_for_tests": "test-only"}, found
