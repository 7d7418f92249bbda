"""The device check (``model/devices.py``), found by review on 2026-12-06 with no GPU lent:

- ``--device cuda`` failed on every machine, GPUs included: the runner made its device current
  with ``torch.cuda.set_device(torch.device("cuda"))``, which torch refuses for a device
  without an index ("Expected a torch.device with a specified index"). ``cuda`` now becomes
  ``cuda:N`` (N the building thread's current GPU) before anything uses it.
- on a machine without CUDA that same torch message was all a user saw, after the weights
  loaded; a KV budget larger than the machine's memory ended in ``OSError: [Errno 12]``, or in
  the kernel killing the process while the zeroing pass faulted the pages in.

No GPU here: CUDA's presence is faked where a test needs it, and the fake ``set_device``
refuses an index-less device as torch does."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from refengine.model import devices
from refengine.model.devices import check_kv_cache_fits, resolve_device
from tests.unit.test_cli_usage_errors import ENV


def fake_cuda(monkeypatch: pytest.MonkeyPatch, count: int, current: int) -> list[torch.device]:
    made_current: list[torch.device] = []

    def set_device(device: str | torch.device) -> None:
        device = torch.device(device)
        if device.index is None:  # what torch.cuda.set_device does
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        made_current.append(device)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    return made_current


def test_cuda_without_an_index_names_the_current_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    made_current = fake_cuda(monkeypatch, count=2, current=1)
    assert resolve_device("cuda") == "cuda:1"
    assert resolve_device("cuda:0") == "cuda:0"
    assert resolve_device("cpu") == "cpu"
    torch.cuda.set_device(resolve_device("cuda"))  # what ModelRunner.use_device does with it
    assert made_current == [torch.device("cuda:1")]


def test_a_gpu_this_machine_lacks_is_refused_naming_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, count=2, current=0)
    with pytest.raises(ValueError, match=r"--device cuda:2: this machine has 2 GPU\(s\), cuda:0 to cuda:1"):
        resolve_device("cuda:2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device cuda: CUDA is not available on this machine"):
        resolve_device("cuda")


def test_a_kv_cache_larger_than_the_free_memory_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "available_bytes", lambda device: 8 << 30)
    check_kv_cache_fits(8 << 30, 1024, "cpu")
    with pytest.raises(ValueError, match=r"1025 blocks needs 8\.01 GiB, but cpu has 8\.00 GiB available; "
                                         r"lower --kv-memory-mib or --num-kv-blocks"):
        check_kv_cache_fits((8 << 30) + (8 << 20), 1025, "cpu")
    monkeypatch.setattr(devices, "available_bytes", lambda device: None)
    check_kv_cache_fits(1 << 60, 1, "cpu")  # the system does not say: nothing to check against


def test_the_host_reports_its_available_memory() -> None:
    available = devices.available_bytes("cpu")
    assert available is not None and 0 < available <= 1 << 50


def run_serve(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "refengine.cli", "serve", "--host", "127.0.0.1", "--port", "0",
                           *flags], capture_output=True, text=True, timeout=180, env=ENV)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_serve_on_a_missing_gpu_says_so_and_exits_1() -> None:
    result = run_serve("--device", "cuda")
    assert result.returncode == 1, result.stderr[-800:]
    assert "--device cuda: CUDA is not available on this machine" in result.stderr, result.stderr[-800:]
    assert "specified index" not in result.stderr and "Traceback" not in result.stderr


def test_serve_with_a_kv_budget_past_the_machine_says_so_and_exits_1() -> None:
    result = run_serve("--kv-memory-mib", str(1 << 40))  # 1 EiB
    assert result.returncode == 1, result.stderr[-800:]
    assert "available; lower --kv-memory-mib or --num-kv-blocks" in result.stderr, result.stderr[-800:]
    assert "Errno 12" not in result.stderr and "Traceback" not in result.stderr


def test_torchs_unused_gpu_cache_counts_as_available(monkeypatch: pytest.MonkeyPatch) -> None:
    """What torch's allocator reserved and no tensor uses (an earlier runner's) is reused without a
    cudaMalloc, so it counts (found by review: a second runner in one process was refused)."""
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 42 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 2 * gib)
    assert devices.available_bytes("cuda:0") == 70 * gib
    check_kv_cache_fits(40 * gib, 1000, "cuda:0")


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_nixl_never_registers_a_gpu_kv_cache(monkeypatch: pytest.MonkeyPatch, role: str) -> None:
    """refengine's NIXL backend registers its regions as host memory ("DRAM", device 0): a cache on a
    GPU must not be handed to it (found by review). A decode engine there pulls over gRPC; a
    prefill engine asked to offer NIXL is refused, naming the flag."""
    from refengine.config import EngineConfig, KvTransferConfig
    from refengine.engine import engine_kv

    class Named:
        def __init__(self, name: str) -> None:
            self.name = name

    monkeypatch.setattr(engine_kv, "nixl_available", lambda: (True, ""))
    on_gpu = EngineConfig(role=role, device="cuda:0", kv_transfer=KvTransferConfig(backend="grpc"))
    assert list(engine_kv.choose_transfer_backends(on_gpu, [Named("grpc")])) == ["grpc"]
    on_cpu = EngineConfig(role="decode", kv_transfer=KvTransferConfig(backend="grpc"))
    assert "nixl" in engine_kv.choose_transfer_backends(on_cpu, [Named("grpc")])  # the control
    offering = EngineConfig(role=role, device="cuda:0", kv_transfer=KvTransferConfig(backend="nixl"))
    with pytest.raises(ValueError, match="--kv-transfer-backend nixl: the KV cache is on cuda:0"):
        engine_kv.choose_transfer_backends(offering, [Named("grpc")])
