"""Section R — the LoRA lifecycle: LoadLora, UnloadLora, ListLoras and ``lora_name``.

The checks write small PEFT adapters (seeded random LoRA weights on every layer's q_proj
and v_proj, strong enough to change greedy output) into ``--lora-dir``, a directory the
target can read (inside its LoRA root), shaped by ``--lora-model-config`` (the served
model's ``config.json``); without both, the checks that need adapters skip. With
``supports_lora = false`` only R5 and R6 run. Each run writes into its own subdirectory,
each check uses its own names and ids (from a per-run random base), unloads what it loaded
and deletes its files: checks are independent and re-runnable against a long-running server.
"""

from __future__ import annotations

import itertools
import os
import random
import shutil
import uuid
import zlib
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import grpc

from refengine.conformance.assertions import NON_OK, expect_rejected, expect_valid
from refengine.conformance.lora_files import ModelShape, write_random_adapter
from refengine.conformance.registry import check, expect, fail, not_claimed, skip
from refengine.conformance.target import Target
from refengine.protocol import oe

RANK = 8  # below every common --max-lora-rank (refengine's default is 16)
Call = tuple[grpc.StatusCode, Any, str]


def _flag(t: Target) -> bool | None:
    return t.model_info.supports_lora if t.model_info.HasField("supports_lora") else None


def _need_lora(t: Target, files: bool = True) -> None:
    """Skip unless LoRA is advertised and (``files``) adapters can be written for the target."""
    flag = _flag(t)
    if flag is None:
        not_claimed("ModelInfo.supports_lora is not reported")
    if not flag:
        not_claimed("supports_lora = false (the disabled server is checked by R5 and R6)")
    if files and not (t.options.lora_dir and t.options.lora_model_config):
        skip("needs adapter files the target can read: run with --lora-dir DIR (inside the target's LoRA root) "
             "and --lora-model-config FILE (the served model's config.json)")


def _shape(t: Target) -> ModelShape:
    """The served model's projection sizes, from its config.json."""
    if "r_shape" not in t.cache:
        t.cache["r_shape"] = ModelShape.from_model_config_json(t.options.lora_model_config)
    return t.cache["r_shape"]


def _run_token(t: Target) -> str:
    """A per-run random token (directory and names); ids count up from a per-run random base."""
    if "r_token" not in t.cache:
        t.cache["r_token"] = uuid.uuid4().hex[:10]
        t.cache["r_ids"] = itertools.count(random.randrange(1 << 30, 1 << 40))
    return t.cache["r_token"]


def _new_id(t: Target) -> int:
    _run_token(t)
    return next(t.cache["r_ids"])


def call(t: Target, method: str, request: Any) -> Call:
    """A Control RPC: (status code, response or None, details)."""
    try:
        return grpc.StatusCode.OK, t.unary(method, request), ""
    except grpc.RpcError as err:
        return err.code(), None, err.details() or ""


def load(t: Target, adapter: Any) -> Call:
    return call(t, "LoadLora", oe.LoadLoraRequest(adapter=adapter))


def unload(t: Target, name: str) -> Call:
    return call(t, "UnloadLora", oe.UnloadLoraRequest(lora_name=name))


def listed(t: Target) -> list[Any]:
    """ListLoras: the loaded adapters (fails the check on a non-OK status)."""
    code, resp, details = call(t, "ListLoras", oe.ListLorasRequest())
    expect(code == grpc.StatusCode.OK, f"ListLoras returned {code.name} ({details!r}) with LoRA advertised")
    return list(resp.adapters)


def expect_code(got: Call, want: grpc.StatusCode, what: str) -> Any:
    code, resp, details = got
    expect(code == want, f"{what}: {code.name} ({details or resp!r}), expected {want.name}")
    return resp


def describe(adapter: Any) -> str:
    return f"(id {adapter.lora_id}, {adapter.lora_name!r}, {adapter.source_path!r})"


class Scratch:
    """One check's adapters: ``specs`` (own id, name and written directory each) and
    ``names``, every name the check may load (all unloaded at the end)."""

    def __init__(self, t: Target, tag: str, count: int) -> None:
        token = _run_token(t)
        self.run_dir = os.path.join(os.path.abspath(t.options.lora_dir), f"oeconf-{token}")
        self.dir = os.path.join(self.run_dir, tag)
        self.specs = [oe.LoraAdapter(lora_id=_new_id(t), lora_name=f"oeconf-{token}-{tag}-{i}",
                                     source_path=os.path.join(self.dir, f"adapter{i}")) for i in range(count)]
        for i, spec in enumerate(self.specs):
            write_random_adapter(spec.source_path, _shape(t), RANK, seed=zlib.crc32(f"{tag}/{i}".encode()))
        self.names = [spec.lora_name for spec in self.specs]

    def other(self, t: Target, suffix: str) -> tuple[int, str]:
        """A fresh id and name (remembered for cleanup)."""
        self.names.append(f"{self.specs[0].lora_name}-{suffix}")
        return _new_id(t), self.names[-1]


@contextmanager
def scratch(t: Target, tag: str, count: int = 1) -> Iterator[Scratch]:
    """Write ``count`` adapters for one check; afterwards unload every name it used
    (errors ignored) and delete the files."""
    _need_lora(t)
    s = Scratch(t, tag, count)
    try:
        yield s
    finally:
        for name in s.names:
            unload(t, name)
        shutil.rmtree(s.dir, ignore_errors=True)
        with suppress(OSError):
            os.rmdir(s.run_dir)  # once empty (the last check of the run)


def lora_request(t: Target, tag: str, name: str, max_tokens: int = 8) -> Any:
    req = t.request(tag, max_tokens=max_tokens, ignore_eos=True)
    req.lora_name = name
    return req


@check("R1", "LoadLora: lora_id ≤ 0, empty name, relative or missing or non-directory path → INVALID_ARGUMENT")
def invalid_adapters(t: Target) -> str:
    """R1: each malformed adapter (one field wrong, the rest valid) is refused with
    INVALID_ARGUMENT, as is a request without an adapter; none of them is listed afterwards. The
    valid adapter is loaded (and unloaded) first: a server refusing it too shows nothing by its
    refusals (found by review: with --lora-dir outside the server's LoRA root R1 passed)."""
    with scratch(t, "r1") as s:
        good = s.specs[0]
        code, _, details = load(t, good)
        if code != grpc.StatusCode.OK:
            skip(f"the valid adapter {describe(good)} was refused too ({code.name}: {details}), so refusals show "
                 "nothing: is --lora-dir inside the server's LoRA root?")
        expect_code(unload(t, good.lora_name), grpc.StatusCode.OK, f"UnloadLora {good.lora_name!r}")
        wrong = {"lora_id 0": {"lora_id": 0}, "negative lora_id": {"lora_id": -7}, "empty lora_name": {"lora_name": ""},
                 "relative source_path": {"source_path": os.path.relpath(good.source_path, "/")},
                 "empty source_path": {"source_path": ""},
                 "non-existent directory": {"source_path": good.source_path + "-missing"},
                 "a file, not a directory": {"source_path": os.path.join(good.source_path, "adapter_config.json")}}
        for i, (what, fields) in enumerate(wrong.items()):
            lora_id, name = s.other(t, str(i))
            adapter = oe.LoraAdapter(**{"lora_id": lora_id, "lora_name": name, "source_path": good.source_path,
                                        **fields})
            expect_code(load(t, adapter), grpc.StatusCode.INVALID_ARGUMENT, f"LoadLora with {what} {describe(adapter)}")
        expect_code(call(t, "LoadLora", oe.LoadLoraRequest()), grpc.StatusCode.INVALID_ARGUMENT,
                    "LoadLora without an adapter")
        leaked = [describe(a) for a in listed(t) if a.lora_name in s.names or a.source_path.startswith(s.dir)]
        expect(not leaked, f"refused adapters are listed by ListLoras: {leaked}")
    return f"{len(wrong) + 1} malformed loads refused with INVALID_ARGUMENT"


@check("R2", "the same id, name and path loaded twice → OK with already_loaded = true, listed once")
def load_twice(t: Target) -> str:
    """R2: the first load reports already_loaded = false, the identical second one true;
    ListLoras lists the adapter exactly once; after UnloadLora it is listed no more."""
    with scratch(t, "r2") as s:
        spec = s.specs[0]
        first = expect_code(load(t, spec), grpc.StatusCode.OK, f"first LoadLora {describe(spec)}")
        expect(not first.already_loaded, "the first LoadLora of a new adapter reports already_loaded = true")
        expect(first.adapter.lora_name == spec.lora_name and first.adapter.lora_id == spec.lora_id,
               f"LoadLora answered adapter {describe(first.adapter)} for {describe(spec)}")
        again = expect_code(load(t, spec), grpc.StatusCode.OK, f"identical second LoadLora {describe(spec)}")
        expect(again.already_loaded, "the identical second LoadLora reports already_loaded = false")
        entries = [a for a in listed(t) if a.lora_name == spec.lora_name]
        expect(len(entries) == 1 and entries[0].lora_id == spec.lora_id,
               f"ListLoras after loading twice lists {[describe(a) for a in entries]}, expected it once")
        expect_code(unload(t, spec.lora_name), grpc.StatusCode.OK, "UnloadLora of the loaded adapter")
        expect(all(a.lora_name != spec.lora_name for a in listed(t)), "the unloaded adapter is still listed")
    return "already_loaded false, then true; listed once; gone after UnloadLora"


@check("R3", "LoadLora sharing one or two of the id, name and path of a loaded adapter → ALREADY_EXISTS")
def conflicting_loads(t: Target) -> str:
    """R3: with one adapter loaded, a load sharing its name, its id or its path and differing in
    the rest, or sharing two of them and differing in the third (found by review: unchecked, so a
    server taking the same id and name with another path as already loaded passed), is
    ALREADY_EXISTS; the original stays loaded unchanged and no conflicting name is listed."""
    with scratch(t, "r3", count=2) as s:
        spec, other_path = s.specs[0], s.specs[1].source_path
        expect_code(load(t, spec), grpc.StatusCode.OK, f"LoadLora {describe(spec)}")
        id_a, name_a = s.other(t, "a")
        id_b, name_b = s.other(t, "b")
        cases = [("its name", oe.LoraAdapter(lora_id=id_a, lora_name=spec.lora_name, source_path=other_path)),
                 ("its id", oe.LoraAdapter(lora_id=spec.lora_id, lora_name=name_a, source_path=other_path)),
                 ("its path", oe.LoraAdapter(lora_id=id_b, lora_name=name_b, source_path=spec.source_path)),
                 ("its id and name", oe.LoraAdapter(lora_id=spec.lora_id, lora_name=spec.lora_name,
                                                    source_path=other_path)),
                 ("its name and path", oe.LoraAdapter(lora_id=id_a, lora_name=spec.lora_name,
                                                      source_path=spec.source_path)),
                 ("its id and path", oe.LoraAdapter(lora_id=spec.lora_id, lora_name=name_a,
                                                    source_path=spec.source_path))]
        for what, adapter in cases:
            expect_code(load(t, adapter), grpc.StatusCode.ALREADY_EXISTS,
                        f"LoadLora sharing only {what} with loaded {describe(spec)}: {describe(adapter)}")
            entries = {a.lora_name: a.lora_id for a in listed(t)}
            expect(entries.get(spec.lora_name) == spec.lora_id,
                   f"after the conflicting load ({what}) the original is listed as {entries.get(spec.lora_name)}")
            expect(name_a not in entries and name_b not in entries,
                   f"a conflicting adapter ({what}) is listed: {sorted(entries)}")
    return f"{len(cases)} conflicts (one or two fields shared) refused with ALREADY_EXISTS; the original stays loaded"


@check("R4", "UnloadLora of an unknown adapter and Generate naming one → NOT_FOUND (before acceptance)")
def unknown_adapter(t: Target) -> str:
    """R4: UnloadLora of a name never loaded is NOT_FOUND; a Generate whose lora_name is
    not loaded ends NOT_FOUND with no event. Needs no adapter files."""
    _need_lora(t, files=False)
    name = f"oeconf-{_run_token(t)}-never-loaded"
    expect_code(unload(t, name), grpc.StatusCode.NOT_FOUND, "UnloadLora of an adapter never loaded")
    expect_rejected(t.generate(lora_request(t, "r4", name)), codes=(grpc.StatusCode.NOT_FOUND,),
                    what="Generate with an unknown lora_name")
    return "UnloadLora and Generate → NOT_FOUND"


@check("R4", "after UnloadLora, the adapter is unknown: Generate and UnloadLora → NOT_FOUND")
def unloaded_adapter(t: Target) -> str:
    """R4: an adapter that was loaded and unloaded is unknown again: a Generate naming it
    ends NOT_FOUND before any event and unloading it again is NOT_FOUND."""
    with scratch(t, "r4u") as s:
        spec = s.specs[0]
        expect_code(load(t, spec), grpc.StatusCode.OK, f"LoadLora {describe(spec)}")
        expect_valid(t.generate(lora_request(t, "r4-loaded", spec.lora_name, max_tokens=2)),
                     what="Generate with the loaded adapter")
        expect_code(unload(t, spec.lora_name), grpc.StatusCode.OK, "UnloadLora")
        expect_rejected(t.generate(lora_request(t, "r4-unloaded", spec.lora_name)),
                        codes=(grpc.StatusCode.NOT_FOUND,), what="Generate naming an unloaded adapter")
        expect_code(unload(t, spec.lora_name), grpc.StatusCode.NOT_FOUND, "UnloadLora of an unloaded adapter")
    t.wait_idle("R4")
    return "served while loaded; NOT_FOUND after UnloadLora"


def _disabled_calls(t: Target) -> list[tuple[str, Call]]:
    """LoadLora (well-formed), UnloadLora and ListLoras on a server that should refuse them."""
    name = f"oeconf-{_run_token(t)}-disabled"
    path = os.path.abspath(t.options.lora_dir) if t.options.lora_dir else os.path.abspath(os.sep)
    loaded = load(t, oe.LoraAdapter(lora_id=_new_id(t), lora_name=name, source_path=path))
    unloaded = unload(t, name)  # also cleans up should the load have worked
    return [("LoadLora", loaded), ("UnloadLora", unloaded), ("ListLoras", call(t, "ListLoras", oe.ListLorasRequest()))]


@check("R5", "LoRA disabled: LoadLora, UnloadLora and ListLoras → FAILED_PRECONDITION")
def disabled_lifecycle(t: Target) -> str:
    """R5: on a server with supports_lora = false, all three lifecycle RPCs answer
    FAILED_PRECONDITION (skips where LoRA is supported)."""
    flag = _flag(t)
    if flag is None:
        not_claimed("ModelInfo.supports_lora is not reported: cannot tell whether LoRA is disabled")
    if flag:
        not_claimed("LoRA is supported (supports_lora = true): nothing disabled to check")
    for method, got in _disabled_calls(t):
        expect_code(got, grpc.StatusCode.FAILED_PRECONDITION, f"{method} with LoRA disabled")
    return "LoadLora, UnloadLora, ListLoras → FAILED_PRECONDITION"


@check("R6", "supports_lora ⇔ the lifecycle RPCs and lora_name work")
def supports_lora_means_it(t: Target) -> str:
    """R6: true → max_loras (when reported) > 0, ListLoras works, a loaded adapter serves a
    Generate naming it; false → the lifecycle RPCs fail and a Generate with lora_name is
    refused before acceptance (which status the RPCs answer is R5's)."""
    flag = _flag(t)
    if flag is None:
        not_claimed("ModelInfo.supports_lora is not reported")
    cap = t.server_info.capacity
    max_loras = cap.max_loras if cap.HasField("max_loras") else None
    if not flag:
        for method, (code, resp, _) in _disabled_calls(t):
            expect(code != grpc.StatusCode.OK, f"{method} succeeded ({resp!r}) with supports_lora = false")
        expect_rejected(t.generate(lora_request(t, "r6-off", "oeconf-no-such-adapter")), codes=NON_OK,
                        what="Generate with lora_name and supports_lora = false")
        return f"false: lifecycle RPCs fail, lora_name refused (max_loras {max_loras})"
    expect(max_loras is None or max_loras > 0, "supports_lora = true but DeploymentCapacity.max_loras = 0")
    with scratch(t, "r6") as s:
        spec = s.specs[0]
        listed(t)
        expect_code(load(t, spec), grpc.StatusCode.OK, f"LoadLora {describe(spec)}")
        res = expect_valid(t.generate(lora_request(t, "r6", spec.lora_name)), what="Generate with lora_name")
        expect(bool(res.tokens()), f"Generate with lora_name produced no tokens: {res.describe()}")
        expect_code(unload(t, spec.lora_name), grpc.StatusCode.OK, "UnloadLora")
    t.wait_idle("R6")
    return f"true: loaded, served {len(res.tokens())} tokens, unloaded (max_loras {max_loras})"


@check("R7", "greedy requests on two adapters and the base model, run concurrently, each get their own output")
def mixed_adapters(t: Target) -> str:
    """R7: greedy output of the base model and of two adapters, each run alone, is three
    different outputs (the adapters are strong enough to matter); run concurrently
    (so they may share a batch), every request returns exactly its solo output."""
    with scratch(t, "r7", count=2) as s:
        for index, spec in enumerate(s.specs):
            loaded = load(t, spec)
            if index and loaded[0] == grpc.StatusCode.RESOURCE_EXHAUSTED:  # found by review: R7 failed it
                skip(f"the server holds one adapter at a time (a second LoadLora: RESOURCE_EXHAUSTED, "
                     f"{loaded[2]!r}); R7 needs two loaded")
            expect_code(loaded, grpc.StatusCode.OK, f"LoadLora {describe(spec)}")
        names = ["", *(spec.lora_name for spec in s.specs)]
        label = {"": "base model", **{n: f"adapter {n!r}" for n in names[1:]}}
        solo = {n: expect_valid(t.generate(lora_request(t, "r7-solo", n, 12)), what=f"{label[n]} alone").tokens()
                for n in names}
        for n in names[1:]:
            expect(solo[n] != solo[""], f"{label[n]} gives the base model's greedy output {solo['']}: the "
                   "adapter was not applied (its weights change greedy output when it is)")
        a, b = names[1:]
        expect(solo[a] != solo[b], f"two different adapters give the same greedy output {solo[a]}: one of them "
               "is not applied with its own weights")
        calls = {n: t.generate_async(lora_request(t, "r7-mix", n, 12)) for n in names}
        mixed = {n: expect_valid(c.join(), what=f"{label[n]} concurrently") for n, c in calls.items()}
        for n in names:
            if mixed[n].tokens() != solo[n]:
                fail(f"{label[n]} run concurrently with the others gave {mixed[n].tokens()}, alone {solo[n]}")
    t.wait_idle("R7")
    overlap = max(r.started for r in mixed.values()) < min(r.times[-1] for r in mixed.values())
    return f"base + 2 adapters: outputs differ, each identical alone and concurrent (streams overlapped: {overlap})"
