"""The engine: requests in, token/text deltas out.

One step = schedule → run model → sample → update requests → emit outputs. Other
threads only enqueue (``add_request``, ``abort``); all request state is touched by
the thread that runs ``step`` (the background loop, or the caller in sync use).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from refengine.config import EngineConfig, ModelConfig
from refengine.engine.detokenizer import IncrementalDetokenizer, NoTextDetokenizer
from refengine.engine.output_processor import OutputProcessor
from refengine.engine.request import OutputSink, OutputState, Request, output_generator
from refengine.engine.stop_checker import StopChecker, TokenHoldBack
from refengine.engine.stream import Completion, RequestStream
from refengine.engine.types import (
    DuplicateRequestError,
    EngineFault,
    EngineStats,
    FinishInfo,
    FinishReason,
    GenerationRequest,
    InvalidRequestError,
    OverloadedError,
    RequestOutput,
    SequenceDelta,
    Usage,
)
from refengine.engine.validation import (
    Limits,
    validate_inputs,
    validate_logprobs,
    validate_prompt,
    validate_sampling,
    validate_stopping,
)
from refengine.kernels.attention import make_attention_backend
from refengine.kv.block_pool import BlockPool
from refengine.kv.kv_manager import KvCacheManager
from refengine.model.runner import DTYPES, ModelRunner
from refengine.sampling.sampler import Sampler
from refengine.scheduler.scheduler import Scheduler
from refengine.scheduler.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

FINISHED_ID_WINDOW = 4096  # finished request ids remembered for abort's ALREADY_FINISHED


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        weights: dict[str, torch.Tensor],
        tokenizer: PreTrainedTokenizerBase,
        model_fingerprint: str = "",
        served_model_name: str | None = None,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name or config.served_model_name or config.model
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings)
        self.eos_token_ids = tuple(model_config.eos_token_ids)
        self.model_fingerprint = model_fingerprint
        torch.manual_seed(config.seed)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        attention = make_attention_backend(config.attention_backend, DTYPES[config.dtype], config.device)
        self.runner = ModelRunner(model_config, weights, config.cache, self.max_model_len,
                                  dtype=DTYPES[config.dtype], device=config.device, attention=attention)
        self.pool = BlockPool(self.runner.num_blocks, config.cache.enable_prefix_caching)
        self.kv = KvCacheManager(self.pool, config.cache.block_size)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.sampler = Sampler(model_config.vocab_size, seed=config.seed)
        self.processor = OutputProcessor(tokenizer, self.sampler, self.fork, self.scheduler.finish)
        # A request's outputs all run at once, so it may not ask for more than max_num_seqs.
        max_num_sequences = min(config.max_num_sequences, config.scheduler.max_num_seqs)
        self.limits = Limits(model_config.vocab_size, self.max_model_len, max_num_sequences, config.max_logprobs)
        self.requests: dict[str, Request] = {}  # accepted and in the scheduler
        self._prompt_logprob_requests: set[str] = set()  # prompt logprobs not yet emitted
        self._lock = threading.Condition()
        self._inbox: list[Request] = []
        self._abort_ids: set[str] = set()
        self._active_ids: set[str] = set()  # inbox + accepted, for duplicate detection
        self._finished_ids: OrderedDict[str, None] = OrderedDict()
        self._stats = self._snapshot_stats(0, 0)
        self._loop_thread: threading.Thread | None = None
        self._stopping = False

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
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
        )

    # -- accepting work (any thread) ------------------------------------------
    def add_request(self, params: GenerationRequest, sink: OutputSink | None = None) -> RequestStream | None:
        """Validate and enqueue. Raises a ``RequestError`` subclass (nothing allocated)
        when the request is refused. Returns the default stream when no sink is given."""
        validate_inputs(params)
        validate_sampling(params, self.limits)
        validate_stopping(params, self.limits)
        validate_logprobs(params, self.limits)
        if params.prompt is not None:
            prompt_ids = list(self.tokenizer.encode(params.prompt, add_special_tokens=False))
        else:
            prompt_ids = list(params.prompt_token_ids or [])
        max_tokens = validate_prompt(params, prompt_ids, self.limits)
        if not self.scheduler.fits_alone(len(prompt_ids) + max_tokens):
            raise InvalidRequestError(
                f"the request needs {self.kv.num_blocks_for(len(prompt_ids) + max_tokens)} KV blocks "
                f"but the pool has only {self.pool.num_blocks}; lower max_tokens or the prompt length"
            )
        stream = None
        if sink is None:
            stream = sink = RequestStream(params.request_id, params.sampling.num_sequences)
        request = Request(params, prompt_ids, max_tokens, sink)
        with self._lock:
            if params.request_id in self._active_ids:
                raise DuplicateRequestError(f"request_id {params.request_id!r} is already active")
            if len(self._active_ids) >= self.config.scheduler.max_waiting_requests:
                raise OverloadedError("too many requests in flight; retry later")
            self._active_ids.add(params.request_id)
            self._finished_ids.pop(params.request_id, None)
            self._inbox.append(request)
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
        """Whether ``request_id`` finished recently (a bounded window)."""
        with self._lock:
            return request_id in self._finished_ids

    @property
    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._active_ids)

    def stats(self) -> EngineStats:
        """Live load figures: a snapshot taken at the end of the last step, plus the
        requests enqueued since (safe to call from any thread)."""
        with self._lock:
            snapshot, num_inbox = self._stats, len(self._inbox)
        return replace(snapshot, waiting_requests=snapshot.waiting_requests + num_inbox)

    def _snapshot_stats(self, num_prefill: int, num_decode: int) -> EngineStats:
        # One pass over the requests: this runs after every step.
        num_running = running_tokens = waiting_tokens = 0
        for request in self.requests.values():
            if any(o.seq.status is SequenceStatus.RUNNING for o in request.outputs):
                num_running += 1
                running_tokens += sum(o.seq.num_tokens for o in request.outputs)
            else:
                waiting_tokens += len(request.prompt_token_ids)
        return EngineStats(
            running_requests=num_running,
            waiting_requests=len(self.requests) - num_running,
            used_kv_blocks=self.pool.num_used,
            total_kv_blocks=self.pool.num_blocks,
            cached_kv_blocks=self.pool.num_cached,
            running_tokens=running_tokens,
            waiting_tokens=waiting_tokens,
            prefill_batch_size=num_prefill,
            decode_batch_size=num_decode,
        )

    # -- the step (engine thread) ----------------------------------------------
    def step(self) -> list[RequestOutput]:
        deltas: dict[str, list[SequenceDelta]] = {}
        self._drain_inbox(deltas)
        sched = self.scheduler.schedule()
        if not sched.is_empty:
            self.runner.copy_blocks(sched.block_copies)
            want_all = [self._wants_prompt_logits(item.seq) for item in sched.scheduled]
            logits = self.runner.execute(sched.scheduled, want_all)
            self.scheduler.update_after_step(sched)
            to_sample = []
            for i, (item, all_rows) in enumerate(zip(sched.scheduled, want_all, strict=True)):
                rows = logits.row_ranges[i]
                if rows is None:
                    continue
                request = self.requests[item.seq.request_id]
                if all_rows:
                    self.processor.record_prompt_logprobs(request, item, logits[i])
                if item.samples:
                    to_sample.append((request, request.outputs[item.seq.index], rows[1] - 1))
            for request, delta in self.processor.sample(logits.values, to_sample):
                deltas.setdefault(request.request_id, []).append(delta)
        outputs = self._emit(deltas)
        num_prefill = sum(1 for s in sched.scheduled if s.num_new_tokens > 1)
        stats = self._snapshot_stats(num_prefill, len(sched.scheduled) - num_prefill)
        with self._lock:
            self._stats = stats
        return outputs

    def _wants_prompt_logits(self, seq: Sequence) -> bool:
        request = self.requests[seq.request_id]
        return request.wants_prompt_logprobs and not request.prompt_logprobs_ready and seq.index == 0

    def _drain_inbox(self, deltas: dict[str, list[SequenceDelta]]) -> None:
        with self._lock:
            new, self._inbox = self._inbox, []
            abort_ids, self._abort_ids = self._abort_ids, set()
        for request in new:
            self._start(request)
        for request_id in abort_ids:
            request = self.requests.get(request_id)
            if request is not None:
                deltas.setdefault(request_id, []).extend(self._cancel(request))

    def _start(self, request: Request) -> None:
        p = request.params
        extra_keys = (self.model_fingerprint,) + ((f"salt:{p.kv.cache_salt}",) if p.kv.cache_salt else ())
        seq = Sequence(
            request_id=request.request_id,
            index=0,
            token_ids=list(request.prompt_token_ids),
            num_prompt_tokens=len(request.prompt_token_ids),
            max_total_tokens=len(request.prompt_token_ids) + request.max_tokens,
            extra_keys=extra_keys,
            priority=p.priority,
            use_prefix_cache=not p.kv.bypass_prefix_cache and not request.wants_prompt_logprobs,
            seq_slots=p.sampling.num_sequences,
        )
        request.generators = [output_generator(p.sampling.seed, i) for i in range(p.sampling.num_sequences)]
        request.outputs.append(self._output_state(request, seq))
        request.forked = p.sampling.num_sequences == 1
        self.requests[request.request_id] = request
        if request.wants_prompt_logprobs:
            self._prompt_logprob_requests.add(request.request_id)
        self.scheduler.add(seq)

    def _output_state(self, request: Request, seq: Sequence) -> OutputState:
        # Without text to send, text is still needed when stop strings must match on it.
        needs_text = request.params.detokenize or bool(request.params.stopping.stop_strings)
        return OutputState(
            seq=seq,
            detokenizer=(IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids) if needs_text
                         else NoTextDetokenizer()),
            stop=StopChecker(request.params.stopping, self.eos_token_ids, request.max_tokens),
            generator=request.generators[seq.index],
            held_tokens=TokenHoldBack(request.params.stopping.include_stop_in_output),
        )

    def fork(self, request: Request) -> None:
        """Create outputs 1 … n-1 sharing output 0's blocks (its prompt is computed)."""
        parent = request.outputs[0].seq
        for index in range(1, request.num_sequences):
            child = Sequence(
                request_id=parent.request_id,
                index=index,
                token_ids=list(parent.token_ids),
                num_prompt_tokens=parent.num_prompt_tokens,
                max_total_tokens=parent.max_total_tokens,
                extra_keys=parent.extra_keys,
                priority=parent.priority,
                use_prefix_cache=parent.use_prefix_cache,
            )
            child.num_cached_tokens = parent.num_cached_tokens
            self.kv.fork(parent, child)
            self.scheduler.add_running(child)
            request.outputs.append(self._output_state(request, child))
        parent.seq_slots = 1
        request.forked = True

    def _cancel(self, request: Request) -> list[SequenceDelta]:
        cancelled = FinishInfo(FinishReason.CANCELLED, message="aborted")
        deltas = []
        for index in range(request.num_sequences):
            out = request.outputs[index] if index < len(request.outputs) else None
            if out is not None and out.finish is not None:
                continue
            if out is not None:
                self.processor.finish_output(out, cancelled)
            deltas.append(SequenceDelta(index=index, finish=cancelled))
        request.forked = True
        for out in request.outputs:
            out.finish = out.finish or cancelled
        return deltas

    def _usage(self, request: Request) -> Usage:
        return Usage(
            prompt_tokens=len(request.prompt_token_ids),
            completion_tokens=sum(o.num_emitted_tokens for o in request.outputs),
            cached_prompt_tokens=request.num_cached_prompt_tokens,
        )

    def _emit(self, deltas: dict[str, list[SequenceDelta]]) -> list[RequestOutput]:
        outputs = []
        pending_prompt = [r for r in self._prompt_logprob_requests if r not in deltas]
        for request_id in list(deltas) + pending_prompt:
            request = self.requests[request_id]
            prompt_tokens = None
            if request.prompt_logprobs_ready and not request.prompt_logprobs_sent:
                self._prompt_logprob_requests.discard(request_id)
                prompt_tokens = tuple(request.prompt_infos)
                request.prompt_logprobs_sent = True
            request_deltas = deltas.get(request_id, [])
            if prompt_tokens is None and not request_deltas:
                continue
            finished = request.finished
            out = RequestOutput(
                request_id=request_id,
                deltas=tuple(request_deltas),
                prompt_tokens=prompt_tokens,
                finished=finished,
                usage=self._usage(request) if finished else None,
            )
            if finished:
                self._retire(request)
            outputs.append(out)
            self._deliver(request, out)
        return outputs

    def _retire(self, request: Request) -> None:
        del self.requests[request.request_id]
        self._prompt_logprob_requests.discard(request.request_id)
        with self._lock:
            self._active_ids.discard(request.request_id)
            self._abort_ids.discard(request.request_id)
            self._finished_ids[request.request_id] = None
            while len(self._finished_ids) > FINISHED_ID_WINDOW:
                self._finished_ids.popitem(last=False)

    @staticmethod
    def _deliver(request: Request, out: RequestOutput) -> None:
        try:
            request.sink(out)
        except Exception:  # a broken consumer must not take the engine down
            logger.exception("output sink of request %s failed", request.request_id)

    def fail_all(self, message: str) -> list[RequestOutput]:
        """An engine fault: end every request with one terminal error, free all KV."""
        outputs = []
        for request in list(self.requests.values()):
            for out in request.outputs:
                if out.finish is None:
                    self.processor.finish_output(out, FinishInfo(FinishReason.CANCELLED, message=message))
            request.forked = True
            out = RequestOutput(request.request_id, finished=True, usage=self._usage(request),
                                error=EngineFault("internal", message, retryable=False))
            self._retire(request)
            outputs.append(out)
            self._deliver(request, out)
        stats = self._snapshot_stats(0, 0)
        with self._lock:
            self._stats = stats
        return outputs

    # -- driving ---------------------------------------------------------------
    def run_until_done(self, requests: Seq[GenerationRequest]) -> list[Completion]:
        """Synchronous helper: add ``requests``, step until all finish, return Completions."""
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
