"""docs/support-matrix.md: its tables are the code's (profiles, registered checks, runs).

The cells are held to live runs by the tests that make them (tests/support_matrix.py); here,
without a server, the page must be exactly what rendering its own cells gives: a check added,
renamed or moved to another profile, or a profile or run changed, shows up as a difference.
"""

from __future__ import annotations

import re

from refengine.conformance import all_checks
from refengine.conformance.matrix import NOT_RUN, render
from refengine.conformance.profiles import BY_NAME, PROFILES, profile_of
from tests.support_matrix import COLUMNS, PAGE, PREAMBLE, TITLE, parse


def listed_checks(text: str) -> list[str]:
    """Check names with a row on the page (``| G14 | `G14:name` | ...``), in page order; read with a
    pattern of this test's own, not the parser's."""
    return re.findall(r"^\| [A-Z]+\d+ \| `([^`]+)` \|", text, flags=re.MULTILINE)


def test_page_is_rendered_from_the_code() -> None:
    text = PAGE.read_text()
    columns, cells = parse(text)
    assert columns == list(COLUMNS)
    assert render(TITLE, PREAMBLE, COLUMNS, cells) == text, "docs/support-matrix.md is stale: run " \
        "python scripts/support_matrix.py"


def test_page_lists_every_check_once_with_a_cell_in_some_run() -> None:
    text = PAGE.read_text()
    names = listed_checks(text)
    assert sorted(names) == sorted(c.name for c in all_checks())
    _, cells = parse(text)
    unrun = [n for n in names if not any((col, n) in cells for col in COLUMNS)]
    assert not unrun, f"checks no run of refengine includes: {unrun}"
    assert NOT_RUN not in {v for v in cells.values()}


def test_refengine_fails_nothing_and_passes_each_claimed_profile() -> None:
    _, cells = parse(PAGE.read_text())
    assert "fail" not in cells.values(), [k for k, v in cells.items() if v == "fail"]
    by_name = {c.name: c for c in all_checks()}
    passed_profiles = {profile_of(by_name[check]).name for (_, check), status in cells.items() if status == "pass"}
    assert passed_profiles == set(BY_NAME), f"profiles with no passing check in any run: " \
        f"{set(BY_NAME) - passed_profiles}"


def test_every_check_is_in_exactly_one_profile() -> None:
    for chk in all_checks():
        profile_of(chk)  # raises when two profiles claim it equally, or none does
    assert [p.name for p in PROFILES][0] == "core"
