"""The KV cache's host memory (``refengine.model.host_memory``): one zeroed slab, each
tensor a page-aligned, disjoint, contiguous view, on transparent huge pages where the
kernel grants them (the NIXL READ rate depends on it: see the module docstring)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from refengine.config import CacheConfig
from refengine.model.host_memory import HUGE_PAGE_BYTES, zeros_on_huge_pages
from refengine.model.runner import ModelRunner
from tests.tiny_models import hf_weights, make_tiny_hf_model, model_config_from_hf

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str:
    """The bracketed mode of ``enabled`` ("always", "madvise" or "never"); "" without THP."""
    if not sys.platform.startswith("linux") or not THP.exists():
        return ""
    text = THP.read_text()
    return text[text.index("[") + 1:text.index("]")]


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping that holds ``address`` (/proc/self/smaps)."""
    inside, huge = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("AnonHugePages:"):
            huge = int(line.split()[1])
    return huge


def test_tensors_are_zeroed_disjoint_page_aligned_views_of_their_shapes() -> None:
    shapes = [(5, 3, 64, 16), (5, 16, 3, 64), (7, 11), (1,)]
    tensors = zeros_on_huge_pages(shapes, torch.bfloat16)
    assert [tuple(t.shape) for t in tensors] == shapes
    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() and not t.any() for t in tensors)
    assert all(t.data_ptr() % 4096 == 0 for t in tensors)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:], strict=False))
    for index, t in enumerate(tensors):  # writing one leaves the others untouched
        t.fill_(index + 1)
    assert [int(t.float().min()) for t in tensors] == [1, 2, 3, 4]
    assert [int(t.float().max()) for t in tensors] == [1, 2, 3, 4]


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="transparent huge pages are off or absent here")
def test_the_slab_is_on_huge_pages() -> None:
    """Fails without the madvise under the usual ``madvise`` mode: torch's allocator never asks."""
    tensors = zeros_on_huge_pages([(8 * HUGE_PAGE_BYTES // 4,)], torch.float32)
    assert _anon_huge_kib(tensors[0].data_ptr()) >= 4 * HUGE_PAGE_BYTES // 1024


def test_the_cpu_runner_keeps_its_kv_cache_in_one_slab() -> None:
    hf = make_tiny_hf_model()
    config, weights = model_config_from_hf(hf), hf_weights(hf)
    runner = ModelRunner(config, weights, CacheConfig(num_blocks=6, block_size=4), max_model_len=32)
    tensors = [t for pair in runner.kv_caches for t in pair]
    assert len(tensors) == 2 * config.num_hidden_layers
    assert all(t.shape[0] == 6 and t.is_contiguous() and not t.any() for t in tensors)
    starts = [t.data_ptr() for t in tensors]
    assert starts == sorted(starts)
    assert starts[-1] - starts[0] < 2 * sum(t.numel() * t.element_size() for t in tensors) + HUGE_PAGE_BYTES
