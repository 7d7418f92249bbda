"""Multimodal input: media items fetched and decoded under ``MediaConfig`` (``sources``, with
SSRF-safe URL fetching in ``url_fetch``), then processed for the model and encoded."""
