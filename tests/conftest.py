"""Suite-wide fixtures.

``release_module_memory``: after each test module, the memory its fixtures freed goes back to
the operating system (a full collection, then glibc's ``malloc_trim``). The servers the later
modules start need that memory: on the 2-core VM the suite runs on, memory beyond what was
recently in use faults in at ~100-170 MB/s (touching 1 GiB took 0.7 s, and 6-10 s while another
process held 5 GB), and three ``refengine serve`` processes took 23 s to be READY beside a
process holding 5 GB, against 9.4 s without. After the golden modules the pytest process held
4.5 GB without this fixture and 2.55 GB with it (2026-12-04).

``intra_op_threads``: a test marked ``threads(n)`` runs with ``n`` intra-op threads
(``torch.set_num_threads``, which the native kernels' OpenMP regions follow), whatever the
process's default. ``scripts/dev.sh test`` runs two pytest workers of one thread each (two
workers of two threads spent their time spinning in each other's way: 934 s against 863 s
serial, and 543 s with one thread each, 2026-12-05). The native kernels split their work
between threads, so their modules are marked ``threads(2)``: their thread-split paths and the
one-thread-against-many comparisons still run under that setting.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from collections.abc import Iterator

import pytest

_LIBC = ctypes.util.find_library("c")
_malloc_trim = getattr(ctypes.CDLL(_LIBC), "malloc_trim", None) if _LIBC else None  # glibc only


@pytest.fixture(scope="module", autouse=True)
def release_module_memory() -> Iterator[None]:
    """Set up before the module's other fixtures, so torn down after them: collect, then trim."""
    yield
    gc.collect()
    if _malloc_trim is not None:
        _malloc_trim(0)


@pytest.fixture(autouse=True)
def intra_op_threads(request: pytest.FixtureRequest) -> Iterator[None]:
    marker = request.node.get_closest_marker("threads")
    if marker is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(marker.args[0])
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def toy_address() -> Iterator[str]:
    """The toy OpenEngine server (tests/conformance/fake_server.py) without faults, for one
    module (imported here, not at the top: most modules never start it)."""
    from tests.conformance.fake_server import serve

    server, address, engine = serve()
    yield address
    server.stop(0)
    engine.running = False
