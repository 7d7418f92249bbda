"""What reaches requests from outside the step: a decode engine's pulled KV, a consumer's pulled
media rows, the end of a sequence that cannot be recomputed here, and, between steps, an engine
fault that ends them all or a reset of the prefix cache. A mixin of ``EngineCore`` (it uses the
core's requests, scheduler and output helpers), kept apart so ``core.py`` reads as the step alone.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from refengine.engine.disagg import first_sampled_token, transfer_fault
from refengine.engine.observe import request_usage
from refengine.scheduler.sequence import SequenceStatus
from refengine.types import EngineFault, FinishInfo, FinishReason, RequestOutput

if TYPE_CHECKING:
    from refengine.engine.core import EngineCore, StepOutcome
    from refengine.engine.request import Request
    from refengine.scheduler.scheduler import SchedulerOutput

LOST_MESSAGE = ("preempted for KV memory, and a decode engine cannot recompute a prompt with media: "
                "retry the request (prefill again)")
UNFIT_MESSAGE = ("longer than this engine's KV pool can now hold (blocks a KV transfer could not stop "
                 "writing are withheld until restart): retry on another replica")


class CoreInflowMixin:
    def _start_media(self: EngineCore, request: Request) -> None:
        """An accepted request with embedding handles: pull them; it is scheduled once they are here."""
        assert self.media_pulls is not None, "handles are refused before acceptance without a pull backend"
        self._awaiting_media.add(request.request_id)
        self.media_pulls.start(request.request_id, [run.handle for run in request.media if run.handle],
                               request.params.trace)

    def _stop_media(self: EngineCore, request: Request) -> None:
        """A request ends while its handles are pulled: the pull stops, its result is dropped."""
        assert self.media_pulls is not None
        self._awaiting_media.discard(request.request_id)
        self.media_pulls.cancel(request.request_id)
        # Never added to the scheduler, though born WAITING: ``Scheduler.finish`` must not look for it there.
        request.outputs[0].seq.status = SequenceStatus.FINISHED

    def _attach_received_kv(self: EngineCore, outcome: StepOutcome) -> None:
        """Decode role: apply the pulls that ended since the last step (see ``disagg.py``)."""
        assert self.disagg is not None
        for request_id, failure in self.disagg.take_finished_loads():
            request = self.requests.get(request_id)
            if request is None:  # ended (fault) after its pull finished
                continue
            out = request.outputs[0]
            if failure is not None:
                self._cancel(request, FinishInfo(FinishReason.CANCELLED, message=str(failure)))
                outcome.faults[request_id] = transfer_fault(failure)
                continue
            self.scheduler.finish_receiving(out.seq)
            token = first_sampled_token(request.params.kv.session)
            if out.generator is not None:  # the prefill engine made this output's first draw
                torch.rand(1, dtype=torch.float64, generator=out.generator)
            # The grammar takes the prefill's token as its own first (K10: the same output as
            # aggregated); one it forbids came from a prefill that did not follow this spec.
            if (fault := self._refused(out, token)) is not None:
                self._cancel(request, FinishInfo(FinishReason.CANCELLED, message=fault.message))
                outcome.faults[request_id] = fault
                continue
            self._append(request, out, token, outcome)

    def _attach_pulled_media(self: EngineCore, outcome: StepOutcome) -> None:
        """Requests whose handles were pulled since the last step: scheduled now, or failed."""
        assert self.media_pulls is not None
        for request_id, pulled, fault in self.media_pulls.take_finished():
            request = self.requests.get(request_id)
            if request is None or request_id not in self._awaiting_media:  # cancelled while pulling
                continue
            self._awaiting_media.discard(request_id)
            if pulled is None:
                assert fault is not None
                request.outputs[0].seq.status = SequenceStatus.FINISHED  # never scheduled (``_stop_media``)
                self._cancel(request, FinishInfo(FinishReason.CANCELLED, message=fault.message))
                outcome.faults[request_id] = fault
                continue
            request.media = tuple(run if run.handle is None else replace(run, embeds=pulled[run.handle.handle_id])
                                  for run in request.media)
            self.scheduler.add(request.outputs[0].seq)

    def reset_prefix_cache(self: EngineCore) -> int:
        """Between steps: free every cached block; its one ``AllBlocksCleared`` goes out now."""
        freed = self.pool.reset_prefix_cache()
        self._publish_kv_events()
        return freed

    def fail_all(self: EngineCore, message: str, code: str = "internal",
                 retryable: bool = False) -> list[RequestOutput]:
        """An engine fault (or a shutdown): end every request with one terminal error, free all KV."""
        outputs = []
        for request in list(self.requests.values()):
            self._cancel(request, FinishInfo(FinishReason.CANCELLED, message=message))
            outputs.append(self._fault_output(request, EngineFault(code, message, retryable)))
        self._last_batch = (0, 0)
        self._publish_kv_events()
        return outputs

    def _fault_output(self: EngineCore, request: Request, fault: EngineFault) -> RequestOutput:
        """The one terminal output of a request failed after acceptance (its KV already freed)."""
        self._retire(request)
        return RequestOutput(request.request_id, finished=True, usage=request_usage(request), error=fault)

    def _end_given_up(self: EngineCore, sched: SchedulerOutput, outcome: StepOutcome) -> None:
        """The sequences the scheduler gave up (``lost``, ``unfit``): their requests end, retryable
        elsewhere (ENC14). This runs after ``schedule``, which is safe only because a request
        with a given-up sequence has no other output in the batch: only a disaggregated engine
        gives sequences up (a decode engine's media prompt, blocks withheld from a pull), and both
        roles take ``num_sequences`` = 1 (``role_check.py``). A scheduled sequence finished here
        would reach ``update_from_output`` with its blocks freed."""
        for given_up, message in ((sched.lost, LOST_MESSAGE), (sched.unfit, UNFIT_MESSAGE)):
            for request_id, _ in given_up:
                request = self.requests.get(request_id)
                if request is None or request_id in outcome.faults:  # another of its outputs ended it
                    continue
                assert len(request.outputs) == 1, "a request giving a sequence up has no other output in the batch"
                self._cancel(request, FinishInfo(FinishReason.CANCELLED, message="preempted"))
                outcome.faults[request_id] = EngineFault("overloaded", message, retryable=True)
