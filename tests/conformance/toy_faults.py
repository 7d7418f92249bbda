"""The toy engine's faults (tests/conformance/toy_engine.py): each field breaks one rule, so that
tests can show the conformance suite catches the violation.
"""

from __future__ import annotations

from dataclasses import dataclass

from refengine.conformance.release import RELEASE_BSR_COMMIT
from refengine.protocol import oe


@dataclass(frozen=True)
class Faults:
    """Deliberate contract violations (the rule each breaks first); all off = a conforming server.
    A few fields are not faults but switches (``guided``, ``lora``, ``multimodal``)."""

    schema_release: str = RELEASE_BSR_COMMIT  # D1: anything else (a tag, a branch) is a violation
    zero_pipeline_size: bool = False  # D2: pipeline_parallel_size present as 0 ("not filled in")
    model_info_unknown_invalid: bool = False  # D3: GetModelInfo(unknown) → INVALID_ARGUMENT, not NOT_FOUND
    refuse_advertised_mode: str = ""  # D4: this guided mode (e.g. "choice") is advertised, yet refused
    dcp_zero: bool = False  # D5: decode_context_parallel_size present as 0
    capacity_shrinks: bool = False  # D6: total_kv_blocks reported as what the prefix cache leaves free
    role_unspecified: bool = False  # D7: the AGGREGATED server's engine_role UNSPECIFIED
    empty_model_id: bool = False  # D8: ModelInfo.model_id empty
    refuse_alias: bool = False  # D8: the listed alias is not accepted by Generate
    multimodal: bool = False  # not a fault: supports_multimodal = true (media validated late, see next)
    late_media_validation: bool = False  # D9: media accepted, then EngineError INVALID_ARGUMENT
    ignore_media: bool = False  # D9/G19: media accepted and silently ignored by a text-only model
    late_fetch_failure: bool = False  # not a fault (D9): media URLs accepted, their fetch fails after acceptance
    images: bool = False  # not a fault: supports_multimodal, PNG images at toy_media.PLACEHOLDER served
    media_not_in_hash: bool = False  # E4: the image is in neither cache's block key (a new image hits the old's blocks)
    images_ignored: bool = False  # D9: images accepted and validated, without effect on the output
    unplaced_images_dropped: bool = False  # G19: items past the placeholders dropped, placeholders past them kept
    image_bytes_unchecked: bool = False  # G19: any bytes accepted as an image (never decoded)
    strict_routing_key: bool = False  # M1: a routing key with "/" refused
    lenient_metadata: bool = False  # M2: "1.5" and "1e3" accepted as numbers
    header_rank_over_session: bool = False  # M3: with a target-dp-rank header, kv.session is dropped
    decode_rank_conflict_ignored: bool = False  # M3: DECODE decodes a session its target-dp-rank header contradicts
    ignore_priority: bool = False  # M4: supports_priority advertised, admission first come first served
    refuse_trace_on_load: bool = False  # M5: GetLoad with trace context → INVALID_ARGUMENT
    accept_no_input: bool = False  # G1: a request without input runs on a default prompt
    ids_not_reusable: bool = False  # G2: a finished request's id is refused (ALREADY_EXISTS)
    accept_unknown_model: bool = False  # G3: any model name served
    zero_sequences_is_one: bool = False  # G4: num_sequences 0 read as 1
    top_k_unchecked: bool = False  # G5: top_k below -1 accepted
    accept_empty_stop: bool = False  # G6: an empty StopCondition accepted (and ignored)
    context_off_by_one: bool = False  # G7: prompt + max_tokens may exceed the context by one
    extra_untyped: bool = False  # G8: extra.toy_knob of any type accepted
    finish_without_request_id: bool = False  # G9: GenerationFinished carries an empty request_id
    token_without_request_id: bool = False  # G9: TokenOutput carries an empty request_id
    omit_output_index: bool = False  # G10: no output_index on TokenOutput / GenerationFinished
    cumulative_text: bool = False  # G11: TokenOutput.text is the whole text so far
    overlapping_deltas: bool = False  # G11: each TokenOutput.text repeats the last character of the one before
    double_finish: bool = False  # G12: every GenerationFinished is sent twice
    double_finish_on_stop_text: bool = False  # G12: sent twice when a stop string ended the output
    omit_finish: bool = False  # G12: no STOP/LENGTH GenerationFinished; ends OK after an empty TokenOutput
    stop_text_without_match: bool = False  # G13: STOP by a stop string carries no stop_match
    eos_without_match: bool = False  # G13: STOP at EOS carries no stop_match
    eos_named_wrong: bool = False  # G13: STOP at EOS names token 0, not the EOS token
    stop_match_names_first: bool = False  # G13: stop_match names the first stop condition of the matched kind
    leak_stop: bool = False  # G14: stop strings stay in the text
    length_drops_held_text: bool = False  # G14: text held back for a partial stop match is dropped at LENGTH
    length_drops_last_text: bool = False  # G11: at LENGTH, the tokens not sent yet go without their text
    min_tokens_ignored: bool = False  # G15: stop tokens and EOS end outputs below min_tokens
    usage_every_event: bool = False  # G16: usage on every event
    omit_usage: bool = False  # G16: no usage at all, not even on the final response
    omit_usage_with_logprobs: bool = False  # G16: no usage when output logprobs were asked for
    one_delta: bool = False  # not a fault (G11 allows it): an output's tokens all in one TokenOutput, at its end
    seed_drifts: bool = False  # G17: the seeded stream depends on how many requests ran before
    greedy_shifts_beside_sampling: bool = False  # G18: greedy output changes beside a sampled request
    accept_sourceless_media: bool = False  # G19: a media item without source dropped, not refused
    prompt_output_always: bool = False  # L1: PromptOutput also when not requested
    prompt_output_per_sequence: bool = False  # L1: one PromptOutput for each of num_sequences outputs
    prompt_logprobs_unadvertised: bool = False  # D4: prompt_logprobs.supported = false, yet they are served
    first_prompt_logprob: bool = False  # L2: the first prompt token carries a logprob
    token_info_without_text: bool = False  # L3: TokenInfo with logprobs has no token text
    all_candidates_truncated: bool = False  # L4: "all" candidates are the top 100 only
    zero_based_rank: bool = False  # L5: sampled tokens' ranks count from 0
    logprobs_before_temperature: bool = False  # L6: logprobs of the T=1 distribution
    raw_guided_logprobs: bool = False  # L6 (and L5): logprobs of the distribution before the grammar mask
    bypass_ignored: bool = False  # K1: bypass_prefix_cache still reuses cached blocks
    prefix_salt_ignored: bool = False  # K2: cache_salt not part of the prefix-cache key
    salt_falls_back_to_unsalted: bool = False  # K2: a salted prompt is served from the unsalted cache too
    token_cache: bool = False  # not a fault: a token-granular prefix cache (pages of one token, as a radix tree)
    block_size_unreported: bool = False  # not a fault: ServerInfo leaves out kv_block_size (it is optional)
    lora_not_in_hash: bool = False  # E4: the adapter is in neither cache's block key (LoRA requests hit base blocks)
    count_own_blocks: bool = False  # K3: a request's freshly stored blocks counted as cached
    cached_blocks_not_tokens: bool = False  # K3: cached_prompt_tokens counts the cached blocks, not their tokens
    prefill_leaks_tokens: bool = False  # K4: the PREFILL stream sends a TokenOutput before PrefillReady
    prefill_without_request_id: bool = False  # G9: the PREFILL server's PrefillReady has an empty request_id
    decode_double_finish: bool = False  # G12: the DECODE server sends every GenerationFinished twice
    decode_accepts_bad_backend: bool = False  # K5: DECODE takes a session of an unknown transfer backend
    decode_accepts_any_endpoints: bool = False  # K5: DECODE takes a session without endpoints, or with port 0
    decode_leaks_on_finish: bool = False  # K7: the DECODE server keeps 2 KV blocks after each finished decode
    identifier_as_number: bool = False  # K9: a 64-bit identifier in attributes_struct as a JSON number
    prefill_accepts_session: bool = False  # K6: PREFILL takes a request carrying kv.session
    session_abort_leaks_blocks: bool = False  # K7: Abort(kv_session) forgets the session, keeps its KV
    gone_session_retryable: bool = False  # K8: the EngineError for a released session says retryable = true
    gone_session_refused: bool = False  # not a fault (K8): a released session refused before acceptance
    gone_session_crashes: bool = False  # K8: a released session fails the call with INTERNAL
    decode_omits_finish: bool = False  # K9: the DECODE stream ends without GenerationFinished
    decode_differs: bool = False  # K10: DECODE continues from the prompt minus its first token
    connector_changes: bool = False  # K11: kv_connector.supports_abort_cleanup flips at every GetServerInfo
    connector_pre_release: bool = False  # K11: kv_connector as the pre-release wire has it (fields 8 and 9)
    abort_no_target_not_found: bool = False  # A1: Abort() → NOT_FOUND
    unknown_abort_finished: bool = False  # A2: Abort(unknown request_id) → ALREADY_FINISHED
    finished_ids_forgotten: bool = False  # A2: Abort(finished request_id) → NOT_FOUND, not ALREADY_FINISHED
    abort_all_wrong_status: bool = False  # A3: Abort(all) with requests running answers ALREADY_FINISHED
    abort_all_leaks: bool = False  # A3: Abort(all) ends the streams CANCELLED but keeps 2 KV blocks
    abort_all_skips_queued: bool = False  # A3: Abort(all) aborts the running requests, not the queued ones
    abort_first_output_only: bool = False  # A4: Abort finishes only the first unfinished output
    cancel_reason: int = oe.FINISH_REASON_CANCELLED  # X4: e.g. 4, a FinishReason the release lacks
    finish_reason: int = 0  # X4: when set (e.g. 17), the reason of every GenerationFinished
    leak_on_cancel: bool = False  # A5: a client cancel leaves one KV block used
    ignore_disconnect: bool = False  # A5: a cancelled call keeps running
    health_check_degraded: bool = False  # H1: overall READY with a DEGRADED check
    probe_unsafe_concurrently: bool = False  # H2: a probe running next to another reports NOT_READY
    probe_holds_session: bool = False  # H2: the PREFILL server's probe prefills into a session it never releases
    starting_unprobed: bool = False  # H3: Health without probe answers STARTING while serving
    health_state: int = oe.HEALTH_STATE_READY  # X4/H3: e.g. 5, the pre-release NOT_READY
    no_rank_rows: bool = False  # H4: include_per_rank gives no RankLoadInfo row
    rank_rows_count_admitted: bool = False  # H4: the rank row's running_requests counts every request admitted
    load_defaults: bool = False  # H4: every load scalar present, unmeasured ones as 0 (total_kv_blocks 0)
    lora: bool = False  # not a fault: LoRA enabled (supports_lora = true, the lifecycle RPCs work)
    lora_path_unchecked: bool = False  # R1: any source_path accepted
    already_loaded_false: bool = False  # R2: an identical second load reports already_loaded = false
    conflict_replaces: bool = False  # R3: a load sharing a loaded adapter's name, id or path replaces it
    path_ignored_when_loaded: bool = False  # R3: the same id and name with another path is "already loaded"
    unknown_lora_invalid: bool = False  # R4: Generate naming an unknown adapter → INVALID_ARGUMENT
    lora_disabled_invalid: bool = False  # R5: LoRA disabled, the lifecycle RPCs → INVALID_ARGUMENT
    max_loras_zero: bool = False  # R6: supports_lora = true with max_loras = 0
    lora_batch_bleed: bool = False  # R7: every request of a batch runs the first adapter in it
    event_after_error: bool = False  # X1: a token event follows the terminal EngineError
    empty_ok_for_invalid_load: bool = False  # X2: LoadLora(id 0, no name) answers OK with an empty response
    overload_not_retryable: bool = False  # X3: EngineError OVERLOADED with retryable = false
    reject_unknown_role: bool = False  # X4: Health(role = 97) → INVALID_ARGUMENT
    guided: bool = True  # not a fault: False = a server without guided decoding (not advertised, refused)
    ignore_grammar: bool = False  # D4: guided requests accepted, output unconstrained
    accept_invalid_guide: bool = False  # X1: a spec that does not compile is accepted (and ignored)
    sampled_outside_top_n: bool = False  # L4: top_n candidates + the token itself when outside them (vLLM's k + 1)
    prompt_info_without_text: bool = False  # L3: prompt TokenInfos and every candidate carry no text
    prompt_logprobs_shifted: bool = False  # L2: position i's logprobs are of the distribution at i - 1 (off by one)
    prompt_candidates_ignored: bool = False  # L4: prompt_candidates asked for, never sent
    python_int_metadata: bool = False  # M2: numbers parsed with Python's int(): "1_000", "+7", "0_0" accepted
    ids_kept_after_completion: bool = False  # G2: an id that ended STOP/LENGTH stays refused (an aborted one is freed)
