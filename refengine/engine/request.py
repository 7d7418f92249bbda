"""A request's state inside the engine core: its ``num_sequences`` outputs, each with
its own sequence, detokenizer, stop checker, token hold-back and, when seeded, sampling
generator.

All outputs exist from admission. Output 0's sequence computes the prompt; outputs
1 … n-1 wait (``WAITING_FOR_PROMPT``) with sequences of their own that are not yet
scheduled. When the prompt has been computed, the first sampling step draws n
tokens from the same logits row and forks the waiting outputs: a KV-only operation
(``Scheduler.fork``) that lets their sequences share the prompt's blocks,
copy-on-write on the last partial block.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from refengine.engine.detokenizer import IncrementalDetokenizer
from refengine.engine.media import MediaRun
from refengine.engine.no_text_detokenizer import NoTextDetokenizer
from refengine.engine.stop_checker import StopChecker
from refengine.engine.token_hold_back import TokenHoldBack
from refengine.lora.registry import LoadedLora
from refengine.sampling.guided import CompiledGuide, GuideMatcher
from refengine.scheduler.sequence import Sequence
from refengine.types import GenerationRequest, TokenInfo

_SEED_STRIDE = 0x9E3779B97F4A7C15  # spreads per-output seeds of one request apart


def output_generator(seed: int | None, index: int) -> torch.Generator | None:
    """Output ``index`` of a seeded request gets its own generator, so its draws do
    not depend on anything else in the batch (G17)."""
    if seed is None:
        return None
    generator = torch.Generator()
    generator.manual_seed((seed + index * _SEED_STRIDE) % (1 << 64))
    return generator


class OutputStatus(enum.Enum):
    WAITING_FOR_PROMPT = "waiting_for_prompt"  # index > 0: forks once output 0's prompt is computed
    ACTIVE = "active"  # its sequence is in the scheduler (waiting, running, receiving) or awaits media pulls
    FINISHED = "finished"  # ``finish`` is set; its sequence holds no KV


@dataclass(eq=False)
class OutputState:
    """One output of a request, from admission to its finish."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer | NoTextDetokenizer
    stop: StopChecker
    generator: torch.Generator | None
    held_tokens: TokenHoldBack
    status: OutputStatus
    matcher: GuideMatcher | None = None  # this output's own grammar state (guided requests)
    num_emitted_tokens: int = 0

    @property
    def index(self) -> int:
        return self.seq.index


@dataclass(eq=False)
class Request:
    """An accepted request. ``prompt_token_ids`` are tokenized once, by the front end."""

    params: GenerationRequest
    prompt_token_ids: list[int]
    max_tokens: int  # resolved: never past the context limit
    guide: CompiledGuide | None = None  # compiled before acceptance; one matcher per output from it
    lora: LoadedLora | None = None  # resolved at acceptance; kept (weights too) until the request ends
    media: tuple[MediaRun, ...] = ()  # its images' embedding runs in the (expanded) prompt
    outputs: list[OutputState] = field(default_factory=list)
    prompt_infos: list[TokenInfo] = field(default_factory=list)
    prompt_logprobs_ready: bool = False  # every requested prompt position is recorded
    prompt_logprobs_sent: bool = False

    @property
    def request_id(self) -> str:
        return self.params.request_id

    @property
    def num_sequences(self) -> int:
        return self.params.sampling.num_sequences

    @property
    def media_identities(self) -> tuple[tuple[int, str], ...]:
        """(first position, identity) of each media item, for the KV session's prompt hash."""
        return tuple((run.start, run.identity) for run in self.media)

    @property
    def awaits_media(self) -> bool:
        """Some media rows are still to be pulled from an encoder (not on a decode engine)."""
        return any(run.embeds is None and run.handle is not None for run in self.media)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.logprobs.prompt_logprobs or self.params.logprobs.prompt_candidates is not None

    @property
    def wants_output_logprobs(self) -> bool:
        return self.params.logprobs.output_logprobs or self.params.logprobs.output_candidates is not None

    @property
    def finished(self) -> bool:
        return all(o.status is OutputStatus.FINISHED for o in self.outputs)

    @property
    def num_cached_prompt_tokens(self) -> int:
        return max(self.outputs[0].seq.num_cached_tokens, 0)
