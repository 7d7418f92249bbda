"""The toy engine behind tests/conformance/fake_server.py (no model, no torch).

Tokens are ASCII characters (ids 0-127) plus EOS (128). The "model" prefers, at
context length L, the L-th character of a fixed text, so greedy output is readable
and deterministic; prompts containing ``<|`` end with EOS after 4 tokens; a LoRA adapter
shifts the preferred character. Guided decoding runs on llguidance over the same ASCII
vocabulary (tests/conformance/toy_requests.py). A prefix cache of 32-token blocks reports
``cached_prompt_tokens``. It implements the rules of the release (OpenEngine v0.1.0: tag
b5f2bd9, BSR commit 768a93c7...) that the suite checks, and can be told to break each of
them (``Faults``) so that tests can show the suite catches the violation.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

import grpc
import llguidance
from google.protobuf import json_format

from refengine.conformance.release import RELEASE_BSR_COMMIT
from refengine.protocol import oe
from tests.conformance.toy_lora import ToyLoras
from tests.conformance.toy_media import place
from tests.conformance.toy_model import PrefixCache, distribution, probabilities, token_info
from tests.conformance.toy_requests import (  # noqa: F401  (the toy's limits, imported from here by tests)
    BLOCK,
    CTX,
    EOS,
    MAX_N,
    MAX_RUNNING,
    MAX_TOP_N,
    MODELS,
    TOKENIZER,
    VOCAB,
    allowed_tokens,
    compile_guide,
    require,
    validate,
)
from tests.conformance.toy_stream import Job, Output, Streams

#: One decode step of every running request: TOKENS_PER_STEP tokens per output, sent as one
#: TokenOutput (fewer events, less CPU), at 50 tokens/s: streams take real time, as the timing checks need.
STEP_S, TOKENS_PER_STEP = 0.04, 2


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


class ToyEngine(Streams):
    """Runs up to MAX_RUNNING jobs (highest priority first), TOKENS_PER_STEP tokens per output
    every STEP_S."""

    def __init__(self, faults: Faults) -> None:
        super().__init__(faults)
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.global_rng = random.Random(0)
        self.cache = PrefixCache(faults)
        self.loras = ToyLoras(faults)
        self.leaked_blocks = 0  # Faults.leak_on_cancel
        self.admitted = 0  # requests accepted so far (Faults.rank_rows_count_admitted)
        # A slot freed in a step is reusable a step later (its KV is released at the step's end): the
        # queued requests that take it are then admitted two steps apart, so that their order
        # (M4) stays clear to a client under load.
        self.cooling = 0
        self.running = True
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def running_jobs(self) -> list[Job]:
        order = sorted(self.jobs.values(), key=lambda j: (-j.priority, j.arrival))
        return order[:MAX_RUNNING - self.cooling]

    def used_blocks(self) -> int:
        blocks = sum(-(-(len(j.prompt) + len(o.tokens)) // BLOCK) for j in self.running_jobs() for o in j.outputs)
        return blocks + self.leaked_blocks

    def loop(self) -> None:
        while self.running:
            with self.wake:
                if not self.jobs:
                    self.wake.wait(0.5)  # idle: sleep until a submit (the timeout lets ``running`` stop us)
                    continue
            time.sleep(STEP_S)
            with self.lock:
                batch, self.ended = self.running_jobs(), 0
                for job in batch:
                    self.step(job, batch)
                self.cooling = self.ended

    def step(self, job: Job, batch: list[Job]) -> None:
        if job.cancelled:
            self.cancel(job)
            return
        if not job.started:  # prefilled now, in its first step: what it computed of the prompt goes first
            job.started = True
            for _ in job.outputs if self.faults.prompt_output_per_sequence else job.outputs[:1]:
                self.prompt_output(job)
        for out in job.outputs:
            for _ in range(TOKENS_PER_STEP):
                if out.done:
                    break
                if self.advance(job, out, *self.next_token(job, out, batch)):
                    return
            if not out.done and out.pending and not self.faults.one_delta:
                self.emit(job, out, len(out.text) - self.held(job, out))

    def shift(self, job: Job, batch: list[Job]) -> int:
        """The LoRA adapter's shift of the preferred character, and the batch faults' (R7, G18)."""
        shift = job.shift
        if self.faults.lora_batch_bleed:
            shift = next((j.shift for j in batch if j.shift), 0)
        if self.faults.greedy_shifts_beside_sampling and job.temperature == 0 and any(j.temperature > 0 for j in batch):
            shift += 1
        return shift

    def next_token(self, job: Job, out: Output, batch: list[Job]) -> tuple[int, Any]:
        st, f = job.req.stopping, self.faults
        masked = set()
        if len(out.tokens) < st.min_tokens and not f.min_tokens_ignored:
            masked |= job.stop_ids | {EOS}
        ctx, temperature, shift = job.prompt + out.tokens, job.temperature, self.shift(job, batch)
        lp = distribution(ctx, job.prompt, temperature, masked, shift)
        reported = distribution(ctx, job.prompt, 1.0, masked, shift) if f.logprobs_before_temperature else lp
        if out.matcher is not None:
            lp = self.guided_distribution(job, out, temperature, masked, shift)
            reported = reported if f.raw_guided_logprobs else lp
        if temperature == 0:
            tok = max(range(VOCAB), key=lp.__getitem__)
        else:
            tok = out.rng.choices(range(VOCAB), weights=probabilities(lp))[0]
        r = job.req.response
        info = token_info(tok, reported if r.return_output_logprobs else None,
                          r.output_candidates if r.HasField("output_candidates") else None, f)
        if out.matcher is not None:
            out.matcher.consume_token(tok)
        return tok, info

    def named(self, job: Job, kind: str, matched: Any) -> Any:
        """What stop_match names for ``matched`` (Faults.stop_match_names_first: the first condition of its kind)."""
        first = [getattr(c, kind) for c in job.req.stopping.conditions if c.WhichOneof("condition") == kind]
        return first[0] if first and self.faults.stop_match_names_first else matched

    def advance(self, job: Job, out: Output, tok: int, info: Any) -> bool:
        """Add ``tok`` to ``out`` (or end it); True when the whole job ended with an error."""
        st = job.req.stopping
        if tok == EOS and not st.ignore_eos:  # under ignore_eos an EOS is an ordinary, textless token (as vLLM)
            self.finish(job, out, oe.FINISH_REASON_STOP,
                        None if self.faults.eos_without_match else
                        oe.StopMatch(eos_token_id=0 if self.faults.eos_named_wrong else EOS))
            return False
        if tok in job.stop_ids:
            if st.include_stop_in_output:
                out.tokens.append(tok)
                out.text += chr(tok)
                out.pending.append(info)
            match = oe.StopMatch(stop_token_id=self.named(job, "stop_token_id", tok))
            self.finish(job, out, oe.FINISH_REASON_STOP, match)
            return False
        out.tokens.append(tok)
        out.text += chr(tok) if tok != EOS else ""
        out.pending.append(info)
        hits = [(out.text.find(x, max(0, out.emitted - len(x))), x) for x in job.stops]
        hits = [(i, x) for i, x in hits if i >= 0]
        if hits:
            at, stop = min(hits)
            if not self.faults.leak_stop:
                out.text = out.text[: at + (len(stop) if st.include_stop_in_output else 0)]
            match = None if self.faults.stop_text_without_match else \
                oe.StopMatch(stop_text=self.named(job, "stop_text", stop))
            self.finish(job, out, oe.FINISH_REASON_STOP, match)
            return False
        if len(out.tokens) >= job.max_tokens:
            self.finish(job, out, oe.FINISH_REASON_LENGTH)
            return False
        if job.fail_after is not None and len(out.tokens) >= job.fail_after:
            self.emit(job, out, len(out.text))
            self.fail(job, oe.ERROR_CODE_OVERLOADED, "toy: request shed under load",
                      retryable=not self.faults.overload_not_retryable)
            return True
        return False

    def guided_distribution(self, job: Job, out: Output, temperature: float, masked: set[int],
                            shift: int) -> tuple[float, ...]:
        """The grammar's mask on top of ``masked``; where nothing would be left, the grammar wins."""
        forbidden = set(range(VOCAB)) - allowed_tokens(out.matcher)
        both = masked | forbidden if len(masked | forbidden) < VOCAB else forbidden
        return distribution(job.prompt + out.tokens, job.prompt, temperature, both, shift)

    # -- admission ---------------------------------------------------------------------
    def submit(self, req: Any, priority: int) -> Job:
        prompt, images, image_shift = place(req, validate(req, self.faults), self.faults)
        require(not req.kv.HasField("session"), "kv.session on an AGGREGATED engine",
                grpc.StatusCode.FAILED_PRECONDITION)
        shift = self.loras.shift(req.lora_name) + image_shift
        grammar = compile_guide(req, self.faults)
        max_tokens = req.stopping.max_tokens if req.stopping.HasField("max_tokens") else CTX - len(prompt)
        n = req.sampling.num_sequences if req.sampling.num_sequences else 1
        fail_after = json_format.MessageToDict(req.extra).get("toy_fail_after")
        with self.lock:
            rid = req.request_id
            require(rid not in self.jobs and not (self.faults.ids_not_reusable and rid in self.finished)
                    and not (self.faults.ids_kept_after_completion and rid in self.completed),
                    "duplicate request_id", grpc.StatusCode.ALREADY_EXISTS)
            outputs = [Output(i, self.rng(req, i), llguidance.LLMatcher(TOKENIZER, grammar, log_level=0)
                              if grammar else None) for i in range(n)]
            job = Job(req, prompt, max_tokens, priority, queue.Queue(), outputs, shift,
                      self.cache.serve(prompt, req.kv.cache_salt, req.lora_name, req.kv.bypass_prefix_cache, images),
                      int(fail_after) if fail_after is not None else None)
            self.jobs[rid] = job
            self.admitted += 1
            self.finished.discard(rid)
            if req.media and self.faults.late_media_validation:
                self.fail(job, oe.ERROR_CODE_INVALID_ARGUMENT, "toy: the media item could not be decoded", False)
            elif req.media and self.faults.late_fetch_failure:
                self.fail(job, oe.ERROR_CODE_INVALID_ARGUMENT, "toy: the media URL could not be fetched", False)
            self.wake.notify()
        return job

    def rng(self, req: Any, index: int) -> random.Random:
        if not req.sampling.HasField("seed"):
            return random.Random(self.global_rng.random())
        offset = len(self.finished) if self.faults.seed_drifts else 0
        return random.Random(req.sampling.seed * 1000 + index + offset)

    def abort(self, request_id: str) -> int | None:
        with self.lock:
            job = self.jobs.get(request_id)
            if job is not None:
                job.cancelled = True
                if job not in self.running_jobs():
                    self.cancel(job)
                return oe.ABORT_STATUS_ABORTED
            if (request_id in self.finished and not self.faults.finished_ids_forgotten) \
                    or self.faults.unknown_abort_finished:
                return oe.ABORT_STATUS_ALREADY_FINISHED
            return None

    def client_gone(self, request_id: str) -> None:
        """A5: the client cancelled or went away: abort its request (Faults.leak_on_cancel keeps a block)."""
        if self.abort(request_id) == oe.ABORT_STATUS_ABORTED and self.faults.leak_on_cancel:
            with self.lock:
                self.leaked_blocks += 1
