"""The scan behind tests/unit/test_dead_code.py: production definitions nothing uses, found statically (``ast``;
nothing is imported but a few stdlib modules).

A production definition -- a module-level function, class or name (an UPPER_CASE constant, a lower-case global,
a type alias), a function or class nested in a function, a method, an attribute a method assigns on ``self``,
or a name a class body assigns (a dataclass or NamedTuple field, a class constant, an enum member) -- must be
used by the package or by the tools shipped beside it (``benchmarks/``, ``scripts/``, the entry points of
pyproject.toml). Writing is no use: a field only passed to its constructor (a keyword argument) or assigned is
dead. A definition nothing uses is dead; one only ``tests/`` mention is test-only API and belongs in a tests/
helper module (tests/unit/kernel_helpers.py, tests/conformance/rule_ids.py).

Where a use is looked for depends on what is defined:

- A module-level name of module ``m`` is used by a load of it in ``m`` (outside its own definition), by a load
  of what a ``from m import name [as alias]`` bound elsewhere (followed through re-exports: an ``__init__``
  that imports it is used where its own name is), and by ``m.name`` where ``m`` resolves to that module
  (``import a.m``, ``import a.m as m``, ``from a import m``). ``x.name`` on anything else (an object, a call,
  a parameter) and ``getattr(x, "name")`` may be the module, so they count whatever ``x`` is; on an imported
  module that is not ``m`` (``torch.name``) they do not. Another module's identically named definition or
  local variable is no use of it.
- A function or class nested in a function is used by a load of its name in the enclosing function (its
  scope), outside its own definition. A decorator may register it (a route, a callback), so a decorated one
  is judged only when its decorators are ``functools``/``contextlib`` wrappers (``WRAPPERS``).
- A class member (method, ``self`` attribute, class-body name) is matched by name, as vulture does: any load of
  ``name`` or ``x.name`` anywhere outside the definition counts, whatever object it is on, so an override is
  alive when its base's method is called. Its type is unknown to ``ast``, so a member that shares its name
  with a used one (``name``, ``size``) is never reported, however dead.

What is reached without a load of its name is handled by rule (see ``is_exempt``): dunders (a class's
``__slots__`` and a module's ``__all__`` too), overrides of a stdlib base's names, gRPC and getattr-dispatched
methods, registered checks. An enum's members are all reached when the enum is looked up by value or name or
iterated (``lookups``), else each is judged. A class whose instances the code base serialises field by field
(``dataclasses.asdict``/``fields``/``astuple``, ``_asdict``, ``vars``) is listed in the test's ``SERIALISED``:
its unnamed fields are exempt. NamedTuple fields are judged by name: unpacking reads them by position, so one
reached only so would need an entry too. A name in ``__all__`` is not a use: that is how test-only API hid
before; a genuine public API is documented and allowlisted instead.

Out of scope: a parameter or local named like a module-level name keeps it alive (every load of the name in
its module counts); methods and fields of a class nested in a function, names a class body assigns under
``if``/``try``, attributes set on objects other than ``self``, names reached through ``globals()`` or a
string naming a module path; an enum is known by a stdlib enum base (one deriving from a project enum is
judged as a plain class).
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
from dataclasses import dataclass, field
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
#: Decorators known only to wrap what they decorate: a nested function under them alone is still judged.
WRAPPERS = ("wraps", "cache", "lru_cache", "cached_property", "contextmanager", "asynccontextmanager")
#: Builtins that read an attribute named in a string: ``getattr(x, "name")`` uses ``name``.
REFLECTION = ("getattr", "hasattr")
#: Method name prefixes a dispatcher builds with getattr (ast.NodeVisitor, pytest's hook lookup).
DISPATCH_PREFIXES = ("visit_", "pytest_")

#: Builtins that iterate what they are given: ``list(Colour)`` reaches every member of an enum.
ITERATING = ("list", "tuple", "set", "frozenset", "sorted", "iter", "len", "dict", "enumerate")

Place = tuple[Path, int]


@dataclass(frozen=True)
class Definition:
    path: Path
    kind: str  # function, class, constant, global, nested function/class, method, field, member, attribute
    name: str
    owner: str | None  # the class of a member, the enclosing function of a nested definition
    first: int
    last: int  # lines of the definition; a use inside it (recursion) does not count
    exempt: bool  # a rule (or, nested, the enclosing function) says something reaches it without naming it
    module: str | None = None  # a module-level name's module: only its uses count; None: any use of the name

    @property
    def key(self) -> str:
        return f"{shown(self.path)}:{self.owner + '.' if self.owner else ''}{self.name}"

    def label(self) -> str:
        return f"{shown(self.path)}:{self.first} {self.kind} {self.key.partition(':')[2]}"


@dataclass
class Uses:
    """Where names are loaded, over every file the scan reads."""

    by_name: dict[str, list[Place]] = field(default_factory=lambda: defaultdict(list))  # on anything
    scoped: dict[tuple[str, str], list[Place]] = field(default_factory=lambda: defaultdict(list))  # (module, name)
    anywhere: dict[str, list[Place]] = field(default_factory=lambda: defaultdict(list))  # x.name: x may be a module
    bound: list[tuple[str, str, str, str]] = field(default_factory=list)  # (module, alias, source, name): from-imports
    starred: list[tuple[str, str]] = field(default_factory=list)  # (module, source) of ``from source import *``
    looked_up: set[str] = field(default_factory=set)  # see lookups

    def of(self, d: Definition) -> list[Place]:
        return self.by_name[d.name] if d.module is None else [*self.scoped[d.module, d.name], *self.anywhere[d.name]]


def shown(path: Path) -> str:
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.name


def module_name(path: Path) -> str:
    """``refengine.kv.keys`` for refengine/kv/keys.py; a file outside the repository (a test's scratch module) is
    a top-level module named by its stem."""
    parts = path.relative_to(REPO).with_suffix("").parts if path.is_relative_to(REPO) else (path.stem,)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


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
    imported, module = import_names(tree), module_name(path)

    def walk(body: Iterable[ast.stmt]) -> Iterator[Definition]:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                registered = any(_callee(d) in REGISTERING_DECORATORS for d in node.decorator_list)
                yield Definition(path, "function", node.name, None, node.lineno, node.end_lineno,
                                 registered or is_exempt(node.name, [], rpcs), module)
            elif isinstance(node, ast.ClassDef):
                yield Definition(path, "class", node.name, None, node.lineno, node.end_lineno, False, module)
                yield from class_members(path, node, stdlib_bases(node, imported), rpcs)
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for name in (n.id for n in ast.walk(target) if isinstance(n, ast.Name)):
                        yield Definition(path, "constant" if name.isupper() else "global", name, None, node.lineno,
                                         node.end_lineno, is_exempt(name, [], rpcs), module)
            elif isinstance(node, ast.If | ast.Try):  # TYPE_CHECKING blocks, optional imports
                yield from walk([*node.body, *getattr(node, "handlers", []), *node.orelse])
            elif isinstance(node, ast.ExceptHandler):
                yield from walk(node.body)

    yield from walk(tree.body)
    yield from nested_definitions(path, tree)


def nested_definitions(path: Path, tree: ast.Module) -> Iterator[Definition]:
    """Functions and classes defined in a function, each judged by the loads of its name in that function."""
    for outer in ast.walk(tree):
        if not isinstance(outer, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for inner in local_definitions(outer):
            used = any(isinstance(n, ast.Name) and n.id == inner.name and not isinstance(n.ctx, ast.Store)
                       and not inner.lineno <= n.lineno <= inner.end_lineno for n in ast.walk(outer))
            registered = any(_callee(d) not in WRAPPERS for d in inner.decorator_list)
            kind = "nested class" if isinstance(inner, ast.ClassDef) else "nested function"
            yield Definition(path, kind, inner.name, outer.name, inner.lineno, inner.end_lineno, used or registered)


def local_definitions(scope: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef]:
    """The functions and classes whose nearest enclosing scope is ``scope`` (not those nested deeper)."""
    for node in ast.iter_child_nodes(scope):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield node
        elif not isinstance(node, ast.Lambda):
            yield from local_definitions(node)


def _callee(decorator: ast.expr) -> str:
    """``check`` for ``@check(...)``, ``@check`` or ``@registry.check(...)``."""
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")


def module_imports(tree: ast.Module, module: str, package: bool, uses: Uses, known: set[str]) -> dict[str, str]:
    """Records the file's from-imports (anywhere in it: a function's own import binds its names for the scan
    too) in ``uses``; returns local name -> the module an import binds it to."""
    modules = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name.split(".")[0]: a.name if a.asname else a.name.split(".")[0]
                        for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            parts = module.split(".")  # ``from .x import y`` in a.b.c (or in a/b/__init__.py) means a.b.x
            base = parts[:len(parts) - node.level + package] if node.level else []
            source = ".".join([*base, *([node.module] if node.module else [])])
            for a in node.names:
                if a.name == "*":
                    uses.starred.append((module, source))
                    continue
                uses.bound.append((module, a.asname or a.name, source, a.name))
                if f"{source}.{a.name}" in known:
                    modules[a.asname or a.name] = f"{source}.{a.name}"
    return modules


def collect(path: Path, tree: ast.Module, uses: Uses, known: set[str]) -> None:
    """Adds the file's uses: loads of names and attributes, getattr/hasattr with a literal name, string
    annotations."""
    module = module_name(path)
    modules = module_imports(tree, module, path.name == "__init__.py", uses, known)

    def module_of(node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            return modules.get(node.id)
        if not isinstance(node, ast.Attribute):
            return None
        outer = module_of(node.value)
        if outer is None or (outer in known and f"{outer}.{node.attr}" not in known):
            return None
        return f"{outer}.{node.attr}"  # a scanned module, or a chain through an outside one (torch.cuda, os.path)

    def add(tree: ast.AST, line: int | None = None) -> None:
        for node in ast.walk(tree):
            at = (path, line or getattr(node, "lineno", 0))
            if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store):
                uses.by_name[node.id].append(at)
                uses.scoped[module, node.id].append(at)
            elif isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Store):
                uses.by_name[node.attr].append(at)
                owner = module_of(node.value)
                if owner in known:
                    uses.scoped[owner, node.attr].append(at)
                elif owner is None:  # not an imported module: it may hold one
                    uses.anywhere[node.attr].append(at)
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in REFLECTION and len(node.args) > 1:
                if isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                    uses.by_name[node.args[1].value].append(at)
                    uses.anywhere[node.args[1].value].append(at)
            elif isinstance(node, ast.arg | ast.FunctionDef | ast.AsyncFunctionDef | ast.AnnAssign):
                note = node.returns if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else node.annotation
                if isinstance(note, ast.Constant) and isinstance(note.value, str):
                    add(ast.parse(note.value, mode="eval"), node.lineno)

    add(tree)
    uses.looked_up.update(lookups(tree))


def follow_imports(uses: Uses) -> None:
    """A name a from-import binds is used where the import's alias is, and a star import passes on every use of
    the importer's names (to a fixed point: a module may re-export what it imported)."""
    pending = list(uses.bound)
    while True:
        alive = [b for b in pending if uses.scoped.get((b[0], b[1]))]
        stars = [(source, name, places) for module, source in uses.starred
                 for (where, name), places in list(uses.scoped.items())
                 if where == module and places and not uses.scoped.get((source, name))]
        if not alive and not stars:
            return
        pending = [b for b in pending if b not in alive]
        for module, alias, source, name in alive:
            uses.scoped[source, name] += uses.scoped[module, alias]
        for source, name, places in stars:
            uses.scoped[source, name] += places


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


def entry_points() -> Iterator[tuple[str, str]]:
    """(module, function) of pyproject.toml's scripts and entry points (``refengine.cli:main``)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    groups = [project.get("scripts", {}), project.get("gui-scripts", {}), *project.get("entry-points", {}).values()]
    for group in groups:
        for target in group.values():
            module, _, function = target.partition(":")
            yield module, function.split(".")[0]


def scan(production: list[Path], tools: list[Path], tests: list[Path],
         serialised: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Production definitions with no use outside themselves: key -> (label, "dead" or "test-only"; or
    "serialised" for a field of a ``serialised`` class, which is no finding). ``production`` files are
    judged and use; ``tools`` only use; ``tests`` only tell the test-only apart (any word of theirs will
    do: faster than parsing them)."""
    rpcs, uses, judged = rpc_names(), Uses(), []
    known, judged_paths = {module_name(path) for path in [*production, *tools]}, set(production)
    for path in [*production, *tools]:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        if path in judged_paths and not is_generated(path):
            judged += definitions(path, tree, rpcs)
        collect(path, tree, uses, known)
    for module, function in entry_points():
        uses.by_name[function].append((REPO / "pyproject.toml", 0))
        uses.scoped[module, function].append((REPO / "pyproject.toml", 0))
    follow_imports(uses)
    test_words = {word for path in tests for word in re.findall(r"\w+", path.read_text(encoding="utf-8"))}
    test_words |= {name for _, alias, _, name in uses.bound if alias in test_words}
    unused = {}
    for d in judged:
        if d.exempt or (d.kind == "member" and d.owner in uses.looked_up):
            continue
        if d.kind.startswith("nested"):
            unused[d.key] = (d.label(), "dead")  # its enclosing function does not use it, and nothing else can
        elif all(path == d.path and d.first <= line <= d.last for path, line in uses.of(d)):
            serial = d.kind == "field" and f"{shown(d.path)}:{d.owner}" in serialised
            unused[d.key] = (d.label(), "serialised" if serial else "test-only" if d.name in test_words else "dead")
    return unused
