"""Process-wide settings, applied by entry points (``refengine serve``, ``refengine
generate``), never by the engine: a library that reconfigures its host process on
construction surprises whoever embeds it (a test suite, a benchmark, a second engine).
"""

from __future__ import annotations

from refengine.config import EngineConfig


def apply_process_settings(config: EngineConfig) -> None:
    """Set torch's intra-op thread count when ``config.num_threads`` is given (the native
    kernels share that OpenMP pool). No global seed: the sampler seeds its own shared
    generator from ``config.seed``. torch is imported only when there is something to
    set, so the server's startup path imports no torch when ``--num-threads`` is absent."""
    if config.num_threads is None:
        return
    import torch

    torch.set_num_threads(config.num_threads)
