"""An adapter's files are read from inside a LoRA root even when the disk changes under the load.

The registry checks ``source_path`` by its resolved path, then reads the files. Anyone who can
write inside a root could swap a directory or a file for a symlink leading out of it between the
two; the adapter's directory is therefore opened once from the root, one component at a time,
never following a symlink, and its files relative to it (``refengine/lora/confined.py``). The
swaps below happen in each window: after the registry's checks, before the read (with files
opened by path, those tests load the outside files and fail); inside ``open_confined``, after a
path is resolved, before the walk opens it; and between the config's read and the weights'
(both must come from the directory opened first).
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from refengine.lora import peft
from refengine.lora.confined import ConfinedDirectory, NotConfinedError, open_confined
from refengine.lora.peft import read_peft_adapter
from refengine.lora.registry import LoraRegistry
from refengine.types import InvalidRequestError, LoraAdapterSpec
from tests.unit.test_lora_engine import adapters, make_engine, tiny  # noqa: F401 - fixtures

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture
def layout(adapters, tmp_path: Path) -> tuple[Path, Path, Path]:  # noqa: F811 - the fixture imported above
    """(root, an adapter directory inside it, a copy of that adapter outside every root)."""
    shared_root, _ = adapters
    tmp_path = Path(os.path.realpath(tmp_path))  # roots are compared as real paths
    root, outside = tmp_path / "root", tmp_path / "outside"
    shutil.copytree(shared_root / "attn4", root / "attn4")
    shutil.copytree(shared_root / "attn4", outside)
    return root, root / "attn4", outside


def swap_after_the_checks(monkeypatch: pytest.MonkeyPatch, swap: Callable[[], None]) -> None:
    """Run ``swap`` right after the registry's last path check, before any file is read."""
    checked = LoraRegistry._confine_entries

    def check_then_swap(self: LoraRegistry, resolved: str) -> None:
        checked(self, resolved)
        swap()
    monkeypatch.setattr(LoraRegistry, "_confine_entries", check_then_swap)


def test_a_directory_swapped_for_a_symlink_after_the_check_is_not_followed(
        tiny, layout, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    root, adapter, outside = layout
    engine = make_engine(tiny, root)

    def swap() -> None:
        adapter.rename(root / "moved-away")
        adapter.symlink_to(outside, target_is_directory=True)
    swap_after_the_checks(monkeypatch, swap)
    with pytest.raises(InvalidRequestError, match="directory cannot be opened: .*not inside an allowed LoRA root"):
        engine.load_lora(LoraAdapterSpec(1, "attn4", str(adapter)))
    assert engine.list_loras() == []


def test_a_weight_file_swapped_for_a_symlink_after_the_check_is_not_followed(
        tiny, layout, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    root, adapter, outside = layout
    engine = make_engine(tiny, root)

    def swap() -> None:
        (adapter / WEIGHTS).unlink()
        (adapter / WEIGHTS).symlink_to(outside / WEIGHTS)
    swap_after_the_checks(monkeypatch, swap)
    with pytest.raises(InvalidRequestError, match=f"{WEIGHTS} cannot be read: .*not inside an allowed LoRA root"):
        engine.load_lora(LoraAdapterSpec(1, "attn4", str(adapter)))
    assert engine.list_loras() == []


def test_the_config_and_the_weights_come_from_the_directory_that_was_opened(
        tiny, adapters, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Another adapter moved into the path between the two reads is not mixed in: both files
    are opened relative to the directory opened first (before, the weights came by path)."""
    shared_root, _ = adapters
    root = Path(os.path.realpath(tmp_path)) / "root"
    shutil.copytree(shared_root / "attn4", root / "adapter")
    shutil.copytree(shared_root / "all8", root / "other")
    model, roots = tiny[1], [str(root)]
    expected = read_peft_adapter(root / "adapter", model, 16, roots).fingerprint
    assert read_peft_adapter(root / "other", model, 16, roots).fingerprint != expected
    monkeypatch.setattr(peft, "_read_bytes", swapping_after_the_config(root))
    assert read_peft_adapter(root / "adapter", model, 16, roots).fingerprint == expected
    assert (root / "moved-away").is_dir(), "the swap did not happen"


def swapping_after_the_config(root: Path) -> Callable[..., bytes]:
    """``peft._read_bytes`` that, once the config is read, moves ``root/adapter`` away and
    ``root/other`` into its place."""
    read_bytes = peft._read_bytes

    def read_then_swap(path: Path, directory, name: str, *args: object) -> bytes:  # noqa: ANN001
        data = read_bytes(path, directory, name, *args)
        if name == peft.CONFIG_FILE:
            (root / "adapter").rename(root / "moved-away")
            (root / "other").rename(root / "adapter")
        return data
    return read_then_swap


def test_a_symlinked_file_is_not_read_once_the_directory_moved(
        tiny, adapters, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """A symlinked weight file is opened by its resolved path, so only while the directory's path
    still names the directory that was opened: after the same swap, the load is refused."""
    shared_root, _ = adapters
    root = Path(os.path.realpath(tmp_path)) / "root"
    shutil.copytree(shared_root / "attn4", root / "adapter")
    shutil.copytree(shared_root / "all8", root / "other")
    (root / "store").mkdir()
    (root / "adapter" / WEIGHTS).rename(root / "store" / WEIGHTS)
    (root / "adapter" / WEIGHTS).symlink_to(root / "store" / WEIGHTS)
    monkeypatch.setattr(peft, "_read_bytes", swapping_after_the_config(root))
    with pytest.raises(InvalidRequestError, match=f"{WEIGHTS} cannot be read: .*no longer the directory"):
        read_peft_adapter(root / "adapter", tiny[1], 16, [str(root)])


def test_symlinks_that_stay_inside_a_root_still_load(tiny, layout) -> None:  # noqa: F811
    """As before the walk: a symlinked directory or file whose target is inside a root is allowed."""
    root, adapter, _ = layout
    (root / "store").mkdir()
    (adapter / WEIGHTS).rename(root / "store" / WEIGHTS)
    (adapter / WEIGHTS).symlink_to(root / "store" / WEIGHTS)
    (root / "alias").symlink_to(adapter, target_is_directory=True)
    engine = make_engine(tiny, root)
    loaded, already = engine.load_lora(LoraAdapterSpec(1, "attn4", str(root / "alias")))
    assert not already and [s.lora_name for s in engine.list_loras()] == ["attn4"]


@pytest.mark.timeout(20)  # opened without O_NONBLOCK, the FIFO would block until a writer came
def test_only_regular_files_inside_a_root_are_opened(tmp_path: Path) -> None:
    tmp_path = Path(os.path.realpath(tmp_path))
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.write_bytes(b"secret")
    (root / "data").write_bytes(b"adapter")
    os.mkfifo(root / "pipe")  # opening it for reading without O_NONBLOCK would wait for a writer forever
    (root / "sub").mkdir()
    with open_confined([str(root)], root / "data") as stream:
        assert stream.read() == b"adapter" and os.get_blocking(stream.fileno())
    for path, message in ((root / "pipe", "not a regular file"), (root / "sub", "not a regular file"),
                          (elsewhere, "not inside an allowed"), (root, "a LoRA root itself")):
        with pytest.raises(NotConfinedError, match=message):
            open_confined([str(root)], path)
    with pytest.raises(FileNotFoundError):
        open_confined([str(root)], root / "missing")
    with ConfinedDirectory([str(root)], root) as directory:
        for name in ("..", "sub/data", str(elsewhere), ""):
            with pytest.raises(ValueError, match="not one file name"):
                directory.open(name)


@pytest.mark.parametrize("swapped", ["directory", "file", "opened directory"])
def test_a_swap_after_the_path_is_resolved_fails_the_walk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         swapped: str) -> None:
    tmp_path = Path(os.path.realpath(tmp_path))
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "adapter").mkdir(parents=True)
    outside.mkdir()
    for directory in (root / "adapter", outside):
        (directory / "data").write_bytes(b"inside" if directory.parent == root else b"secret")
    resolve = os.path.realpath

    def resolve_then_swap(path: str | os.PathLike[str]) -> str:
        resolved = resolve(path)
        if swapped != "file":
            (root / "adapter").rename(root / "moved-away")
            (root / "adapter").symlink_to(outside, target_is_directory=True)
        else:
            (root / "adapter" / "data").unlink()
            (root / "adapter" / "data").symlink_to(outside / "data")
        return resolved
    monkeypatch.setattr(os.path, "realpath", resolve_then_swap)
    with pytest.raises(OSError) as raised:
        if swapped == "opened directory":  # the adapter directory itself, its last component
            ConfinedDirectory([str(root)], root / "adapter")
        else:
            open_confined([str(root)], root / "adapter" / "data")
    # O_NOFOLLOW: ELOOP for a symlinked file; with O_DIRECTORY too, Linux says ENOTDIR (macOS ELOOP)
    expected = {errno.ELOOP} if swapped == "file" else {errno.ENOTDIR, errno.ELOOP}
    assert raised.value.errno in expected, raised.value
