"""The OpenEngine release this suite checks, and how to tell its identifiers apart.

Schema revision 1 is the release v0.1.0 of ai-dynamo/openengine: signed Git tag
``v0.1.0`` = commit b5f2bd9, published on the Buf registry as module
``buf.build/openengine/openengine`` at the immutable commit 768a93c7.... (An earlier
copy of the contract was made from commit 4def7c5, which is not the release; the
values it had and the release lacks are listed in ``PRE_RELEASE_VALUES``.)
"""

from __future__ import annotations

import re

SCHEMA_REVISION = 1
RELEASE_TAG = "v0.1.0"
RELEASE_GIT_COMMIT = "b5f2bd93721f7b888d3e2440679e0ae7012939d1"
RELEASE_BSR_COMMIT = "768a93c7b44e40f28c692ad0b471a8f2"
RELEASE = f"OpenEngine {RELEASE_TAG} (tag {RELEASE_GIT_COMMIT[:7]}, BSR commit {RELEASE_BSR_COMMIT[:8]})"

#: Enum values of the pre-release copy (commit 4def7c5) that the release does not have.
#: A server still sending them was built from the wrong schema.
PRE_RELEASE_VALUES: dict[tuple[str, int], str] = {
    ("openengine.v1.HealthState", 5): "the pre-release NOT_READY; the release's NOT_READY is 4",
    ("openengine.v1.ErrorCode", 12): "the pre-release INTERNAL; the release's INTERNAL is 11",
}

_BSR_COMMIT = re.compile(r"^[0-9a-f]{32}$")
_GIT_SHA = re.compile(r"^[0-9a-f]{40}$")
_HEX = re.compile(r"^[0-9a-fA-F]+$")
_TAG = re.compile(r"^v?\d+(\.\d+)+([-+][0-9A-Za-z.-]+)?$")
BRANCH_NAMES = {"main", "master", "develop", "dev", "head", "trunk", "latest", "nightly", "stable", "release"}


def schema_release_problem(release: str) -> str | None:
    """D1: why ``release`` is not a valid ``ServerInfo.schema_release``; None when it is.

    Valid: the release's BSR commit, or (an unpublished build) a full 40-hex Git
    commit. Everything else names something movable (a tag, a BSR label, a branch)
    or is not a full commit id."""
    if release == RELEASE_BSR_COMMIT or _GIT_SHA.match(release):
        return None
    want = f"the BSR commit {RELEASE_BSR_COMMIT!r} (or, unpublished, a 40-hex Git commit)"
    if not release:
        return f"schema_release is empty; expected {want}"
    if _BSR_COMMIT.match(release):
        return f"schema_release {release!r} is a BSR commit, but not the one of {RELEASE_TAG}; expected {want}"
    if _HEX.match(release):
        kind = "upper-case hex" if release.lower() != release else f"{len(release)} hex digits"
        return f"schema_release {release!r} is not a full commit id ({kind}); expected {want}"
    return f"schema_release {release!r} {_movable_kind(release)}, never valid; expected {want}"


def _movable_kind(release: str) -> str:
    """What kind of movable name ``release`` looks like (tags and labels can be moved)."""
    lowered = release.lower()
    if ":" in release or lowered.startswith("buf.build/"):
        return "is a BSR label (a label can be moved to another commit)"
    if _TAG.match(release) or lowered.startswith("refs/tags/"):
        return "is a tag (tags can be moved or re-signed)"
    if lowered in BRANCH_NAMES or lowered.startswith(("refs/heads/", "branch", "origin/")):
        return "is a branch name"
    return "is a name, not an immutable commit (a tag, BSR label or branch name)"
