"""The engine's thread-safe front end: requests in, ``RequestOutput``s out to sinks.

Any thread may call ``add_request`` (input processing: validation and tokenization,
once; ``engine_accept.py``), ``abort``, ``stats``; they only touch the inbox under a lock. The step —
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
from functools import partial
from typing import TYPE_CHECKING

import torch

from refengine.config import EngineConfig, ModelConfig
from refengine.engine.core import EngineCore, KvEventSink
from refengine.engine.disagg import Disaggregation
from refengine.engine.engine_accept import EngineAcceptMixin
from refengine.engine.engine_kv import EngineKvMixin, choose_transfer_backends
from refengine.engine.engine_loop import EngineLoopMixin
from refengine.engine.engine_lora import EngineLoraMixin, StepLora
from refengine.engine.info import configured_context, context_bounded_by_pool, engine_info, kernel_paths
from refengine.engine.input_processor import InputProcessor
from refengine.engine.interface import OutputSink
from refengine.engine.kv_events import KvEventHub
from refengine.engine.media import MediaInputs
from refengine.engine.media_pulls import make_media_pulls
from refengine.engine.request import Request
from refengine.engine.role_check import RoleCheck
from refengine.engine.stream import Completion
from refengine.engine.validation import Limits
from refengine.kv.transfer.base import KvTransferBackend
from refengine.kv.transfer.sessions import KvSessionStore
from refengine.lora.registry import LoraRegistry
from refengine.model.dtypes import DTYPES
from refengine.model.kv_io import KvBlockIO
from refengine.model.runner import kv_bytes_per_block, kv_pool_blocks, make_runner
from refengine.sampling.guided import GuideCompiler
from refengine.types import (
    EngineFault,
    EngineStats,
    GenerationRequest,
    RequestOutput,
    Usage,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

FINISHED_ID_WINDOW = 4096  # finished request ids remembered for abort's ALREADY_FINISHED


class Engine(EngineAcceptMixin, EngineKvMixin, EngineLoraMixin, EngineLoopMixin):
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        weights: dict[str, torch.Tensor],
        tokenizer: PreTrainedTokenizerBase,
        model_fingerprint: str = "",
        served_model_name: str | None = None,
        kv_event_sink: KvEventSink | None = None,
        transfer_backends: Seq[KvTransferBackend] = (),
        media: MediaInputs | None = None,
        embedding_backends: Seq[KvTransferBackend] = (),
    ) -> None:
        if config.role == "encoder":
            raise ValueError("the encoder role runs an EncoderEngine (refengine.engine.encoder), not an Engine")
        self.config = config
        self.tokenizer = tokenizer
        max_model_len = configured_context(config, model_config)
        backends = choose_transfer_backends(config, transfer_backends)
        runner = make_runner(config, model_config, weights, max_model_len, kv_huge_pages="nixl" in backends)
        max_model_len = context_bounded_by_pool(max_model_len, runner.num_blocks * config.cache.block_size)
        self.loras = LoraRegistry(config.lora, model_config)
        self.kv_events = KvEventHub(config.kv_events.retained_batches, config.kv_events.subscriber_buffer)
        self.block_io = KvBlockIO(runner.kv_caches, runner.kv_layout_name)
        self.kv_sessions = KvSessionStore(on_change=self._wake)
        self._bind_backends(backends)
        disagg = None if config.role == "aggregated" else partial(
            Disaggregation, config, store=self.block_io, fingerprint=model_fingerprint, sessions=self.kv_sessions,
            backends=backends, on_load_done=self._wake)
        self.core = EngineCore(config, runner, tokenizer, tuple(model_config.eos_token_ids), model_fingerprint,
                               self._kv_sink(config, kv_event_sink), disagg,
                               StepLora(config.lora.max_loras, runner) if config.lora.enabled else None,
                               make_media_pulls(config, media, embedding_backends, self._wake))
        self._step_lock = threading.Lock()  # held by a step; subscribing waits for the step to end
        name = served_model_name or config.served_model_name or config.model
        self.media = media  # the model's vision path (None: text only)
        self.info = engine_info(config, model_config, name, max_model_len, runner.num_blocks, tuple(backends),
                                multimodal=media is not None, kernels=kernel_paths(config))
        self.guides = GuideCompiler(tokenizer, model_config.vocab_size, tuple(model_config.eos_token_ids),
                                    config.guided)
        self.input_processor = InputProcessor(tokenizer, Limits(
            model_config.vocab_size, max_model_len, config.max_sequences_per_request, config.max_logprobs),
            self.guides,
            RoleCheck(config.role, model_fingerprint, config.cache.block_size, self.block_io, backends,
                      model_config.vocab_size, config.kv_transfer.allowed_sources, config.guided.default_backend),
            self.loras, media,
            tuple(self.core.media_pulls.backends) if self.core.media_pulls else ())
        self._init_front_end()

    def _init_front_end(self) -> None:
        """The inbox, the sinks and the loop's state (guarded by ``_lock``)."""
        self._lock = threading.Condition()
        self._inbox: list[Request] = []
        self._abort_ids: set[str] = set()
        self._active_ids: set[str] = set()  # inbox + accepted, for duplicate detection
        #: request id -> (a health probe, aborted): requests between their checks and the inbox
        self._accepting: dict[str, tuple[bool, bool]] = {}
        self._finished_ids: OrderedDict[str, bool] = OrderedDict()  # id -> whether an abort ended it
        self._probe_ids: set[str] = set()  # active health probes: not client work, not aborted by abort_all
        self._num_steps = 0  # steps run in total: GetLoad's figures say nothing of progress
        self._sinks: dict[str, OutputSink] = {}  # touched by the step thread only
        self._new_sinks: dict[str, OutputSink] = {}  # guarded by the lock, moved with the inbox
        self._unadmitted: list[Request] = []  # taken by a step that failed before the core had them
        self._stats = self.core.stats()
        self._num_taken = 0  # requests the running step took from the inbox, until it scheduled
        self._loop_thread: threading.Thread | None = None
        self._stopping = False
        self._shut_down = False  # ``shutdown`` closed the worker pools (grammar, pulls): no restart
        self._shutdown_on_exit = False  # ``shutdown`` was called on the loop's thread: the loop finishes it
        self._broken = False  # stopped after a fault whose ``fail_all`` failed too: no restart
        self._woken = False  # a wake since the last step began (e.g. a cancelled pull to clean up)
        self._stalled = False  # the last step ran nothing: wait for a wake (or poll), not spin
        self._stopped_callbacks: list[Callable[[str], None]] = []  # on_stopped's

    def _wake(self) -> None:
        """Something changed outside a step (a pull ended, a session became due): step again."""
        with self._lock:
            self._woken = True
            self._stalled = False
            self._lock.notify_all()

    @classmethod
    def from_config(cls, config: EngineConfig, kv_event_sink: KvEventSink | None = None,
                    transfer_backends: Seq[KvTransferBackend] = (),
                    embedding_backends: Seq[KvTransferBackend] = ()) -> Engine:
        """Load the model named by ``config.model`` (manifest name or path)."""
        from refengine.model import devices, loader

        devices.resolve_device(config.device)  # a missing GPU fails now, not after the weights load
        resolved = loader.resolve_model(config.model)
        model_config, dtype = loader.load_model_config(resolved.path), DTYPES[config.dtype]
        # So does a KV pool that holds no block or cannot fit the memory free now (found by review).
        kv_dtype = DTYPES[config.kv_dtype]
        num_blocks = kv_pool_blocks(model_config, config.cache, kv_dtype)
        devices.check_kv_cache_fits(num_blocks * kv_bytes_per_block(model_config, config.cache.block_size, kv_dtype),
                                    num_blocks, config.device)
        weights = loader.load_weights(resolved.path, dtype)
        media = MediaInputs.from_model(resolved.path, model_config, weights, dtype, config.device, config.media)
        vision = media.expectation.fingerprint if media is not None else ""
        return cls(
            config, model_config, weights, loader.load_tokenizer(resolved.path),
            model_fingerprint=loader.model_fingerprint(resolved.path, config.dtype, config.kv_dtype, vision),
            served_model_name=config.served_model_name or resolved.name,
            kv_event_sink=kv_event_sink, transfer_backends=transfer_backends,
            media=media, embedding_backends=embedding_backends,
        )

    def was_finished(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._finished_ids

    def ended_by_abort(self, request_id: str) -> bool | None:
        with self._lock:  # one read: a request leaves _active_ids and enters _finished_ids together
            if request_id in self._accepting or request_id in self._active_ids:
                return None
            return self._finished_ids.get(request_id, False)

    @property
    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._active_ids or self._accepting)

    def stats(self) -> EngineStats:
        """A snapshot taken when the running step chose its batch (else at the end of the last
        step), plus the requests enqueued since, also those a step has taken and not yet scheduled."""
        subscribers = self.kv_events.num_subscribers  # the hub's own lock, not taken under the engine's
        with self._lock:
            snapshot, num_new = self._stats, len(self._inbox) + self._num_taken
            return replace(snapshot, waiting_requests=snapshot.waiting_requests + num_new, num_steps=self._num_steps,
                           kv_event_subscribers=subscribers)

    # -- the step (engine thread) ----------------------------------------------
    def step(self) -> list[RequestOutput]:
        with self._lock:
            new, self._inbox = self._inbox, []
            self._num_taken = len(new)
            abort_ids, self._abort_ids = self._abort_ids, set()
            self._sinks.update(self._new_sinks)
            self._new_sinks = {}
        with self._step_lock:
            for index, request in enumerate(new):
                try:
                    self.core.add_request(request)
                except Exception:  # the loop's fail_all ends these too: the core never got them
                    self._unadmitted = [r for r in new[index:] if r.request_id not in self.core.requests]
                    raise
            # A step that took new requests refreshes GetLoad's snapshot once it has scheduled them
            # (a long prefill is load); otherwise the last step's snapshot still describes it.
            outputs = self.core.step(abort_ids, on_scheduled=self._take_stats if new else None)
        self._deliver(outputs)
        self._check_when_idle()
        return outputs

    def _take_stats(self) -> None:
        """The load snapshot GetLoad reads (engine thread, inside the step)."""
        stats = self.core.stats()
        with self._lock:
            self._stats = stats
            self._num_taken = 0

    def fail_all(self, message: str, code: str = "internal", retryable: bool = False) -> list[RequestOutput]:
        """An engine fault (or a shutdown: ``cancelled``, retryable): end every request with one
        terminal error, free all KV; also those a failed step took and never handed to the core. Its
        KV events are published under the step lock, like a step's (never inside a snapshot)."""
        with self._step_lock:
            outputs = self.core.fail_all(message, code, retryable)
            fault = EngineFault(code, message, retryable)
            outputs += [RequestOutput(r.request_id, finished=True, error=fault,
                                      usage=Usage(len(r.prompt_token_ids), 0, 0)) for r in self._unadmitted]
            self._unadmitted = []
            self._take_stats()  # the failed step may never have: GetLoad would count what it took as waiting
        self._deliver(outputs)
        return outputs

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Retire the finished ids first (a client may reuse an id as soon as it reads the
        final output), then call each sink."""
        stats = self.core.stats()
        with self._lock:
            self._stats = stats
            # a step that ran nothing (e.g. only pulls in flight): the loop waits for a wake
            self._stalled = not outputs and stats.prefill_batch_size + stats.decode_batch_size == 0
            self._num_steps += 1
            for out in outputs:
                if out.finished:
                    self._active_ids.discard(out.request_id)
                    self._probe_ids.discard(out.request_id)
                    self._abort_ids.discard(out.request_id)
                    self._finished_ids[out.request_id] = out.ended_by_abort
            while len(self._finished_ids) > FINISHED_ID_WINDOW:
                self._finished_ids.popitem(last=False)
        for out in outputs:
            sink = self._sinks.pop(out.request_id) if out.finished else self._sinks[out.request_id]
            try:
                sink(out)
            except Exception:  # a broken consumer must not take the engine down
                logger.exception("output sink of request %s failed", out.request_id)

    # -- driving (the background loop: engine_loop.py) ------------------------------
    def run_until_done(self, requests: Seq[GenerationRequest]) -> list[Completion]:
        """Synchronous use: add ``requests``, step until all finish, return Completions."""
        streams = [self.add_request(r) for r in requests]
        while self.has_unfinished_requests:
            self.step()
        return [s.result() for s in streams]
