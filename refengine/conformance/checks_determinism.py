"""Section G, part 4 — reproducibility: seeded sampling (G17) and greedy invariance (G18)."""

from __future__ import annotations

from typing import Any

from refengine.conformance.assertions import expect_valid
from refengine.conformance.checks_output import LONG_PROMPT, OTHER_PROMPTS
from refengine.conformance.registry import check, expect, skip
from refengine.conformance.streams import Background, StreamResult
from refengine.conformance.target import Target


def _load_in_background(t: Target, count: int, tag: str) -> list[tuple[Any, Background]]:
    """Start ``count`` unrelated requests (different prompts and lengths, sampled) and
    return them; the caller joins them. They keep the batch mixed while a check runs."""
    started = []
    for i in range(count):
        req = t.request(tag, prompt=OTHER_PROMPTS[i % len(OTHER_PROMPTS)] * (1 + i % 3),
                        max_tokens=12 + 6 * i, temperature=0.8, ignore_eos=True)
        req.sampling.seed = 100 + i
        started.append((req, t.generate_async(req)))
    t.wait_busy(lambda lo: lo.running_requests + lo.queued_requests >= min(count, 2), timeout=5)
    return started


def _join_all(started: list[tuple[Any, Background]]) -> None:
    for req, call in started:
        expect_valid(call.join(), what=f"background request {req.request_id}")


def _outputs(res: StreamResult, n: int) -> list[list[int]]:
    return [res.tokens(i) for i in range(n)]


def _seeded(t: Target, seed: int, n: int = 1) -> Any:
    req = t.request("g17", prompt=LONG_PROMPT, max_tokens=12, temperature=1.0, ignore_eos=True)
    req.sampling.seed = seed
    req.sampling.top_p = 0.95
    if n > 1:
        req.sampling.num_sequences = n
    return req


@check("G17", "seed: the same seeded request gives the same tokens, alone and batched with others")
def seed_reproducible(t: Target) -> str:
    """G17: seeded sampling is reproducible, independent of what else is batched."""
    n = 2 if (t.max_num_sequences or 1) >= 2 else 1
    first = expect_valid(t.generate(_seeded(t, 1234, n)), num_sequences=n, what="seeded run 1")
    again = expect_valid(t.generate(_seeded(t, 1234, n)), num_sequences=n, what="seeded run 2 (alone)")
    expect(_outputs(again, n) == _outputs(first, n),
           f"same seed, run alone twice: {_outputs(first, n)} then {_outputs(again, n)}")
    background = _load_in_background(t, 3, "g17bg")
    try:
        busy = expect_valid(t.generate(_seeded(t, 1234, n)), num_sequences=n, what="seeded run 3 (batched)")
    finally:
        _join_all(background)
    expect(_outputs(busy, n) == _outputs(first, n),
           f"same seed, alone {_outputs(first, n)} vs batched with 3 others {_outputs(busy, n)}")
    other = expect_valid(t.generate(_seeded(t, 4321, n)), num_sequences=n, what="other seed")
    note = "" if _outputs(other, n) != _outputs(first, n) else " (note: seed 4321 gave the same tokens)"
    t.wait_idle("G17")
    return f"seed 1234 reproducible alone and batched ({n} output(s)){note}"


@check("G18", "greedy output is identical alone, under concurrent load, and on prefix-cache hits")
def greedy_invariant(t: Target) -> str:
    """G18: temperature 0 is independent of batch composition and cache hits.

    Runs the same greedy request alone, then while four other requests (different
    prompts and lengths) run concurrently, then again (its prefix is now cached),
    then with bypass_prefix_cache when advertised."""

    def greedy(tag: str, **kv: Any) -> StreamResult:
        req = t.request(tag, prompt=LONG_PROMPT, max_tokens=16, ignore_eos=True)
        for key, value in kv.items():
            setattr(req.kv, key, value)
        return expect_valid(t.generate(req), what=f"greedy run ({tag})")

    alone = greedy("g18alone")
    background = _load_in_background(t, 4, "g18bg")
    try:
        busy = greedy("g18busy")
    finally:
        _join_all(background)
    expect(busy.tokens() == alone.tokens(),
           f"greedy alone {alone.tokens()} vs with 4 concurrent requests {busy.tokens()}")
    cached = greedy("g18cached")
    expect(cached.tokens() == alone.tokens(),
           f"greedy alone {alone.tokens()} vs repeated (prefix cached) {cached.tokens()}")
    usage = cached.usage()  # None (no usage at all) is G16's finding, not this check's
    hits = usage.cached_prompt_tokens if usage is not None and usage.HasField("cached_prompt_tokens") else None
    notes = [f"cached_prompt_tokens={hits}"]
    if t.caps.HasField("supports_prefix_cache_bypass") and t.caps.supports_prefix_cache_bypass:
        bypass = greedy("g18bypass", bypass_prefix_cache=True)
        expect(bypass.tokens() == alone.tokens(),
               f"greedy alone {alone.tokens()} vs bypass_prefix_cache {bypass.tokens()}")
        notes.append("bypass checked")
    # A prompt extending the cached one: the shared prefix is reused, the rest computed.
    longer_req = t.request("g18ext", prompt=LONG_PROMPT + " And then", max_tokens=8, ignore_eos=True)
    longer = expect_valid(t.generate(longer_req))
    longer_again = expect_valid(t.generate(t.request("g18ext", prompt=LONG_PROMPT + " And then", max_tokens=8,
                                                     ignore_eos=True)))
    expect(longer.tokens() == longer_again.tokens(),
           f"extended prompt, first {longer.tokens()} vs repeated {longer_again.tokens()}")
    t.wait_idle("G18")
    return "identical alone, batched, cached; " + ", ".join(notes)


@check("G18", "greedy output of a prompt longer than the step token budget (chunked prefill) is invariant")
def greedy_chunked(t: Target) -> str:
    """G18: a prompt above max_batched_tokens must be prefilled in chunks; its greedy
    output is the same alone, while other requests share the step budget, and cached."""
    cap = t.server_info.capacity
    budget = cap.max_batched_tokens if cap.HasField("max_batched_tokens") else None
    ctx = t.max_context_length or 0
    if budget is None:
        skip("max_batched_tokens not reported: chunking cannot be forced (the other G18 check still runs)")
    length = budget + budget // 2 + 7
    needs = f"forcing chunking needs a prompt of {length} tokens (1.5 x max_batched_tokens {budget})"
    if ctx and length + 8 > ctx:
        skip(f"{needs}; the context holds {ctx}")
    if length > t.options.max_long_prompt:
        skip(f"{needs}; the longest prompt this run sends is {t.options.max_long_prompt}")
    ids = t.known_token_ids()
    prompt = [ids[(i * 7) % len(ids)] for i in range(length)]

    def greedy(tag: str) -> StreamResult:
        req = t.request(tag, token_ids=prompt, max_tokens=8, ignore_eos=True)
        if t.caps.HasField("supports_cache_salt") and t.caps.supports_cache_salt:
            req.kv.cache_salt = f"oeconf-{tag}"  # no cache reuse between these runs
        return expect_valid(t.generate(req, timeout=max(t.options.stream_timeout_s, 120)),
                            what=f"{length}-token greedy run ({tag})")

    alone = greedy("g18chunk-alone")
    background = _load_in_background(t, 3, "g18cbg")
    try:
        busy = greedy("g18chunk-busy")
    finally:
        _join_all(background)
    expect(busy.tokens() == alone.tokens(),
           f"{length}-token prompt (budget {budget}): alone {alone.tokens()} vs batched {busy.tokens()}")
    t.wait_idle("G18 chunked")
    return f"{length}-token prompt over a {budget}-token budget: identical alone and batched"
