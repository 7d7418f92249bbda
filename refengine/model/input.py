"""``ModelInput``: everything one forward step needs, as plain data.

The engine's input builder makes it from the scheduler's output; the runner takes
nothing else. All tensors are on the CPU (the runner moves them to its device), so
a ``ModelInput`` can be broadcast to other ranks or diffed into persistent device
buffers without touching any scheduler object.

Layout: the step's tokens are laid out sequence after sequence; sequence ``i`` owns
rows ``query_start_loc[i] : query_start_loc[i + 1]`` and, after the step, holds
``seq_lens[i]`` tokens of context. Logits are computed only for the last
``num_logit_rows[i]`` rows of each sequence (0: none, 1: the sampling row, all:
prompt logprobs), in sequence order; ``logit_row_indices`` lists those rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int64, padded with 0
    query_start_loc: list[int]  # [num_seqs + 1]
    seq_lens: list[int]  # [num_seqs]
    num_logit_rows: list[int]  # [num_seqs]
    logit_row_indices: torch.Tensor  # [sum(num_logit_rows)] int64
    block_copies: list[tuple[int, int]]  # (src, dst) whole-block copies to run before the step
    adapter_slots: torch.Tensor | None = None  # [num_tokens] LoRA slot per token (-1: base); None = no adapters
    # Media: (step rows [n] int64, their input embeddings [n, hidden]) replacing the token
    # embeddings of those rows (an image's positions); None = token embeddings only.
    input_embeds: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    def logit_row_ranges(self) -> list[tuple[int, int]]:
        """Per sequence, its ``[start, end)`` rows in the step's logits."""
        ranges, start = [], 0
        for n in self.num_logit_rows:
            ranges.append((start, start + n))
            start += n
        return ranges
