"""The toy engine's "model" (tests/conformance/toy_engine.py): next-token log-probabilities over
its ASCII vocabulary, the TokenInfo it reports, and its prefix cache."""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Sequence
from typing import Any

from refengine.kv.prefix_hash import MediaSpan
from refengine.protocol import oe
from tests.conformance.toy_faults import Faults
from tests.conformance.toy_requests import EOS, VOCAB

TEXT = "the quick brown fox jumps over the lazy dog, and then it sleeps under a tree. "
CACHE_BLOCK = 32  # prefix-cache granularity: longer than the suite's "[oeconf-<run>-<tag>-<n>]" prompt prefixes


def log_softmax(xs: list[float]) -> tuple[float, ...]:
    top = max(xs)
    z = top + math.log(sum(math.exp(x - top) for x in xs if x != -math.inf))
    return tuple(x - z for x in xs)


def distribution(ctx: list[int], prompt: list[int], temperature: float, masked: set[int],
                 shift: int = 0) -> tuple[float, ...]:
    """Log-probabilities of the next token: peaked at the text's next character (moved by
    ``shift``: a LoRA adapter, or a fault); EOS likely after 4 tokens of a ``<|`` prompt."""
    target = min(127, ord(TEXT[len(ctx) % len(TEXT)]) + shift)
    eos_likely = len(ctx) - len(prompt) >= 4 and asks_for_eos(tuple(prompt))
    return log_probs(target, eos_likely, temperature, frozenset(masked))


@functools.lru_cache(maxsize=1024)
def asks_for_eos(prompt: tuple[int, ...]) -> bool:
    return "<|" in "".join(chr(i) for i in prompt if i < 128)


@functools.lru_cache(maxsize=8192)
def log_probs(target: int, eos_likely: bool, temperature: float, masked: frozenset[int]) -> tuple[float, ...]:
    """``distribution``'s result, which depends on nothing else: cached, because the ~80
    negative controls' toys ask for the same few thousand rows, and computing each in Python
    was a good part of their CPU time."""
    logits = [-0.5 * abs(j - target) - 0.001 * j for j in range(VOCAB)]
    logits[EOS] = 5.0 if eos_likely else -20.0
    scale = temperature if temperature > 0 else 1.0
    return log_softmax([-math.inf if j in masked else x / scale for j, x in enumerate(logits)])


@functools.lru_cache(maxsize=8192)
def ranking(lp: tuple[float, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(token ids from most to least likely, each token's 1-based rank: 1 + how many are likelier)."""
    order = tuple(sorted(range(VOCAB), key=lambda j: -lp[j]))
    negated = sorted(-x for x in lp)  # how many are likelier than x = how many negations are below -x
    return order, tuple(1 + bisect.bisect_left(negated, -x) for x in lp)


@functools.lru_cache(maxsize=8192)
def probabilities(lp: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(math.exp(x) for x in lp)


def token_info(tok: int, lp: tuple[float, ...] | None, spec: Any | None, faults: Faults) -> Any:
    info = oe.TokenInfo(token_id=tok, token=chr(tok) if tok < 128 else "</s>")
    if lp is None:
        return info
    if faults.token_info_without_text:
        info.token = ""
    order, ranks = ranking(lp)
    info.logprob = lp[tok]
    info.rank = ranks[tok] - (1 if faults.zero_based_rank else 0)
    kind = spec.WhichOneof("selection") if spec is not None else None
    everything = order[:100] if faults.all_candidates_truncated else order
    chosen = {"top_n": lambda: order[: spec.top_n], "all": lambda: everything,
              "token_ids": lambda: list(spec.token_ids.ids)}.get(kind, lambda: [])()
    if faults.sampled_outside_top_n and kind == "top_n" and tok not in chosen:
        chosen = [*chosen, tok]  # vLLM's logprobs=k: the top k, and the token itself
    for j in chosen:
        info.candidates.add(token_id=j, logprob=lp[j] if lp[j] != -math.inf else -1e30,
                            token="" if faults.prompt_info_without_text else (chr(j) if j < 128 else "</s>"),
                            rank=ranks[j])
    return info


class PrefixCache:
    """Full CACHE_BLOCK-token blocks, each keyed by its whole prefix, the cache salt, the LoRA adapter
    and the images with a position in it (their spans: tests/conformance/toy_media.py)."""

    def __init__(self, faults: Faults) -> None:
        self.faults = faults
        self.blocks: set[int] = set()
        self.block = 1 if faults.token_cache else CACHE_BLOCK

    def keys(self, prompt: list[int], salt: str, lora_name: str, images: Sequence[MediaSpan]) -> list[int]:
        """The key of each full block: its whole prefix, the salt, the adapter and its images."""
        keys, key = [], hash((salt, lora_name))
        for end in range(self.block, len(prompt) + 1, self.block):
            held = tuple(name for first, last, name in images if first < end and last > end - self.block)
            key = hash((key, tuple(prompt[end - self.block:end]), held))
            keys.append(key)
        return keys

    def hits(self, keys: list[int]) -> int:
        """The leading blocks of ``keys`` that are cached."""
        return next((i for i, k in enumerate(keys) if k not in self.blocks), len(keys))

    def serve(self, prompt: list[int], salt: str, lora_name: str, bypass: bool, images: Sequence[MediaSpan]) -> int:
        """K1-K3, E4: store the prompt's blocks; returns the prompt tokens served from cache."""
        salt = "" if self.faults.prefix_salt_ignored else salt
        lora_name = "" if self.faults.lora_not_in_hash else lora_name
        images = () if self.faults.media_not_in_hash else images
        keys = self.keys(prompt, salt, lora_name, images)
        hits = self.hits(keys)
        if salt and self.faults.salt_falls_back_to_unsalted:  # K2's fault: a salted miss looks in the unsalted cache
            hits = max(hits, self.hits(self.keys(prompt, "", lora_name, images)))
        if bypass and not self.faults.bypass_ignored:
            hits = 0
        self.blocks.update(keys)
        if self.faults.count_own_blocks and not bypass:
            hits = len(keys)
        return hits if self.faults.cached_blocks_not_tokens else hits * self.block
