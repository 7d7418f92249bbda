"""A request's state inside the engine: its sequences (one per output), and per
output the detokenizer, stop checker and sampling generator.

A request with ``num_sequences`` > 1 starts as one sequence; when its prompt has
been computed, the first sampling step forks it into ``num_sequences`` sequences
that share the prompt's KV blocks (copy-on-write on the last partial block).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from refengine.engine.detokenizer import IncrementalDetokenizer, NoTextDetokenizer
from refengine.engine.stop_checker import StopChecker, TokenHoldBack
from refengine.engine.types import FinishInfo, GenerationRequest, RequestOutput, TokenInfo
from refengine.scheduler.sequence import Sequence

OutputSink = Callable[[RequestOutput], None]

_SEED_STRIDE = 0x9E3779B97F4A7C15  # spreads per-output seeds of one request apart


def output_generator(seed: int | None, index: int) -> torch.Generator | None:
    """Output ``index`` of a seeded request gets its own generator, so its draws do
    not depend on anything else in the batch (G17)."""
    if seed is None:
        return None
    generator = torch.Generator()
    generator.manual_seed((seed + index * _SEED_STRIDE) % (1 << 64))
    return generator


@dataclass(eq=False)
class OutputState:
    """Per-output bookkeeping next to its Sequence."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer | NoTextDetokenizer
    stop: StopChecker
    generator: torch.Generator | None
    held_tokens: TokenHoldBack
    num_emitted_tokens: int = 0
    finish: FinishInfo | None = None


@dataclass(eq=False)
class Request:
    params: GenerationRequest
    prompt_token_ids: list[int]
    max_tokens: int  # resolved: never past the context limit
    sink: OutputSink
    generators: list[torch.Generator | None] = field(default_factory=list)  # one per output index
    outputs: list[OutputState] = field(default_factory=list)
    forked: bool = False  # num_sequences outputs exist (always True when num_sequences == 1)
    prompt_infos: list[TokenInfo] = field(default_factory=list)
    prompt_logprobs_ready: bool = False  # every requested prompt position is recorded
    prompt_logprobs_sent: bool = False
    abort_requested: bool = False

    @property
    def request_id(self) -> str:
        return self.params.request_id

    @property
    def num_sequences(self) -> int:
        return self.params.sampling.num_sequences

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.logprobs.prompt_logprobs or self.params.logprobs.prompt_candidates is not None

    @property
    def wants_output_logprobs(self) -> bool:
        return self.params.logprobs.output_logprobs or self.params.logprobs.output_candidates is not None

    @property
    def finished(self) -> bool:
        return self.forked and all(o.finish is not None for o in self.outputs)

    @property
    def num_cached_prompt_tokens(self) -> int:
        return max(self.outputs[0].seq.num_cached_tokens, 0)
