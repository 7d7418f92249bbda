"""Section G, part 2 — what an accepted Generate stream contains (G9–G18).

Stop strings and tokens are chosen from a greedy reference run of the same
prompt, so the checks know where a match must happen without a tokenizer.
"""

from __future__ import annotations

from typing import Any

from refengine.conformance.assertions import expect_finish, expect_valid, overlapping_outputs
from refengine.conformance.registry import CheckSkipped, check, expect, skip
from refengine.conformance.streams import StreamResult
from refengine.conformance.target import Target
from refengine.protocol import oe

#: Prompts tried in order (up to 48 tokens each) until one ends at EOS. The plain question goes
#: first: small models end it within a dozen tokens (SmolLM2-135M-Instruct: 10), while they run
#: past 48 on the chat-templated ones, which are there for models that need a template to stop.
EOS_PROMPTS = [
    "Question: What is 2 + 2?\nAnswer:",
    "<|im_start|>user\nReply with the single word OK.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "[INST] Say OK. [/INST]",
]
LONG_PROMPT = ("In the beginning the universe was created. This has made a lot of people very angry and been "
               "widely regarded as a bad move.")
OTHER_PROMPTS = ["Write a poem about the sea.", "1, 2, 3, 4, 5,", "def fibonacci(n):",
                 "The weather today is", "Translate to French: good morning"]


def greedy_reference(t: Target, max_tokens: int = 24, prompt: str | None = None) -> StreamResult:
    """A greedy, ignore_eos run of the default (or given) prompt, shared between checks."""
    key = f"greedy:{max_tokens}:{prompt}"
    if key not in t.cache:
        res = t.generate(t.request("ref", prompt=prompt, max_tokens=max_tokens, ignore_eos=True))
        t.cache[key] = expect_valid(res, what="greedy reference run")
        expect(len(res.tokens()) == max_tokens, f"greedy reference produced {len(res.tokens())} tokens, "
                                                f"max_tokens {max_tokens} with ignore_eos")
    return t.cache[key]


def eos_reference(t: Target) -> tuple[Any, StreamResult] | None:
    """A (request, result) whose greedy output ends at the model's EOS, or None. The probes set no
    stop condition, so an output ending STOP before max_tokens ended at EOS, whatever its
    stop_match says (G13 judges that)."""
    if "eos" not in t.cache:
        t.cache["eos"] = None
        if t.supports_text():
            for prompt in EOS_PROMPTS:
                req = t.request("eos", prompt=prompt, max_tokens=48)
                res = expect_valid(t.generate(req), what="EOS probe")
                fin = res.finished()
                expect(fin is not None, f"the EOS probe's stream has no GenerationFinished ({res.describe()})")
                if fin.reason == oe.FINISH_REASON_STOP:
                    t.cache["eos"] = (req, res)
                    break
    return t.cache["eos"]


def spanning_stop(ref: StreamResult, span: int) -> tuple[str, int, int]:
    """A stop string crossing ``span`` delta boundaries of ``ref`` whose first occurrence
    is there. Returns (stop, start offset in the text, tokens needed to complete it)."""
    events = ref.token_events(0)
    texts = [e.text for e in events]
    full = "".join(texts)
    offsets, tokens_through = [], []
    pos = count = 0
    for e in events:
        offsets.append(pos)
        pos += len(e.text)
        count += len(e.tokens)
        tokens_through.append(count)
    for d in range(1, len(texts) - span):
        middle = texts[d + 1: d + span]
        if not texts[d] or not texts[d + span] or (span > 1 and not all(middle)):
            continue
        left = texts[d][-2:] if span == 1 else texts[d][-1:]
        right = texts[d + span][:2] if span == 1 else texts[d + span][:1]
        stop = left + "".join(middle) + right
        start = offsets[d] + len(texts[d]) - len(left)
        if stop.strip() and full.find(stop) == start:
            return stop, start, tokens_through[d + span]
    # How a server groups tokens into deltas is its own choice (one TokenOutput is a valid delta):
    # without such a boundary hold-back cannot be observed, which is no violation.
    raise CheckSkipped(f"no stop string spanning {span + 1} deltas found in the reference text {full!r} "
                       f"({len(texts)} TokenOutput deltas)")


def some_stop(ref: StreamResult) -> str:
    """A stop string of the reference text whose first occurrence ends the output early: one
    spanning a delta boundary when the deltas offer one, else any 3 characters from its middle."""
    try:
        return spanning_stop(ref, 1)[0]
    except CheckSkipped:
        full = ref.text()
        for start in range(2, len(full) - 3):
            stop = full[start:start + 3]
            if stop.strip() and full.find(stop) == start:
                return stop
        raise


def text_through(ref: StreamResult, num_tokens: int) -> str | None:
    """The reference's text of its first ``num_tokens`` tokens, when a delta ends right there
    (how a server groups tokens into deltas is its own choice); None otherwise."""
    text, count = "", 0
    for event in ref.token_events(0):
        if count == num_tokens:
            return text
        text, count = text + event.text, count + len(event.tokens)
    return text if count == num_tokens else None


def first_unique_token(ref: StreamResult, lo: int = 2) -> tuple[int, int]:
    """(position, id) of a reference token at position >= lo that does not occur earlier."""
    tokens = ref.tokens()
    for j in range(lo, len(tokens)):
        if tokens[j] not in tokens[:j]:
            return j, tokens[j]
    raise CheckSkipped(f"no token of the reference output {tokens} is usable as a stop token (each repeats an "
                       "earlier one)")


@check("G9", "every response carries the request's request_id")
def request_id_echo(t: Target) -> str:
    """G9: checked on a plain, a multi-output and an aborted stream."""
    expect_valid(t.generate(t.request("g9", max_tokens=4)))
    count = 1
    if t.max_num_sequences and t.max_num_sequences >= 2:
        req = t.request("g9", max_tokens=3, temperature=1.0)
        req.sampling.num_sequences, req.sampling.seed = 2, 3
        expect_valid(t.generate(req), num_sequences=2)
        count += 1
    req = t.long_request("g9")
    res = t.generate_aborted(req)
    for i, event in enumerate(res.events):
        expect(event.request_id == req.request_id,
               f"aborted stream event {i} carries request_id {event.request_id!r}, sent {req.request_id!r}")
    return f"{count + 1} streams checked"


@check("G10", "TokenOutput and GenerationFinished always carry output_index (also 0), within range")
def output_index(t: Target) -> str:
    """G10 for one output: output_index present (proto3 optional, also 0) on every token and finish."""
    expect_valid(t.generate(t.request("g10", max_tokens=3)))  # presence for index 0 via stream_violations
    return "index 0 present"


@check("G10", "num_sequences 3: every output_index present and within 0..2")
def output_index_multi(t: Target) -> str:
    """G10 for several outputs: indices present and in range (profile multi-sequence)."""
    t.need_sequences(3)
    req = t.request("g10", max_tokens=3, temperature=1.0, ignore_eos=True)
    req.sampling.num_sequences, req.sampling.seed = 3, 11
    res = expect_valid(t.generate(req), num_sequences=3)
    seen = {e.output_index for e in res.of("token")} | {f.output_index for f in res.of("finished")}
    expect(seen == {0, 1, 2}, f"num_sequences 3 produced output indices {sorted(seen)}, expected [0, 1, 2]")
    return "indices 0..2 present"


@check("G11", "TokenOutput is a delta: concatenated tokens and text give the full output")
def token_deltas(t: Target) -> str:
    """G11: deltas hold only new tokens and text, and a LENGTH finish keeps its last step's text
    (found by review: only a prefix was asked of the shorter run, so a server losing the text of
    the tokens it ends with passed). The shorter run ends where a reference delta ends, so that
    the reference's text through those tokens is known and must be there."""
    ref = greedy_reference(t)
    n = next((j for j in (8, *range(4, 17)) if text_through(ref, j) is not None), 8)
    short = expect_valid(t.generate(t.request("g11", max_tokens=n, ignore_eos=True)))
    n = len(short.tokens())
    usage = short.usage()  # None: no usage at all is G16's finding, not a crash of this check
    expect(usage is None or n == usage.completion_tokens,
           f"{n} tokens across deltas, usage.completion_tokens {usage.completion_tokens if usage else None}")
    expect(ref.tokens()[:n] == short.tokens(), f"greedy tokens of max_tokens 8 {short.tokens()} are not a prefix "
                                               f"of max_tokens 24 {ref.tokens()}")
    expect(ref.text().startswith(short.text()),
           f"text of max_tokens {n} {short.text()!r} is not a prefix of max_tokens 24 {ref.text()!r}")
    through = text_through(ref, n)
    expect(through is None or short.text().startswith(through),
           f"max_tokens {n} ended with text {short.text()!r}, but the same {n} tokens of max_tokens 24 had "
           f"sent {through!r}: the text of the last delta is lost at the LENGTH finish")
    overlaps = overlapping_outputs(ref)
    expect(not overlaps, f"the text holds {overlaps[0][1] if overlaps else 0} more non-space characters than "
                         f"the tokens' own texts: text deltas overlap")
    if len(ref.token_events()) < 2:  # legal (one delta is still a delta), but shows nothing of G11
        skip("24 tokens arrived in a single TokenOutput: delta concatenation cannot be observed")
    return f"{len(ref.token_events())} deltas for {len(ref.tokens())} tokens"


@check("G12", "one GenerationFinished for a single output, nothing after it, never UNSPECIFIED")
def one_finish(t: Target) -> str:
    """G12 for one output: a successful stream ends with exactly one finish."""
    res = expect_valid(t.generate(t.request("g12", max_tokens=4)))
    count = len(res.of("finished"))
    expect(count == 1, f"{count} GenerationFinished events for one output, expected one")
    return "one finish"


@check("G12", "one GenerationFinished per output (num_sequences > 1), nothing after it, never UNSPECIFIED")
def one_finish_per_output(t: Target) -> str:
    """G12: exactly one finish per output index (profile multi-sequence)."""
    t.need_sequences(3)
    req = t.request("g12", max_tokens=6, temperature=1.0)
    req.sampling.num_sequences, req.sampling.seed = 3, 5
    res = expect_valid(t.generate(req), num_sequences=3)
    counts = [sum(1 for f in res.of("finished") if f.output_index == i) for i in range(3)]
    expect(counts == [1, 1, 1], f"GenerationFinished per output: {counts}, expected one each")
    return "one finish per output for 3 outputs"


@check("G13", "LENGTH when max_tokens ends the output (exactly max_tokens tokens)")
def finish_length(t: Target) -> str:
    """G13: max_tokens ends the output with reason LENGTH."""
    res = expect_valid(t.generate(t.request("g13", max_tokens=5, ignore_eos=True)))
    expect_finish(res, oe.FINISH_REASON_LENGTH)
    expect(len(res.tokens()) == 5, f"max_tokens 5 produced {len(res.tokens())} tokens")
    return "LENGTH after 5 tokens"


@check("G13", "STOP carries stop_match naming the stop string or stop token")
def finish_stop_match(t: Target) -> str:
    """G13: reason STOP comes with the StopMatch that ended the output, which is not merely the
    first condition of its kind: a condition that never matches goes first (found by review: a
    server naming the first configured condition passed)."""
    ref = greedy_reference(t)
    stop = some_stop(ref)
    req = t.request("g13s", max_tokens=24, ignore_eos=True)
    decoy_text = next(d for d in ("\u2400\u2401", "\u2402\u2403", "\u2404\u2405") if d not in ref.text())
    req.stopping.conditions.add(stop_text=decoy_text)
    req.stopping.conditions.add(stop_text=stop)
    fin = expect_finish(expect_valid(t.generate(req)), oe.FINISH_REASON_STOP, what=f"stop string {stop!r}")
    expect(fin.stop_match.WhichOneof("match") == "stop_text" and fin.stop_match.stop_text == stop,
           f"stop_match is {fin.stop_match} for stop string {stop!r} (after {decoy_text!r}, which never matches)")
    at, token = first_unique_token(ref)
    later = [tok for tok in ref.tokens()[at + 1:] if tok not in ref.tokens()[:at + 1]]  # never sent before it
    req = t.request("g13t", max_tokens=24, ignore_eos=True)
    for stop_id in later[:1] + [token]:
        req.stopping.conditions.add(stop_token_id=stop_id)
    fin = expect_finish(expect_valid(t.generate(req)), oe.FINISH_REASON_STOP, what=f"stop token {token}")
    expect(fin.stop_match.WhichOneof("match") == "stop_token_id" and fin.stop_match.stop_token_id == token,
           f"stop_match is {fin.stop_match} for stop token {token}"
           + (f" (after {later[0]}, which the output never reaches)" if later else ""))
    decoys = "a decoy of each kind first" if later else "a decoy stop string first (no token left for a decoy)"
    return f"stop string {stop!r} and stop token {token} matched, {decoys}"


@check("G13", "STOP at the model's EOS carries stop_match naming eos_token_id")
def finish_eos_match(t: Target) -> str:
    """G13: an output ended by EOS says so (found by :func:`eos_reference`, which looks for it)."""
    eos = eos_reference(t)
    if eos is None:
        skip("no prompt reached EOS within 48 tokens: an EOS stop cannot be observed")
    req, res = eos
    match = res.finished().stop_match
    expect(match.WhichOneof("match") == "eos_token_id",
           f"output of {req.prompt!r} stopped at EOS (STOP, no stop condition set) with stop_match {match}")
    named, tokens = match.eos_token_id, res.tokens()
    through = ignoring_eos(t, req, tokens)
    if named in (through[len(tokens)], tokens[-1] if tokens else None):
        return f"EOS ({named}) matched"
    # Under ignore_eos the model went on with another token: the name is wrong, or the server
    # masks EOS under ignore_eos (no rule forbids it). The prompt logprobs of the output with
    # the named token appended tell: greedy decoding chose it there, so it ranks first.
    rank = rank_after(t, req, tokens, named)
    if rank is None:
        skip(f"under ignore_eos the output went on with token {through[len(tokens)]} where it had stopped at EOS "
             f"(named {named}), and without prompt logprobs for token ids it cannot be told whether the server "
             "masks EOS there or named the wrong token")
    expect(rank == 1, f"output of {req.prompt!r} stopped at EOS naming eos_token_id {named}, but that token ranks "
                      f"{rank} there, not 1 (greedy chose the token the output stopped at)")
    return f"EOS ({named}) matched (ranks first there; EOS masked under ignore_eos)"


def ignoring_eos(t: Target, req: Any, tokens: list[int]) -> list[int]:
    """The same greedy request with ``ignore_eos``, one token longer than the EOS-ended output
    ``tokens``: it goes on through the EOS token unless the server masks EOS then (G15; greedy
    output is the same whatever else runs, G18)."""
    again = t.request("eosig", prompt=req.prompt, max_tokens=len(tokens) + 1, ignore_eos=True)
    through = expect_valid(t.generate(again), what="EOS probe with ignore_eos").tokens()
    if through[:len(tokens)] != tokens or len(through) <= len(tokens):
        skip(f"the EOS probe with ignore_eos produced {through}, not the EOS-ended output {tokens} and one more "
             "token: where the EOS was cannot be told (G18 judges greedy reproducibility)")
    return through


def rank_after(t: Target, req: Any, tokens: list[int], token: int) -> int | None:
    """The rank of ``token`` after ``req``'s prompt and ``tokens`` (prompt logprobs of them all
    sent as token ids); None when the server offers no prompt logprobs or token-id input."""
    caps = t.caps.prompt_logprobs
    if not (t.caps.HasField("prompt_logprobs") and caps.supported and t.model_info.supports_token_ids_input):
        return None
    asked = t.request("eosp", prompt=req.prompt, max_tokens=1)
    asked.response.return_prompt_logprobs = True
    prompt = [info.token_id for out in expect_valid(t.generate(asked)).of("prompt") for info in out.tokens]
    scored = t.request("eosr", token_ids=prompt + tokens + [token], max_tokens=1)
    scored.response.return_prompt_logprobs = True
    infos = [info for out in expect_valid(t.generate(scored)).of("prompt") for info in out.tokens]
    expect(bool(infos) and infos[-1].token_id == token and infos[-1].HasField("rank"),
           f"prompt logprobs of {len(prompt + tokens) + 1} token ids end with {infos[-1:]}, not a ranked {token}")
    return infos[-1].rank


@check("G13", "CANCELLED when the request is aborted")
def finish_cancelled(t: Target) -> str:
    """G13 (with A4): an aborted output finishes with CANCELLED."""
    req = t.long_request("g13c")
    res = t.generate_aborted(req)
    expect_valid(res, what="aborted stream")
    expect_finish(res, oe.FINISH_REASON_CANCELLED, what="aborted request")
    t.wait_idle("G13 abort")
    return "CANCELLED after Abort"
