"""Section K, the prefix cache (K1–K3): reuse is reported, can be bypassed, and is namespaced by salt.

What a client can see of a prefix cache is ``Usage.cached_prompt_tokens``. Every check sends
a prompt no earlier request began with (random text first) so that its first run cannot be a
hit, then repeats it. A server may have no prefix cache, or evict between two requests: a
repeat served from nothing is then not a violation, and the parts that need a hit are
skipped, saying so. What is always a violation: a hit on a prompt never seen (K3), a hit
through ``bypass_prefix_cache`` (K1), a hit across different salts (K2). A cache of
single-token pages (a radix tree, as SGLang's by default) may serve a never-seen prompt's first
tokens (BOS, a leading piece) from an earlier prompt: up to SHARED_START_TOKENS is no hit.
"""

from __future__ import annotations

from typing import Any

from refengine.conformance.assertions import expect_valid
from refengine.conformance.kv_subscriber import fresh_prompt
from refengine.conformance.registry import check, expect, not_claimed, skip
from refengine.conformance.target import Target

#: Cached tokens a never-seen prompt may report on a token-granular cache (found by review: K2 and
#: K3 failed such a cache for its shared start). A hit of a page-granular cache is a whole page.
SHARED_START_TOKENS = 4


def _cached(t: Target, prompt: str, what: str, salt: str = "", bypass: bool = False) -> int:
    """Send ``prompt`` (greedy, 2 tokens); its ``cached_prompt_tokens`` (checked ≤ prompt_tokens)."""
    return _usage(t, prompt, what, salt, bypass).cached_prompt_tokens


def _usage(t: Target, prompt: str, what: str, salt: str = "", bypass: bool = False) -> Any:
    """Send ``prompt`` (greedy, 2 tokens); its Usage, with ``cached_prompt_tokens`` ≤ prompt_tokens."""
    req = t.request("k", prompt=prompt, max_tokens=2)
    if salt:
        req.kv.cache_salt = salt
    if bypass:
        req.kv.bypass_prefix_cache = True
    usage: Any = expect_valid(t.generate(req), what=what).usage()
    if usage is None or not usage.HasField("cached_prompt_tokens"):
        not_claimed("Usage.cached_prompt_tokens is not reported: prefix-cache reuse cannot be observed")
    expect(0 <= usage.cached_prompt_tokens <= usage.prompt_tokens,
           f"{what}: cached_prompt_tokens {usage.cached_prompt_tokens} outside 0..prompt_tokens {usage.prompt_tokens}")
    return usage


def _need_text(t: Target) -> None:
    if not t.supports_text():
        not_claimed("the model takes no text prompt; the prefix-cache checks send fresh text prompts")


@check("K3", "cached_prompt_tokens: 0 for a prompt never seen, the reused prefix for its repeat")
def cached_prompt_tokens(t: Target) -> str:
    """K3: a fresh prompt is served from nothing; its repeat reports the cached prefix, in tokens
    (found by review: any positive count passed, so a server reporting cached blocks did)."""
    _need_text(t)
    prompt = fresh_prompt(t, "k3")
    first = _cached(t, prompt, "a prompt never seen")
    expect(first <= SHARED_START_TOKENS, f"a prompt no request began with reported cached_prompt_tokens {first}; "
                                         f"expected 0 (up to {SHARED_START_TOKENS} for a token-granular cache)")
    usage = _usage(t, prompt, "the same prompt again")
    if usage.cached_prompt_tokens == 0:
        skip("the repeat was not served from cache (no prefix cache, or evicted): nothing more to observe")
    return f"fresh 0, repeat {usage.cached_prompt_tokens} cached; {_whole_prefix(t, prompt, usage)}"


def _whole_prefix(t: Target, prompt: str, usage: Any) -> str:
    """K3 in tokens: a repeat served from cache reports at least a third of its prompt. A cache of
    pages of g tokens serves at least one page, and all but the last two (a server may keep the
    last one uncached, and the last prompt token is computed anyway): at least max(g, P - 2g)
    ≥ P / 3 of P prompt tokens, whatever g (it may be coarser than ``capacity.kv_block_size``: the
    toy caches 32-token pages over 4-token blocks). A count of blocks (P / kv_block_size) is
    below that for blocks of 4 tokens or more. Below it, a third send (its pages were all just
    stored again) tells a partial eviction from a count in the wrong unit."""
    least, again = (usage.prompt_tokens - 1) // 3, usage.cached_prompt_tokens
    if again < least:
        third = _cached(t, prompt, "the same prompt a third time")
        cap = t.server_info.capacity if t.server_info is not None else None
        unit = f" (of {cap.kv_block_size} tokens)" if cap is not None and cap.HasField("kv_block_size") else ""
        expect(third >= least, f"repeats of a {usage.prompt_tokens}-token prompt reported cached_prompt_tokens "
                               f"{again}, then {third}: under a third of the prompt ({least}), what no cache "
                               f"serving whole prefix pages reports; K3 counts tokens, not blocks{unit}")
    return f"at least a third of the {usage.prompt_tokens}-token prompt"


@check("K1", "bypass_prefix_cache: no reuse for that request (a plain repeat after it is reported, not judged)")
def bypass_skips_reuse(t: Target) -> str:
    """K1: a bypassing repeat reports 0 cached tokens; a later plain repeat may hit (RULES K1: the
    bypassing request's blocks "may still be cached", so a miss there is no failure; found by
    review: the title promised the prompt could still be reused)."""
    _need_text(t)
    if not t.caps.supports_prefix_cache_bypass:
        not_claimed("supports_prefix_cache_bypass is not advertised")
    prompt = fresh_prompt(t, "k1")
    _cached(t, prompt, "the prompt, first time")
    bypassed = _cached(t, prompt, "the prompt again with bypass_prefix_cache", bypass=True)
    expect(bypassed == 0, f"bypass_prefix_cache = true reported cached_prompt_tokens {bypassed}; expected 0")
    plain = _cached(t, prompt, "the prompt again without bypass")
    if plain == 0:  # found by review: a server with no prefix cache passed (every count is 0 there)
        skip("a plain repeat was not served from cache either (no prefix cache, or evicted): a bypass "
             "reporting 0 shows nothing")
    return f"bypass 0 cached; a plain repeat {plain} cached"


@check("K2", "cache_salt: equal prompts with different salts share no cached block")
def salt_namespaces(t: Target) -> str:
    """K2: salt A caches; salt B and no salt see nothing of it; salt A again may hit. The other
    way round too: a prompt cached without salt is nothing to salt C (found by review: a cache
    falling back to the unsalted namespace on a salted miss passed). When a prompt's first run
    already reports a hit, the server counts hits on prompts never seen (K3's finding) and a hit
    across salts could be that: nothing to judge (skip)."""
    _need_text(t)
    if not t.caps.supports_cache_salt:
        not_claimed("supports_cache_salt is not advertised")
    salt_a, salt_b, salt_c = (t.new_id(f"salt-{x}") for x in "abc")
    cases = [("salt A", salt_a, (("salt B", salt_b), ("no salt", ""))), ("no salt", "", (("salt C", salt_c),))]
    for first_what, first_salt, others in cases:
        prompt = fresh_prompt(t, "k2")
        first = _cached(t, prompt, f"{first_what}, first time", salt=first_salt)
        if first > SHARED_START_TOKENS:
            skip(f"a prompt never seen reported cached_prompt_tokens {first} (K3 fails for it): salt isolation "
                 "cannot be told from that")
        for what, salt in others:
            other = _cached(t, prompt, f"the prompt with {what}", salt=salt)
            expect(other <= max(first, SHARED_START_TOKENS),
                   f"the prompt cached with {first_what}, sent with {what}, reported cached_prompt_tokens {other}; "
                   "different salts share no blocks")
    same = _cached(t, prompt, "no salt again")
    if same == 0:  # found by review: a server with no prefix cache passed (every count is 0 there)
        skip("a plain repeat was not served from cache (no prefix cache, or evicted): salts isolating "
             "nothing cannot be told from salts isolating")
    return f"salt B, no salt and salt C: nothing of the other namespace cached; a plain repeat {same} cached"
