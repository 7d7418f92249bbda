"""Negative controls: every check is shown able to fail, and each fails only for its own rule.

Each control (tests/conformance/toy_controls.py) is the toy server broken in exactly one way; the
WHOLE suite runs against it (tests/conformance/control_runner.py: every control at once, the module
fixture below) and must fail exactly that control's rule: its checks catch the violation, and no
other check fails for a violation that is not its rule's. The unbroken toy must fail nothing. The
draft encoder profile's rules need a real model: their controls (tests/conformance/encoder_controls.py)
put a fault proxy in front of refengine's own servers (tests/integration/test_encoder_conformance.py).
A rule with a check but no control in either table must be listed in NO_CONTROL, saying why.
Beyond failing nothing, the unbroken toy must check every rule of the covered sections and PASS
the checks it can exercise; and the G10 control shows that checks reading its streams never blame
another rule for a missing ``output_index`` (before, omitting it failed 33 rules).
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import pytest

from refengine.conformance import Status, select
from refengine.conformance.registry import all_checks
from tests.conformance import encoder_controls
from tests.conformance.control_runner import NICE, Outcome, run_all, take_work
from tests.conformance.rule_ids import PROFILE_PAGES, profile_rules_in, rules_in
from tests.conformance.test_conformance import COVERED_SECTIONS, REPO, rules_markdown
from tests.conformance.toy_controls import CONTROLS, NO_CONTROL, Control

Failure = tuple[str, str, str]  # check name, rule, message

#: Checks of the re-base on the release that the toy server can exercise: they must PASS, not SKIP.
RELEASE_CHECKS = ["D1:schema_revision", "D8:primary_model_name", "D8:model_aliases", "D9:multimodal_validated",
                  "G19:media_refused_when_unsupported", "G19:media_source_required", "H3:serving_state",
                  "H4:load_presence", "K11:kv_connector_static", "X4:release_enum_values"]
#: E3's checks: the toy stores, evicts (least recently used, a chain's tail first) and stores again.
BLOCK_EVENT_CHECKS = ["E3:stored_full_blocks", "E3:removed_on_eviction"]
#: The guided-decoding checks: the toy server advertises five modes (llguidance), so all must PASS.
GUIDED_CHECKS = [c.name for c in select() if "guided" in c.name]


def _niceness_in_a_thread() -> int:
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(os.nice, 0).result()


def test_the_controls_yield_the_cpu_to_the_other_tests() -> None:
    """The threads of a worker process run at niceness NICE above this process's (at most 19)."""
    context = multiprocessing.get_context("forkserver")
    with ProcessPoolExecutor(1, mp_context=context, initializer=take_work, initargs=(None,)) as pool:
        assert pool.submit(_niceness_in_a_thread).result() == min(19, os.nice(0) + NICE)


#: Every test judging the controls' outcomes is in this module: under ``--dist loadfile`` one worker
#: takes them all, so the controls run once (a fixture shared across modules would run once per worker).
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
