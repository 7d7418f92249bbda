"""What the native kernel tests need of ``refengine.kernels.cpu`` beyond its API: forgetting, as a
new process would, the libraries ``load`` built and loaded in this one (``load`` is memoized per
process, so a test that changes the compiler or the cache directory must clear the memo)."""

from __future__ import annotations

from refengine.kernels import cpu


def forget_loaded_kernels() -> None:
    """The next ``cpu.load`` looks for, checks and (if needed) builds the library again."""
    cpu._load.cache_clear()
