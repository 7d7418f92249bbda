"""The ``threads`` marker (tests/conftest.py): the native kernels' modules rely on it to test
their work split between threads when the suite's workers run with one thread each."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.threads(3)  # neither a worker's default (1) nor this machine's core count (2)
def test_the_marker_sets_the_thread_count() -> None:
    assert torch.get_num_threads() == 3
