"""Raw NIXL READ bandwidth between two processes on this machine: the ceiling the NIXL KV
transfer backend (``refengine.kv.transfer.nixl_backend``) can reach, without its per-block
descriptors, validation or notification.

A spawned child registers one buffer of ``num_bytes`` (DRAM, UCX backend) and hands its
agent metadata and address over a Pipe; this process registers its own buffer and READs the
whole buffer as one descriptor. One untimed READ first (it opens the UCX connection), then the
best of ``repeats`` timed READs (post until ``check_xfer_state`` says DONE). MB/s = 1e6 bytes/s.
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


def raw_loopback_mb_per_s(num_bytes: int, repeats: int = 3) -> float:
    """Best-of-``repeats`` NIXL READ bandwidth of one ``num_bytes`` buffer from a second
    process on this machine, in MB/s (1e6 bytes/s)."""
    context = multiprocessing.get_context("spawn")
    mine, theirs = context.Pipe()
    child = context.Process(target=_source, args=(theirs, num_bytes), daemon=True)
    child.start()
    try:
        metadata, address, head = mine.recv()
        agent = _agent("nixl-raw-reader")
        buffer = np.zeros(num_bytes, dtype=np.uint8)
        registered = agent.register_memory([(buffer.ctypes.data, num_bytes, 0, "")], "DRAM")
        agent.add_remote_agent(metadata)
        local = agent.get_xfer_descs([(buffer.ctypes.data, num_bytes, 0)], "DRAM")
        remote = agent.get_xfer_descs([(address, num_bytes, 0)], "DRAM")
        _read_seconds(agent, local, remote)  # opens the connection: not timed
        best = min(_read_seconds(agent, local, remote) for _ in range(repeats))
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
        print(f"{size // MiB:>3} MiB: {raw_loopback_mb_per_s(size):8.0f} MB/s")
