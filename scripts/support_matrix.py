"""Regenerate docs/support-matrix.md from the conformance runs of the test suite.

Runs the tests that run the suite against refengine (tests/support_matrix.py lists them as
columns) with REFENGINE_SUPPORT_MATRIX_OUT set, so each result is recorded instead of being
compared with the page, then renders the page. A few minutes on 2 cores::

    python scripts/support_matrix.py            # writes docs/support-matrix.md
    python scripts/support_matrix.py --check    # exit 1 if the page would change
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from refengine.conformance.matrix import render  # noqa: E402
from tests.support_matrix import COLUMNS, OUT_ENV, PAGE, PREAMBLE, TITLE  # noqa: E402

TESTS = ["tests/conformance/test_conformance.py::test_rule", "tests/conformance/test_conformance.py::"
         "test_rule_lora_disabled", "tests/integration/test_media_grpc.py::test_conformance_media_checks_pass",
         "tests/integration/test_disagg_grpc.py::test_conformance_section_k_passes_on_the_pair",
         "tests/integration/test_encoder_conformance.py"]


def collect() -> dict[tuple[str, str], str]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.jsonl"
        env = {**os.environ, OUT_ENV: str(out), "HF_HUB_OFFLINE": "1"}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS], cwd=REPO,
                              env=env)
        if proc.returncode != 0:
            sys.exit(f"the conformance runs failed (pytest exit {proc.returncode}): the page is not written")
        rows = [json.loads(line) for line in out.read_text().splitlines()]
    return {(r["column"], r["check"]): r["status"] for r in rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if the page would change")
    args = parser.parse_args()
    page = render(TITLE, PREAMBLE, COLUMNS, collect())
    if args.check:
        current = PAGE.read_text() if PAGE.is_file() else ""
        print("docs/support-matrix.md is current" if current == page else "docs/support-matrix.md is stale")
        return 0 if current == page else 1
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
