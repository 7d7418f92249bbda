"""The project stays ruff clean (pyproject.toml's ``[tool.ruff]``): checked with the suite, so a
lint error fails CI like a failing test (found when a docstring line past 120 columns landed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing() -> None:
    pytest.importorskip("ruff", reason="ruff is in the test extra; install it to lint")
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "refengine", "tests", "benchmarks", "scripts"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-1000:]
