"""Imports every section module so that their checks register (order = RULES.md, then the draft
profiles, then the run-wide checks)."""

from refengine.conformance import (  # noqa: F401
    checks_abort,
    checks_determinism,
    checks_disagg,
    checks_discovery,
    checks_encoder,
    checks_encoder_consumer,
    checks_errors,
    checks_generate,
    checks_guided,
    checks_health,
    checks_kv_block_events,
    checks_kv_connector,
    checks_kv_events,
    checks_kv_hash,
    checks_kv_sources,
    checks_logprobs,
    checks_lora,
    checks_media,
    checks_metadata,
    checks_models,
    checks_output,
    checks_prefix_cache,
    checks_stopping,
    checks_structure,
)
