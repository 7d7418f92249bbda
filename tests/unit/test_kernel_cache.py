"""The native kernel cache (``refengine.kernels.cpu``) under damage and misconfiguration, each
found by review: a truncated cached library killed every later process with SIGBUS inside
``dlopen`` and an empty one disabled the kernels for good (both are now rebuilt: a library loads
only when it matches the digest its build wrote); aarch64 CPUs all had one cache key; a broken
``CC`` raised out of ``load`` or hung it instead of falling back."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from refengine.kernels import cpu
from tests.unit.kernel_helpers import forget_loaded_kernels

NEEDS_CC = pytest.mark.skipif(cpu._compiler() is None, reason="needs a C compiler to build the kernels")
LOAD_IN_A_NEW_PROCESS = ("from refengine.kernels import cpu; loaded = cpu.load('fused_ops'); "
                         "print(loaded.library is not None, loaded.reason)")


@pytest.fixture
def fresh_loader(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("REFENGINE_CACHE_DIR", str(tmp_path / "cache"))
    forget_loaded_kernels()
    yield tmp_path / "cache"
    forget_loaded_kernels()


@NEEDS_CC
@pytest.mark.parametrize("kept", [0.5, 0.0], ids=["half-written", "empty"])
def test_a_damaged_cached_library_is_rebuilt(fresh_loader: Path, kept: float) -> None:
    path = Path(cpu.load("fused_ops").library._name)
    good = path.read_bytes()
    os.truncate(path, int(len(good) * kept))
    result = subprocess.run([sys.executable, "-c", LOAD_IN_A_NEW_PROCESS], capture_output=True, text=True,
                            env=dict(os.environ), timeout=120)
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-300:]}"
    assert result.stdout.startswith("True"), result.stdout
    assert len(path.read_bytes()) == len(good)


def _script(directory: Path, name: str, body: str) -> Path:
    path = directory / name
    path.write_text(body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_a_compiler_that_cannot_run_is_a_reason(fresh_loader: Path, monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    monkeypatch.setenv("CC", str(_script(tmp_path, "not-a-program", "\x7fELF garbage")))
    loaded = cpu.load("fused_ops")
    assert loaded.library is None and "could not build or load" in loaded.reason


def test_a_compiler_that_hangs_is_a_reason(fresh_loader: Path, monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    monkeypatch.setattr(cpu, "PROBE_TIMEOUT_SECONDS", 0.5)
    monkeypatch.setenv("CC", str(_script(tmp_path, "slow-cc", "#!/bin/sh\nsleep 30\n")))
    loaded = cpu.load("fused_ops")
    assert loaded.library is None and "timed out" in loaded.reason


ARM_CPUINFO = {
    "graviton2": "processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 "
                 "atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs\nCPU implementer\t: 0x41\n"
                 "CPU architecture: 8\nCPU part\t: 0xd0c\n",
    "graviton3": "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 "
                 "atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve "
                 "asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng\n"
                 "CPU implementer\t: 0x41\nCPU architecture: 8\nCPU part\t: 0xd40\n",
}


def test_arm_cpus_have_signatures_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    real = Path.read_text
    signatures = {}
    for name, text in ARM_CPUINFO.items():
        monkeypatch.setattr(Path, "read_text", lambda self, *a, _t=text, **k: _t if str(self) == "/proc/cpuinfo"
                            else real(self, *a, **k))
        signatures[name] = cpu._cpu_signature()
    assert signatures["graviton2"] and signatures["graviton2"] != signatures["graviton3"]
    assert "svebf16" in signatures["graviton3"]


def _cache_paths(library: Path) -> dict[str, Path]:
    return {"kernels directory": library.parent.parent, "key directory": library.parent, "library": library,
            "digest": library.with_name(library.name + ".sha256")}


@NEEDS_CC
@pytest.mark.parametrize("writable", ["kernels directory", "key directory", "library", "digest"])
def test_a_library_others_could_have_replaced_is_built_again_and_closed(fresh_loader: Path, writable: str) -> None:
    """Found by review: a cache in a shared, world-writable directory let another user plant a
    library (and its digest) that every later process loaded and ran. This user's own paths that
    others could write are closed, and the library is built again rather than trusted."""
    library = Path(cpu.load("fused_ops").library._name)
    path = _cache_paths(library)[writable]
    path.chmod(stat.S_IMODE(path.stat().st_mode) | stat.S_IWOTH | stat.S_IWGRP)
    planted = library.stat().st_ino
    forget_loaded_kernels()
    assert cpu.load("fused_ops").library is not None
    assert library.stat().st_ino != planted, "the library others could have written was loaded"
    for each in _cache_paths(library).values():
        assert each.stat().st_mode & 0o022 == 0, f"{each} is still writable by others"


@NEEDS_CC
@pytest.mark.parametrize("writable", ["kernels directory", "library"])
def test_root_s_library_others_could_replace_is_not_loaded_by_another_user(
        fresh_loader: Path, writable: str, monkeypatch: pytest.MonkeyPatch) -> None:
    library = Path(cpu.load("fused_ops").library._name)
    path = _cache_paths(library)[writable]
    path.chmod(stat.S_IMODE(path.stat().st_mode) | stat.S_IWOTH)
    monkeypatch.setattr(os, "getuid", lambda: os.stat(path).st_uid + 4321)  # someone else: root or not
    forget_loaded_kernels()
    loaded = cpu.load("fused_ops")
    assert loaded.library is None
    if os.stat(path).st_uid == 0:  # root's, trusted, but open: refused, naming the open path
        assert f"{path} is writable by other users" in loaded.reason
    else:  # run as a user: the cache is now another user's
        assert "owned by uid" in loaded.reason


@NEEDS_CC
@pytest.mark.skipif(os.geteuid() != 0, reason="handing a file to another user needs root")
def test_a_library_owned_by_another_user_is_not_loaded(fresh_loader: Path) -> None:
    library = Path(cpu.load("fused_ops").library._name)
    os.chown(library, 4321, -1)
    forget_loaded_kernels()
    loaded = cpu.load("fused_ops")
    assert loaded.library is None and "owned by uid 4321" in loaded.reason


@NEEDS_CC
def test_the_cache_is_built_closed_to_others_under_any_umask(fresh_loader: Path) -> None:
    previous = os.umask(0)
    try:
        loaded = cpu.load("fused_ops")
    finally:
        os.umask(previous)
    library = Path(loaded.library._name)
    for path in _cache_paths(library).values():
        assert path.stat().st_mode & 0o022 == 0, f"{path} is writable by others"
