"""The device the engine runs on, and whether its KV cache fits there: checked before anything
large is loaded or allocated, so a wrong ``--device`` or ``--kv-memory-mib`` fails in a second
with a message naming the flag, not with torch's error after a long load (found by review:
``--device cuda`` on a CPU machine said "Expected a torch.device with a specified index").
"""

from __future__ import annotations

import os

import torch


def resolve_device(device: str) -> str:
    """``device`` with its GPU index fixed: ``cuda`` becomes ``cuda:N``, N the calling thread's
    current GPU. The step thread makes the runner's GPU current (``ModelRunner.use_device``), and
    ``torch.cuda.set_device`` refuses a device without an index. ``ValueError`` when this machine
    has no such GPU."""
    parsed = torch.device(device)
    if parsed.type != "cuda":
        return device
    if not torch.cuda.is_available():
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "built without CUDA"
        raise ValueError(f"--device {device}: CUDA is not available on this machine (torch {torch.__version__}, "
                         f"{build}); use --device cpu")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if parsed.index is None else parsed.index
    if index >= count:
        raise ValueError(f"--device {device}: this machine has {count} GPU(s), cuda:0 to cuda:{count - 1}")
    return f"cuda:{index}"


def available_bytes(device: str) -> int | None:
    """Memory a new allocation can take on ``device`` now: free GPU memory (torch's unused cache
    included), or the host's ``MemAvailable`` (None where the system does not say)."""
    if torch.device(device).type == "cuda":
        gpu = torch.device(device)
        # what CUDA has free, plus what torch's allocator holds unused (an earlier runner's): torch
        # reuses that without a cudaMalloc (found by review)
        return torch.cuda.mem_get_info(gpu)[0] + torch.cuda.memory_reserved(gpu) - torch.cuda.memory_allocated(gpu)
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def check_kv_cache_fits(kv_bytes: int, num_blocks: int, device: str) -> None:
    """``ValueError`` when a KV cache of ``kv_bytes`` cannot fit in what ``device`` has free: on a
    CPU it would be faulted in by the zeroing pass until the kernel kills the process."""
    available = available_bytes(device)
    if available is not None and kv_bytes > available:
        raise ValueError(f"the KV cache of {num_blocks} blocks needs {kv_bytes / 2**30:.2f} GiB, but {device} has "
                         f"{available / 2**30:.2f} GiB available; lower --kv-memory-mib or --num-kv-blocks")
