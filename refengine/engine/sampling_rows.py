"""Which outputs get a token this step, and the ``SamplingRow`` each is drawn with.

A request whose outputs wait for its prompt (``num_sequences`` > 1) gets one row per
output from output 0's logits row: the n first tokens are drawn from the same
distribution, each with its own generator.
"""

from __future__ import annotations

import torch

from refengine.engine.request import OutputState, OutputStatus, Request
from refengine.model.input import ModelInput
from refengine.sampling.guided import allocate_bitmask
from refengine.sampling.sampler import SampledToken, Sampler, SamplingRow
from refengine.scheduler.scheduler import SchedulerOutput

#: One sampling row's target: the request and the output that receives the token.
SampleTarget = tuple[Request, OutputState]


def sampling_targets(
    sched: SchedulerOutput, model_input: ModelInput, requests: dict[str, Request]
) -> tuple[list[SampleTarget], list[int]]:
    """Per row to sample: its target, and the row of the step's logits it reads."""
    targets: list[SampleTarget] = []
    logit_rows: list[int] = []
    for item, (_, end) in zip(sched.scheduled, model_input.logit_row_ranges(), strict=True):
        if not item.samples:
            continue
        request = requests[item.request_id]
        out = request.outputs[item.index]
        waiting = [o for o in request.outputs if o.status is OutputStatus.WAITING_FOR_PROMPT]
        for target in [out, *waiting] if item.index == 0 else [out]:
            targets.append((request, target))
            logit_rows.append(end - 1)
    return targets, logit_rows


def sampling_row(request: Request, out: OutputState) -> SamplingRow:
    p = request.params
    seq = out.seq
    return SamplingRow(
        params=p.sampling,
        prompt_token_ids=request.prompt_token_ids,
        output_token_ids=seq.token_ids[seq.num_prompt_tokens :],
        generator=out.generator,
        suppressed_token_ids=tuple(out.stop.suppressed_token_ids(seq.num_output_tokens)),
        want_logprob=request.wants_output_logprobs,
        candidates=p.logprobs.output_candidates,
    )


def sample_step(
    sampler: Sampler, sched: SchedulerOutput, model_input: ModelInput, logits: torch.Tensor | None,
    requests: dict[str, Request],
) -> tuple[list[SampleTarget], list[SampledToken]]:
    """Draw this step's tokens: one per target, guided rows under one shared bitmask."""
    targets, logit_rows = sampling_targets(sched, model_input, requests)
    if not targets:
        return [], []
    assert logits is not None, "rows to sample but no logits"
    # A decode-only step samples every row once, in order: no copy of the logits.
    if logit_rows != list(range(logits.shape[0])):
        logits = logits[torch.tensor(logit_rows, device=logits.device)]
    rows = [sampling_row(r, o) for r, o in targets]
    guided = [j for j, (_, out) in enumerate(targets) if out.matcher is not None]
    if not guided:
        return targets, sampler(logits, rows)
    bitmask = allocate_bitmask(len(targets), sampler.vocab_size)
    for j in guided:  # one bitmask for the step; unguided rows stay all-allowed and unapplied
        targets[j][1].matcher.fill_bitmask(bitmask, j)
    # The matchers fill it on the CPU; it goes to the logits (a GPU's, with device sampling).
    return targets, sampler(logits, rows, bitmask.to(logits.device), guided)
