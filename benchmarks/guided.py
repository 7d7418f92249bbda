"""Guided decoding: throughput of JSON-schema requests against the same requests unguided,
the per-step cost of the grammar masks, and grammar compile times.

SmolLM2-135M-Instruct (the embedded default), fp32, CPU, in-process ``Engine``. 32 concurrent
requests, chat-formatted prompts asking for a JSON object, temperature 1.0 with one seed per
request, ``max_tokens`` N (default 64). Four JSON schemas, eight requests each.

- **unguided**: the same prompts and seeds, ``ignore_eos``, so every request makes N tokens;
- **json_schema (xgrammar / llguidance)**: the grammar ends an output as soon as the
  document is complete, so outputs are shorter than N: rates are tokens per second of the
  tokens actually produced;
- **unguided, matched lengths**: each request ``ignore_eos`` with ``max_tokens`` = the length
  its guided twin produced (xgrammar run), which removes the effect of a shrinking batch
  from the comparison.

Every configuration runs ``--rounds`` times, interleaved (rates are of the median round).
Schemas are compiled before each timed run (compile cost is reported on its own) and the
prefix cache is reset before each run. The mask timings wrap ``GuideMatcher.fill_bitmask``
(every backend's matcher) and the sampler's ``apply_bitmask`` in this process only, summed
per engine step.

    python benchmarks/guided.py --threads 1  # what benchmarks/README.md shows (~3 min)
    python benchmarks/guided.py              # torch's default threads: wall rates need a quiet machine
    python benchmarks/guided.py --quick      # 8 requests, 16 tokens: a smoke run

Rates are given per wall second and per CPU second of this process; the mask timings are in
CPU time of the step thread. On a machine shared with other jobs, use ``--threads 1``: with
several torch threads a busy core stalls every OpenMP barrier (wall rates then swing
tenfold between rounds), while one thread's CPU time measures the work alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import refengine.sampling.sampler as sampler_module  # noqa: E402
from refengine.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from refengine.engine.engine import Engine  # noqa: E402
from refengine.model.loader import (  # noqa: E402
    load_model_config,
    load_tokenizer,
    load_weights,
    model_fingerprint,
    resolve_model,
)
from refengine.sampling.guided import GuideMatcher  # noqa: E402
from refengine.sampling.guided.budget import BudgetedMatcher  # noqa: E402
from refengine.types import GenerationRequest, GuidedSpec, SamplingParams, StoppingParams  # noqa: E402

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24}}, "required": ["name", "age", "city"],
        "additionalProperties": False},
    "product": {"type": "object", "properties": {
        "id": {"type": "integer"}, "title": {"type": "string", "maxLength": 32}, "price": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
        "required": ["id", "title", "price", "tags"], "additionalProperties": False},
    "event": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 32},
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "attendees": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 16}, "email": {"type": "string", "maxLength": 24}},
            "required": ["name"], "additionalProperties": False}}},
        "required": ["title", "date", "attendees"], "additionalProperties": False},
    "status": {"type": "object", "properties": {
        "status": {"type": "string", "enum": ["ok", "degraded", "down"]}, "healthy": {"type": "boolean"},
        "checks": {"type": "integer", "minimum": 0}, "note": {"type": "string", "maxLength": 40}},
        "required": ["status", "healthy", "checks"], "additionalProperties": False},
}
ASKS = {"person": "a fictional person", "product": "a product in a web shop", "event": "a meeting",
        "status": "the status of a web service"}


# -- timing the masks ------------------------------------------------------------------------
@dataclass
class MaskTimes:
    """Seconds spent filling and applying grammar bitmasks, per engine step with guided rows."""

    fill: list[float] = field(default_factory=list)
    apply: list[float] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    step: list[float] = field(default_factory=list)
    _fill: float = 0.0
    _apply: float = 0.0
    _rows: int = 0

    def reset(self) -> None:
        self.fill, self.apply, self.rows, self.step = [], [], [], []

    def begin_step(self) -> None:
        self._fill, self._apply, self._rows = 0.0, 0.0, 0

    def end_step(self, seconds: float) -> None:
        if self._rows:
            self.fill.append(self._fill)
            self.apply.append(self._apply)
            self.rows.append(self._rows)
            self.step.append(seconds)


def _timed(fn: Callable[..., Any], add: Callable[[float], None]) -> Callable[..., Any]:
    """``fn`` timed in CPU time of the calling thread: on a shared machine, time other
    processes take from this one is not counted (the masks run on the step thread)."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            add(time.thread_time() - t0)

    return wrapper


def instrument(engine: Engine) -> MaskTimes:
    """Wrap every matcher's ``fill_bitmask``, the sampler's ``apply_bitmask`` and the engine's
    step (in this process only) so that each step's mask work is summed into one sample."""
    times = MaskTimes()

    def on_fill(dt: float) -> None:
        times._fill += dt
        times._rows += 1

    def on_apply(dt: float) -> None:
        times._apply += dt

    for cls in GuideMatcher.__subclasses__():
        if cls is not BudgetedMatcher:  # it wraps a backend's matcher: timing both counted every row twice
            cls.fill_bitmask = _timed(cls.fill_bitmask, on_fill)
    sampler_module.apply_bitmask = _timed(sampler_module.apply_bitmask, on_apply)
    step = engine.step

    def timed_step() -> Any:
        times.begin_step()
        t0 = time.thread_time()  # with 1 torch thread, the whole step runs on this thread
        out = step()
        times.end_step(time.thread_time() - t0)
        return out

    engine.step = timed_step  # type: ignore[method-assign]
    return times


# -- workload ------------------------------------------------------------------------------------
def prompts(tokenizer: Any, n: int) -> list[tuple[str, str]]:
    """(schema name, chat-formatted prompt) for ``n`` requests, schemas in turn."""
    names = list(SCHEMAS)
    out = []
    for i in range(n):
        name = names[i % len(names)]
        ask = (f"Describe {ASKS[name]} (number {i + 1}) as a JSON object with the keys "
               f"{', '.join(SCHEMAS[name]['properties'])}. Reply with the JSON only.")
        text = tokenizer.apply_chat_template([{"role": "user", "content": ask}], tokenize=False,
                                             add_generation_prompt=True)
        out.append((name, text))
    return out


def requests(work: list[tuple[str, str]], max_tokens: list[int], backend: str | None, tag: str) -> list[Any]:
    """``backend`` None: unguided with ``ignore_eos``; else the request's schema on that backend."""
    reqs = []
    for i, ((name, prompt), n) in enumerate(zip(work, max_tokens, strict=True)):
        guided = None if backend is None else GuidedSpec("json_schema", json.dumps(SCHEMAS[name]), backend=backend)
        reqs.append(GenerationRequest(request_id=f"{tag}-{i}", prompt=prompt, guided=guided,
                                      sampling=SamplingParams(temperature=1.0, seed=1000 + i),
                                      stopping=StoppingParams(max_tokens=n, ignore_eos=backend is None)))
    return reqs


@dataclass
class Run:
    """One configuration over every round: the outputs (the same each round: fixed seeds) and
    each round's stepping time."""

    label: str
    lengths: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # wall time
    cpu: list[float] = field(default_factory=list)  # CPU time of this process

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def rate(self) -> float:
        """Tokens per wall second of the median round."""
        return self.tokens / statistics.median(self.seconds)

    @property
    def cpu_rate(self) -> float:
        """Tokens per CPU second of this process, median round: what other processes on a
        shared machine change least (with 1 torch thread, which never spin-waits)."""
        return self.tokens / statistics.median(self.cpu)

    def spread(self) -> str:
        return " / ".join(f"{self.tokens / s:.1f}" for s in self.seconds)


def run(engine: Engine, result: Run, reqs: list[Any]) -> Run:
    """One round: add every request (guides compile here, from the cache), time the steps only."""
    engine.reset_prefix_cache()
    streams = [engine.add_request(r) for r in reqs]
    start, cpu = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests:
        engine.step()
    result.seconds.append(time.perf_counter() - start)
    result.cpu.append(time.process_time() - cpu)
    outputs = [s.result().outputs[0] for s in streams]
    result.lengths, result.texts = [len(o.tokens) for o in outputs], [o.text for o in outputs]
    return result


# -- compile times ---------------------------------------------------------------------------------
def compile_times(engine: Engine, backend: str, repeats: int) -> tuple[float, dict[str, tuple[float, float]]]:
    """(backend init s, {schema: (median cold s, median cached s)}). A cold compile is forced by a
    ``$comment`` that changes the spec text (the cache key) but not the grammar."""
    t0 = time.perf_counter()
    engine.guides.compile(GuidedSpec("regex", "init", backend=backend))  # builds the backend's vocabulary once
    init = time.perf_counter() - t0
    out = {}
    for name, schema in SCHEMAS.items():
        cold, cached = [], []
        for k in range(repeats):
            spec = GuidedSpec("json_schema", json.dumps({**schema, "$comment": f"cold {k}"}), backend=backend)
            t0 = time.perf_counter()
            engine.guides.compile(spec)
            cold.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            engine.guides.compile(spec)
            cached.append(time.perf_counter() - t0)
        out[name] = (statistics.median(cold), statistics.median(cached))
    return init, out


# -- report ----------------------------------------------------------------------------------------------
def _ms(xs: list[float]) -> str:
    if not xs:
        return "—"
    ordered = sorted(xs)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return f"{statistics.mean(xs) * 1e3:.2f} / {statistics.median(xs) * 1e3:.2f} / {p99 * 1e3:.2f}"


def print_runs(runs: list[Run], base: Run, matched: Run) -> None:
    print("\n| run | requests | output tokens | tok/s wall (median) | rounds, tok/s wall | tok per CPU-s "
          "| vs unguided (wall / CPU) | vs matched lengths (wall / CPU) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        vs_matched = (f"{r.rate / matched.rate:.2f}x / {r.cpu_rate / matched.cpu_rate:.2f}x"
                      if r.label.startswith("json_schema") else "")
        print(f"| {r.label} | {len(r.lengths)} | {r.tokens} | {r.rate:.1f} | {r.spread()} | {r.cpu_rate:.1f} "
              f"| {r.rate / base.rate:.2f}x / {r.cpu_rate / base.cpu_rate:.2f}x | {vs_matched} |")


def print_masks(masks: dict[str, MaskTimes]) -> None:
    print("\n| backend | guided steps | rows/step | fill ms/step (mean / p50 / p99) | fill µs/row "
          "| apply ms/step (mean / p50 / p99) | step ms (mean) | (fill + apply) / step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, m in masks.items():
        if not m.rows:
            continue
        per_row = sum(m.fill) / sum(m.rows) * 1e6
        share = (sum(m.fill) + sum(m.apply)) / sum(m.step)
        print(f"| {name} | {len(m.rows)} | {statistics.mean(m.rows):.1f} | {_ms(m.fill)} | {per_row:.0f} "
              f"| {_ms(m.apply)} | {statistics.mean(m.step) * 1e3:.1f} | {share * 100:.1f} % |")
    print("(CPU time of the step thread, summed per step over its guided rows; with more than one torch "
          "thread the step's time on the other threads is not in 'step ms')")


def print_compiles(compiles: dict[str, tuple[float, dict[str, tuple[float, float]]]], repeats: int) -> None:
    names = list(compiles)
    print(f"\n| schema | {' | '.join(f'{n} cold ms | {n} cached µs' for n in names)} |")
    print("|---|" + "---:|---:|" * len(names))
    print("| (backend init, first use) | " + " | ".join(f"{compiles[n][0] * 1e3:.0f} | —" for n in names) + " |")
    for schema in SCHEMAS:
        cells = " | ".join(f"{compiles[n][1][schema][0] * 1e3:.1f} | {compiles[n][1][schema][1] * 1e6:.0f}"
                           for n in names)
        print(f"| {schema} | {cells} |")
    print(f"(cold: median of {repeats} compiles through the engine's GuideCompiler, worker thread included; "
          "cached: the same spec again)")


def complete_documents(run_: Run) -> int:
    """How many guided outputs are complete JSON documents (the rest hit max_tokens)."""
    complete = 0
    for text in run_.texts:
        try:
            json.loads(text)
            complete += 1
        except ValueError:
            pass
    return complete


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 requests of 16 tokens")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every configuration")
    parser.add_argument("--compile-repeats", type=int, default=5)
    args = parser.parse_args()
    n, max_tokens = (8, 16) if args.quick else (args.requests, args.max_tokens)
    if args.quick:
        args.rounds = 1

    if args.threads:
        torch.set_num_threads(args.threads)
    resolved = resolve_model("smollm2-135m-instruct")
    tokenizer = load_tokenizer(resolved.path)
    engine = Engine(EngineConfig(cache=CacheConfig(num_blocks=4096),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=max(n, 16))),
                    load_model_config(resolved.path), load_weights(resolved.path), tokenizer,
                    model_fingerprint=model_fingerprint(resolved.path))
    print(f"torch threads: {torch.get_num_threads()}, requests: {n}, max_tokens: {max_tokens}")

    backends = ["xgrammar", "llguidance"]
    compiles = {b: compile_times(engine, b, 2 if args.quick else args.compile_repeats) for b in backends}
    work = prompts(tokenizer, n)
    times = instrument(engine)
    warm_up = requests(work[:4], [8] * 4, "xgrammar", "warm") + requests(work[:4], [8] * 4, None, "w")
    run(engine, Run("warm-up"), warm_up)

    base = Run(f"unguided (ignore_eos, {max_tokens} tokens each)")
    guided = {b: Run(f"json_schema, {b}") for b in backends}
    matched = Run("unguided, lengths matched to the xgrammar run")
    masks = {b: MaskTimes() for b in backends}
    for _ in range(args.rounds):  # interleaved, so that every configuration sees the same machine
        run(engine, base, requests(work, [max_tokens] * n, None, "u"))
        for backend in backends:
            times.reset()
            run(engine, guided[backend], requests(work, [max_tokens] * n, backend, backend[:2]))
            for name in ("fill", "apply", "rows", "step"):
                getattr(masks[backend], name).extend(getattr(times, name))
        run(engine, matched, requests(work, guided["xgrammar"].lengths, None, "m"))

    for g in guided.values():
        print(f"{g.label}: {complete_documents(g)}/{n} outputs are complete JSON documents; lengths "
              f"min {min(g.lengths)} / mean {statistics.mean(g.lengths):.1f} / max {max(g.lengths)}")
    print("sample output:", guided["xgrammar"].texts[0])
    print_runs([base, *guided.values(), matched], base, matched)
    print("(guided rates are tokens/s of the tokens actually produced: the grammar ends outputs early)")
    print_masks(masks)
    print_compiles(compiles, 2 if args.quick else args.compile_repeats)


if __name__ == "__main__":
    main()
