"""``benchmarks/gpu_check.py --dry-run``: the GPU check's own code, run on tiny CPU shapes so that
the script works before a lent GPU machine's scarce minutes are spent on it."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.triton_interpreter import requires_triton

REPO = Path(__file__).resolve().parents[2]


def test_dry_run_writes_every_section(tmp_path: Path) -> None:
    out = tmp_path / "dry.json"
    result = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--out", str(out)], cwd=REPO,
                            capture_output=True, text=True, timeout=300, env={"HF_HUB_OFFLINE": "1",
                                                                               "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] and report["device"] == "cpu" and report["copy_bandwidth_gb_per_s"] > 0
    assert {row["backend"] for row in report["attention"]} >= {"torch"}
    assert all(row["decode_ms"] > 0 and row["prefill_tflops"] > 0 for row in report["attention"])
    assert [row["batch"] for row in report["decode"]] == [1, 4] and not any(r["cuda_graphs"] for r in report["decode"])
    assert all(0 < r["input_build_ms"] and 0 < r["host_issue_ms"] for r in report["decode"])
    assert "weight-read bound" in result.stdout and "host issue ms" in result.stdout


TUNING_UNDER_THE_INTERPRETER = """
import importlib.util, sys
from refengine.kernels.attention import triton_paged
triton_paged.unavailable_reason = lambda dtype, device: ""  # the interpreter stands in for CUDA
spec = importlib.util.spec_from_file_location("gpu_check", "benchmarks/gpu_check.py")
gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)  # for its dataclasses
spec.loader.exec_module(gpu_check)
timed = gpu_check.best_of
gpu_check.best_of = lambda fn, device, calls=1: timed(fn, device, repeats=1)  # the interpreter is slow: one call
rows = gpu_check.decode_tuning(gpu_check.shapes(dry_run=True), bandwidth=1e9)
assert [(r["block_n"], r["num_warps"], r["num_stages"]) for r in rows] == gpu_check.TUNING, rows
assert all(r.get("ms", 0) > 0 and r["fraction_of_copy"] > 0 for r in rows), rows
print(len(rows), "configurations")
"""


@requires_triton
def test_decode_tuning_sweep_runs_under_the_triton_interpreter() -> None:
    """The sweep's own code (every launch configuration through the Triton backend), on the
    dry run's shapes, with the interpreter standing in for the GPU it is meant for."""
    result = subprocess.run([sys.executable, "-c", TUNING_UNDER_THE_INTERPRETER], cwd=REPO, capture_output=True,
                            text=True, timeout=300, env={"HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1",
                                                         "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "18 configurations" in result.stdout


def test_failing_kernel_tests_fail_the_check(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """gpu_check exited 0 when the GPU kernel tests failed (found by review): only sections with
    an "error" key counted."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    gpu_check = importlib.import_module("gpu_check")
    monkeypatch.setattr(gpu_check, "kernel_tests", lambda dry_run: {
        "command": "pytest", "returncode": 1, "summary": "3 failed, 40 passed in 90s"})
    for section in ("attention_rates", "decode_tuning", "decode_steps"):
        monkeypatch.setattr(gpu_check, section, lambda sections, bandwidth: [])
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--dry-run", "--out", str(tmp_path / "check.json")])
    assert gpu_check.main() == 1
