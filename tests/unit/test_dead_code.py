"""No dead code and no test-only API in ``refengine/``, checked statically (``ast``; nothing is imported
but a few stdlib modules).

A production definition -- a module-level function, class or UPPER_CASE constant, a method, an
attribute a method assigns on ``self``, or a name a class body assigns (a dataclass or NamedTuple field,
a class constant, an enum member) -- must be used by the package or by the tools shipped beside
it (``benchmarks/``, ``scripts/``, the entry points of pyproject.toml). Use is matched by name, as
vulture does: any load of ``name`` or ``x.name`` outside the definition itself counts, whatever
object it is on, so an override is alive when its base's method is called. Writing is no use: a field
only passed to its constructor (a keyword argument) or assigned is dead. ``from x import foo as bar``
uses ``foo`` only where ``bar`` is used. A definition nothing uses is dead; one only ``tests/``
mention is test-only API and belongs in a tests/ helper module (tests/unit/kernel_helpers.py,
tests/conformance/rule_ids.py).

What is reached without a load of its name is handled by rule (see ``is_exempt``): dunders (a class's
``__slots__`` too), overrides of a stdlib base's names, gRPC and getattr-dispatched methods, registered
checks. An enum's members are all reached when the enum is looked up by value or name or iterated
(``lookups``), else each is judged. A class whose instances the code base serialises field by field
(``dataclasses.asdict``/``fields``/``astuple``, ``_asdict``, ``vars``) is in ``SERIALISED`` with where:
its unnamed fields are exempt. NamedTuple fields are judged by name: unpacking reads them by position,
so one reached only so would need an entry too. What no rule covers is in ``ALLOWLIST``, each entry
with its reason. A name in ``__all__`` is not a use: that is how test-only API hid before; a genuine
public API is documented and allowlisted instead.

Out of scope: functions and classes nested in a function, module-level lower-case globals, names a
class body assigns under ``if``/``try``, attributes set on objects other than ``self``, import aliases
of whole modules (``import x as y``); an enum is known by a stdlib enum base (one deriving from a project
enum is judged as a plain class). Use is matched by name across the code base, so a name one
definition shares with a used one (``name``, ``size``) is never reported, however dead.
"""

from __future__ import annotations

import ast
import enum
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

#: Builtins that iterate what they are given: ``list(Colour)`` reaches every member of an enum.
ITERATING = ("list", "tuple", "set", "frozenset", "sorted", "iter", "len", "dict", "enumerate")

#: "path:class" -> where the code base serialises its instances field by field (``dataclasses.asdict``,
#: ``fields()``, ``astuple``, ``_asdict``, ``vars``), which reads every field without naming it; its fields
#: that nothing names are exempt. A class is listed only while one of its fields needs it.
SERIALISED: dict[str, str] = {
    "refengine/types/outputs.py:MediaStats": "refengine/server/control.py: media_attributes exports every field "
    "as a refengine.v1alpha1.<field> load attribute through dataclasses.asdict (ENC15)",
}

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


def class_fields(cls: ast.ClassDef) -> Iterator[tuple[str, ast.stmt]]:
    """Names a class body assigns, annotated or not: dataclass and NamedTuple fields, class constants, enum
    members (``x: int`` with no value declares a field too)."""
    for node in cls.body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Name):
                        yield sub.id, node


def self_attributes(method: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[tuple[str, ast.stmt]]:
    """Attributes the method assigns on ``self`` (``self.x = ...``; ``+=`` reads it too, so it defines nothing)."""
    for node in ast.walk(method):
        if isinstance(node, ast.Assign | ast.AnnAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                        yield sub.attr, node


def class_members(path: Path, cls: ast.ClassDef, bases: list[type], rpcs: set[str]) -> Iterator[Definition]:
    # An enum's members are judged apart: a lookup by value or name, or iterating the enum, reaches them all.
    field_kind = "member" if any(isinstance(b, type) and issubclass(b, enum.Enum) for b in bases) else "field"
    for name, stmt in class_fields(cls):
        yield Definition(path, field_kind, name, cls.name, stmt.lineno, stmt.end_lineno, is_exempt(name, bases, rpcs))
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
    """(name, line) of every use: loads of a name or attribute, getattr/hasattr with a literal name, string
    annotations. The original name of an aliased import is no use by itself: see ``aliases``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store):
            yield node.id, node.lineno
        elif isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Store):
            yield node.attr, node.lineno
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in REFLECTION and len(node.args) > 1:
            if isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                yield node.args[1].value, node.lineno
        elif isinstance(node, ast.arg | ast.FunctionDef | ast.AsyncFunctionDef | ast.AnnAssign):
            note = node.returns if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else node.annotation
            if isinstance(note, ast.Constant) and isinstance(note.value, str):
                yield from references(ast.parse(note.value, mode="eval"))  # type: ignore[arg-type]


def aliases(tree: ast.Module) -> Iterator[tuple[str, str, int]]:
    """(alias, original name, line) of ``from x import foo as bar``: ``foo`` is used where ``bar`` is."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            yield from ((a.asname, a.name, node.lineno) for a in node.names if a.asname and a.asname != a.name)


def lookups(tree: ast.Module) -> Iterator[str]:
    """Names looked up by value or name, or iterated: ``Colour(v)``, ``Colour[n]``, ``for c in Colour``,
    ``list(Colour)``, ``Colour.__members__``. For an enum, each reaches every member without naming it."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            yield node.func.id
            if node.func.id in ITERATING:
                yield from (arg.id for arg in node.args if isinstance(arg, ast.Name))
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
            yield node.value.id
        elif isinstance(node, ast.For | ast.AsyncFor | ast.comprehension) and isinstance(node.iter, ast.Name):
            yield node.iter.id
        elif isinstance(node, ast.Attribute) and node.attr == "__members__" and isinstance(node.value, ast.Name):
            yield node.value.id


def entry_points() -> Iterator[str]:
    """The functions pyproject.toml's scripts and entry points name (``refengine.cli:main`` -> ``main``)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    groups = [project.get("scripts", {}), project.get("gui-scripts", {}), *project.get("entry-points", {}).values()]
    for group in groups:
        yield from (target.partition(":")[2].split(".")[-1] for target in group.values())


def scan(production: list[Path], tools: list[Path], tests: list[Path],
         serialised: dict[str, str] = SERIALISED) -> dict[str, tuple[str, str]]:
    """Production definitions with no use outside themselves: key -> (label, "dead" or "test-only"; or
    "serialised" for a field of a ``serialised`` class, which is no finding). ``production`` files are
    judged and use; ``tools`` only use; ``tests`` only tell the test-only apart (any word of theirs will
    do: faster than parsing them)."""
    rpcs = rpc_names()
    uses: dict[str, list[tuple[Path, int]]] = defaultdict(list)
    renamed: list[tuple[str, str, Path, int]] = []
    looked_up: set[str] = set()
    judged: list[Definition] = []
    judged_paths = set(production)
    for path in [*production, *tools]:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        if path in judged_paths and not is_generated(path):
            judged += definitions(path, tree, rpcs)
        for name, line in references(tree):
            uses[name].append((path, line))
        renamed += ((alias, name, path, line) for alias, name, line in aliases(tree))
        looked_up.update(lookups(tree))
    for name in entry_points():
        uses[name].append((REPO / "pyproject.toml", 0))
    resolve_aliases(uses, renamed)
    test_words = {word for path in tests for word in re.findall(r"\w+", path.read_text(encoding="utf-8"))}
    test_words |= {name for alias, name, _, _ in renamed if alias in test_words}
    unused = {}
    for d in judged:
        if d.exempt or (d.kind == "member" and d.owner in looked_up):
            continue
        if all(path == d.path and d.first <= line <= d.last for path, line in uses[d.name]):
            serial = d.kind == "field" and f"{shown(d.path)}:{d.owner}" in serialised
            unused[d.key] = (d.label(), "serialised" if serial else "test-only" if d.name in test_words else "dead")
    return unused


def resolve_aliases(uses: dict[str, list[tuple[Path, int]]], renamed: list[tuple[str, str, Path, int]]) -> None:
    """An imported name is used where an alias of it is (to a fixed point: an alias may be re-aliased)."""
    pending = list(renamed)
    while alive := [r for r in pending if uses.get(r[0])]:
        pending = [r for r in pending if r not in alive]
        for _, name, path, line in alive:
            uses[name].append((path, line))


@cache
def repo_findings() -> dict[str, tuple[str, str]]:
    return scan(sorted(PACKAGE.rglob("*.py")), sorted(p for tool in TOOLS for p in (REPO / tool).rglob("*.py")),
                sorted((REPO / "tests").rglob("*.py")))


def test_no_dead_or_test_only_code() -> None:
    problems = [f"{verdict}: {label}" for key, (label, verdict) in repo_findings().items()
                if key not in ALLOWLIST and verdict != "serialised"]
    assert not problems, ("production definitions nothing in refengine/, benchmarks/ or scripts/ uses (remove the "
                          "dead; move the test-only to a tests/ helper):\n" + "\n".join(problems))


def test_every_allowlist_entry_is_still_needed() -> None:
    stale = sorted(set(ALLOWLIST) - set(repo_findings()))
    assert not stale, f"allowlisted but used now, or gone: {stale}"
    exempted = {key.rpartition(".")[0] for key, (_, verdict) in repo_findings().items() if verdict == "serialised"}
    stale = sorted(set(SERIALISED) - exempted)
    assert not stale, f"serialised classes whose fields are all named now, or gone: {stale}"


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


FIELDS_PROBE = """
import dataclasses
import enum
from typing import NamedTuple


@dataclasses.dataclass
class Stats:
    read: int
    written_only: int


@dataclasses.dataclass
class Exported:
    total: int = 0


class Point(NamedTuple):
    x: int
    unread: int


class Colour(enum.Enum):
    RED = 1
    GREEN = 2


class Mode(enum.Enum):
    FAST = "fast"
    SLOW = "slow"


class Shade(enum.Enum):
    DARK = 1


class Slotted:
    __slots__ = ()
    KIND = "k"
    UNUSED_KIND = "u"


def aliased_used() -> None:
    pass


def aliased_unused() -> None:
    pass


print(Stats(read=1, written_only=2).read, dataclasses.asdict(Exported()), Point(1, 2).x, Colour.RED, Mode("fast"),
      list(Shade), Slotted.KIND)
"""


def test_the_scan_judges_class_fields_and_aliases(tmp_path: Path) -> None:
    """Class-body names: a dataclass field only written (a constructor keyword), a NamedTuple field never read,
    an enum member never named, a class constant are reported; a read field, a dunder, the members of an enum
    looked up by value (``Mode("fast")``) or iterated (``list(Shade)``) are not, and a field of a serialised
    class is only while its class is not listed as such. An import alias keeps its original alive only if
    something reads the alias."""
    probe = tmp_path / "_dead_probe.py"
    probe.write_text(FIELDS_PROBE)
    user = tmp_path / "_dead_probe_user.py"
    user.write_text("from _dead_probe import aliased_unused as renamed_unused, aliased_used as renamed_used\n"
                    "renamed_used()\n")
    expected = {"Stats.written_only": "dead", "Point.unread": "dead", "Colour.GREEN": "dead",
                "Slotted.UNUSED_KIND": "dead", "aliased_unused": "dead", "Exported.total": "dead"}
    found = {key.partition(":")[2]: verdict for key, (_, verdict) in scan([probe, user], [], [], {}).items()}
    assert found == expected, found
    listed = scan([probe, user], [], [], {"_dead_probe.py:Exported": "print(asdict(Exported()))"})
    assert {key.partition(":")[2]: verdict for key, (_, verdict) in listed.items()} == {
        **expected, "Exported.total": "serialised"}
