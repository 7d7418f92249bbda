"""After the model ran: sample, fork, append tokens, check stops, detokenize, and
turn all of it into per-request ``RequestOutput`` deltas.

This is the engine's ``postprocess``: it updates request state; the runner and the
scheduler stay unaware of requests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from refengine.engine.detokenizer import token_text
from refengine.engine.request import OutputState, Request
from refengine.engine.stop_checker import process_token
from refengine.engine.types import Candidate, FinishInfo, SequenceDelta, TokenInfo
from refengine.sampling.sampler import SampledToken, Sampler, SamplingRow, prompt_logprobs
from refengine.scheduler.scheduler import ScheduledSequence
from refengine.scheduler.sequence import Sequence

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class _RowTarget:
    request: Request
    index: int  # output index that receives the sampled token


class OutputProcessor:
    """Owns no request state: ``fork`` creates a request's extra outputs (the engine
    does, as it owns the scheduler) and ``release`` hands a finished sequence back."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        sampler: Sampler,
        fork: Callable[[Request], None],
        release: Callable[[Sequence], None],
    ) -> None:
        self.tokenizer = tokenizer
        self.sampler = sampler
        self.fork = fork
        self.release = release

    # -- token info ----------------------------------------------------------
    def _text(self, request: Request, token_id: int) -> str:
        """A token's own text, or "" for a request that asked for token ids only."""
        return token_text(self.tokenizer, token_id) if request.params.detokenize else ""

    def _token_info(self, request: Request, sampled: SampledToken | tuple, token_id: int) -> TokenInfo:
        if isinstance(sampled, SampledToken):
            logprob, rank, candidates = sampled.logprob, sampled.rank, sampled.candidates
        else:
            logprob, rank, candidates = sampled
        return TokenInfo(
            token_id=token_id,
            text=self._text(request, token_id),
            logprob=logprob,
            rank=rank,
            candidates=tuple(Candidate(tid, lp, rk, self._text(request, tid)) for tid, lp, rk in candidates),
        )

    # -- prompt logprobs -----------------------------------------------------
    def record_prompt_logprobs(self, request: Request, item: ScheduledSequence, logits: torch.Tensor) -> None:
        """Row j of ``logits`` predicts the token at position start+j+1.

        ``prompt_infos[k]`` holds position ``prompt_logprob_start + k``; positions
        recomputed after a preemption are already recorded and skipped.
        """
        seq = item.seq
        start = item.start
        first_pos = request.params.logprobs.prompt_logprob_start
        infos = request.prompt_infos
        if first_pos == 0 and not infos:
            first_id = request.prompt_token_ids[0]
            infos.append(TokenInfo(first_id, self._text(request, first_id)))  # nothing predicts it (L2)
        rows, targets = [], []
        for j in range(item.num_new_tokens):
            pos = start + j + 1
            if pos == first_pos + len(infos) + len(rows) and pos < seq.num_prompt_tokens:
                rows.append(j)
                targets.append(request.prompt_token_ids[pos])
        if rows:
            results = prompt_logprobs(logits[rows], targets, True, request.params.logprobs.prompt_candidates)
            for token_id, result in zip(targets, results, strict=True):
                infos.append(self._token_info(request, result, token_id))
        request.prompt_logprobs_ready = first_pos + len(infos) == seq.num_prompt_tokens

    # -- sampling ------------------------------------------------------------
    def sample(
        self, logits: torch.Tensor | None, sampling: list[tuple[Request, OutputState, int]]
    ) -> list[tuple[Request, SequenceDelta]]:
        """Sample for every (request, output, row of ``logits``) and apply the tokens.
        A request not yet forked gets ``num_sequences`` rows from the same logits row."""
        rows: list[SamplingRow] = []
        logits_rows: list[int] = []
        targets: list[_RowTarget] = []
        for request, out, logits_row in sampling:
            indices = range(request.num_sequences) if not request.forked else [out.seq.index]
            for index in indices:
                rows.append(self._sampling_row(request, out, index))
                logits_rows.append(logits_row)
                targets.append(_RowTarget(request, index))
        if not rows:
            return []
        assert logits is not None, "rows to sample but no logits"
        # A decode-only step samples every row once, in order: no copy of the logits.
        if logits_rows != list(range(logits.shape[0])):
            logits = logits[torch.tensor(logits_rows)]
        sampled = self.sampler(logits, rows)
        deltas = []
        for target, token in zip(targets, sampled, strict=True):
            request = target.request
            if not request.forked:
                self.fork(request)
            deltas.append((request, self.append_token(request, request.outputs[target.index], token)))
        return deltas

    def _sampling_row(self, request: Request, out: OutputState, index: int) -> SamplingRow:
        p = request.params
        seq = out.seq
        generator = request.generators[index]
        return SamplingRow(
            params=p.sampling,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=seq.token_ids[seq.num_prompt_tokens :],
            generator=generator,
            suppressed_token_ids=tuple(out.stop.suppressed_token_ids(seq.num_output_tokens)),
            want_logprob=request.wants_output_logprobs,
            candidates=p.logprobs.output_candidates,
        )

    def append_token(self, request: Request, out: OutputState, sampled: SampledToken) -> SequenceDelta:
        seq = out.seq
        token_id = sampled.token_id
        seq.token_ids.append(token_id)
        step = process_token(out.stop, out.detokenizer, token_id, seq.num_output_tokens)
        if step.keep_token:
            if request.wants_output_logprobs:
                info = self._token_info(request, sampled, token_id)
            else:
                info = TokenInfo(token_id, self._text(request, token_id))
            out.held_tokens.add(info, step.num_detokenized_chars)
        # Hold-back works on the text even when it is not sent (stop strings need it).
        tokens = out.held_tokens.release(len(step.text), step.finish)
        out.num_emitted_tokens += len(tokens)
        if step.finish is not None:
            self.finish_output(out, step.finish)
        text = step.text if request.params.detokenize else ""
        return SequenceDelta(index=seq.index, tokens=tokens, text=text, finish=step.finish)

    def finish_output(self, out: OutputState, finish: FinishInfo) -> None:
        out.finish = finish
        self.release(out.seq)
