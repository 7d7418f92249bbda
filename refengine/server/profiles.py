"""Draft-profile discovery: ``ServerInfo.extra["refengine.profiles"]`` (until a discovery profile exists).

Each entry: ``{"name", "version", "status", "sides"}``; a profile that is not listed is not
supported, and is never emulated. Profiles (docs/profiles/):

- ``encoder`` v1alpha1, draft: side ``encoder`` on an encoder server (``refengine.v1alpha1.Media``),
  side ``consumer`` on a server with a vision path (``GenerateRequest.extra`` media handles).
"""

from __future__ import annotations

from refengine.engine.interface import EngineInfo

PROFILES_KEY = "refengine.profiles"
ENCODER_PROFILE = {"name": "encoder", "version": "v1alpha1", "status": "draft"}


def profiles_of(info: EngineInfo) -> list[dict]:
    if info.role == "encoder":
        return [{**ENCODER_PROFILE, "sides": ["encoder"]}]
    if info.supports_multimodal:
        return [{**ENCODER_PROFILE, "sides": ["consumer"]}]
    return []
