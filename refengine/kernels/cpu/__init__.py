"""Native CPU kernels: C sources compiled on first use with the machine's C compiler.

A kernel is built once per (source, compiler, flags, CPU) into the refengine cache
(``<cache>/kernels/<key>/``) and loaded with ctypes; ``-march=native`` is why the
CPU is part of the key. When no compiler is found or the build fails, the loader
returns ``None`` with the reason, and callers fall back to the torch reference;
``KernelConfig.native_cpu_kernels`` = False (``--no-native-kernels``) skips the build.

The library is linked with ``-fopenmp``: it asks for ``libgomp.so.1``, which torch
has already loaded, so the kernel's parallel loops share torch's OpenMP thread pool
(and its ``torch.set_num_threads`` setting) instead of starting a second one.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp before any kernel library)

from refengine.config import default_cache_dir

SOURCE_DIR = Path(__file__).parent
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11")
# Linked in a separate step without -ffast-math: a fast-math link adds crtfastmath.o,
# whose constructor sets flush-to-zero for the whole process when the library loads.
LINK_FLAGS = ("-shared", "-fopenmp")
BUILD_TIMEOUT_SECONDS = 120


@dataclass(frozen=True)
class KernelLibrary:
    library: ctypes.CDLL | None
    reason: str  # why it is unavailable; "" when loaded


def _cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _compiler_version(compiler: str) -> str:
    result = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False)
    return result.stdout.splitlines()[0] if result.stdout else compiler


DISABLED = KernelLibrary(None, "disabled by --no-native-kernels (KernelConfig.native_cpu_kernels)")


def load(name: str, enabled: bool = True) -> KernelLibrary:
    """Build (if needed) and load ``<name>.c`` from this package; ``enabled`` is
    ``KernelConfig.native_cpu_kernels`` (False: nothing is built, callers fall back).
    Memoized per process (see ``clear_cache``)."""
    if not enabled:
        return DISABLED
    return _load(name)


@functools.cache
def _load(name: str) -> KernelLibrary:
    compiler = _compiler()
    if compiler is None:
        return KernelLibrary(None, "no C compiler found (set CC, or install gcc)")
    # The source and every header beside it (``#include "x.h"``): a changed header rebuilds.
    source = (SOURCE_DIR / f"{name}.c").read_bytes() + b"".join(p.read_bytes() for p in sorted(SOURCE_DIR.glob("*.h")))
    key = hashlib.sha256(
        b"\0".join([source, " ".join(COMPILE_FLAGS + LINK_FLAGS).encode(), _compiler_version(compiler).encode(),
                    _cpu_signature().encode()])
    ).hexdigest()[:16]
    target = default_cache_dir() / "kernels" / key / f"lib{name}.so"
    try:
        if not target.exists():
            error = _build(compiler, SOURCE_DIR / f"{name}.c", target)
            if error:
                return KernelLibrary(None, error)
        return KernelLibrary(ctypes.CDLL(str(target)), "")
    except OSError as exc:  # an unwritable cache, a library that does not load
        return KernelLibrary(None, f"could not build or load {target}: {exc}")


def clear_cache() -> None:
    """Forget what ``load`` built and loaded in this process (tests that change the
    compiler or the cache directory call it; the next ``load`` looks again)."""
    _load.cache_clear()


def _build(compiler: str, source: Path, target: Path) -> str:
    """Compile and link ``source`` into ``target``; returns the error, "" on success.
    Builds under a temporary name and renames, as concurrent processes may race here."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
    os.close(fd)
    obj = tmp + ".o"
    try:
        for command in ([compiler, *COMPILE_FLAGS, "-c", str(source), "-o", obj],
                        [compiler, *LINK_FLAGS, obj, "-o", tmp, "-lm"]):
            try:
                result = subprocess.run(command, capture_output=True, text=True, check=False,
                                        timeout=BUILD_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                return f"{compiler} took over {BUILD_TIMEOUT_SECONDS} s to build {source.name}"
            if result.returncode != 0:
                return f"{compiler} failed to build {source.name}: {result.stderr.strip()[:500]}"
        # mkstemp makes the file owner-only (the link left it 0711): a shared cache needs others to read it.
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
        return ""
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)
