"""The engine core: single-threaded; one step at a time.

One step (``step``):

1. apply this step's aborts;
2. ``Scheduler.schedule()`` picks sequences and token counts (plain data);
3. ``build_model_input`` turns that into one ``ModelInput``;
4. ``ModelRunner.execute`` returns logits for the rows that need them;
5. the sampler draws one token per sampling row;
6. ``update_from_output`` — the one place a step's results are applied: advance
   computed tokens and publish full blocks, record prompt logprobs, fork outputs
   waiting for the prompt, append tokens, check stops, finish outputs (freeing
   their KV) — and return the step's ``RequestOutput``s;
7. hand the step's KV events, in order, to the event sink.

Nothing below calls back up, and only this module changes request state. The core
knows nothing of threads or streams: the front end (``engine.py``) feeds it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from refengine.config import EngineConfig
from refengine.engine.admission import make_outputs
from refengine.engine.input_builder import build_model_input
from refengine.engine.output_processor import OutputProcessor
from refengine.engine.request import OutputState, OutputStatus, Request
from refengine.engine.sampling_rows import SampleTarget, sampling_row, sampling_targets
from refengine.kv.block_pool import BlockPool
from refengine.kv.kv_manager import KvCacheManager
from refengine.model.input import ModelInput
from refengine.model.runner import ModelRunner
from refengine.sampling.guided import allocate_bitmask
from refengine.sampling.sampler import SampledToken, Sampler
from refengine.scheduler.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from refengine.scheduler.sequence import SequenceStatus
from refengine.types import (
    EngineFault,
    EngineStats,
    FinishInfo,
    FinishReason,
    KvEvent,
    RequestOutput,
    SequenceDelta,
    Usage,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

KvEventSink = Callable[[list[KvEvent]], None]  # called on the step thread, once per step with events


@dataclass
class StepOutcome:
    """What a step produced, per request: output deltas, or the fault that ended it."""

    deltas: dict[str, list[SequenceDelta]] = field(default_factory=dict)
    faults: dict[str, EngineFault] = field(default_factory=dict)


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        tokenizer: PreTrainedTokenizerBase,
        eos_token_ids: tuple[int, ...],
        model_fingerprint: str = "",
        kv_event_sink: KvEventSink | None = None,
    ) -> None:
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.model_fingerprint = model_fingerprint
        self.pool = BlockPool(runner.num_blocks, config.cache.enable_prefix_caching,
                              record_events=kv_event_sink is not None)
        self.kv = KvCacheManager(self.pool, config.cache.block_size)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.sampler = Sampler(runner.config.vocab_size, seed=config.seed)
        self.outputs = OutputProcessor(tokenizer)
        self.kv_event_sink = kv_event_sink
        self.requests: dict[str, Request] = {}  # accepted and not yet finished
        self._prompt_logprobs_pending: set[str] = set()  # prompt logprobs not yet emitted
        self._last_batch = (0, 0)  # (prefill, decode) sequences of the last step

    # -- admission and abort -----------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Admit: all ``num_sequences`` outputs exist from here; output 0's sequence is scheduled."""
        request.outputs = make_outputs(request, self.tokenizer, self.eos_token_ids, self.model_fingerprint)
        self.requests[request.request_id] = request
        if request.wants_prompt_logprobs:
            self._prompt_logprobs_pending.add(request.request_id)
        self.scheduler.add(request.outputs[0].seq)

    def _cancel(self, request: Request, finish: FinishInfo) -> list[SequenceDelta]:
        """End every unfinished output with ``finish``; frees their KV."""
        deltas = []
        for out in request.outputs:
            if out.status is not OutputStatus.FINISHED:
                self._finish_output(out, finish)
                deltas.append(SequenceDelta(index=out.index, finish=finish))
        return deltas

    def _finish_output(self, out: OutputState, finish: FinishInfo) -> None:
        if out.status is OutputStatus.ACTIVE:
            self.scheduler.finish(out.seq)  # frees the sequence's blocks
        out.finish = finish
        out.status = OutputStatus.FINISHED

    # -- the step ----------------------------------------------------------------
    def step(self, abort_ids: Iterable[str] = ()) -> list[RequestOutput]:
        outcome = StepOutcome()
        cancelled = FinishInfo(FinishReason.CANCELLED, message="aborted")
        for request_id in abort_ids:
            request = self.requests.get(request_id)
            if request is not None:
                outcome.deltas.setdefault(request_id, []).extend(self._cancel(request, cancelled))
        sched = self.scheduler.schedule()
        if not sched.is_empty:
            prompt_rows = [self._wants_prompt_logits(item) for item in sched.scheduled]
            num_logit_rows = [item.num_new_tokens if all_rows else int(item.samples)
                              for item, all_rows in zip(sched.scheduled, prompt_rows, strict=True)]
            model_input = build_model_input(sched, self.kv.block_size, num_logit_rows)
            logits = self.runner.execute(model_input)
            targets, sampled = self._sample(sched, model_input, logits)
            self.update_from_output(sched, model_input, logits, prompt_rows, list(zip(targets, sampled, strict=True)),
                                    outcome)
        num_prefill = sum(1 for s in sched.scheduled if s.num_new_tokens > 1)
        self._last_batch = (num_prefill, len(sched.scheduled) - num_prefill)
        outputs = self._emit(outcome)
        self._publish_kv_events()
        if self.config.debug_kv_integrity and not self.requests:
            self.check_idle()
        return outputs

    def _wants_prompt_logits(self, item: ScheduledSequence) -> bool:
        request = self.requests[item.request_id]
        return request.wants_prompt_logprobs and not request.prompt_logprobs_ready and item.index == 0

    def _sample(
        self, sched: SchedulerOutput, model_input: ModelInput, logits: torch.Tensor | None
    ) -> tuple[list[SampleTarget], list[SampledToken]]:
        targets, logit_rows = sampling_targets(sched, model_input, self.requests)
        if not targets:
            return [], []
        assert logits is not None, "rows to sample but no logits"
        # A decode-only step samples every row once, in order: no copy of the logits.
        if logit_rows != list(range(logits.shape[0])):
            logits = logits[torch.tensor(logit_rows)]
        rows = [sampling_row(r, o) for r, o in targets]
        guided = [j for j, (_, out) in enumerate(targets) if out.matcher is not None]
        if not guided:
            return targets, self.sampler(logits, rows)
        bitmask = allocate_bitmask(len(targets), self.sampler.vocab_size)
        for j in guided:  # one bitmask for the step; unguided rows stay all-allowed and unapplied
            targets[j][1].matcher.fill_bitmask(bitmask, j)
        return targets, self.sampler(logits, rows, bitmask, guided)

    def update_from_output(
        self,
        sched: SchedulerOutput,
        model_input: ModelInput,
        logits: torch.Tensor | None,
        prompt_rows: list[bool],
        sampled: list[tuple[SampleTarget, SampledToken]],
        outcome: StepOutcome,
    ) -> None:
        """Apply everything the step produced, in order, into ``outcome`` (each output's delta,
        each failed request's fault)."""
        self.scheduler.update_from_output(sched)
        for item, all_rows, (start, end) in zip(sched.scheduled, prompt_rows, model_input.logit_row_ranges(),
                                                strict=True):
            if all_rows:
                assert logits is not None
                self.outputs.record_prompt_logprobs(self.requests[item.request_id], item, logits[start:end])
        for request, out in [t for t, _ in sampled]:
            if out.status is OutputStatus.WAITING_FOR_PROMPT:  # forks before output 0 appends its token
                self.scheduler.fork(request.outputs[0].seq, out.seq)
                out.status = OutputStatus.ACTIVE
        for (request, out), token in sampled:
            if request.request_id in outcome.faults:
                continue
            if out.matcher is not None and not out.matcher.accept_token(token.token_id):
                # A sampled token the grammar forbids means a masking bug: fail this request only.
                self._cancel(request, FinishInfo(FinishReason.CANCELLED, message="grammar rejected a token"))
                outcome.faults[request.request_id] = EngineFault(
                    "internal", f"output {out.index}: the grammar rejected sampled token {token.token_id}", False)
                continue
            delta = self.outputs.append_token(request, out, token)
            if delta.finish is not None:
                self._finish_output(out, delta.finish)
            outcome.deltas.setdefault(request.request_id, []).append(delta)

    # -- emission ----------------------------------------------------------------
    def _usage(self, request: Request) -> Usage:
        return Usage(
            prompt_tokens=len(request.prompt_token_ids),
            completion_tokens=sum(o.num_emitted_tokens for o in request.outputs),
            cached_prompt_tokens=request.num_cached_prompt_tokens,
        )

    def _emit(self, outcome: StepOutcome) -> list[RequestOutput]:
        deltas = outcome.deltas
        outputs = [self._fault_output(self.requests[rid], fault) for rid, fault in outcome.faults.items()]
        pending_prompt = [r for r in self._prompt_logprobs_pending if r not in deltas]
        for request_id in list(deltas) + pending_prompt:
            if request_id in outcome.faults:
                continue
            request = self.requests[request_id]
            prompt_tokens = None
            if request.prompt_logprobs_ready and not request.prompt_logprobs_sent:
                self._prompt_logprobs_pending.discard(request_id)
                prompt_tokens = tuple(request.prompt_infos)
                request.prompt_logprobs_sent = True
            request_deltas = deltas.get(request_id, [])
            if prompt_tokens is None and not request_deltas:
                continue
            finished = request.finished
            outputs.append(RequestOutput(
                request_id=request_id,
                deltas=tuple(request_deltas),
                prompt_tokens=prompt_tokens,
                finished=finished,
                usage=self._usage(request) if finished else None,
            ))
            if finished:
                self._retire(request)
        return outputs

    def _retire(self, request: Request) -> None:
        del self.requests[request.request_id]
        self._prompt_logprobs_pending.discard(request.request_id)

    def _publish_kv_events(self) -> None:
        if self.kv_event_sink is None:
            return
        events = self.pool.take_events()
        if events:
            self.kv_event_sink(events)

    def _fault_output(self, request: Request, fault: EngineFault) -> RequestOutput:
        """The one terminal output of a request failed after acceptance (its KV already freed)."""
        self._retire(request)
        return RequestOutput(request.request_id, finished=True, usage=self._usage(request), error=fault)

    def reset_prefix_cache(self) -> int:
        """Between steps: free every cached block; its one ``AllBlocksCleared`` goes out now."""
        freed = self.pool.reset_prefix_cache()
        self._publish_kv_events()
        return freed

    def fail_all(self, message: str) -> list[RequestOutput]:
        """An engine fault: end every request with one terminal error, free all KV."""
        outputs = []
        for request in list(self.requests.values()):
            self._cancel(request, FinishInfo(FinishReason.CANCELLED, message=message))
            outputs.append(self._fault_output(request, EngineFault("internal", message, retryable=False)))
        self._last_batch = (0, 0)
        self._publish_kv_events()
        return outputs

    # -- observation -------------------------------------------------------------
    def stats(self) -> EngineStats:
        """Load figures after the last step (one pass over the requests)."""
        num_running = running_tokens = waiting_tokens = 0
        for request in self.requests.values():
            if any(o.seq.status is SequenceStatus.RUNNING for o in request.outputs):
                num_running += 1
                running_tokens += sum(o.seq.num_tokens for o in request.outputs if o.status is OutputStatus.ACTIVE)
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
            prefill_batch_size=self._last_batch[0],
            decode_batch_size=self._last_batch[1],
        )

    def check_idle(self) -> None:
        """With no request in the core, every KV block is free or cached, and each ref
        count matches its owners (``--debug-kv-integrity`` runs this whenever idle)."""
        assert not self.requests and not self.scheduler.running and not self.scheduler.waiting
        self.kv.check_integrity()
        assert self.pool.num_used == sum(len(self.kv.held_block_ids(o)) for o in self.kv.owners), \
            f"{self.pool.num_used} KV blocks in use with no request to own them"
