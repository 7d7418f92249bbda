"""Where the Triton kernel tests run: on CUDA when there is a GPU (compiled, in the test's
process), otherwise on the CPU under Triton's interpreter, in fp32/fp16 (its bf16 arithmetic
is wrong). The interpreter cannot be switched on inside a process: ``TRITON_INTERPRET`` is read
when a function is decorated with ``triton.jit``, and ``import triton`` already decorates
``triton.language``'s own helpers, so it must be set before anything imports Triton, and leaving
it set would turn every later Triton kernel of the session into an interpreted one. So each
kernel test file has one test, ``test_kernels_on_the_interpreter``, that runs the file again in a
subprocess with ``TRITON_INTERPRET=1`` (``run_interpreted``), where its kernel tests run."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = None if not HAS_TRITON else "cpu" if INTERPRET else "cuda" if torch.cuda.is_available() else None
requires_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (the CUDA kernels' dependency)")
kernel_test = pytest.mark.skipif(
    DEVICE is None, reason="no Triton device here: test_kernels_on_the_interpreter runs these in a subprocess")
in_a_subprocess = pytest.mark.skipif(DEVICE is not None, reason="the kernel tests run in this process")


def run_interpreted(test_file: str) -> None:
    """Run ``test_file`` under ``TRITON_INTERPRET=1``; fails unless its tests pass there."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", test_file]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"interpreter run failed\n{result.stdout[-8000:]}\n{result.stderr[-2000:]}"
    assert " passed" in result.stdout and " failed" not in result.stdout, result.stdout[-4000:]
