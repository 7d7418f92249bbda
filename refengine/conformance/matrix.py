"""A published support matrix: several runs side by side, one column per run.

A column is one configuration the suite ran against (a target, the named targets and
options it was given); a cell is a check's status in that run, or ``·`` when that run did not
include the check. :func:`render` writes the profile table (from :data:`PROFILES`) and then,
profile by profile, a table of checks × columns; tests/support_matrix.py reads the cells back, so
a test can hold a live run to the published page. Statuses only, never messages or timings: the page
is the same for every run of the same engine build.
"""

from __future__ import annotations

from refengine.conformance.profiles import PROFILES, profile_of
from refengine.conformance.registry import Check, all_checks

NOT_RUN = "·"
Cells = dict[tuple[str, str], str]  # (column, check name) -> status value


def profile_table() -> str:
    """The profiles and their members, as the code groups them (profiles.PROFILES)."""
    rows = ["| profile | what it covers | members | claimed when |", "|---|---|---|---|"]
    for p in PROFILES:
        members = ", ".join(f"`{m}`" for m in p.members)
        rows.append(f"| {p.name}{' (draft)' if p.draft else ''} | {p.title} | {members} | {p.claimed_when} |")
    return "\n".join(rows)


def check_tables(columns: dict[str, str], cells: Cells, checks: list[Check] | None = None) -> str:
    """Per profile, one row per check: its rule, its name and its status in each column."""
    checks = checks if checks is not None else all_checks()
    names = list(columns)
    out: list[str] = []
    for p in PROFILES:
        mine = [c for c in checks if profile_of(c).name == p.name]
        if not mine:
            continue
        out += [f"### {p.name}", "", "| rule | check | " + " | ".join(names) + " |",
                "|---|---|" + "---|" * len(names)]
        out += [f"| {c.rule} | `{c.name}` | " + " | ".join(cells.get((col, c.name), NOT_RUN) for col in names) + " |"
                for c in mine]
        out.append("")
    return "\n".join(out)


def column_table(columns: dict[str, str]) -> str:
    rows = ["| column | the run |", "|---|---|"]
    return "\n".join(rows + [f"| {name} | {what} |" for name, what in columns.items()])


def render(title: str, preamble: str, columns: dict[str, str], cells: Cells) -> str:
    return "\n\n".join([f"# {title}", preamble.strip(), "## Profiles", profile_table(), "## Runs",
                        column_table(columns), "## Checks", check_tables(columns, cells)]).rstrip() + "\n"
