"""Disaggregated prefill/decode inside the engine core (role ``prefill`` or ``decode``).

Prefill role: when output 0's first token is sampled, the request ends there (K4). Its
blocks move to a new KV session (``KvSessionStore``) under a lease; the session's
attributes carry the first token and everything the decode engine checks. The token is
not emitted here: the decode engine emits it, so the two legs together stream exactly
what one aggregated engine would (K10).

Decode role: an admitted request's blocks are allocated at once and its pull runs on a
transfer thread (``KvLoads``); between steps the core takes the finished pulls. A
good one publishes the received blocks like computed ones and appends the first
token from the attributes; a failed one ends the request with one ``EngineFault``. A
request that ends before the core took its pull's end (cancelled mid-pull, or its pull ended
during the step that cancels it) hands its blocks to a ``load:`` owner, released when the core
takes that end: only then has the pull surely stopped writing (``base.KvTransferBackend``'s
invariant), and its outcome is dropped, never applied to the ended request; where it could not
stop writing, the blocks it pulls into are withheld until restart, as for a request still
receiving (``KvCacheManager.withhold``). Each pull has its own key: a request id is reusable
once its stream ended, possibly while its cancelled namesake's pull still runs or waits for a
transfer thread.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace

from refengine.config import EngineConfig
from refengine.engine.first_token_options import first_token_options
from refengine.engine.request import OutputState, Request
from refengine.kv.kv_manager import KvCacheManager
from refengine.kv.transfer.attributes import FirstToken, SessionAttributes, prompt_hash
from refengine.kv.transfer.base import BlockStore, Cancellation, KvTransferBackend, PullOrder, TransferFailure
from refengine.kv.transfer.sessions import KvSession, KvSessionStore
from refengine.kv.transfer.source_pool import SourcePool, source_of
from refengine.sampling.sampler import SampledToken
from refengine.scheduler.scheduler import KvLoad
from refengine.types import EngineFault, EngineStats, KvSessionSpec

logger = logging.getLogger(__name__)


def _prompt_hash(request: Request) -> int:
    return prompt_hash(request.prompt_token_ids, request.media_identities,
                       "" if request.lora is None else request.lora.cache_key)


def session_content(prompt_digest: int) -> str:
    """What a KV session holds: the prompt (``_prompt_hash``: with media and LoRA adapter). The
    source says it and the decode side, which has the same prompt, checks it before it uses the
    blocks, so a session id swapped for another prompt's fails the pull instead of putting that
    prompt's KV into the prefix cache under this prompt's hashes (K10)."""
    return f"prompt {prompt_digest}"


class KvLoads:
    """Decode role: pulls on transfer threads, each under its own key (``start`` returns it);
    finished ones wait for ``take_finished``."""

    def __init__(self, backends: Mapping[str, KvTransferBackend], num_threads: int,
                 on_done: Callable[[], None], block_nbytes: int, timeout_seconds: float) -> None:
        self.backends = backends
        self.block_nbytes = block_nbytes
        self.pulled_bytes = 0  # over every pull that succeeded, for LoadInfo (transfer rate)
        self.pull_seconds = 0.0
        # a hung source never takes every thread; a pull that waited its timeout for one fails at once
        self._pool = SourcePool(num_threads, "refengine-kv-pull", timeout_seconds, "source", "--kv-pull-timeout")
        self._on_done = on_done  # wakes the step loop
        self._lock = threading.Lock()
        self._keys = itertools.count()
        self._cancel: dict[int, Cancellation] = {}  # the pulls not finished yet
        self._finished: list[tuple[int, str, TransferFailure | None]] = []  # (key, request id, failure)

    def start(self, order: PullOrder) -> int:
        cancelled = Cancellation()
        with self._lock:
            key = next(self._keys)
            self._cancel[key] = cancelled
        self._pool.submit(source_of(order.session.endpoints), lambda late: self._run(key, order, cancelled, late))
        return key

    def _run(self, key: int, order: PullOrder, cancelled: Cancellation, late: TransferFailure | None) -> None:
        failure = None
        started = time.perf_counter()
        try:
            if late is not None:
                raise late
            self.backends[order.session.transfer_backend].pull(order, cancelled)
        except TransferFailure as exc:
            failure = exc
        except Exception as exc:  # a backend bug must still end the request, and free its blocks
            logger.exception("KV pull of request %s failed", order.request_id)
            failure = TransferFailure("failed", f"{type(exc).__name__}: {exc}")
        seconds = time.perf_counter() - started
        logger.debug("KV pull of %s: %d blocks in %.1f ms (%s)", order.request_id, len(order.dest_block_ids),
                     seconds * 1e3, failure or "ok")
        with self._lock:
            if failure is None:
                self.pulled_bytes += len(order.dest_block_ids) * self.block_nbytes
                self.pull_seconds += seconds
            del self._cancel[key]
            self._finished.append((key, order.request_id, failure))
        self._on_done()

    def cancel(self, key: int) -> None:
        with self._lock:
            event = self._cancel.get(key)
        if event is not None:
            event.set()

    def take_finished(self) -> list[tuple[int, str, TransferFailure | None]]:
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    def shutdown(self) -> None:
        with self._lock:
            for event in self._cancel.values():
                event.set()
        self._pool.shutdown()


class Disaggregation:
    """The core's prefill and decode halves (``EngineCore`` calls them; only it changes state)."""

    def __init__(self, config: EngineConfig, kv: KvCacheManager, store: BlockStore, fingerprint: str,
                 sessions: KvSessionStore, backends: Mapping[str, KvTransferBackend],
                 on_load_done: Callable[[], None]) -> None:
        self.config = config
        self.kv = kv
        self.store = store
        self.fingerprint = fingerprint
        self.sessions = sessions
        self.backends = backends
        self.loads = KvLoads(backends, config.kv_transfer.num_transfer_threads, on_load_done, store.block_nbytes,
                             config.kv_transfer.pull_timeout_seconds)
        self._receiving: dict[str, int] = {}  # request id -> its pull's key, until the core takes the pull's end
        #: pull key -> (the owner of the blocks of its request, ended before that; the first block it pulls)
        self._ended: dict[int, tuple[str, int]] = {}
        self._unstoppable: set[str] = set()  # receiving requests whose pull may still write into their blocks

    def add_stats(self, stats: EngineStats) -> EngineStats:
        return replace(stats, active_kv_sessions=len(self.sessions), kv_pulled_bytes=self.loads.pulled_bytes,
                       kv_pull_seconds=self.loads.pull_seconds, withheld_kv_blocks=self.kv.num_withheld_blocks)

    # -- prefill role ------------------------------------------------------------
    def hand_over(self, request: Request, out: OutputState, token: SampledToken) -> KvSessionSpec:
        """Move output 0's blocks (the prompt's KV) into a new session; returns its handle."""
        ttl = self.config.kv_transfer.session_ttl_seconds
        backend = self.backends[self.config.kv_transfer.backend]
        prompt_digest = _prompt_hash(request)  # hashing a long prompt costs: once for both uses
        session = KvSession(secrets.token_hex(16), session_content(prompt_digest), (), time.monotonic() + ttl)
        session.block_ids = self.kv.transfer(out.seq, session.owner)
        self.sessions.add(session)
        attributes = SessionAttributes(
            model_fingerprint=self.fingerprint, block_size=self.kv.block_size, kv_dtype=self.store.dtype,
            kv_layout=self.store.layout, block_nbytes=self.store.block_nbytes,
            num_prompt_tokens=len(request.prompt_token_ids),
            prompt_hash=prompt_digest,
            num_blocks=len(session.block_ids),
            first_token=FirstToken(token.token_id, token.logprob, token.rank, tuple(token.candidates)),
            lease_expires_unix_nanos=time.time_ns() + int(ttl * 1e9), lease_seconds=ttl,
            transfer=backend.source_attributes(session.session_id, session.block_ids),
            first_token_options=first_token_options(request.params, self.config.guided.default_backend))
        return KvSessionSpec(session.session_id, backend.name, attributes=attributes.to_json())

    def free_due_sessions(self) -> int:
        """Free the blocks of every session that is due (step thread). Returns how many."""
        due = self.sessions.take_due()
        for session in due:
            self.kv.release(session.owner)
            logger.debug("KV session %s freed (%s)", session.session_id, session.release_reason or "lease expired")
        return len(due)

    # -- decode role -------------------------------------------------------------
    def start_loads(self, loads: list[KvLoad], requests: Mapping[str, Request]) -> None:
        for load in loads:
            request = requests[load.request_id]
            session = request.params.kv.session
            assert session is not None
            self._receiving[load.request_id] = self.loads.start(PullOrder(
                load.request_id, session, load.first_block_index, load.dest_block_ids, request.params.trace,
                content=session_content(_prompt_hash(request))))

    def cancel_receiving(self, out: OutputState) -> None:
        """An output ends before its pull was applied: its blocks are freed when its pull's end
        was taken, else — while the pull may still write into them — handed to an owner until then."""
        request_id = out.seq.request_id
        key = self._receiving.pop(request_id, None)
        first_pulled = out.seq.num_cached_tokens // self.kv.block_size  # the head: prefix-cache hits
        if request_id in self._unstoppable:  # a write into them may still land: never reuse them
            self._unstoppable.discard(request_id)
            self.kv.withhold(out.seq, self._owner_name("quarantine", request_id), first_pulled)
        elif key is not None:
            self._ended[key] = (self._owner_name("load", request_id), first_pulled)
            self.kv.transfer(out.seq, self._ended[key][0])
            self.loads.cancel(key)
        else:
            self.kv.free(out.seq)

    def _owner_name(self, kind: str, request_id: str) -> str:
        """``kind:request_id``, numbered when a namesake's blocks are still held."""
        name, n = f"{kind}:{request_id}", 1
        while name in self.kv.owners:
            name, n = f"{kind}:{request_id}#{n}", n + 1
        return name

    def take_finished_loads(self) -> list[tuple[str, TransferFailure | None]]:
        """Finished pulls of requests still receiving; those of ended requests free their blocks here."""
        finished = []
        for key, request_id, failure in self.loads.take_finished():
            may_change = failure is not None and failure.dest_may_change
            if may_change:
                logger.error("request %s: KV blocks withheld from reuse until restart: %s", request_id, failure)
            ended = self._ended.pop(key, None)
            if ended is None:  # its request still receives: the core applies the outcome
                del self._receiving[request_id]
                if may_change:
                    self._unstoppable.add(request_id)  # the core ends it now: cancel_receiving withholds them
                finished.append((request_id, failure))
            elif may_change:  # its request ended first: its owner keeps the tail for good, counted as withheld
                self.kv.withhold_held(*ended)  # (found by review: it was held, uncounted, so the pool looked whole)
            else:  # its request ended first: free them
                self.kv.release(ended[0])
        return finished


def first_sampled_token(session: KvSessionSpec) -> SampledToken:
    """The token the prefill engine sampled (validated before acceptance)."""
    first = SessionAttributes.from_json(session.attributes).first_token
    return SampledToken(first.token_id, first.logprob, first.rank, first.candidates)


def transfer_fault(failure: TransferFailure) -> EngineFault:
    code = "kv_session_not_found" if failure.kind == "not_found" else "kv_transfer_failed"
    return EngineFault(code, f"KV transfer: {failure}", failure.retryable)
