"""The toy engine behind tests/conformance/fake_server.py (no model, no torch).

Tokens are ASCII characters (ids 0-127) plus EOS (128). The "model" prefers, at
context length L, the L-th character of a fixed text, so greedy output is readable
and deterministic; prompts containing ``<|`` end with EOS after 4 tokens. Guided decoding
runs on llguidance over the same ASCII vocabulary (five modes; structural_tag is not
advertised, so the suite sees an unadvertised mode refused). It
implements the rules of the release (OpenEngine v0.1.0: tag b5f2bd9, BSR commit
768a93c7...) that the suite checks, and can be told to break some of them
(``Faults``) so that tests can show the suite catches the violation.
"""

from __future__ import annotations

import json
import math
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
import llguidance
from google.protobuf import json_format

from refengine.conformance.release import RELEASE_BSR_COMMIT
from refengine.protocol import oe

TEXT = "the quick brown fox jumps over the lazy dog, and then it sleeps under a tree. "
EOS, VOCAB, CTX, BLOCK, MAX_RUNNING, MAX_N, MAX_TOP_N = 128, 129, 256, 4, 4, 4, 20
MODELS = ("toy", "toy-alias")
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@dataclass(frozen=True)
class Faults:
    """Deliberate contract violations."""

    leak_stop: bool = False  # G14: stop strings stay in the text
    usage_every_event: bool = False  # G16: usage on every event
    ignore_disconnect: bool = False  # A5: a cancelled call keeps running
    schema_release: str = RELEASE_BSR_COMMIT  # D1: anything else (a tag, a branch) is a violation
    refuse_alias: bool = False  # D8: the listed alias is not accepted by Generate
    ignore_media: bool = False  # D9/G19: media accepted and silently ignored by a text-only model
    load_defaults: bool = False  # H4: every load scalar present, unmeasured ones as 0 (total_kv_blocks 0)
    health_state: int = oe.HEALTH_STATE_READY  # X4/H3: e.g. 5, the pre-release NOT_READY
    cancel_reason: int = oe.FINISH_REASON_CANCELLED  # X4: e.g. 4, a FinishReason the release lacks
    guided: bool = True  # not a fault: False = a server without guided decoding (not advertised, refused)
    ignore_grammar: bool = False  # D4: guided requests accepted, output unconstrained
    accept_invalid_guide: bool = False  # X1: a spec that does not compile is accepted (and ignored)
    raw_guided_logprobs: bool = False  # L6: logprobs of the distribution before the grammar mask


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _require(ok: bool, message: str, code: grpc.StatusCode = INVALID) -> None:
    if not ok:
        raise Refused(code, message)


def log_softmax(xs: list[float]) -> list[float]:
    top = max(xs)
    z = top + math.log(sum(math.exp(x - top) for x in xs if x != -math.inf))
    return [x - z for x in xs]


#: Guided decoding (llguidance over the toy's ASCII vocabulary): every mode but structural_tag,
#: so that the suite also sees an unadvertised mode refused.
GUIDED_MODES = {"json_schema": oe.GUIDED_DECODING_MODE_JSON_SCHEMA, "json_object": oe.GUIDED_DECODING_MODE_JSON_OBJECT,
                "regex": oe.GUIDED_DECODING_MODE_REGEX, "ebnf_grammar": oe.GUIDED_DECODING_MODE_EBNF_GRAMMAR,
                "choice": oe.GUIDED_DECODING_MODE_CHOICE}
GUIDED_BACKEND = "llguidance"


class _AsciiTokenizer:
    """What llguidance.TokenizerWrapper reads: one byte per token, EOS last."""

    eos_token_id, bos_token_id = EOS, None
    tokens = [bytes([i]) for i in range(128)] + [b"</s>"]
    special_token_ids = [EOS]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


TOKENIZER = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_AsciiTokenizer()))


def _grammar(g: Any, mode: str) -> str:
    if mode == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(g.json_schema, defaults={"whitespace_flexible": False})
    if mode == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}',
                                                             defaults={"whitespace_flexible": False})
    if mode == "regex":
        return llguidance.grammar_from("regex", g.regex)
    if mode == "ebnf_grammar":
        return llguidance.grammar_from("gbnf", g.ebnf_grammar)
    _require(len(g.choice.choices) > 0, "guided.choice: no choices")
    return llguidance.grammar_from("choice", json.dumps(list(g.choice.choices)))


def compile_guide(req: Any, faults: Faults) -> str | None:
    """The llguidance grammar of ``req.guided`` (None: unguided); refuses what cannot run."""
    g = req.guided
    mode = g.WhichOneof("guide")
    if mode is None and not g.backend:
        return None
    _require(faults.guided, "guided decoding is not supported")
    _require(mode is not None, "guided.backend is set but no guide is")
    _require(mode in GUIDED_MODES, f"guided mode {mode} is not supported")
    _require(g.backend in ("", GUIDED_BACKEND), f"unknown guided backend {g.backend!r}")
    try:
        grammar = _grammar(g, mode)
        error = llguidance.LLMatcher.validate_grammar(grammar, TOKENIZER)
    except (ValueError, Refused) as exc:
        error = str(exc) or "invalid"
    if error:
        _require(faults.accept_invalid_guide, f"invalid guided.{mode}: {error}")
        return None
    return None if faults.ignore_grammar else grammar


def allowed_tokens(matcher: llguidance.LLMatcher) -> set[int]:
    mask = matcher.compute_bitmask()
    return {j for j in range(VOCAB) if mask[j // 8] >> (j % 8) & 1}


@dataclass
class Output:
    index: int
    rng: random.Random
    matcher: llguidance.LLMatcher | None = None
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0
    done: bool = False


@dataclass
class Job:
    req: Any
    prompt: list[int]
    max_tokens: int
    priority: int
    events: queue.Queue
    outputs: list[Output]
    arrival: float = field(default_factory=time.monotonic)
    cancelled: bool = False

    @property
    def stops(self) -> list[str]:
        return [c.stop_text for c in self.req.stopping.conditions if c.WhichOneof("condition") == "stop_text"]

    @property
    def stop_ids(self) -> set[int]:
        return {c.stop_token_id for c in self.req.stopping.conditions if c.WhichOneof("condition") == "stop_token_id"}


def distribution(ctx: list[int], prompt: list[int], temperature: float, masked: set[int]) -> list[float]:
    target = ord(TEXT[len(ctx) % len(TEXT)])
    logits = [-0.5 * abs(j - target) - 0.001 * j for j in range(VOCAB)]
    eos_prompt = "<|" in "".join(chr(i) for i in prompt if i < 128)
    logits[EOS] = 5.0 if eos_prompt and len(ctx) - len(prompt) >= 4 else -20.0
    scale = temperature if temperature > 0 else 1.0
    logits = [-math.inf if j in masked else x / scale for j, x in enumerate(logits)]
    return log_softmax(logits)


def token_info(tok: int, lp: list[float] | None, spec: Any | None) -> Any:
    info = oe.TokenInfo(token_id=tok, token=chr(tok) if tok < 128 else "</s>")
    if lp is None:
        return info
    info.logprob = lp[tok]
    info.rank = 1 + sum(1 for x in lp if x > lp[tok])
    order = sorted(range(VOCAB), key=lambda j: -lp[j])
    kind = spec.WhichOneof("selection") if spec is not None else None
    chosen = {"top_n": lambda: order[: spec.top_n], "all": lambda: order,
              "token_ids": lambda: list(spec.token_ids.ids)}.get(kind, lambda: [])()
    for j in chosen:
        info.candidates.add(token_id=j, logprob=lp[j] if lp[j] != -math.inf else -1e30,
                            token=chr(j) if j < 128 else "</s>", rank=1 + sum(1 for x in lp if x > lp[j]))
    return info


class ToyEngine:
    def __init__(self, faults: Faults) -> None:
        self.faults = faults
        self.lock = threading.Lock()
        self.jobs: dict[str, Job] = {}
        self.finished: set[str] = set()
        self.global_rng = random.Random(0)
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.running = True
        self.thread.start()

    def running_jobs(self) -> list[Job]:
        order = sorted(self.jobs.values(), key=lambda j: (-j.priority, j.arrival))
        return order[:MAX_RUNNING]

    def loop(self) -> None:
        while self.running:
            time.sleep(0.02)
            with self.lock:
                for job in self.running_jobs():
                    self.step(job)

    def step(self, job: Job) -> None:
        if job.cancelled:
            for out in job.outputs:
                if not out.done:
                    self.finish(job, out, self.faults.cancel_reason)
            return
        s, st = job.req.sampling, job.req.stopping
        temperature = s.temperature if s.HasField("temperature") else 1.0
        for out in job.outputs:
            if out.done:
                continue
            masked = set()
            if len(out.tokens) < st.min_tokens:
                masked |= job.stop_ids | {EOS}
            if st.ignore_eos:
                masked.add(EOS)
            lp = distribution(job.prompt + out.tokens, job.prompt, temperature, masked)
            reported = lp  # the distribution whose logprobs are sent
            if out.matcher is not None:
                lp = self.guided_distribution(job, out, temperature, masked)
                reported = reported if self.faults.raw_guided_logprobs else lp
            if temperature == 0:
                tok = max(range(VOCAB), key=lambda j: lp[j])
            else:
                tok = out.rng.choices(range(VOCAB), weights=[math.exp(x) for x in lp])[0]
            want_lp = job.req.response.return_output_logprobs
            info = token_info(tok, reported if want_lp else None, job.req.response.output_candidates
                              if job.req.response.HasField("output_candidates") else None)
            if out.matcher is not None:
                out.matcher.consume_token(tok)
            if tok == EOS:
                self.finish(job, out, oe.FINISH_REASON_STOP, oe.StopMatch(eos_token_id=EOS))
                continue
            if tok in job.stop_ids:
                if st.include_stop_in_output:
                    out.tokens.append(tok)
                    out.text += chr(tok)
                self.finish(job, out, oe.FINISH_REASON_STOP, oe.StopMatch(stop_token_id=tok),
                            [info] if st.include_stop_in_output else [])
                continue
            out.tokens.append(tok)
            out.text += chr(tok)
            hits = [(out.text.find(x, max(0, out.emitted - len(x))), x) for x in job.stops]
            hits = [(i, x) for i, x in hits if i >= 0]
            if hits:
                at, stop = min(hits)
                keep = out.text if self.faults.leak_stop else out.text[: at + (len(stop) if st.include_stop_in_output
                                                                              else 0)]
                out.text = keep
                self.finish(job, out, oe.FINISH_REASON_STOP, oe.StopMatch(stop_text=stop), [info])
                continue
            if len(out.tokens) >= job.max_tokens:
                self.finish(job, out, oe.FINISH_REASON_LENGTH, None, [info])
                continue
            held = max([k for x in job.stops for k in range(1, len(x)) if out.text.endswith(x[:k])], default=0)
            self.emit(job, out, [info], len(out.text) - held)

    @staticmethod
    def guided_distribution(job: Job, out: Output, temperature: float, masked: set[int]) -> list[float]:
        """The grammar's mask on top of ``masked``; where nothing would be left, the grammar wins."""
        forbidden = set(range(VOCAB)) - allowed_tokens(out.matcher)
        both = masked | forbidden if len(masked | forbidden) < VOCAB else forbidden
        return distribution(job.prompt + out.tokens, job.prompt, temperature, both)

    def emit(self, job: Job, out: Output, infos: list[Any], upto: int) -> None:
        upto = max(upto, out.emitted)
        ev = oe.GenerateResponse(request_id=job.req.request_id,
                                 token=oe.TokenOutput(output_index=out.index, tokens=infos,
                                                      text=out.text[out.emitted: upto]))
        out.emitted = upto
        self.put(job, ev, final=False)

    def finish(self, job: Job, out: Output, reason: int, match: Any = None, infos: list[Any] = ()) -> None:
        if infos or out.emitted < len(out.text):
            self.emit(job, out, list(infos), len(out.text))
        out.done = True
        fin = oe.GenerationFinished(output_index=out.index, reason=reason)
        if match is not None:
            fin.stop_match.CopyFrom(match)
        last = all(o.done for o in job.outputs)
        ev = oe.GenerateResponse(request_id=job.req.request_id, finished=fin)
        self.put(job, ev, final=last)
        if last:
            del self.jobs[job.req.request_id]
            self.finished.add(job.req.request_id)
            job.events.put(None)

    def put(self, job: Job, ev: Any, final: bool) -> None:
        if final or self.faults.usage_every_event:
            done = sum(len(o.tokens) for o in job.outputs)
            ev.usage.CopyFrom(oe.Usage(prompt_tokens=len(job.prompt), completion_tokens=done,
                                       total_tokens=len(job.prompt) + done, cached_prompt_tokens=0))
        job.events.put(ev)

    # -- admission ---------------------------------------------------------------
    def submit(self, req: Any, priority: int) -> Job:
        prompt = validate(req, self.faults)
        grammar = compile_guide(req, self.faults)
        max_tokens = req.stopping.max_tokens if req.stopping.HasField("max_tokens") else CTX - len(prompt)
        n = req.sampling.num_sequences if req.sampling.HasField("num_sequences") else 1
        seed = req.sampling.seed if req.sampling.HasField("seed") else None
        rngs = [random.Random(seed * 1000 + i) if seed is not None else random.Random(self.global_rng.random())
                for i in range(n)]
        outputs = [Output(i, rngs[i], llguidance.LLMatcher(TOKENIZER, grammar, log_level=0) if grammar else None)
                   for i in range(n)]
        job = Job(req, prompt, max_tokens, priority, queue.Queue(), outputs)
        with self.lock:
            _require(req.request_id not in self.jobs, "duplicate request_id", grpc.StatusCode.ALREADY_EXISTS)
            self.jobs[req.request_id] = job
            self.finished.discard(req.request_id)
        if req.response.return_prompt_logprobs:
            po = oe.PromptOutput()
            spec = req.response.prompt_candidates if req.response.HasField("prompt_candidates") else None
            for i in range(req.response.prompt_logprob_start, len(prompt)):
                lp = distribution(prompt[:i], prompt, 1.0, set()) if i > 0 else None
                po.tokens.append(token_info(prompt[i], lp, spec))
            job.events.put(oe.GenerateResponse(request_id=req.request_id, prompt=po))
        return job

    def abort(self, request_id: str) -> int | None:
        with self.lock:
            if request_id in self.jobs:
                self.jobs[request_id].cancelled = True
                if self.jobs[request_id] not in self.running_jobs():
                    self.step(self.jobs[request_id])
                return oe.ABORT_STATUS_ABORTED
            return oe.ABORT_STATUS_ALREADY_FINISHED if request_id in self.finished else None


def validate(req: Any, faults: Faults) -> list[int]:
    """G1-G8 (and G19) as refengine reads them; returns the prompt token ids."""
    _require(bool(req.request_id), "request_id is empty")
    models = ("", MODELS[0]) if faults.refuse_alias else ("", *MODELS)
    _require(req.model in models, f"model {req.model!r} not served", grpc.StatusCode.NOT_FOUND)
    kind = req.WhichOneof("input")
    _require(kind is not None, "no input")
    prompt = [min(ord(c), 63) if ord(c) >= 128 else ord(c) for c in req.prompt] if kind == "prompt" \
        else list(req.token_ids.ids)
    _require(bool(prompt) and all(t < VOCAB for t in prompt), "empty prompt or token id out of vocabulary")
    s, st, r = req.sampling, req.stopping, req.response
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        _require(not s.HasField(name) or math.isfinite(getattr(s, name)), f"{name} not finite")
    _require(s.temperature >= 0 and (not s.HasField("top_p") or 0 < s.top_p <= 1) and s.top_k >= -1
             and 0 <= s.min_p <= 1 and (not s.HasField("repetition_penalty") or s.repetition_penalty > 0),
             "sampling value out of range")
    _require(not s.HasField("num_sequences") or 1 <= s.num_sequences <= MAX_N, "num_sequences out of range")
    _require(all(c.WhichOneof("condition") for c in st.conditions), "empty StopCondition")
    _require(all(c.stop_token_id < VOCAB for c in st.conditions), "stop token out of vocabulary")
    _require(not st.HasField("max_tokens") or st.max_tokens >= 1, "max_tokens 0")
    _require(not st.HasField("max_tokens") or st.min_tokens <= st.max_tokens, "min_tokens > max_tokens")
    _require(len(prompt) < CTX and len(prompt) + st.max_tokens <= CTX, "context limit")
    _require(r.prompt_logprob_start < len(prompt), "prompt_logprob_start beyond the prompt")
    for spec in (r.prompt_candidates, r.output_candidates):
        kind = spec.WhichOneof("selection")
        _require(kind != "top_n" or 1 <= spec.top_n <= MAX_TOP_N, "top_n out of range")
        _require(kind != "token_ids" or all(t < VOCAB for t in spec.token_ids.ids), "candidate id out of vocab")
    _require(not req.media or faults.ignore_media, "multimodal input is not supported")
    _require(not req.lora_name, "unknown LoRA adapter", grpc.StatusCode.NOT_FOUND)
    _require(not req.kv.HasField("session"), "kv.session on an AGGREGATED engine", grpc.StatusCode.FAILED_PRECONDITION)
    extra = json_format.MessageToDict(req.extra)
    _require("toy_knob" not in extra or isinstance(extra["toy_knob"], int | float), "extra.toy_knob: a number")
    return prompt


def parse_metadata(md: Any) -> int:
    """M1/M2: returns the priority."""
    seen: dict[str, str] = {}
    for key, value in md:
        if key.startswith("openengine-"):
            _require(key not in seen, f"{key} repeated")
            seen[key] = value
    if "openengine-routing-key" in seen:
        _require(seen["openengine-routing-key"] != "", "empty routing key")
    for key, lo, hi in (("openengine-target-dp-rank", 0, 2**32 - 1), ("openengine-priority", -(2**31), 2**31 - 1)):
        if key in seen:
            v = seen[key]
            _require(v.lstrip("-").isdigit() and (key != "openengine-target-dp-rank" or v.isdigit())
                     and lo <= int(v) <= hi, f"{key}: {v!r}")
    return int(seen.get("openengine-priority", 0))
