"""Negative controls: every check is shown able to fail, and each fails only for its own rule.

Each control is the toy server (tests/conformance/fake_server.py, with KV events, LoRA and a
PREFILL/DECODE pair) broken in exactly one way; the WHOLE suite runs against it and must
fail exactly that control's rule: its checks catch the violation, and no other check fails
for a violation that is not its rule's. The unbroken toy must fail nothing. The draft encoder
profile's rules need a real model: their controls (tests/conformance/encoder_controls.py) put a
fault proxy in front of refengine's own servers (tests/integration/test_encoder_conformance.py).
A rule with a check but no control in either table must be listed in NO_CONTROL, saying why.
Beyond failing nothing, the unbroken toy must check every rule of the covered sections and PASS
the checks it can exercise; and the G10 control shows that checks reading its streams never blame
another rule for a missing ``output_index`` (before, omitting it failed 33 rules).

The controls run at once (about 25 s each alone, mostly waiting on the toy's paced streams):
PROCESSES worker processes (forkserver: no gRPC state inherited from this one) take them from
one queue, THREADS at a time each, every control with servers of its own; the module fixture
runs them all, the tests assert on the results. Those processes run at niceness NICE, so that
the other pytest worker's servers are not starved meanwhile.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest

from refengine.conformance import Options, Status, run, select
from refengine.conformance.registry import all_checks
from tests.conformance import encoder_controls
from tests.conformance.rule_ids import PROFILE_PAGES, profile_rules_in, rules_in
from tests.conformance.test_conformance import COVERED_SECTIONS, REPO, rules_markdown
from tests.conformance.toy_faults import Faults
from tests.conformance.toy_kv_events import KvFaults, serve_kv
from tests.conformance.toy_media import PLACEHOLDER
from tests.conformance.toy_roles import serve_pair

#: 48 at once: the controls (126 on 2026-12-06) run in rounds of 48 (with ~80 controls, 48 at once
#: took 73-76 s here against 89 s for 40 at once).
PROCESSES, THREADS = 8, 6
#: The niceness of those processes (their threads inherit it). Together they take more than the
#: 2 cores of the CI machine (~200-300 s of CPU in ~180-220 s), and at the default priority their
#: dozens of runnable threads starved the other pytest worker: beside them, the real-engine G13,
#: G14, G17 and G18 checks and the X1 stall test of test_conformance.py took 173-217 s against
#: 114 s beside controls at niceness 10, which themselves took 204 s against 180-217 s (2026-12-07).
NICE = 10
#: The served model's config.json for the R checks' adapters: tiny shapes (the toy reads no weights).
MODEL_CONFIG = {"model_type": "llama", "hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2,
                "num_key_value_heads": 2, "head_dim": 4, "num_hidden_layers": 1}
#: E3's eviction check fills the toy's cache (4,096 blocks of 4) with ~20 fresh prompts: it runs
#: for the unbroken toy and the E3 controls; for the rest it skips (over its budget of 0 tokens).
EVICTION_BUDGET = 16384
#: A post-acceptance failure on demand: the toy sheds a request after 3 tokens (X1, X3).
SHED_AFTER = {"toy_fail_after": 3}


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

Failure = tuple[str, str, str]  # check name, rule, message
Outcome = tuple[str, str, str, str]  # check name, rule, status (its value), message
#: Checks of the re-base on the release that the toy server can exercise: they must PASS, not SKIP.
RELEASE_CHECKS = ["D1:schema_revision", "D8:primary_model_name", "D8:model_aliases", "D9:multimodal_validated",
                  "G19:media_refused_when_unsupported", "G19:media_source_required", "H3:serving_state",
                  "H4:load_presence", "K11:kv_connector_static", "X4:release_enum_values"]
#: E3's checks: the toy stores, evicts (least recently used, a chain's tail first) and stores again.
BLOCK_EVENT_CHECKS = ["E3:stored_full_blocks", "E3:removed_on_eviction"]
#: The guided-decoding checks: the toy server advertises five modes (llguidance), so all must PASS.
GUIDED_CHECKS = [c.name for c in select() if "guided" in c.name]
#: Controls that take longest (their fault makes later checks wait out the idle timeout, or
#: runs a long request to its end, or they fill the cache for E3): started first.
SLOW = ("kv-block-leaked-after-cancel", "context-off-by-one", "unbroken", "partial-block-stored",
        "eviction-unannounced", "recomputed-block-unannounced", "lagging-event-stream")


def run_control(control: Control) -> list[Outcome]:
    """The whole suite against ``control``'s servers; every check's outcome."""
    with tempfile.TemporaryDirectory() as tmp:
        config, lora_dir = os.path.join(tmp, "config.json"), os.path.join(tmp, "lora")
        os.mkdir(lora_dir)
        with open(config, "w") as f:
            json.dump(MODEL_CONFIG, f)
        server, address, engine = serve_kv(control.kv, control.faults)
        pair, prefill, decode, pair_engines = serve_pair(control.faults)
        options = Options(idle_timeout_s=3.0, prefill_address=prefill, decode_address=decode, lora_dir=lora_dir,
                          lora_model_config=config, slow_reader_s=0.2, slow_reader_extra=SHED_AFTER,
                          media_placeholder_token_id=PLACEHOLDER if control.faults.images else None,
                          eviction_budget_tokens=EVICTION_BUDGET if control.rule in ("", "E3") else 0)
        try:
            results = run(address, None, options)
        finally:
            for s in (server, *pair):
                s.stop(0)
            for e in (engine, *pair_engines):
                e.running = False
    return [(r.name, r.rule, r.status.value, r.message) for r in results]


_work: Any = None  # a worker process's queue of controls to run (None: no more)


def _take_work(queue: Any) -> None:
    """A worker process's initializer: before it starts any thread (Linux: a thread's niceness
    is inherited by the threads it starts)."""
    global _work
    os.nice(NICE)
    _work = queue


def run_queued() -> dict[str, list[Outcome]]:
    """One worker process's share: THREADS threads taking controls from the queue until it is empty."""
    found: dict[str, list[Outcome]] = {}

    def drain() -> None:
        while (control := _work.get()) is not None:
            found[control.id] = run_control(control)

    with ThreadPoolExecutor(THREADS) as pool:
        for done in [pool.submit(drain) for _ in range(THREADS)]:
            done.result()
    return found


def run_all(controls: list[Control]) -> dict[str, list[Outcome]]:
    """Every control's outcomes, run at once: PROCESSES worker processes take them from one
    queue (the slow ones first, so that none of them starts last)."""
    context = multiprocessing.get_context("forkserver")
    queue = context.Queue()
    for control in sorted(controls, key=lambda c: c.id not in SLOW) + [None] * (PROCESSES * THREADS):
        queue.put(control)
    found: dict[str, list[Outcome]] = {}
    with ProcessPoolExecutor(PROCESSES, mp_context=context, initializer=_take_work, initargs=(queue,)) as pool:
        for part in [pool.submit(run_queued) for _ in range(PROCESSES)]:
            found.update(part.result())
    return found


def _niceness_in_a_thread() -> int:
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(os.nice, 0).result()


def test_the_controls_yield_the_cpu_to_the_other_tests() -> None:
    """The threads of a worker process run at niceness NICE above this process's (at most 19)."""
    context = multiprocessing.get_context("forkserver")
    with ProcessPoolExecutor(1, mp_context=context, initializer=_take_work, initargs=(None,)) as pool:
        assert pool.submit(_niceness_in_a_thread).result() == min(19, os.nice(0) + NICE)


@pytest.fixture(scope="module")
def outcomes() -> dict[str, list[Outcome]]:
    return run_all(CONTROLS)


@pytest.mark.parametrize("control", CONTROLS, ids=[f"{c.rule or 'none'}-{c.id}" for c in CONTROLS])
def test_the_suite_fails_exactly_the_broken_rule(control: Control, outcomes: dict[str, list[Outcome]]) -> None:
    failed: list[Failure] = [(name, rule, message) for name, rule, status, message in outcomes[control.id]
                             if status == Status.FAIL.value]
    want = {control.rule} - {""}
    assert {rule for _, rule, _ in failed} == want, (
        f"{control.id} breaks {control.rule or 'nothing'}; failed:\n"
        + ("\n".join(f"  {name}: {message}" for name, _, message in failed) or "  nothing"))


def test_the_unbroken_toy_checks_every_rule_and_passes_what_it_can_exercise(
        outcomes: dict[str, list[Outcome]]) -> None:
    results = outcomes["unbroken"]
    assert {rule for _, rule, _, _ in results} >= set(rules_in(rules_markdown(), COVERED_SECTIONS))
    by_name = {name: (status, message) for name, _, status, message in results}
    not_passed = {name: by_name[name] for name in RELEASE_CHECKS + GUIDED_CHECKS + BLOCK_EVENT_CHECKS
                  if by_name[name][0] != Status.PASS.value}
    assert not not_passed, not_passed


#: The checks that send real images at the model's placeholder: the toy serving images must PASS them.
IMAGE_CHECKS = ["D9:multimodal_image_accepted", "D9:multimodal_image_used", "G19:media_placeholder_mismatch_refused",
                "G19:media_malformed_image_refused", "E4:media_in_block_hash"]


def test_the_toy_serving_images_passes_the_image_checks(outcomes: dict[str, list[Outcome]]) -> None:
    by_name = {name: (status, message) for name, _, status, message in outcomes["images-served"]}
    not_passed = {name: by_name[name] for name in IMAGE_CHECKS if by_name[name][0] != Status.PASS.value}
    assert not not_passed, not_passed


#: The image controls and the one check each must fail: D9, G19 and E4 have other checks, and the
#: exact-rule test judges rules only, so this shows the image checks themselves can fail.
IMAGE_FAULT_CHECKS = {"images-ignored": "D9:multimodal_image_used", "media-not-in-block-hash": "E4:media_in_block_hash",
                      "unplaced-images-dropped": "G19:media_placeholder_mismatch_refused",
                      "image-bytes-unchecked": "G19:media_malformed_image_refused"}


@pytest.mark.parametrize(("control_id", "check_name"), IMAGE_FAULT_CHECKS.items())
def test_each_image_control_fails_its_own_image_check(control_id: str, check_name: str,
                                                      outcomes: dict[str, list[Outcome]]) -> None:
    failed = {name for name, _, status, _ in outcomes[control_id] if status == Status.FAIL.value}
    assert failed == {check_name}, failed


def test_a_missing_output_index_is_blamed_on_g10_alone(outcomes: dict[str, list[Outcome]]) -> None:
    """G10 names what is missing; the checks that read the same streams and cannot tell their
    outputs apart without it skip, saying so (the exact-rule test above: they do not fail)."""
    by_name = {name: (status, message) for name, _, status, message in outcomes["no-output-index"]}
    assert "has no output_index" in by_name["G10:output_index"][1], by_name["G10:output_index"]
    unattributable = {name: status for name, (status, message) in by_name.items() if "cannot be told apart" in message}
    assert unattributable and set(unattributable.values()) == {Status.SKIP.value}, unattributable


def test_one_delta_per_output_skips_only_what_needs_delta_boundaries(outcomes: dict[str, list[Outcome]]) -> None:
    """G11 allows a server to send an output in one TokenOutput: what needs delta boundaries
    skips, the rest still runs (G13's stop string, G14's release of held-back text)."""
    by_name = {name: status for name, _, status, _ in outcomes["one-delta"]}
    assert by_name["G11:token_deltas"] == by_name["G14:stop_string_held_back"] == Status.SKIP.value
    for name in ("G13:finish_stop_match", "G14:partial_match_released", "G14:stop_token_excluded"):
        assert by_name[name] == Status.PASS.value, (name, by_name[name])


def test_every_rule_with_a_check_has_a_negative_control() -> None:
    defined = set(rules_in(rules_markdown(), "DMGLKAHREX"))
    defined |= set(profile_rules_in((REPO / PROFILE_PAGES["ENC"]).read_text(), "ENC"))
    checked = {c.rule for c in all_checks()} & defined
    uncontrolled = checked - {c.rule for c in CONTROLS} - {c.rule for c in encoder_controls.controls()}
    assert sorted(uncontrolled) == sorted(NO_CONTROL), (
        f"without a control and not in NO_CONTROL: {sorted(uncontrolled - set(NO_CONTROL))}; in NO_CONTROL but "
        f"controlled or unchecked: {sorted(set(NO_CONTROL) - uncontrolled)}")
