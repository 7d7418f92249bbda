"""``benchmarks/gpu_check.py --dry-run``: the GPU check's own code, run on tiny CPU shapes so that
the script works before a lent GPU machine's scarce minutes are spent on it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
