"""Scheduler output → ``ModelInput``: the one place a step's tensors are made.

Per-token values are computed with tensor ops over the step's sequences rather than
per-token Python loops: only each sequence's new token ids are copied as a list.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from refengine.model.input import ModelInput
from refengine.scheduler.scheduler import SchedulerOutput


def build_model_input(sched: SchedulerOutput, block_size: int, num_logit_rows: Sequence[int],
                      adapter_slots: Sequence[int] | None = None,
                      input_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> ModelInput:
    """``num_logit_rows[i]``: how many of sequence ``i``'s last rows need logits (0, 1, or
    all of its new tokens for prompt logprobs); ``adapter_slots[i]``: its LoRA slot (-1: none);
    ``input_embeds``: step rows whose input is an embedding (media), and those embeddings."""
    scheduled = sched.scheduled
    input_ids: list[int] = []
    for item in scheduled:
        input_ids.extend(item.token_ids)
    query_lens = torch.tensor([item.num_new_tokens for item in scheduled], dtype=torch.int64)
    starts = torch.tensor([item.start for item in scheduled], dtype=torch.int64)
    query_start_loc = [0]
    for item in scheduled:
        query_start_loc.append(query_start_loc[-1] + item.num_new_tokens)
    num_tokens = query_start_loc[-1]
    seq_index = torch.repeat_interleave(torch.arange(len(scheduled)), query_lens)
    row_starts = torch.tensor(query_start_loc[:-1], dtype=torch.int64)
    positions = torch.arange(num_tokens, dtype=torch.int64) - row_starts[seq_index] + starts[seq_index]

    max_blocks = max(len(item.block_table) for item in scheduled)
    block_tables = torch.tensor(
        [item.block_table + (0,) * (max_blocks - len(item.block_table)) for item in scheduled], dtype=torch.int64
    )
    slot_mapping = block_tables[seq_index, positions // block_size] * block_size + positions % block_size

    logit_rows: list[int] = []
    for i, n in enumerate(num_logit_rows):
        end = query_start_loc[i + 1]
        logit_rows.extend(range(end - n, end))
    return ModelInput(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=positions,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        query_start_loc=query_start_loc,
        seq_lens=[item.start + item.num_new_tokens for item in scheduled],
        num_logit_rows=list(num_logit_rows),
        logit_row_indices=torch.tensor(logit_rows, dtype=torch.int64),
        block_copies=list(sched.block_copies),
        adapter_slots=None if adapter_slots is None else torch.repeat_interleave(
            torch.tensor(adapter_slots, dtype=torch.int64), query_lens),
        input_embeds=input_embeds,
    )
