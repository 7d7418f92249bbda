"""Run single scheduled sequences through a ``ModelRunner`` the way the engine core does
(``ScheduledSequence`` → ``build_model_input`` → ``execute``), for tests and benchmarks that
drive the runner directly."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from refengine.engine.input_builder import build_model_input
from refengine.model.runner import ModelRunner
from refengine.scheduler.scheduler import ScheduledSequence, SchedulerOutput
from refengine.scheduler.sequence import Sequence


def model_input_for(runner: ModelRunner, items: Seq[tuple[Sequence, int]], all_logits: bool = False):  # noqa: ANN201
    """The ``ModelInput`` of one step computing ``num_new`` tokens of each sequence: logits for
    every new row (``all_logits``) or for the sampling row of each sequence that samples."""
    scheduled = [ScheduledSequence.of(seq, num_new) for seq, num_new in items]
    rows = [s.num_new_tokens if all_logits else int(s.samples) for s in scheduled]
    return build_model_input(SchedulerOutput(scheduled), runner.block_size, rows)


def run_step(runner: ModelRunner, seq: Sequence, num_new: int, all_logits: bool = False) -> torch.Tensor:
    """Logits of one step of ``seq`` alone (``[rows, vocab]``)."""
    logits = runner.execute(model_input_for(runner, [(seq, num_new)], all_logits))
    assert logits is not None
    return logits
