"""Section E — KV events, E4: block hashes chain through ``parent_block_hash`` and include
everything that changes the KV.

A subscriber's view built from a snapshot and the live batches never meets a child before its
parent, nor a removal of a block it never saw. The same prompt under a new ``cache_salt`` (with
``supports_cache_salt``) stores blocks of its own; under a LoRA adapter (with ``supports_lora``
and adapter files, as section R writes them) it stores blocks of its own or, on a server that
leaves blocks computed under an adapter out of its cache, at least is not served the base
prompt's. A block computed under either is not the base prompt's block and must not hash as
it. With the model's image placeholder known (``--media-placeholder-token-id``, as D9 needs), the
same token prompt with another image stores the blocks from the image on again.
"""

from __future__ import annotations

import random
from typing import Any

import grpc

from refengine.conformance.assertions import expect_valid
from refengine.conformance.checks_lora import describe, load, scratch
from refengine.conformance.checks_media import _image, _placeholder
from refengine.conformance.encoder_support import unique_png
from refengine.conformance.kv_announced import Tracker, announced
from refengine.conformance.kv_subscriber import (
    EVENT_WAIT_S,
    HashKey,
    KvView,
    _block_size,
    _key,
    _need_text,
    fresh_prompt,
    generate,
    subscribe,
)
from refengine.conformance.registry import check, expect, fail, skip
from refengine.conformance.target import Target


def _roots(stored: list[Any]) -> list[Any]:
    return [e for e in stored if not e.HasField("parent_block_hash")]


def _own_blocks(stored: list[Any]) -> int:
    """The blocks ``stored`` names from its first chain root on: a request's own chain (the
    BlockStored before that root are an earlier request's, delivered late)."""
    first_root = next((i for i, e in enumerate(stored) if not e.HasField("parent_block_hash")), len(stored))
    return sum(len(e.block_hashes) for e in stored[first_root:])


@check("E4", "every BlockStored's parent is known; a salted copy of a prompt stores blocks of its own")
def stored_events_chain(t: Target) -> str:
    """E3/E4: a view built from a snapshot and the live batches never meets a child before
    its parent or a removal of an unknown block; the prompt extended by a block stores no chain
    root (its blocks extend the prompt's); with ``supports_cache_salt``, the same prompt under a
    new salt stores its blocks again (under other hashes: the salt is part of them). Each step
    waits until what it judges arrived (``kv_announced``), not for a time window: a stream may
    run late. A child of a block the view never saw, after an empty snapshot, may be the
    snapshot's omission (E2's finding): then the chain cannot be judged (skip)."""
    _need_text(t)
    tracker = Tracker(subscribe(t, include_snapshot=True))
    salted = bool(t.caps.supports_cache_salt)
    try:
        expect(bool(tracker.sub.batches), f"include_snapshot sent no batch: {tracker.sub.describe()}")
        prompt = fresh_prompt(t, "e4")
        announced(t, tracker, lambda: generate(t, prompt), lambda _: False)  # judged: view.problems
        # a shared prefix: its new blocks chain onto cached ones (found by review: " And then" alone
        # filled no block of 16, and a first new block with no parent passed)
        extension = prompt + " And then" * (_block_size(t) // 2 + 1)
        _, _, ext = announced(t, tracker, lambda: generate(t, extension), lambda seen: bool(_roots(seen)))
        before, salt = len(tracker.sub.batches), t.new_id("salt")
        if salted:  # a new salt: every block is new, the first a chain root (the extension's late ones are not)
            generate(t, prompt, salt=salt)

            def judgeable(_: Any) -> bool:  # its root arrived, or the chain already fails
                tracker.catch_up()
                return bool(_roots(tracker.stored_since(before)) or tracker.view.problems)

            tracker.sub.wait(judgeable, EVENT_WAIT_S)
        tracker.catch_up()
        expect(not tracker.sub.errors, f"the subscription failed: {tracker.sub.describe()}")
    finally:
        tracker.sub.close()
    view, batches = tracker.view, tracker.sub.batches
    if view.problems and not batches[0].events:
        skip(f"{view.problems[0]}, after an empty snapshot (E2 fails for it): the chain cannot be followed")
    expect(not view.problems, "; ".join(view.problems[:3]))
    expect(not _roots(ext), f"the prompt extended by ' And then' ... stored {len(ext)} BlockStored; "
                            f"{len(_roots(ext))} without parent_block_hash, though its blocks extend the prompt's "
                            "blocks stored before (a chain root)")
    if not salted:
        return f"{len(batches)} batches chain; cache_salt not advertised"
    stored = _own_blocks(tracker.stored_since(before))
    expect(stored > 0, "the same prompt under a new cache_salt stored no block: its blocks hash as the unsalted "
                       "ones, so the salt is not in the block hash (E4, K2)")
    return (f"{len(batches)} batches chain ({len(ext)} BlockStored of the extension, parented); a salted copy "
            f"stored {stored} blocks of its own")


@check("E4", "the same prompt under a LoRA adapter stores blocks of its own")
def lora_in_block_hash(t: Target) -> str:
    """E4: a fresh prompt, sent without an adapter (its blocks stored), then again under a
    loaded LoRA adapter, stores blocks again: the adapter's KV differs from the base model's,
    so its blocks hash differently, a chain of its own from a new root. Skips, saying why,
    without LoRA or adapter files (section R needs the same), or when the adapter does not load
    (R's finding). It waits for what it judges, not for a time window: the base prompt's blocks
    until announced (``kv_announced``), then the adapted prompt's chain root, unless its Usage
    shows it served from cache (found with a stream whose step's later batches come 1 s late:
    the base prompt's late batches, counted as the adapter's, passed a server leaving the
    adapter out of the block hash)."""
    _need_text(t)
    with scratch(t, "e4lora") as files:
        adapter = files.specs[0]
        code, _, details = load(t, adapter)
        if code != grpc.StatusCode.OK:
            skip(f"LoadLora {describe(adapter)} returned {code.name} ({details!r}): section R judges that")
        tracker = Tracker(subscribe(t))
        try:
            prompt = fresh_prompt(t, "e4lora")
            _, _, base = announced(t, tracker, lambda: generate(t, prompt), lambda _: False)
            before = len(tracker.sub.batches)
            usage = generate(t, prompt, lora_name=adapter.lora_name)
            cached = usage.cached_prompt_tokens if usage is not None else 0
            if not cached:  # else the violation is visible already

                def rooted(_: Any) -> bool:
                    return bool(_roots(tracker.stored_since(before)))

                tracker.sub.wait(rooted, EVENT_WAIT_S)
            expect(not tracker.sub.errors, f"the subscription failed: {tracker.sub.describe()}")
            since = tracker.stored_since(before)
        finally:
            tracker.sub.close()
    if not base:
        skip("the prompt without an adapter stored no block (E3 judges that): nothing to compare")
    if adapted := _own_blocks(since):
        return (f"the base prompt stored {sum(len(e.block_hashes) for e in base)} blocks, the same prompt under "
                f"an adapter {adapted} of its own")
    expect(not cached, f"the same prompt under LoRA adapter {adapter.lora_name!r} stored no block and reported "
                       f"{cached} cached prompt tokens: it was served the base model's blocks, which hash the same "
                       "without the adapter in the block hash")
    skip(f"the prompt under adapter {adapter.lora_name!r} stored no block and hit none: this server does not cache "
         "blocks computed under an adapter, so there is no hash to judge")


def _image_prompt(t: Target, token: int) -> list[int]:
    """A first block no earlier request began with (known ids in a random order), the image's
    placeholder, then two blocks of text: the blocks from the image on depend on the image."""
    text = [i for i in t.known_token_ids() if i != token]
    expect(bool(text), f"no known token id other than the placeholder {token}")
    block = _block_size(t)
    rng = random.Random(t.new_id("e4img"))
    return [rng.choice(text) for _ in range(block)] + [token] + [text[k % len(text)] for k in range(2 * block)]


def _children(view: KvView, block: HashKey) -> set[HashKey]:
    """The blocks ``view`` holds whose parent is ``block``."""
    return {key for key, parent in view.blocks.items() if parent == block}


@check("E4", "the same prompt with a different image stores blocks of its own")
def media_in_block_hash(t: Target) -> str:
    """E4 (media; found by review: the media part was unchecked): one token prompt, a block of
    text then the image's placeholder, sent with a fresh image, then with another fresh image.
    The text block is the same under both, so the second image's blocks chain onto the cached
    one (no chain root, unlike the salted or adapted copies): the block holding the image's
    first position depends on the image, so each image stores a child of the text block of its
    own. Served the first image's blocks, the second would answer about the wrong picture.

    It waits for what it judges, not for a time window: the first image prompt's blocks until
    announced (``kv_announced``), then a second child of its text block (either image's may
    come late; up to EVENT_WAIT_S), unless the second request's Usage reports more cached
    prompt tokens than the text before the image: a position from the image on then reused KV
    computed with the first image, the violation visible (the text block itself is a
    legitimate hit, unlike any hit under an adapter). Counting the blocks stored 0.3 s after
    each request passed a server leaving the image out of its block hash on a stream whose
    step's later batches come 1 s late: the first prompt's late batches counted as the
    second's. Skips without the placeholder (D9's option) or when no block after the text
    block was stored (a server not caching blocks that hold an image)."""
    token = _placeholder(t)
    ids = _image_prompt(t, token)
    tracker = Tracker(subscribe(t))

    def send(tag: str, image: bytes) -> Any:
        req = t.request(tag, token_ids=ids, max_tokens=2)
        _image(image)(req.media.add())
        return expect_valid(t.generate(req), what=f"the image prompt ({tag})").usage()

    try:
        image = unique_png(t, "e4imga")
        _, _, first = announced(t, tracker, lambda: send("e4imga", image), lambda _: False)
        text = next((_key(e.block_hashes[0]) for e in _roots(first)), None)
        usage = send("e4imgb", unique_png(t, "e4imgb"))
        cached = usage.cached_prompt_tokens if usage is not None else 0
        if text is not None and cached <= ids.index(token):  # else the violation is visible already

            def forked(_: Any) -> bool:
                tracker.catch_up()
                return len(_children(tracker.view, text)) > 1

            tracker.sub.wait(forked, EVENT_WAIT_S)
        tracker.catch_up()
        expect(not tracker.sub.errors, f"the subscription failed: {tracker.sub.describe()}")
    finally:
        tracker.sub.close()
    if not first:
        skip("the first image prompt stored no block (E3 judges that): nothing to compare")
    if text is None:
        skip("the first image prompt stored no chain root (E4's chain check judges that): its text block is unknown")
    children = _children(tracker.view, text)
    if len(children) > 1:
        return (f"the prompt's text block has a child block under each image: the second image's blocks hash apart "
                f"from the image on ({sum(len(e.block_hashes) for e in first)} blocks of the first image prompt "
                "announced before the second was sent)")
    if not children:
        skip("neither image prompt stored a block after its text block: this server does not cache blocks holding "
             "an image, so there is no hash to judge")
    fail(f"the same token prompt with another image stored no block of its own from the image on ({cached} cached "
         "prompt tokens): its blocks hash as the first image's, so the image is not in the block hash")
