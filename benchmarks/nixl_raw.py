"""Raw NIXL READ bandwidth between two processes on this machine: the ceiling the NIXL KV
transfer backend (``refengine.kv.transfer.nixl_backend``) can reach, without its per-block
descriptors, validation or notification.

A spawned child registers one buffer of ``num_bytes`` (DRAM, UCX backend) and hands its
agent metadata and address over a Pipe; this process registers its own buffer and READs the
whole buffer as one descriptor. One untimed READ first (it opens the UCX connection), then the
best of ``repeats`` timed READs (post until ``check_xfer_state`` says DONE): of the same bytes
(cache-hot), or with ``cold=True`` of a different slice of a 256 MiB span each time. MB/s = 1e6 bytes/s.
UCX picks the transport itself (CMA/shared memory on one machine; set ``UCX_TLS=tcp`` to compare).

    OMP_NUM_THREADS=1 python benchmarks/nixl_raw.py
"""

from __future__ import annotations

import multiprocessing
import os
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

MiB = 1 << 20


def _agent(name: str) -> Any:
    try:  # nixl_cu12 directly: the ``nixl`` meta package refuses a CUDA-13 torch
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    except ImportError:
        from nixl._api import nixl_agent, nixl_agent_config
    # no progress thread (it spins a core for good, as in the backend): polling progresses UCX
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def _source(conn: Connection, num_bytes: int) -> None:
    """The child: a registered buffer of random bytes, served until the parent says so."""
    agent = _agent("nixl-raw-source")
    buffer = np.random.default_rng(0).integers(0, 256, num_bytes, dtype=np.uint8)
    registered = agent.register_memory([(buffer.ctypes.data, num_bytes, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), buffer.ctypes.data, bytes(buffer[:4096])))
    while not conn.poll(0.001):  # serve the READs: over TCP they need this side's progress
        agent.get_new_notifs()
    agent.deregister_memory(registered)


def _read_seconds(agent: Any, local: Any, remote: Any) -> float:
    start = time.perf_counter()
    handle = agent.initialize_xfer("READ", local, remote, "nixl-raw-source")
    state = agent.transfer(handle)
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    seconds = time.perf_counter() - start
    agent.release_xfer_handle(handle)
    if state != "DONE":
        raise RuntimeError(f"NIXL READ ended in {state}")
    return seconds


COLD_SPAN = 256 * MiB  # cold reads walk this much memory: more than any CPU cache here


def raw_loopback_mb_per_s(num_bytes: int, repeats: int = 3, cold: bool = False) -> float:
    """Best-of-``repeats`` NIXL READ bandwidth of ``num_bytes`` from a second process on this
    machine, in MB/s (1e6 bytes/s). ``cold``: every READ copies a different slice of a larger
    span (both sides' pages touched beforehand), so neither side's bytes are in a CPU cache —
    as for KV blocks written some time before; otherwise the same buffer is read each time."""
    slots = max(repeats + 1, -(-COLD_SPAN // num_bytes)) if cold else 1
    context = multiprocessing.get_context("spawn")
    mine, theirs = context.Pipe()
    child = context.Process(target=_source, args=(theirs, num_bytes * slots), daemon=True)
    child.start()
    try:
        metadata, address, head = mine.recv()
        agent = _agent("nixl-raw-reader")
        buffer = np.ones(num_bytes * slots, dtype=np.uint8)  # ones: every page is touched now
        registered = agent.register_memory([(buffer.ctypes.data, buffer.nbytes, 0, "")], "DRAM")
        agent.add_remote_agent(metadata)

        def read(slot: int) -> float:
            offset = (slot % slots) * num_bytes
            local = agent.get_xfer_descs([(buffer.ctypes.data + offset, num_bytes, 0)], "DRAM")
            remote = agent.get_xfer_descs([(address + offset, num_bytes, 0)], "DRAM")
            return _read_seconds(agent, local, remote)

        read(0)  # opens the connection: not timed
        best = min(read(slot) for slot in range(1, repeats + 1))
        if bytes(buffer[:4096]) != head:
            raise RuntimeError("the READ did not copy the source's bytes")
        agent.remove_remote_agent("nixl-raw-source")
        agent.deregister_memory(registered)
        mine.send("done")
        child.join(10)
    finally:
        if child.is_alive():
            child.kill()
            child.join(5)
    return num_bytes / best / 1e6


if __name__ == "__main__":
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # nixl logs INFO lines to stdout otherwise
    for size in (1 * MiB, 16 * MiB, 64 * MiB):
        print(f"{size // MiB:>3} MiB: {raw_loopback_mb_per_s(size):8.0f} MB/s (cache-hot), "
              f"{raw_loopback_mb_per_s(size, cold=True):8.0f} MB/s (cold)")
