"""The engine core: single-threaded; one step at a time.

One step (``step``):

1. apply this step's aborts;
2. ``Scheduler.schedule()`` picks sequences and token counts (plain data);
3. the step's LoRA adapters go into device slots (``engine_lora.py``), then
   ``build_model_input`` turns it all into one ``ModelInput``;
4. ``ModelRunner.execute`` returns logits for the rows that need them;
5. the sampler draws one token per sampling row;
6. ``update_from_output`` — the one place a step's results are applied: advance computed
   tokens and publish full blocks, record prompt logprobs, fork outputs waiting for the
   prompt, append tokens, check stops, finish outputs (freeing their KV);
7. emit the step's ``RequestOutput``s; hand its KV events, in order, to the event sink.

Roles (``disagg.py``): before scheduling, a prefill engine frees its due KV sessions and
a decode engine applies its finished pulls; a prefill engine ends a request at its first
token with a session instead of emitting the token. A request whose media are embedding
handles waits outside the scheduler until its rows are pulled (``media_pulls.py``).
Nothing below calls back up. Only the core changes request state (with the helpers it calls:
``core_inflow.py``, ``output_processor.py``, the scheduler); ``engine.py`` feeds it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from refengine.config import EngineConfig
from refengine.engine.admission import make_outputs
from refengine.engine.core_inflow import CoreInflowMixin
from refengine.engine.disagg import Disaggregation
from refengine.engine.engine_lora import StepLora
from refengine.engine.input_builder import build_model_input
from refengine.engine.media import step_embeds
from refengine.engine.media_pulls import MediaPulls
from refengine.engine.observe import batch_sizes, check_idle, engine_stats, request_usage
from refengine.engine.output_processor import OutputProcessor
from refengine.engine.request import OutputState, OutputStatus, Request
from refengine.engine.sampling_rows import SampleTarget, sample_step
from refengine.kv.block_pool import BlockPool
from refengine.kv.kv_manager import KvCacheManager
from refengine.model.input import ModelInput
from refengine.model.runner import ModelRunner
from refengine.sampling.sampler import SampledToken, Sampler
from refengine.scheduler.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from refengine.scheduler.sequence import SequenceStatus
from refengine.types import (
    EngineFault,
    EngineStats,
    FinishInfo,
    FinishReason,
    KvEvent,
    KvSessionSpec,
    RequestOutput,
    SequenceDelta,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

KvEventSink = Callable[[list[KvEvent]], None]  # under the step lock: once per step, reset or fail_all with events


@dataclass
class StepOutcome:
    """What a step produced, per request: output deltas, or the fault that ended it."""

    deltas: dict[str, list[SequenceDelta]] = field(default_factory=dict)
    faults: dict[str, EngineFault] = field(default_factory=dict)
    prefills: dict[str, KvSessionSpec] = field(default_factory=dict)  # prefill role: the sessions made


class EngineCore(CoreInflowMixin):
    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        tokenizer: PreTrainedTokenizerBase,
        eos_token_ids: tuple[int, ...],
        model_fingerprint: str = "",
        kv_event_sink: KvEventSink | None = None,
        disagg: Callable[[KvCacheManager], Disaggregation] | None = None,
        lora: StepLora | None = None,
        media_pulls: MediaPulls | None = None,
    ) -> None:
        self.config = config
        self.runner = runner
        self.logits_on_device = config.kernels.device_sampling and torch.device(config.device).type != "cpu"
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.model_fingerprint = model_fingerprint
        self.pool = BlockPool(runner.num_blocks, config.cache.enable_prefix_caching,
                              record_events=kv_event_sink is not None)
        self.kv = KvCacheManager(self.pool, config.cache.block_size)
        self.scheduler = Scheduler(config.scheduler, self.kv, config.lora.max_loras if lora else 0)
        self.lora = lora
        self.sampler = Sampler(runner.config.vocab_size, seed=config.seed)
        self.outputs = OutputProcessor(tokenizer)
        self.kv_event_sink = kv_event_sink
        self.disagg = disagg(self.kv) if disagg is not None else None  # prefill and decode roles
        self.requests: dict[str, Request] = {}  # accepted and not yet finished
        self.media_pulls = media_pulls
        self._awaiting_media: set[str] = set()  # accepted, their embedding handles being pulled
        self._prompt_logprobs_pending: set[str] = set()  # prompt logprobs not yet emitted
        self._last_batch = (0, 0)  # (prefill, decode) sequences of the last step

    # -- admission and abort -----------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Admit: all ``num_sequences`` outputs exist; output 0's sequence is scheduled (or once media are pulled)."""
        request.outputs = make_outputs(request, self.tokenizer, self.eos_token_ids, self.model_fingerprint)
        self.requests[request.request_id] = request
        if request.wants_prompt_logprobs:
            self._prompt_logprobs_pending.add(request.request_id)
        if request.awaits_media:
            self._start_media(request)
            return
        self.scheduler.add(request.outputs[0].seq)

    def _cancel(self, request: Request, finish: FinishInfo) -> list[SequenceDelta]:
        """End every unfinished output with ``finish``; frees their KV."""
        if request.request_id in self._awaiting_media:  # never scheduled: only its pull to stop
            self._stop_media(request)
        deltas = []
        for out in request.outputs:
            if out.status is not OutputStatus.FINISHED:
                self._finish_output(out)
                deltas.append(SequenceDelta(index=out.index, finish=finish))
        return deltas

    def _finish_output(self, out: OutputState) -> None:
        if out.seq.status is SequenceStatus.RECEIVING:
            assert self.disagg is not None
            self.disagg.cancel_receiving(out)
        if out.status is OutputStatus.ACTIVE:
            self.scheduler.finish(out.seq)  # frees the sequence's blocks
        out.status = OutputStatus.FINISHED

    # -- the step ----------------------------------------------------------------
    def step(self, abort_ids: Iterable[str] = (),
             on_scheduled: Callable[[], None] | None = None) -> list[RequestOutput]:
        """One step. ``on_scheduled`` runs once the step's batch is chosen, before the model
        runs, when ``stats()`` already describes it (the engine's GetLoad snapshot: a long
        prefill step is load, not idleness). Its KV events are published also when it raises: a
        snapshot taken before the engine's ``fail_all`` must hold no block stored after it (E2)."""
        try:
            return self._step(abort_ids, on_scheduled)
        finally:
            self._publish_kv_events()

    def _step(self, abort_ids: Iterable[str], on_scheduled: Callable[[], None] | None) -> list[RequestOutput]:
        outcome = StepOutcome()
        cancelled = FinishInfo(FinishReason.CANCELLED, message="aborted")
        for request_id in abort_ids:
            request = self.requests.get(request_id)
            if request is not None:
                outcome.deltas.setdefault(request_id, []).extend(self._cancel(request, cancelled))
        if self.disagg is not None:
            self.disagg.free_due_sessions()
            self._attach_received_kv(outcome)
        if self.media_pulls is not None:
            self._attach_pulled_media(outcome)
        sched = self.scheduler.schedule()
        self._end_given_up(sched, outcome)
        if sched.kv_loads:
            assert self.disagg is not None
            self.disagg.start_loads(sched.kv_loads, self.requests)
        self._last_batch = batch_sizes(sched.scheduled, self.requests)
        if on_scheduled is not None:
            on_scheduled()
        if not sched.is_empty:
            prompt_rows = [self._wants_prompt_logits(item) for item in sched.scheduled]
            num_logit_rows = [item.num_new_tokens if all_rows else int(item.samples)
                              for item, all_rows in zip(sched.scheduled, prompt_rows, strict=True)]
            adapter_slots = self.lora.step_slots(sched, self.requests) if self.lora is not None else None
            model_input = build_model_input(sched, self.kv.block_size, num_logit_rows, adapter_slots,
                                            step_embeds(sched, self.requests))
            logits = self.runner.execute(model_input, logits_on_device=self.logits_on_device)
            targets, sampled = sample_step(self.sampler, sched, model_input, logits, self.requests)
            self.update_from_output(sched, model_input, logits, prompt_rows, list(zip(targets, sampled, strict=True)),
                                    outcome)
        return self._emit(outcome)

    def _wants_prompt_logits(self, item: ScheduledSequence) -> bool:
        request = self.requests[item.request_id]
        return request.wants_prompt_logprobs and not request.prompt_logprobs_ready and item.index == 0

    def update_from_output(self, sched: SchedulerOutput, model_input: ModelInput, logits: torch.Tensor | None,
                           prompt_rows: list[bool], sampled: list[tuple[SampleTarget, SampledToken]],
                           outcome: StepOutcome) -> None:
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
            if (fault := self._refused(out, token)) is not None:  # fails this request only
                self._cancel(request, FinishInfo(FinishReason.CANCELLED, message=fault.message))
                outcome.faults[request.request_id] = fault
                continue
            if self.config.role == "prefill":  # K4: the first token goes with the session, not out
                assert self.disagg is not None
                outcome.prefills[request.request_id] = self.disagg.hand_over(request, out, token)
                self._finish_output(out)  # its stream ends with the PrefillReady, no GenerationFinished
                outcome.deltas.setdefault(request.request_id, [])
                continue
            self._append(request, out, token, outcome)

    def _refused(self, out: OutputState, token: SampledToken) -> EngineFault | None:
        """Why ``token`` cannot go onto ``out`` (None: it can). An id past the vocabulary: the
        sampler's answer to non-finite logits. A grammar limit hit mid-way: the spec's fault. Any
        other token the grammar forbids: a masking bug (or a foreign first token)."""
        where = f"output {out.index}: "
        if token.token_id >= self.sampler.vocab_size:
            return EngineFault("internal", where + "the model's logits are not finite (NaN or infinity)", False)
        if out.matcher is not None and not out.matcher.accept_token(token.token_id):
            if why := out.matcher.error():
                return EngineFault("invalid_argument", where + f"the guided spec hit a grammar limit ({why})", False)
            return EngineFault("internal", where + f"the grammar rejected token {token.token_id}", False)
        return None

    def _append(self, request: Request, out: OutputState, token: SampledToken, outcome: StepOutcome) -> None:
        """One token onto one output (checked by :meth:`_refused`): stops, finish."""
        delta = self.outputs.append_token(request, out, token)
        if delta.finish is not None:
            self._finish_output(out)
        outcome.deltas.setdefault(request.request_id, []).append(delta)

    # -- emission ----------------------------------------------------------------
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
            if prompt_tokens is None and not request_deltas and request_id not in outcome.prefills:
                continue
            finished = request.finished
            outputs.append(RequestOutput(
                request_id=request_id,
                deltas=tuple(request_deltas),
                prompt_tokens=prompt_tokens,
                finished=finished,
                usage=request_usage(request) if finished else None,
                prefill=outcome.prefills.get(request_id),
            ))
            if finished:
                self._retire(request)
        return outputs

    def _retire(self, request: Request) -> None:
        del self.requests[request.request_id]
        self._prompt_logprobs_pending.discard(request.request_id)

    def _publish_kv_events(self) -> None:
        """After ``_emit`` retired the finished requests: a failing sink must not end the step
        (their outputs would be lost, their streams never end), so it is logged instead."""
        sink = self.kv_event_sink
        if sink is not None and (events := self.pool.take_events()):
            try:
                sink(events)
            except Exception:
                logger.exception("publishing %d KV events failed; they are lost to subscribers", len(events))

    # -- observation -------------------------------------------------------------
    def stats(self) -> EngineStats:
        """Load figures after the last step."""
        stats = engine_stats(self.requests.values(), self.pool, self._last_batch)
        if self.media_pulls is not None:
            stats = replace(stats, embedding_pulled_bytes=self.media_pulls.pulled_bytes,
                            embedding_pull_seconds=self.media_pulls.pull_seconds)
        return stats if self.disagg is None else self.disagg.add_stats(stats)

    def check_idle(self) -> None:
        """``--debug-kv-integrity``, whenever idle: see ``observe.check_idle``."""
        check_idle(self.requests, self.scheduler, self.kv)
