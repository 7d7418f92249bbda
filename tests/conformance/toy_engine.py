"""The toy engine behind tests/conformance/fake_server.py (no model, no torch).

Tokens are ASCII characters (ids 0-127) plus EOS (128). The "model" prefers, at
context length L, the L-th character of a fixed text, so greedy output is readable
and deterministic; prompts containing ``<|`` end with EOS after 4 tokens; a LoRA adapter
shifts the preferred character. Guided decoding runs on llguidance over the same ASCII
vocabulary (tests/conformance/toy_requests.py). A prefix cache of 32-token blocks reports
``cached_prompt_tokens``. It implements the rules of the release (OpenEngine v0.1.0: tag
b5f2bd9, BSR commit 768a93c7...) that the suite checks, and can be told to break each of
them (``Faults``, tests/conformance/toy_faults.py) so that tests can show the suite catches
the violation.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from typing import Any

import grpc
import llguidance
from google.protobuf import json_format

from refengine.protocol import oe
from tests.conformance.toy_faults import Faults
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
