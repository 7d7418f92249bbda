"""The negative controls' table: the toy server (tests/conformance/fake_server.py, with KV events,
LoRA and a PREFILL/DECODE pair) broken in exactly one way each, and the one rule the whole suite
must find broken for it ("" = none). tests/conformance/control_runner.py runs the suite against
each; tests/conformance/test_negative_controls.py judges the outcomes. The draft encoder profile's
controls are tests/conformance/encoder_controls.py (they need a real model).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tests.conformance.toy_faults import Faults
from tests.conformance.toy_kv_events import KvFaults


def broken(**fields: object) -> Faults:
    """The base toy (LoRA on) with ``fields`` set."""
    return Faults(**{"lora": True, **fields})


def events(**fields: object) -> KvFaults:
    """The base toy's KV events with ``fields`` set: 8 batches retained, so that E1 sees a
    replay point expire."""
    return KvFaults(**{"retained": 8, **fields})


@dataclass(frozen=True)
class Control:
    """One deliberately broken toy and the one rule the suite must find broken ("" = none)."""

    id: str
    rule: str
    faults: Faults = field(default_factory=broken)
    kv: KvFaults = field(default_factory=events)


CONTROLS = [
    Control("unbroken", ""),
    # Conforming, not broken: every output in one TokenOutput (G11 allows it) fails nothing.
    Control("one-delta", "", broken(one_delta=True)),
    Control("schema-release-a-tag", "D1", broken(schema_release="v0.1.0")),
    Control("pipeline-size-zero", "D2", broken(zero_pipeline_size=True)),
    Control("unknown-model-info-invalid", "D3", broken(model_info_unknown_invalid=True)),
    Control("advertised-mode-refused", "D4", broken(refuse_advertised_mode="choice")),
    Control("dcp-size-zero", "D5", broken(dcp_zero=True)),
    Control("capacity-shrinks", "D6", broken(capacity_shrinks=True)),
    Control("role-unspecified", "D7", broken(role_unspecified=True)),
    Control("model-id-empty", "D8", broken(empty_model_id=True)),
    Control("alias-refused", "D8", broken(refuse_alias=True)),
    Control("media-validated-late", "D9", broken(multimodal=True, late_media_validation=True)),
    Control("routing-key-strict", "M1", broken(strict_routing_key=True)),
    Control("lenient-numbers", "M2", broken(lenient_metadata=True)),
    Control("header-rank-over-session", "M3", broken(header_rank_over_session=True)),
    Control("decode-rank-conflict-ignored", "M3", broken(decode_rank_conflict_ignored=True)),
    Control("priority-ignored", "M4", broken(ignore_priority=True)),
    Control("trace-refused-on-getload", "M5", broken(refuse_trace_on_load=True)),
    Control("no-input-accepted", "G1", broken(accept_no_input=True)),
    Control("id-not-reusable", "G2", broken(ids_not_reusable=True)),
    Control("unknown-model-served", "G3", broken(accept_unknown_model=True)),
    Control("zero-sequences-as-one", "G4", broken(zero_sequences_is_one=True)),
    Control("top-k-unchecked", "G5", broken(top_k_unchecked=True)),
    Control("empty-stop-accepted", "G6", broken(accept_empty_stop=True)),
    Control("context-off-by-one", "G7", broken(context_off_by_one=True)),
    Control("extra-untyped", "G8", broken(extra_untyped=True)),
    Control("finish-without-request-id", "G9", broken(finish_without_request_id=True)),
    Control("token-without-request-id", "G9", broken(token_without_request_id=True)),
    Control("no-output-index", "G10", broken(omit_output_index=True)),
    Control("cumulative-text", "G11", broken(cumulative_text=True)),
    Control("double-finish", "G12", broken(double_finish=True)),
    # Broken only in streams other rules' checks read: the run-wide checks (checks_structure) find it.
    Control("double-finish-on-stop-string", "G12", broken(double_finish_on_stop_text=True)),
    Control("finish-omitted", "G12", broken(omit_finish=True)),
    Control("stop-text-without-match", "G13", broken(stop_text_without_match=True)),
    Control("eos-without-match", "G13", broken(eos_without_match=True)),
    Control("eos-named-wrong", "G13", broken(eos_named_wrong=True)),
    Control("stop-string-leaks", "G14", broken(leak_stop=True)),
    Control("min-tokens-ignored", "G15", broken(min_tokens_ignored=True)),
    Control("usage-on-every-event", "G16", broken(usage_every_event=True)),
    Control("usage-omitted", "G16", broken(omit_usage=True)),
    Control("usage-omitted-with-logprobs", "G16", broken(omit_usage_with_logprobs=True)),
    Control("seed-drifts", "G17", broken(seed_drifts=True)),
    Control("greedy-shifts-beside-sampling", "G18", broken(greedy_shifts_beside_sampling=True)),
    Control("sourceless-media-dropped", "G19", broken(accept_sourceless_media=True)),
    Control("prompt-output-unasked", "L1", broken(prompt_output_always=True)),
    Control("first-prompt-logprob", "L2", broken(first_prompt_logprob=True)),
    Control("token-info-without-text", "L3", broken(token_info_without_text=True)),
    Control("all-candidates-truncated", "L4", broken(all_candidates_truncated=True)),
    Control("zero-based-rank", "L5", broken(zero_based_rank=True)),
    Control("logprobs-before-temperature", "L6", broken(logprobs_before_temperature=True)),
    Control("bypass-ignored", "K1", broken(bypass_ignored=True)),
    Control("salt-not-in-cache-key", "K2", broken(prefix_salt_ignored=True)),
    Control("own-blocks-counted-cached", "K3", broken(count_own_blocks=True)),
    Control("prefill-leaks-tokens", "K4", broken(prefill_leaks_tokens=True)),
    Control("decode-accepts-bad-backend", "K5", broken(decode_accepts_bad_backend=True)),
    Control("decode-accepts-any-endpoint", "K5", broken(decode_accepts_any_endpoints=True)),
    Control("identifier-as-number", "K9", broken(identifier_as_number=True)),
    Control("prefill-accepts-session", "K6", broken(prefill_accepts_session=True)),
    Control("session-abort-leaks-blocks", "K7", broken(session_abort_leaks_blocks=True)),
    Control("decode-leaks-on-finish", "K7", broken(decode_leaks_on_finish=True)),
    Control("gone-session-retryable", "K8", broken(gone_session_retryable=True)),
    Control("gone-session-refused-before-acceptance", "", broken(gone_session_refused=True)),
    Control("gone-session-crashes", "K8", broken(gone_session_crashes=True)),
    Control("decode-omits-finish", "K9", broken(decode_omits_finish=True)),
    Control("decode-differs", "K10", broken(decode_differs=True)),
    Control("connector-not-static", "K11", broken(connector_changes=True)),
    Control("connector-pre-release-wire", "K11", broken(connector_pre_release=True)),
    Control("abort-no-target-not-found", "A1", broken(abort_no_target_not_found=True)),
    Control("unknown-abort-already-finished", "A2", broken(unknown_abort_finished=True)),
    Control("finished-ids-forgotten", "A2", broken(finished_ids_forgotten=True)),
    Control("abort-all-wrong-status", "A3", broken(abort_all_wrong_status=True)),
    Control("abort-all-leaks-kv", "A3", broken(abort_all_leaks=True)),
    Control("abort-finishes-first-output-only", "A4", broken(abort_first_output_only=True)),
    Control("kv-block-leaked-after-cancel", "A5", broken(leak_on_cancel=True)),
    Control("ready-with-degraded-check", "H1", broken(health_check_degraded=True)),
    Control("probe-unsafe-concurrently", "H2", broken(probe_unsafe_concurrently=True)),
    Control("probe-holds-a-session", "H2", broken(probe_holds_session=True)),
    Control("starting-while-serving", "H3", broken(starting_unprobed=True)),
    Control("no-per-rank-rows", "H4", broken(no_rank_rows=True)),
    Control("lora-path-unchecked", "R1", broken(lora_path_unchecked=True)),
    Control("already-loaded-false", "R2", broken(already_loaded_false=True)),
    Control("conflicting-load-replaces", "R3", broken(conflict_replaces=True)),
    Control("other-path-already-loaded", "R3", broken(path_ignored_when_loaded=True)),
    Control("unknown-adapter-invalid", "R4", broken(unknown_lora_invalid=True)),
    Control("lora-disabled-invalid-argument", "R5", Faults(lora_disabled_invalid=True)),
    Control("max-loras-zero", "R6", broken(max_loras_zero=True)),
    Control("adapter-bleeds-across-batch", "R7", broken(lora_batch_bleed=True)),
    Control("expired-replay-skipped-silently", "E1", kv=events(silent_expired=True)),
    Control("empty-snapshot", "E2", kv=events(empty_snapshot=True)),
    Control("snapshot-without-leaves", "E2", kv=events(leafless_snapshot=True)),
    Control("partial-block-stored", "E3", kv=events(partial_blocks=True)),
    Control("parent-named-within-a-batch-only", "E4", kv=events(parent_in_batch_only=True)),
    # Not a fault (RULES set no latency bound): batches 0.5 s late, a step's later ones 1 s.
    Control("lagging-event-stream", "", kv=events(staggered=True)),
    Control("eviction-unannounced", "E3", kv=events(silent_eviction=True)),
    Control("recomputed-block-unannounced", "E3", kv=events(announce_once=True)),
    Control("salt-not-in-block-hash", "E4", kv=events(salt_ignored=True)),
    Control("lora-not-in-block-hash", "E4", broken(lora_not_in_hash=True)),
    # Not a fault: a multimodal toy serving images at its placeholder (the suite is told it, as for a real model).
    Control("images-served", "", broken(images=True)),
    Control("media-not-in-block-hash", "E4", broken(images=True, media_not_in_hash=True)),
    Control("images-ignored", "D9", broken(images=True, images_ignored=True)),
    Control("unplaced-images-dropped", "G19", broken(images=True, unplaced_images_dropped=True)),
    Control("image-bytes-unchecked", "G19", broken(images=True, image_bytes_unchecked=True)),
    Control("replay-failure-as-status", "E5", kv=events(status_on_failure=True)),
    Control("expired-replay-as-status", "E5", kv=events(status_on_expired=True)),
    Control("wildcard-event-host", "E6", kv=events(wildcard_host=True)),
    Control("event-source-not-listening", "E6", kv=events(unconnectable_source=True)),
    Control("event-after-engine-error", "X1", broken(event_after_error=True)),
    Control("failure-as-empty-ok", "X2", broken(empty_ok_for_invalid_load=True)),
    Control("overload-not-retryable", "X3", broken(overload_not_retryable=True)),
    Control("unknown-role-rejected", "X4", broken(reject_unknown_role=True)),
    Control("finish-reason-17", "X4", broken(finish_reason=17)),
    # Found by review (2026-12-06): each passed every check of its rule before.
    Control("top-n-plus-the-token", "L4", broken(sampled_outside_top_n=True)),
    Control("prompt-info-without-text", "L3", broken(prompt_info_without_text=True)),
    Control("prompt-logprobs-shifted", "L2", broken(prompt_logprobs_shifted=True)),
    Control("prompt-candidates-ignored", "L4", broken(prompt_candidates_ignored=True)),
    Control("python-int-metadata", "M2", broken(python_int_metadata=True)),
    Control("ids-kept-after-completion", "G2", broken(ids_kept_after_completion=True)),
    Control("length-drops-held-text", "G14", broken(length_drops_held_text=True)),
    Control("length-drops-last-text", "G11", broken(length_drops_last_text=True)),
    Control("prompt-output-per-sequence", "L1", broken(prompt_output_per_sequence=True)),
    Control("prompt-logprobs-unadvertised", "D4", broken(prompt_logprobs_unadvertised=True)),
    Control("media-url-fetch-fails-late", "", broken(multimodal=True, late_fetch_failure=True)),
    Control("salt-falls-back-to-unsalted", "K2", broken(salt_falls_back_to_unsalted=True)),
    Control("token-granular-cache", "", broken(token_cache=True)),
    Control("abort-all-skips-queued", "A3", broken(abort_all_skips_queued=True)),
    Control("rank-rows-count-admitted", "H4", broken(rank_rows_count_admitted=True)),
    # Broken only on the disaggregated pair (found by review: its streams were never judged on structure).
    Control("decode-double-finish", "G12", broken(decode_double_finish=True)),
    Control("prefill-without-request-id", "G9", broken(prefill_without_request_id=True)),
    Control("overlapping-deltas", "G11", broken(overlapping_deltas=True)),
    Control("cached-blocks-not-tokens", "K3", broken(cached_blocks_not_tokens=True)),
    Control("stop-match-names-first", "G13", broken(stop_match_names_first=True)),
]

#: Rules with a check but no negative control, and why (none today: the draft encoder profile's
#: controls are tests/conformance/encoder_controls.py, run against real servers by
#: tests/integration/test_encoder_conformance.py).
NO_CONTROL: dict[str, str] = {}
