"""Per output, what a sampled token (or a prompt chunk's logits) adds: the token
appended to its sequence, stop checks, detokenization, token infos with logprobs,
and the ``SequenceDelta`` to emit.

It touches only request state (``Request`` / ``OutputState``) and calls nothing
back: finishing an output, freeing its KV and forking are the engine core's
``update_from_output``, which calls this (as does ``core_inflow._attach_received_kv`` for a
decode engine's first token).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from refengine.engine.request import OutputState, Request
from refengine.engine.stop_checker import process_token
from refengine.engine.token_texts import token_text, token_texts, tokenizer_info
from refengine.sampling.sampler import SampledToken, prompt_logprobs
from refengine.scheduler.scheduler import ScheduledSequence
from refengine.types import Candidate, FinishInfo, FinishReason, SequenceDelta, TokenInfo

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class OutputProcessor:
    """Owns no state besides the tokenizer (for token texts)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        # Built now, at start-up, rather than on the step thread at the first request: the
        # per-token bytes of a byte-level vocabulary take 0.2 s (SmolLM2's 49k tokens).
        tokenizer_info(tokenizer)

    # -- token info ----------------------------------------------------------
    def _text(self, request: Request, token_id: int) -> str:
        """A token's own text, or "" for a request that asked for token ids only."""
        return token_text(self.tokenizer, token_id) if request.params.detokenize else ""

    def _candidates(self, request: Request, candidates: tuple[tuple[int, float, int], ...]) -> tuple[Candidate, ...]:
        if not request.params.detokenize:
            return tuple(Candidate(*candidate, "") for candidate in candidates)
        texts = token_texts(self.tokenizer, [token_id for token_id, _, _ in candidates])
        return tuple(Candidate(*candidate, text) for candidate, text in zip(candidates, texts, strict=True))

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
            candidates=self._candidates(request, candidates),
        )

    # -- prompt logprobs -----------------------------------------------------
    def record_prompt_logprobs(self, request: Request, item: ScheduledSequence, logits: torch.Tensor) -> None:
        """Row j of ``logits`` predicts the token at position start+j+1.

        ``prompt_infos[k]`` holds position ``prompt_logprob_start + k``; positions
        recomputed after a preemption are already recorded and skipped.
        """
        num_prompt_tokens = len(request.prompt_token_ids)
        start = item.start
        first_pos = request.params.logprobs.prompt_logprob_start
        infos = request.prompt_infos
        if first_pos == 0 and not infos:
            first_id = request.prompt_token_ids[0]
            infos.append(TokenInfo(first_id, self._text(request, first_id)))  # nothing predicts it (L2)
        rows, targets = [], []
        for j in range(item.num_new_tokens):
            pos = start + j + 1
            if pos == first_pos + len(infos) + len(rows) and pos < num_prompt_tokens:
                rows.append(j)
                targets.append(request.prompt_token_ids[pos])
        if rows:
            results = prompt_logprobs(logits[rows], targets, True, request.params.logprobs.prompt_candidates)
            for token_id, result in zip(targets, results, strict=True):
                infos.append(self._token_info(request, result, token_id))
        request.prompt_logprobs_ready = first_pos + len(infos) == num_prompt_tokens

    # -- sampled tokens ------------------------------------------------------
    def append_token(self, request: Request, out: OutputState, sampled: SampledToken) -> SequenceDelta:
        """Append ``sampled`` to ``out``'s sequence; the delta's ``finish`` is set when the
        output ends with it (the caller then finishes the output)."""
        seq = out.seq
        token_id = sampled.token_id
        seq.token_ids.append(token_id)
        # A guided output whose grammar is complete ends here (it accepted its stop token, an
        # EOS, which ``ignore_eos`` would otherwise let pass): STOP, matched by that token.
        grammar_done = out.matcher is not None and out.matcher.is_terminated()
        forced = FinishInfo(FinishReason.STOP, eos_token_id=token_id) if grammar_done else None
        step = process_token(out.stop, out.detokenizer, token_id, seq.num_output_tokens, forced)
        info = None  # a dropped stop token / EOS: its step may still release earlier tokens' text
        if step.keep_token:
            if request.wants_output_logprobs:
                info = self._token_info(request, sampled, token_id)
            else:
                info = TokenInfo(token_id, self._text(request, token_id))
        out.held_tokens.add(info, step.num_detokenized_chars, step.text_pending, step.num_chars_before,
                            step.token_ends)
        # Hold-back works on the text even when it is not sent (stop strings need it).
        tokens = out.held_tokens.release(len(step.text), step.finish)
        out.num_emitted_tokens += len(tokens)
        text = step.text if request.params.detokenize else ""
        return SequenceDelta(index=seq.index, tokens=tokens, text=text, finish=step.finish)
