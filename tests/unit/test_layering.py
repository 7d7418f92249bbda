"""The layer rules of DESIGN.md, checked on every import statement of ``refengine/``
(module level and inside functions, parsed with ``ast``; nothing is imported).

Data flows down, results flow up: a component may import only the components listed
for it in ``MAY_IMPORT`` (and itself). The table is the intended architecture, top to
bottom; a violation names the file, the line, the import and the rule it breaks.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "refengine"

CORE = ("engine", "scheduler", "kv", "lora", "multimodal", "model", "kernels", "sampling")
# plain data, __version__, pure block-key functions, the KV transfer interface (no torch, no grpc)
BOTTOM = ("types", "config", "package", "keys", "transfer_api")
#: Modules that form a component of their own, below the package they sit in: the block-key
#: functions a router (or an edge) may call without touching the KV cache's state.
MODULE_COMPONENTS = {"refengine.encoder_client": "client",
                     "refengine.config_checks": "config", "refengine.config_features": "config",
                     "refengine.args_config": "args",
                     "refengine.kv.keys": "keys", "refengine.kv.prefix_hash": "keys", "refengine.kv": "keys",
                     "refengine.kv.transfer": "transfer_api", "refengine.kv.transfer.base": "transfer_api",
                     "refengine.kv.transfer.attributes": "transfer_api"}

#: component -> the components it may import, highest layer first. ``protocol`` is the
#: generated gRPC bindings; ``args``/``runtime`` are the entry points' config helpers.
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "cli": ("commands", "server", "args", *BOTTOM),  # the entry point: assembles the subcommands
    "commands": ("server", "client", "conformance", "bench", "engine", "model", "args", "runtime", *BOTTOM),
    "conformance": ("protocol",),  # checks any server: never this engine's internals
    "bench": ("client", "protocol"),
    "client": ("protocol",),  # a client for any server: no torch, no engine
    "server": ("engine", "protocol", "args", "runtime", *BOTTOM),
    "engine": ("scheduler", "kv", "lora", "multimodal", "model", "kernels", "sampling", *BOTTOM),
    "multimodal": BOTTOM,
    "lora": ("kernels", *BOTTOM),
    "scheduler": ("kv", *BOTTOM),
    "model": ("kernels", *BOTTOM),
    "sampling": BOTTOM,
    "kv": BOTTOM,
    "kernels": BOTTOM,
    "args": BOTTOM,
    "runtime": BOTTOM,
    "protocol": (),
    "types": (),
    "config": (),
    "package": (),  # refengine/__init__.py
    "keys": (),
    "transfer_api": ("types",),
}

#: Third-party modules a component must never import, and why.
FORBIDDEN_EXTERNAL: dict[str, tuple[tuple[str, ...], str]] = {
    **{c: (("grpc", "google.protobuf", "grpc_health", "grpc_reflection"),
           "the engine core never sees the wire protocol") for c in CORE},
    "server": (("torch",), "the server never touches tensors"),
    "client": (("torch",), "the client is for any server and needs no tensors"),
    "conformance": (("torch",), "the conformance suite checks any server over gRPC"),
    "bench": (("torch",), "the load generator is for any server"),
    "config": (("torch",), "the server imports config and must not load torch"),
    "args": (("torch",), "the server imports args and must not load torch"),
    "types": (("torch",), "shared plain data"),
    "transfer_api": (("torch", "grpc", "google.protobuf"), "the transfer interface is plain data for every side"),
}


def component(module: str) -> str | None:
    """``refengine.engine.core`` -> ``engine``; None for a module outside refengine."""
    parts = module.split(".")
    if parts[0] != "refengine":
        return None
    if module in MODULE_COMPONENTS:
        return MODULE_COMPONENTS[module]
    if len(parts) == 1:
        return "package"
    return parts[1]


def module_of(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path`` (module ``module``), relative ones resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target))
    return found


def package_files() -> list[tuple[Path, str]]:
    """(path, module) of every hand-written module of refengine (not the generated bindings)."""
    return [(path, module_of(path)) for path in sorted(PACKAGE.rglob("*.py"))
            if "protocol" not in path.relative_to(PACKAGE).parts[:1]]


def violations(files: list[tuple[Path, str]]) -> list[str]:
    problems = []
    for path, module in files:
        source = component(module)
        assert source in MAY_IMPORT, f"{path}: component {source!r} is not in the layer table"
        allowed = {source, *MAY_IMPORT[source]}
        banned, why = FORBIDDEN_EXTERNAL.get(source, ((), ""))
        for line, target in imports(path, module):
            where = f"{path.name if not path.is_relative_to(REPO) else path.relative_to(REPO)}:{line} imports {target}"
            target_component = component(target)
            if target_component is None:
                if any(target == b or target.startswith(b + ".") for b in banned):
                    problems.append(f"{where}: {source} must not import {target.split('.')[0]} ({why})")
            elif target_component not in allowed:
                rule = ("nothing imports the CLI" if target_component == "cli"
                        else f"{source} may import only {sorted(allowed - {source})}")
                problems.append(f"{where}: {source} -> {target_component} breaks the layering ({rule})")
    return problems


def test_every_import_follows_the_layer_table() -> None:
    problems = violations(package_files())
    assert not problems, "layering violations:\n" + "\n".join(problems)


def test_the_table_is_a_hierarchy() -> None:
    """No cycles: following MAY_IMPORT from any component never comes back to it."""
    def reachable(start: str) -> set[str]:
        seen, todo = set(), list(MAY_IMPORT[start])
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo += MAY_IMPORT[name]
        return seen

    for name in MAY_IMPORT:
        assert name not in reachable(name), f"{name} can reach itself through MAY_IMPORT"


def test_the_checker_catches_a_violation(tmp_path: Path) -> None:
    """A deliberately wrong module (a scratch file posing as part of ``sampling``) is reported
    with the rule it breaks."""
    bad = tmp_path / "_layering_probe.py"
    bad.write_text("from refengine.engine.core import EngineCore\nimport grpc\n")
    problems = violations([(bad, "refengine.sampling._layering_probe")])
    assert any("_layering_probe.py:1" in p and "sampling -> engine" in p for p in problems), problems
    assert any("_layering_probe.py:2" in p and "must not import grpc" in p for p in problems), problems


@pytest.mark.parametrize("module", ["refengine.server.app", "refengine.client", "refengine.conformance",
                                    "refengine.config", "refengine.args", "refengine.types"])
def test_importing_an_edge_loads_no_torch(module: str) -> None:
    """The transitive check (a subprocess): loading the module never loads torch."""
    code = f"import sys, {module}; sys.exit(1 if 'torch' in sys.modules else 0)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"importing {module} loaded torch\n{result.stderr[-2000:]}"
