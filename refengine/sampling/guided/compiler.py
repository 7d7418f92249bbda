"""Compiling guides: backend choice, size limits, a bounded LRU cache, and a time limit.

``GuideCompiler.compile`` runs on the caller's thread (the engine front end's, before a
request is accepted) and waits for a worker thread; the step loop never compiles. A
compile that runs longer than ``compile_timeout_seconds`` refuses its request but keeps running
on its worker, and its result is cached, so a retry of the same spec can hit. A compile that
waited the whole time for a worker (every one busy with slow specs) never runs: its request
is refused as overloaded (RESOURCE_EXHAUSTED, retry later), not blamed on its spec (another
request sharing the compile then submits it again and waits out its own time). One that
started late gets its own full time before its spec is blamed (so a caller waits at most twice
the limit; found by review: a spec compiling in 0.2 s, started 0.1 s before the limit, was told
to "simplify it"). One compiler serves one engine, so one tokenizer: the cache key is (backend,
mode, spec, choices).
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

from refengine.config import GUIDED_BACKENDS, GuidedConfig
from refengine.sampling.guided import llguidance_backend, xgrammar_backend
from refengine.sampling.guided.base import CompiledGuide, GrammarBackend, GuidedSpecError
from refengine.sampling.guided.bitmask import allocate_bitmask, num_allowed
from refengine.sampling.guided.budget import BudgetedGuide
from refengine.types import EngineStoppedError, GuidedSpec, OverloadedError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_BACKEND_CLASSES = {"xgrammar": xgrammar_backend.XGrammarBackend, "llguidance": llguidance_backend.LlguidanceBackend}
_BACKEND_MODES = {"xgrammar": xgrammar_backend.MODES, "llguidance": llguidance_backend.MODES}
CacheKey = tuple[str, str, str, tuple[str, ...]]


class _Compile(Future):
    """A compile job's future, with when a worker started it (None until then)."""

    started_at: float | None = None


_Job = tuple[_Compile, Callable[[], CompiledGuide]]


class _DaemonPool:
    """Worker threads that never hold up process exit: a compile that outlived its request's
    time limit may still be running when the server shuts down.

    The threads hold the job queue, not the pool, and forget each job once it is done (its
    closure holds the compiler; a failed job's traceback holds the frames that called it, up
    to the engine): so ``close``, or dropping the pool, ends them and frees what they compiled
    for. (Before, each engine left its threads, its compiler and, after a refused spec, itself
    alive for the rest of the process.)"""

    def __init__(self, num_threads: int) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        for i in range(num_threads):
            threading.Thread(target=_work, args=(self._jobs,), name=f"refengine-guide-compile-{i}",
                             daemon=True).start()
        # One stop per thread, put once: by ``close`` or when the pool is collected.
        self.close = weakref.finalize(self, _stop, self._jobs, num_threads)

    def submit(self, job: Callable[[], CompiledGuide]) -> _Compile:
        if not self.close.alive:  # the engine shut down while a request was being accepted (UNAVAILABLE)
            raise EngineStoppedError("the engine is shut down: its guide compiler is closed")
        future = _Compile()
        self._jobs.put((future, job))
        return future


def _work(jobs: queue.SimpleQueue[_Job | None]) -> None:
    """A worker: run jobs until a stop (None); no reference to a finished job survives the loop."""
    while (item := jobs.get()) is not None:
        future, job = item
        del item
        future.started_at = time.monotonic()  # before it runs: a waiter that finds it running reads it
        if future.set_running_or_notify_cancel():  # False: its waiters gave up before it started
            try:
                future.set_result(job())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                future.set_exception(exc)
        del future, job


def _stop(jobs: queue.SimpleQueue[_Job | None], num_threads: int) -> None:
    for _ in range(num_threads):
        jobs.put(None)


def backend_modes() -> dict[str, tuple[str, ...]]:
    """Each backend's name -> the modes it can express."""
    return {name: _BACKEND_MODES[name] for name in GUIDED_BACKENDS}


#: Nesting of JSON objects and arrays in a schema. Compile time grows about quadratically with
#: it (xgrammar, 49k tokens: 0.3 s at 128 arrays deep, 1.2 s at 256, 36 s at 900), and a compile
#: past its time limit still runs to its end on a worker: two such specs held both workers.
MAX_SCHEMA_DEPTH = 128


def json_depth(text: str) -> int:
    """The deepest nesting of ``{`` and ``[`` in JSON ``text``, outside strings (a scan: the
    parser would recurse as deep, and a 64 KiB spec can nest 32,000 levels)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "}]":
            depth -= 1
    return deepest


def _check_depth(spec: GuidedSpec) -> None:
    if spec.mode in ("json_schema", "structural_tag") and (depth := json_depth(spec.spec)) > MAX_SCHEMA_DEPTH:
        raise GuidedSpecError(f"the {spec.mode} nests objects and arrays {depth} deep; the limit is "
                              f"{MAX_SCHEMA_DEPTH}")


class GuideCompiler:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: tuple[int, ...],
                 config: GuidedConfig) -> None:
        self.config = config
        self._backend_args = (tokenizer, vocab_size, stop_token_ids)
        # Built on first use (a vocabulary scan each, 0.1-0.5 s for 49k tokens), by the caller,
        # under a lock of their own: not counted against that request's compile time limit, and
        # never holding up cache hits meanwhile.
        self._backends: dict[str, GrammarBackend] = {}
        self._backends_lock = threading.Lock()
        self._pool = _DaemonPool(config.compile_threads)
        self._lock = threading.Lock()
        self._cache: OrderedDict[CacheKey, CompiledGuide] = OrderedDict()
        self._cached_bytes = 0  # the entries' memory_bytes, bounded by config.cache_bytes
        self._compiling: dict[CacheKey, _Compile] = {}

    def close(self) -> None:
        """Stop the worker threads once their running compiles end (the engine's shutdown)."""
        self._pool.close()

    def compile(self, spec: GuidedSpec) -> CompiledGuide:
        """The compiled guide of ``spec``; raises ``GuidedSpecError`` saying what is wrong."""
        name = self._check(spec)
        backend = self._backend(name)
        key: CacheKey = (name, spec.mode, spec.spec, spec.choices)
        timeout = self.config.compile_timeout_seconds
        deadline = time.monotonic() + timeout
        while True:
            job = self._cached_or_submitted(key, backend, spec)
            if not isinstance(job, _Compile):
                return job
            try:
                return job.result(max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                if job.cancel():  # it never started: nothing is known about the spec
                    with self._lock:
                        if self._compiling.get(key) is job:
                            del self._compiling[key]
                    raise self._busy() from None
                break
            except CancelledError:  # another request for the spec gave up before it started
                if time.monotonic() >= deadline:  # this one waited its own time too (found by review:
                    raise self._busy() from None  # it was told "busy" when the other's time was up)
        try:  # it started late: it gets its own full time before the spec is blamed
            assert job.started_at is not None
            return job.result(max(0.0, job.started_at + timeout - time.monotonic()))
        except FutureTimeout:
            raise GuidedSpecError(f"compiling the {spec.mode} took longer than {timeout:g} s "
                                  "(--guided-compile-timeout); simplify it") from None

    def _cached_or_submitted(self, key: CacheKey, backend: GrammarBackend,
                             spec: GuidedSpec) -> CompiledGuide | _Compile:
        """The cached guide of ``key``, else the compile in flight for it, else a new one."""
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
            job = self._compiling.get(key)
        if job is None or job.cancelled():  # the scan (3 ms for 64 KiB) is not repeated on each hit
            _check_depth(spec)
            with self._lock:
                if (cached := self._cache.get(key)) is not None:  # compiled meanwhile
                    return cached
                job = self._compiling.get(key)
                if job is None or job.cancelled():
                    job = self._compiling[key] = self._pool.submit(lambda: self._compile(key, backend, spec))
        return job

    def _busy(self) -> OverloadedError:
        return OverloadedError(f"every guide compile worker was busy for {self.config.compile_timeout_seconds:g} s "
                               f"(--guided-compile-threads {self.config.compile_threads}); retry later")

    def _check(self, spec: GuidedSpec) -> str:
        name = spec.backend or self.config.default_backend
        if name not in _BACKEND_CLASSES:
            raise GuidedSpecError(f"guided.backend {spec.backend!r} is not available; accepted: "
                                  f"{', '.join(GUIDED_BACKENDS)} (empty = {self.config.default_backend})")
        if spec.mode not in _BACKEND_MODES[name]:
            raise GuidedSpecError(f"guided backend {name} cannot express {spec.mode}; it supports "
                                  f"{', '.join(_BACKEND_MODES[name])}")
        size = len(spec.spec.encode()) + sum(len(c.encode()) for c in spec.choices)
        if size > self.config.max_spec_bytes:
            raise GuidedSpecError(f"the {spec.mode} is {size} bytes; the limit is {self.config.max_spec_bytes} "
                                  "(--guided-max-spec-kib)")
        if spec.mode == "choice" and not 0 < len(spec.choices) <= self.config.max_choices:
            raise GuidedSpecError(f"guided.choice needs 1 to {self.config.max_choices} choices, got "
                                  f"{len(spec.choices)}")
        if spec.mode not in ("json_object", "choice") and not spec.spec:
            raise GuidedSpecError(f"guided.{spec.mode} is empty")
        return name

    def _backend(self, name: str) -> GrammarBackend:
        backend = self._backends.get(name)  # built once and never replaced: reading needs no lock
        if backend is not None:
            return backend
        with self._backends_lock:
            backend = self._backends.get(name)
            if backend is None:
                backend = self._backends[name] = _BACKEND_CLASSES[name](*self._backend_args)
            return backend

    def _check_start(self, compiled: CompiledGuide, spec: GuidedSpec) -> None:
        """Refuse a guide that cannot start: a language without any string (``[^\\s\\S]``), or a
        limit the backend hits computing the first mask (llguidance's lexer on ``a{1000000}``).
        Accepted, it would fail after acceptance, a sampled token outside every mask."""
        matcher = compiled.new_matcher()
        vocab_size = self._backend_args[1]
        mask = allocate_bitmask(1, vocab_size)
        matcher.fill_bitmask(mask, 0)
        error = matcher.error()  # a budgeted matcher's: over the time budget already
        if num_allowed(mask, 0, vocab_size) == 0:
            raise GuidedSpecError(f"the {spec.mode} admits no output: no token may start it"
                                  + (f" ({error})" if error else ""))
        if error:
            raise GuidedSpecError(f"the {spec.mode} admits no output the grammar engine can follow: {error}")

    def _compile(self, key: CacheKey, backend: GrammarBackend, spec: GuidedSpec) -> CompiledGuide:
        """On a worker: compile, cache (LRU-bounded), forget the in-flight entry."""
        try:
            compiled = BudgetedGuide(backend.compile(spec), self.config.max_token_seconds)
            self._check_start(compiled, spec)
        except BaseException:
            with self._lock:
                self._compiling.pop(key, None)
            raise
        # Cached and no longer in flight at once: a caller in between would compile it again.
        with self._lock:
            self._compiling.pop(key, None)
            self._cache[key] = compiled
            self._cached_bytes += compiled.memory_bytes
            # A 20-character regex compiles to ~9 MB of token masks (49k tokens): a count alone
            # let 256 of them hold gigabytes. The newest entry stays, whatever its size.
            while len(self._cache) > 1 and (len(self._cache) > self.config.cache_size
                                            or self._cached_bytes > self.config.cache_bytes):
                self._cached_bytes -= self._cache.popitem(last=False)[1].memory_bytes
        return compiled
