"""The rule ids a rules page defines, so the tests can hold the registered checks to them
(every rule has a check, every check names a defined rule)."""

from __future__ import annotations

import re

#: Sections of the registry that are draft profiles (docs/profiles/README.md), not RULES.md: each
#: names its page, where its rules are written ``- **ENC1** ...``.
PROFILE_PAGES: dict[str, str] = {"ENC": "docs/profiles/encoder.md"}


def rules_in(markdown: str, sections: str) -> list[str]:
    """Rule ids defined in a RULES.md text (lines ``- G14 ...``) for the given sections."""
    found = re.findall(r"^- ([A-Z]\d+)\b", markdown, flags=re.MULTILINE)
    return [r for r in found if r[0] in sections]


def profile_rules_in(markdown: str, section: str) -> list[str]:
    """Rule ids a draft profile's page defines (lines ``- **ENC3** ...``) for ``section`` (``ENC``)."""
    return re.findall(rf"^- \*\*({re.escape(section)}\d+)\*\*", markdown, flags=re.MULTILINE)
