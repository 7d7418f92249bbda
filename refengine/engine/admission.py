"""Admission: a request's ``num_sequences`` outputs, all made at once.

Output 0's sequence will compute the prompt; outputs 1 … n-1 wait for it with sequences
of their own (same tokens, no blocks) and fork when it is computed. Each output owns its
detokenizer, stop checker, token hold-back, grammar matcher and, when seeded, sampling
generator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from refengine.engine.detokenizer import IncrementalDetokenizer
from refengine.engine.no_text_detokenizer import NoTextDetokenizer
from refengine.engine.request import OutputState, OutputStatus, Request, output_generator
from refengine.engine.stop_checker import StopChecker
from refengine.engine.token_hold_back import TokenHoldBack
from refengine.kv.keys import engine_extra_keys
from refengine.scheduler.sequence import Sequence

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def make_outputs(request: Request, tokenizer: PreTrainedTokenizerBase, eos_token_ids: tuple[int, ...],
                 model_fingerprint: str) -> list[OutputState]:
    p = request.params
    n = request.num_sequences
    # Everything besides token ids that changes the KV a request computes (its blocks' keys).
    lora = request.lora
    extra_keys = engine_extra_keys(model_fingerprint, p.kv.cache_salt, None if lora is None else lora.cache_key)
    # Without text to send, text is still needed when stop strings must match on it.
    needs_text = p.detokenize or bool(p.stopping.stop_strings)
    outputs = []
    for index in range(n):
        seq = Sequence(
            request_id=request.request_id,
            index=index,
            token_ids=list(request.prompt_token_ids),
            num_prompt_tokens=len(request.prompt_token_ids),
            max_num_tokens=len(request.prompt_token_ids) + request.max_tokens,
            extra_keys=extra_keys,
            priority=p.priority,
            use_prefix_cache=not p.kv.bypass_prefix_cache and not request.wants_prompt_logprobs,
            num_pending_forks=n - 1 if index == 0 else 0,
            kv_from_remote=p.kv.session is not None,  # decode role (num_sequences is 1 there)
            lora_key=0 if lora is None else lora.key,
            lora=None if lora is None else lora.spec,
            media_spans=tuple((run.start, run.end, run.identity) for run in request.media),
            # a decode engine has no media rows: it could not recompute such a prompt
            recomputable=all(run.embeds is not None or run.handle is not None for run in request.media),
        )
        outputs.append(OutputState(
            seq=seq,
            detokenizer=(IncrementalDetokenizer(tokenizer, request.prompt_token_ids) if needs_text
                         else NoTextDetokenizer()),
            stop=StopChecker(p.stopping, eos_token_ids, request.max_tokens, guided=request.guide is not None),
            generator=output_generator(p.sampling.seed, index),
            held_tokens=TokenHoldBack(p.stopping.include_stop_in_output),
            status=OutputStatus.ACTIVE if index == 0 else OutputStatus.WAITING_FOR_PROMPT,
            matcher=None if request.guide is None else request.guide.new_matcher(),
        ))
    return outputs
