"""The G18 check shared by the projection tests: a row's bits do not depend on the call."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def assert_rows_do_not_depend_on_the_call(layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                                          prefixes: Iterable[int], row_step: int, one_thread: bool = True) -> None:
    """G18: ``layer`` on the first n rows of ``x`` (n in ``prefixes``), on every ``row_step``-th
    row alone and, with ``one_thread``, on all of ``x`` with one thread gives the bits of its call
    on all of ``x``."""
    batch = layer(x)
    for rows in prefixes:
        assert torch.equal(layer(x[:rows]), batch[:rows])
    for i in range(0, x.shape[0], row_step):
        assert torch.equal(layer(x[i:i + 1]), batch[i:i + 1]), f"row {i}"
    if not one_thread:
        return
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(layer(x), batch)
    finally:
        torch.set_num_threads(threads)
