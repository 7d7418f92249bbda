"""Section E — KV events, E4: block hashes chain through ``parent_block_hash`` and include
everything that changes the KV.

A subscriber's view built from a snapshot and the live batches never meets a child before its
parent, nor a removal of a block it never saw. The same prompt under a new ``cache_salt`` (with
``supports_cache_salt``) stores blocks of its own; under a LoRA adapter (with ``supports_lora``
and adapter files, as section R writes them) it stores blocks of its own or, on a server that
leaves blocks computed under an adapter out of its cache, at least is not served the base
prompt's. A block computed under either is not the base prompt's block and must not hash as
it. The media part of the rule is not checked: the suite has no image the target's model is
sure to take.
"""

from __future__ import annotations

from typing import Any

import grpc

from refengine.conformance.checks_lora import describe, load, scratch
from refengine.conformance.kv_subscriber import (
    KvView,
    _need_text,
    fresh_prompt,
    generate,
    new_batches,
    stored_count,
    subscribe,
)
from refengine.conformance.registry import check, expect, skip
from refengine.conformance.target import Target


@check("E4", "every BlockStored's parent is known; a salted copy of a prompt stores blocks of its own")
def stored_events_chain(t: Target) -> str:
    """E3/E4: a view built from a snapshot and the live batches never meets a child before
    its parent or a removal of an unknown block; with ``supports_cache_salt``, the same prompt
    under a new salt stores its blocks again (under other hashes: the salt is part of them).
    A child of a block the view never saw, after an empty snapshot, may be the snapshot's
    omission (E2's finding): then the chain cannot be judged (skip)."""
    _need_text(t)
    sub = subscribe(t, include_snapshot=True)
    salted = bool(t.caps.supports_cache_salt)
    try:
        expect(bool(sub.batches), f"include_snapshot sent no batch: {sub.describe()}")
        prompt = fresh_prompt(t, "e4")
        new_batches(sub, lambda: generate(t, prompt))
        # a shared prefix: its new blocks chain onto cached ones
        new_batches(sub, lambda: generate(t, prompt + " And then"))
        again = new_batches(sub, lambda: generate(t, prompt, salt=t.new_id("salt"))) if salted else []
        batches = sub.batches
        expect(not sub.errors, f"the subscription failed: {sub.describe()}")
    finally:
        sub.close()
    view = KvView()
    for b in batches:  # in arrival order: how they are numbered is E1's
        view.apply(b)
    if view.problems and not batches[0].events:
        skip(f"{view.problems[0]}, after an empty snapshot (E2 fails for it): the chain cannot be followed")
    expect(not view.problems, "; ".join(view.problems[:3]))
    if not salted:
        return f"{len(batches)} batches chain; cache_salt not advertised"
    stored = stored_count(again)
    expect(stored > 0, "the same prompt under a new cache_salt stored no block: its blocks hash as the unsalted "
                       "ones, so the salt is not in the block hash (E4, K2)")
    return f"{len(batches)} batches chain; a salted copy stored {stored} blocks of its own"


@check("E4", "the same prompt under a LoRA adapter stores blocks of its own")
def lora_in_block_hash(t: Target) -> str:
    """E4: a fresh prompt, sent without an adapter (its blocks stored), then again under a
    loaded LoRA adapter, stores blocks again: the adapter's KV differs from the base model's,
    so its blocks hash differently. Skips, saying why, without LoRA or adapter files (section R
    needs the same), or when the adapter does not load (R's finding)."""
    _need_text(t)
    with scratch(t, "e4lora") as files:
        adapter = files.specs[0]
        code, _, details = load(t, adapter)
        if code != grpc.StatusCode.OK:
            skip(f"LoadLora {describe(adapter)} returned {code.name} ({details!r}): section R judges that")
        sub = subscribe(t)
        try:
            prompt = fresh_prompt(t, "e4lora")
            base = stored_count(new_batches(sub, lambda: generate(t, prompt)))
            usages: list[Any] = []
            adapted = stored_count(new_batches(
                sub, lambda: usages.append(generate(t, prompt, lora_name=adapter.lora_name))))
            expect(not sub.errors, f"the subscription failed: {sub.describe()}")
        finally:
            sub.close()
    if not base:
        skip("the prompt without an adapter stored no block (E3 judges that): nothing to compare")
    if adapted:
        return f"the base prompt stored {base} blocks, the same prompt under an adapter {adapted} of its own"
    cached = usages[0].cached_prompt_tokens if usages and usages[0] is not None else 0
    expect(not cached, f"the same prompt under LoRA adapter {adapter.lora_name!r} stored no block and reported "
                       f"{cached} cached prompt tokens: it was served the base model's blocks, which hash the same "
                       "without the adapter in the block hash")
    skip(f"the prompt under adapter {adapter.lora_name!r} stored no block and hit none: this server does not cache "
         "blocks computed under an adapter, so there is no hash to judge")
