"""The KV cache's host memory (``refengine.model.host_memory``): one zeroed slab, each
tensor a page-aligned, disjoint, contiguous view, on transparent huge pages where NIXL
registers the cache and the kernel grants them (the NIXL READ rate depends on it; elsewhere
they only slow the start: see the module docstring); and the step buffers, which glibc's
malloc is told to keep for reuse (``keep_freed_memory``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from refengine.config import CacheConfig, EngineConfig, KvTransferConfig
from refengine.engine import engine_kv
from refengine.engine.engine_kv import choose_transfer_backends
from refengine.model.host_memory import HUGE_PAGE_BYTES, keep_freed_memory, zeroed_slab
from refengine.model.runner import ModelRunner, kv_bytes_per_block
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


@pytest.mark.parametrize("huge_pages", [True, False])
def test_tensors_are_zeroed_disjoint_page_aligned_views_of_their_shapes(huge_pages: bool) -> None:
    shapes = [(5, 3, 64, 16), (5, 16, 3, 64), (7, 11), (1,)]
    tensors = zeroed_slab(shapes, torch.bfloat16, huge_pages)
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
    tensors = zeroed_slab([(8 * HUGE_PAGE_BYTES // 4,)], torch.float32, huge_pages=True)
    assert _anon_huge_kib(tensors[0].data_ptr()) >= 4 * HUGE_PAGE_BYTES // 1024


@pytest.mark.skipif(_thp_mode() != "madvise", reason=f"THP mode is {_thp_mode() or 'absent'}, not madvise: "
                    "only there does a slab get huge pages exactly when it is advised")
@pytest.mark.parametrize("huge_pages", [True, False])
def test_the_runner_asks_for_huge_pages_only_when_told(huge_pages: bool) -> None:
    hf = make_tiny_hf_model()
    config, weights = model_config_from_hf(hf), hf_weights(hf)
    num_blocks = -(-8 * HUGE_PAGE_BYTES // kv_bytes_per_block(config, 4, torch.float32))
    runner = ModelRunner(config, weights, CacheConfig(num_blocks=num_blocks, block_size=4), max_model_len=32,
                         kv_huge_pages=huge_pages)
    huge_kib = _anon_huge_kib(runner.kv_caches[0][0].data_ptr())
    assert (huge_kib >= 4 * HUGE_PAGE_BYTES // 1024) if huge_pages else huge_kib == 0, huge_kib


class _Named:
    """A transfer backend as the choice sees one: its name."""

    def __init__(self, name: str) -> None:
        self.name = name


@pytest.mark.parametrize(("role", "offered", "importable", "given", "huge"), [
    ("aggregated", "grpc", True, (), False),
    ("decode", "grpc", True, (), True),  # a decode engine reads with NIXL wherever it can
    ("decode", "grpc", False, (), False),
    ("prefill", "grpc", True, (), False),  # offers gRPC pulls: NIXL never touches its cache
    ("prefill", "nixl", True, (), True),
    ("prefill", "grpc", False, (_Named("nixl"),), True),  # a NIXL backend handed in
])
def test_only_an_engine_whose_kv_nixl_registers_goes_on_huge_pages(monkeypatch: pytest.MonkeyPatch, role: str,
                                                                   offered: str, importable: bool, given: tuple,
                                                                   huge: bool) -> None:
    monkeypatch.setattr(engine_kv, "nixl_available", lambda: (importable, "" if importable else "not installed"))
    config = EngineConfig(role=role, kv_transfer=KvTransferConfig(backend=offered))
    huge_pages = "nixl" in choose_transfer_backends(config, (_Named("grpc"), *given))  # as Engine.__init__ asks
    assert huge_pages is huge


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


def _is_glibc() -> bool:
    try:
        return sys.platform.startswith("linux") and bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (ValueError, OSError, AttributeError):
        return False


# A step's life in small: a 48 MiB activation (above glibc's largest adaptive mmap threshold,
# 32 MiB) allocated, written and freed, 10 times to settle (glibc grows its heap over the first
# few; in a fresh clone 5 were not always enough), then 10 times counted. Prints the minor page faults of the 10.
_STEP_LOOP = """
import resource, sys, torch
from refengine.model.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
for _ in range(10):
    torch.empty(12 << 20).fill_(1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.empty(12 << 20).fill_(1.0)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _step_loop_faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", _STEP_LOOP, mode], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2], check=True)
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(not _is_glibc(), reason="keep_freed_memory sets glibc's malloc options; this libc is not glibc")
def test_freed_step_buffers_are_reused_not_faulted_in_again() -> None:
    """Without the setting every 48 MiB buffer is a fresh mapping (12,288 pages faulted in
    each time); with it the freed chunk is reused and nothing faults in again."""
    pages = (48 << 20) // 4096
    assert _step_loop_faults("default") >= 9 * pages
    assert _step_loop_faults("keep") <= pages // 8


@pytest.mark.skipif(not _is_glibc(), reason="keep_freed_memory sets glibc's malloc options; this libc is not glibc")
def test_keep_freed_memory_is_idempotent_and_the_kv_slab_keeps_its_own_mapping() -> None:
    assert keep_freed_memory() and keep_freed_memory()
    tensors = zeroed_slab([(4 * HUGE_PAGE_BYTES // 4,)], torch.float32, huge_pages=True)
    start = tensors[0].data_ptr()
    mappings = [line.split()[0] for line in Path("/proc/self/maps").read_text().splitlines()]
    spans = [tuple(int(part, 16) for part in head.split("-")) for head in mappings]
    holder = next((lo, hi) for lo, hi in spans if lo <= start < hi)
    assert "[heap]" not in next(line for line in Path("/proc/self/maps").read_text().splitlines()
                                if line.startswith(f"{holder[0]:x}-"))
