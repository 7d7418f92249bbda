"""Native CPU kernels: C sources compiled on first use with the machine's C compiler.

A kernel is built once per (source, compiler, flags, CPU) into the refengine cache
(``<cache>/kernels/<key>/``) and loaded with ctypes; ``-march=native`` is why the
CPU is part of the key: the macros the compiler predefines for it (``__AVX512BF16__``,
``__ARM_FEATURE_SVE``...) and the CPU's own description. When no compiler is found, it does
not answer in time or the build fails, the loader returns ``None`` with the reason, and callers
fall back to the torch reference; ``KernelConfig.native_cpu_kernels`` = False
(``--no-native-kernels``) skips the build.

A library is loaded only when its SHA-256 matches the one its build wrote beside it
(``lib<name>.so.sha256``), else it is built again: a truncated file (a crash soon after the
build, a cut-off copy of the cache) killed every later process with SIGBUS inside ``dlopen``,
which Python cannot catch, and an empty one disabled the kernels for good (found by review).
Nor is one loaded that another user could have replaced (``_untrusted``): where the cache's
directories or files are owned by neither this user nor root, or are root's and writable by others,
the kernels are off and the reason says which path; where they are this user's and writable by
others, they are closed and the library is built again.

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
import stat
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
PROBE_TIMEOUT_SECONDS = 20  # asking the compiler its version and target: a broken CC must not hang start-up


@dataclass(frozen=True)
class KernelLibrary:
    library: ctypes.CDLL | None
    reason: str  # why it is unavailable; "" when loaded


def _cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    # x86: model name, flags; aarch64 has neither (found by review: every ARM CPU had one key).
    prefixes = ("model name", "flags", "Features", "CPU implementer", "CPU part", "CPU architecture")
    lines = [line for line in text.splitlines() if line.startswith(prefixes)]
    return "\n".join(sorted(set(lines)))


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _ask(command: list[str]) -> str:
    """A compiler's answer (stdout); raises ``OSError``/``SubprocessError`` when it has none in time."""
    return subprocess.run(command, capture_output=True, text=True, check=False, timeout=PROBE_TIMEOUT_SECONDS).stdout


def _key(compiler: str, name: str) -> str:
    """The build's cache key: sources, flags, the compiler, and what ``-march=native`` targets here."""
    # The source and every header beside it (``#include "x.h"``): a changed header rebuilds.
    source = (SOURCE_DIR / f"{name}.c").read_bytes() + b"".join(p.read_bytes() for p in sorted(SOURCE_DIR.glob("*.h")))
    version = _ask([compiler, "--version"]).partition("\n")[0] or compiler
    target = _ask([compiler, *COMPILE_FLAGS, "-dM", "-E", "-x", "c", os.devnull])
    parts = [source, " ".join(COMPILE_FLAGS + LINK_FLAGS).encode(), version.encode(), target.encode(),
             _cpu_signature().encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _digest_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _untrusted(library: Path) -> str:
    """Why another user could have replaced ``library``, "" when no one could now. Loading a library
    runs its code in this process, and the digest guards against damage, not against a writer who
    rewrites both (found by review: a cache in a shared, world-writable directory).

    Its directories, itself and its digest must be owned by this user or root and writable by
    neither group nor others. Paths of this user's that are (an older build under umask 002) are
    closed, and the library is deleted, so it is built again rather than trusted."""
    closed = False
    for path in (library.parent.parent, library.parent, library, _digest_path(library)):
        try:
            info = path.stat()
        except FileNotFoundError:
            continue  # built here, by this user, with the modes ``_build`` sets
        if info.st_uid not in (os.getuid(), 0):
            return f"{path} is owned by uid {info.st_uid}, neither this user nor root"
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            if info.st_uid != os.getuid():
                return f"{path} is writable by other users (mode {stat.S_IMODE(info.st_mode):o})"
            os.chmod(path, stat.S_IMODE(info.st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))
            closed = True
    if closed:
        library.unlink(missing_ok=True)
    return ""


def _intact(library: Path) -> bool:
    """Whether ``library`` is the file its build wrote (checked before ``dlopen``, see above)."""
    try:
        return _digest_path(library).read_text().strip() == hashlib.sha256(library.read_bytes()).hexdigest()
    except OSError:
        return False


DISABLED = KernelLibrary(None, "disabled by --no-native-kernels (KernelConfig.native_cpu_kernels)")


def load(name: str, enabled: bool = True) -> KernelLibrary:
    """Build (if needed) and load ``<name>.c`` from this package; ``enabled`` is
    ``KernelConfig.native_cpu_kernels`` (False: nothing is built, callers fall back).
    Memoized per process: each library is looked for, built and loaded once."""
    if not enabled:
        return DISABLED
    return _load(name)


@functools.cache
def _load(name: str) -> KernelLibrary:
    compiler = _compiler()
    if compiler is None:
        return KernelLibrary(None, "no C compiler found (set CC, or install gcc)")
    try:
        target = default_cache_dir() / "kernels" / _key(compiler, name) / f"lib{name}.so"
        if problem := _untrusted(target):
            return KernelLibrary(None, f"not loading lib{name}.so: {problem}")
        if not _intact(target):
            error = _build(compiler, SOURCE_DIR / f"{name}.c", target)
            if error:
                return KernelLibrary(None, error)
        return KernelLibrary(ctypes.CDLL(str(target)), "")
    except (OSError, subprocess.SubprocessError) as exc:  # an unwritable cache, a broken compiler, a bad library
        return KernelLibrary(None, f"could not build or load lib{name}.so with {compiler}: {exc}")


def _build(compiler: str, source: Path, target: Path) -> str:
    """Compile and link ``source`` into ``target``; returns the error, "" on success.
    Builds under a temporary name and renames, as concurrent processes may race here."""
    target.parent.parent.parent.mkdir(parents=True, exist_ok=True)  # the cache root: not ours to judge
    for directory in (target.parent.parent, target.parent):  # not writable by others, whatever the umask
        directory.mkdir(mode=0o755, exist_ok=True)
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
        _write_durably(Path(tmp + ".sha256"), hashlib.sha256(Path(tmp).read_bytes()).hexdigest().encode())
        _sync(tmp)
        os.replace(tmp + ".sha256", _digest_path(target))
        os.replace(tmp, target)  # last: a library whose digest is not there yet is only rebuilt
        _sync(str(target.parent))
        return ""
    finally:
        for path in (tmp, obj, tmp + ".sha256"):
            if os.path.exists(path):
                os.unlink(path)


def _write_durably(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    os.chmod(path, 0o644)  # readable by a shared cache's users, writable by none of them
    _sync(str(path))


def _sync(path: str) -> None:
    """Flush ``path`` (a file or a directory) to disk, so a rename never outlives its content."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
