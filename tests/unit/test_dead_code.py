"""No dead code and no test-only API in ``refengine/``: every production definition -- module-level function,
class or name, function nested in a function, method, ``self`` attribute, class-body name -- is used by the
package or the tools shipped beside it (``benchmarks/``, ``scripts/``, pyproject.toml's entry points). The
rules (where a use is looked for, what is reached without one) and what they cannot see are in
tests/unit/dead_code_scan.py's docstring; what no rule covers is in ``ALLOWLIST``, each entry with its reason.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from tests.unit.dead_code_scan import PACKAGE, REPO, TOOLS, scan

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


@cache
def repo_findings() -> dict[str, tuple[str, str]]:
    return scan(sorted(PACKAGE.rglob("*.py")), sorted(p for tool in TOOLS for p in (REPO / tool).rglob("*.py")),
                sorted((REPO / "tests").rglob("*.py")), SERIALISED)


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
    found = {key.partition(":")[2]: verdict for key, (_, verdict) in scan([probe], [], [user], {}).items()}
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


NESTED_PROBE = """
import functools


def helper() -> int:
    return 0


def outer() -> int:
    def used_inner() -> int:
        return 1

    def recursive_inner(n: int) -> int:
        return recursive_inner(n - 1) if n else 0

    @functools.cache
    def cached_inner() -> int:
        return 2

    @app.route("/x")
    def registered_inner() -> None:
        pass

    class LocalClass:
        pass

    def closure() -> int:
        return used_inner()

    return closure()


class Service:
    def run(self) -> None:
        def helper() -> None:
            pass


print(outer(), helper(), Service().run())
"""


def test_the_scan_judges_nested_definitions_in_their_scope(tmp_path: Path) -> None:
    """A function or class nested in a function is used only by its enclosing function (a closure within it
    counts): one only calling itself, one under a wrapping decorator, an unused class and an unused method-local
    ``helper`` are reported, the last although a module-level ``helper`` is used; one a closure calls and one
    under a decorator that may register it (``@app.route``) are not."""
    probe = tmp_path / "_dead_probe.py"
    probe.write_text(NESTED_PROBE)
    found = {key.partition(":")[2]: verdict for key, (_, verdict) in scan([probe], [], [], {}).items()}
    assert found == {"outer.recursive_inner": "dead", "outer.cached_inner": "dead", "outer.LocalClass": "dead",
                     "run.helper": "dead"}, found


SCOPED_PROBE = """
import threading

_lock = threading.Lock()
_stale_lock = threading.Lock()
table = {"a": 1}
read_as_attribute = 3
read_by_getattr = 4
Alias = dict[str, int]
count = 0
only_tests = 5


def locked() -> None:
    with _lock:
        pass


def reexported() -> None:
    pass


def sep() -> str:
    return "/"


def join() -> str:
    return ""
"""
SCOPED_API = "from _scoped import reexported\n"
SCOPED_USER = """
import os

import _scoped
from _scoped import table as renamed
from _scoped_api import reexported

count = 1
print(count, renamed, _scoped.read_as_attribute, _scoped.locked, os.sep, os.path.join,
      getattr(_scoped, "read_by_getattr"), reexported())
"""


def test_the_scan_judges_module_level_names_by_their_module(tmp_path: Path) -> None:
    """A module-level name -- a lower-case global or type alias too -- is used by a load in its module, by what a
    from-import of it binds elsewhere (through a re-export), by ``module.name`` and ``getattr(module, "name")``;
    not by another module's own ``count``, nor by ``os.sep`` or ``os.path.join`` for a ``sep`` or ``join`` of its
    own. So an unread lock, an
    unused alias, a ``count`` only its namesake elsewhere is read as and a ``sep`` only ``os`` has read are dead,
    and a global only tests name is test-only."""
    sources = {"_scoped": SCOPED_PROBE, "_scoped_api": SCOPED_API, "_scoped_user": SCOPED_USER}
    paths = [tmp_path / f"{name}.py" for name in sources]
    for path, text in zip(paths, sources.values(), strict=True):
        path.write_text(text)
    tests = tmp_path / "test_scoped.py"
    tests.write_text("from _scoped import only_tests\nassert only_tests\n")
    found = {key.partition(":")[2]: verdict for key, (_, verdict) in scan(paths, [], [tests], {}).items()}
    assert found == {"_stale_lock": "dead", "Alias": "dead", "count": "dead", "sep": "dead", "join": "dead",
                     "only_tests": "test-only"}, found
