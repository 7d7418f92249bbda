"""The engine's thread-safe front end: requests in, ``RequestOutput``s out to sinks.

Any thread may call ``add_request`` (input processing: validation and tokenization,
once), ``abort``, ``stats``; they only touch the inbox under a lock. The step —
``EngineCore.step`` in ``core.py`` — runs on one thread (the background loop, or the
caller in synchronous use), which also delivers each step's outputs to their sinks.
Edges see this class only as an ``EngineClient`` with a frozen ``EngineInfo``.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from refengine.config import EngineConfig, ModelConfig
from refengine.engine.core import EngineCore, KvEventSink
from refengine.engine.input_processor import InputProcessor
from refengine.engine.interface import EngineInfo, OutputSink
from refengine.engine.kv_events import KvEventHub, KvEventSubscription
from refengine.engine.request import Request
from refengine.engine.stream import Completion, RequestStream
from refengine.engine.validation import Limits
from refengine.kernels.attention import make_attention_backend
from refengine.model.dtypes import DTYPES
from refengine.model.runner import ModelRunner
from refengine.sampling.guided import GuideCompiler, backend_modes
from refengine.types import (
    DuplicateRequestError,
    EngineStats,
    GenerationRequest,
    InvalidRequestError,
    KvEvent,
    OverloadedError,
    RequestOutput,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

FINISHED_ID_WINDOW = 4096  # finished request ids remembered for abort's ALREADY_FINISHED


def engine_info(config: EngineConfig, model_config: ModelConfig, served_model_name: str, max_model_len: int,
                num_blocks: int) -> EngineInfo:
    return EngineInfo(
        served_model_name=served_model_name,
        served_model_aliases=tuple(a for a in config.served_model_aliases if a != served_model_name),
        model_id=config.model,
        vocab_size=model_config.vocab_size,
        max_model_len=max_model_len,
        bos_token_id=model_config.bos_token_id,
        eos_token_ids=tuple(model_config.eos_token_ids),
        max_sequences_per_request=config.max_sequences_per_request,
        max_logprobs=config.max_logprobs,
        kv_block_size=config.cache.block_size,
        total_kv_blocks=num_blocks,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        device=config.device,
        dtype=config.dtype,
        guided_modes=backend_modes()[config.guided.default_backend],
        guided_backends=tuple(sorted(backend_modes().items(), key=lambda kv: kv[0] != config.guided.default_backend)),
    )


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        weights: dict[str, torch.Tensor],
        tokenizer: PreTrainedTokenizerBase,
        model_fingerprint: str = "",
        served_model_name: str | None = None,
        kv_event_sink: KvEventSink | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                            model_config.max_position_embeddings)
        dtype = DTYPES[config.dtype]
        attention = make_attention_backend(config.attention_backend, dtype, config.device, config.kernels)
        runner = ModelRunner(model_config, weights, config.cache, max_model_len, dtype=dtype, device=config.device,
                             attention=attention, kernels=config.kernels)
        self.kv_events = KvEventHub(config.kv_events.retained_batches, config.kv_events.subscriber_buffer)
        self.core = EngineCore(config, runner, tokenizer, tuple(model_config.eos_token_ids), model_fingerprint,
                               self._kv_sink(config, kv_event_sink))
        self._step_lock = threading.Lock()  # held by a step; subscribing waits for the step to end
        name = served_model_name or config.served_model_name or config.model
        self.info = engine_info(config, model_config, name, max_model_len, runner.num_blocks)
        self.guides = GuideCompiler(tokenizer, model_config.vocab_size, tuple(model_config.eos_token_ids),
                                    config.guided)
        self.input_processor = InputProcessor(tokenizer, Limits(
            model_config.vocab_size, max_model_len, config.max_sequences_per_request, config.max_logprobs,
            config.cache.block_size, runner.num_blocks), self.guides)
        self._lock = threading.Condition()
        self._inbox: list[Request] = []
        self._abort_ids: set[str] = set()
        self._active_ids: set[str] = set()  # inbox + accepted, for duplicate detection
        self._finished_ids: OrderedDict[str, None] = OrderedDict()
        self._sinks: dict[str, OutputSink] = {}  # touched by the step thread only
        self._new_sinks: dict[str, OutputSink] = {}  # guarded by the lock, moved with the inbox
        self._stats = self.core.stats()
        self._loop_thread: threading.Thread | None = None
        self._stopping = False

    def _kv_sink(self, config: EngineConfig, extra: KvEventSink | None) -> KvEventSink | None:
        """The hub, when KV events are on, and ``extra`` (an in-process observer) too."""
        sinks = ([self.kv_events.publish] if config.kv_events.enabled else []) + ([extra] if extra else [])
        if len(sinks) <= 1:
            return sinks[0] if sinks else None

        def both(events: list[KvEvent]) -> None:
            for sink in sinks:
                sink(events)

        return both

    @classmethod
    def from_config(cls, config: EngineConfig, kv_event_sink: KvEventSink | None = None) -> Engine:
        """Load the model named by ``config.model`` (manifest name or path)."""
        from refengine.model.loader import (
            load_model_config,
            load_tokenizer,
            load_weights,
            model_fingerprint,
            resolve_model,
        )

        resolved = resolve_model(config.model)
        return cls(
            config,
            load_model_config(resolved.path),
            load_weights(resolved.path, DTYPES[config.dtype]),
            load_tokenizer(resolved.path),
            model_fingerprint=model_fingerprint(resolved.path),
            served_model_name=config.served_model_name or resolved.name,
            kv_event_sink=kv_event_sink,
        )

    # -- accepting work (any thread) ------------------------------------------
    def add_request(self, params: GenerationRequest, sink: OutputSink | None = None) -> RequestStream | None:
        """Validate and enqueue. Raises a ``RequestError`` subclass (nothing allocated)
        when the request is refused. Returns the default stream when no sink is given."""
        request = self.input_processor.process(params)
        stream = None
        if sink is None:
            stream = sink = RequestStream(params.request_id, params.sampling.num_sequences)
        with self._lock:
            if params.request_id in self._active_ids:
                raise DuplicateRequestError(f"request_id {params.request_id!r} is already active")
            if len(self._active_ids) >= self.config.scheduler.max_active_requests:
                raise OverloadedError("too many requests in flight; retry later")
            self._active_ids.add(params.request_id)
            self._finished_ids.pop(params.request_id, None)
            self._inbox.append(request)
            self._new_sinks[params.request_id] = sink
            self._lock.notify_all()
        return stream

    def abort(self, request_id: str) -> bool:
        """Ask to cancel a request. False when no such request is active."""
        with self._lock:
            if request_id not in self._active_ids:
                return False
            self._abort_ids.add(request_id)
            self._lock.notify_all()
            return True

    def abort_all(self) -> list[str]:
        with self._lock:
            ids = list(self._active_ids)
            self._abort_ids.update(ids)
            self._lock.notify_all()
            return ids

    def was_finished(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._finished_ids

    @property
    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._active_ids)

    def stats(self) -> EngineStats:
        """A snapshot taken at the end of the last step, plus the requests enqueued since."""
        with self._lock:
            snapshot, num_inbox = self._stats, len(self._inbox)
        return replace(snapshot, waiting_requests=snapshot.waiting_requests + num_inbox)

    # -- the step (engine thread) ----------------------------------------------
    def step(self) -> list[RequestOutput]:
        with self._lock:
            new, self._inbox = self._inbox, []
            abort_ids, self._abort_ids = self._abort_ids, set()
            self._sinks.update(self._new_sinks)
            self._new_sinks = {}
        with self._step_lock:
            for request in new:
                self.core.add_request(request)
            outputs = self.core.step(abort_ids)
        self._deliver(outputs)
        return outputs

    # -- KV events and the prefix cache (any thread; each waits for the current step) --
    def subscribe_kv_events(self, on_ready: Callable[[], None], include_snapshot: bool = False,
                            start_sequence_number: int = 0) -> KvEventSubscription:
        """A subscription to the numbered event batches: from a snapshot of the cached
        blocks, or replayed from ``start_sequence_number``, or live from the next batch."""
        if not self.config.kv_events.enabled:
            raise InvalidRequestError("KV events are disabled on this engine (--no-kv-events)")
        if include_snapshot and start_sequence_number:
            raise InvalidRequestError("include_snapshot and start_sequence_number exclude each other: a snapshot "
                                      "starts a view afresh, a replay continues one")
        with self._step_lock:
            snapshot = self.core.pool.snapshot() if include_snapshot else None
            return self.kv_events.subscribe(on_ready, snapshot, start_sequence_number)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (blocks in use stay); one ``AllBlocksCleared`` is
        published at once. Returns how many cached blocks were freed."""
        with self._step_lock:
            freed = self.core.reset_prefix_cache()
            stats = self.core.stats()
        with self._lock:
            self._stats = stats  # an idle engine takes no step that would refresh it
        return freed

    def fail_all(self, message: str) -> list[RequestOutput]:
        """An engine fault: end every request with one terminal error, free all KV. Its
        KV events are published under the step lock, like a step's (never inside a snapshot)."""
        with self._step_lock:
            outputs = self.core.fail_all(message)
        self._deliver(outputs)
        return outputs

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Retire the finished ids first (a client may reuse an id as soon as it reads the
        final output), then call each sink."""
        stats = self.core.stats()
        with self._lock:
            self._stats = stats
            for out in outputs:
                if out.finished:
                    self._active_ids.discard(out.request_id)
                    self._abort_ids.discard(out.request_id)
                    self._finished_ids[out.request_id] = None
            while len(self._finished_ids) > FINISHED_ID_WINDOW:
                self._finished_ids.popitem(last=False)
        for out in outputs:
            sink = self._sinks.pop(out.request_id) if out.finished else self._sinks[out.request_id]
            try:
                sink(out)
            except Exception:  # a broken consumer must not take the engine down
                logger.exception("output sink of request %s failed", out.request_id)

    # -- driving ---------------------------------------------------------------
    def run_until_done(self, requests: Seq[GenerationRequest]) -> list[Completion]:
        """Synchronous use: add ``requests``, step until all finish, return Completions."""
        streams = [self.add_request(r) for r in requests]
        while self.has_unfinished_requests:
            self.step()
        return [s.result() for s in streams]

    def start(self) -> None:
        """Run ``step`` on a background thread whenever there is work."""
        if self._loop_thread is not None:
            return
        self._stopping = False
        self._loop_thread = threading.Thread(target=self._loop, name="refengine-step-loop", daemon=True)
        self._loop_thread.start()

    def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._loop_thread is not None:
            self._loop_thread.join()
            self._loop_thread = None

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._active_ids:
                    self._lock.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as exc:
                logger.exception("engine step failed")
                self.fail_all(f"engine fault: {type(exc).__name__}: {exc}")
