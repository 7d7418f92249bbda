"""A sequence: one output stream of a request, the unit the scheduler schedules.

There are no prefill/decode phases: a sequence simply has ``num_computed_tokens``
catching up with ``len(token_ids)`` (prompt + outputs so far). When it has caught
up except for the newest token, it decodes.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from refengine.types import LoraAdapterSpec

_arrival_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    RECEIVING = "receiving"  # decode role: blocks allocated, the prompt's KV being pulled in
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int  # output index within the request (0 … num_sequences-1)
    token_ids: list[int]
    num_prompt_tokens: int
    max_num_tokens: int = 0  # the longest it may grow (prompt + max_tokens); 0: its current length
    extra_keys: tuple[str, ...] = ()  # everything besides tokens that changes KV (prefix-cache hash)
    priority: int = 0
    use_prefix_cache: bool = True  # False: bypass_prefix_cache, or prompt logprobs are needed
    # Siblings that will fork from this sequence once its prompt is computed (num_sequences > 1).
    # Each claims a running slot already, so admission never over-commits ``max_num_seqs``;
    # ``Scheduler.fork`` moves one claim at a time to the new sibling.
    num_pending_forks: int = 0
    # Decode role: the prompt's KV comes from a prefill engine's session, not from a forward pass.
    kv_from_remote: bool = False
    # The LoRA adapter it runs with: ``lora_key`` identifies the load (0: the base model), at
    # most ``max_loras`` distinct ones run at once; ``lora`` names it in KV events.
    lora_key: int = 0
    lora: LoraAdapterSpec | None = None
    # Its media items' runs of positions in the prompt, with their identities (prefix-cache keys).
    media_spans: tuple[tuple[int, int, str], ...] = ()
    # False when its prompt cannot be computed here (a decode engine lacks a media item's rows): a
    # preemption then ends it (``SchedulerOutput.lost``) instead of queueing a recompute.
    recomputable: bool = True
    arrival: int = field(default_factory=lambda: next(_arrival_counter))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache (-1 = not yet scheduled)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_slots(self) -> int:
        """Running slots this sequence claims: itself and its pending forks."""
        return 1 + self.num_pending_forks

    @property
    def sort_key(self) -> tuple[int, int]:
        """Higher priority first, then first come first served."""
        return (-self.priority, self.arrival)
