"""Input processing: a ``GenerationRequest`` in, an accepted core ``Request`` out.

Every check runs here, once (the edge checks only what the engine cannot see, such
as proto presence and the capability table), the prompt is tokenized here, once, and a
guided request's grammar is compiled here (on a compile worker, bounded in time), so an
invalid or too slow grammar is refused before acceptance and the step never compiles.
Anything wrong raises ``InvalidRequestError`` naming the field and the allowed range,
before anything is allocated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from refengine.engine.media import MediaInputs, MediaRun
from refengine.engine.request import Request
from refengine.engine.role_check import RoleCheck
from refengine.engine.validation import (
    Limits,
    validate_context,
    validate_inputs,
    validate_logprobs,
    validate_prompt,
    validate_sampling,
    validate_stopping,
)
from refengine.lora.registry import LoraRegistry
from refengine.sampling.guided import CompiledGuide, GuideCompiler, GuidedSpecError
from refengine.types import GenerationRequest, InvalidRequestError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


#: How much a tokenizer's normalizer may shrink a text (in characters) before the bound below
#: still holds: composing a base letter and its combining marks, or three Hangul jamo into one
#: syllable, shrinks by up to 3; NFKC and lowercasing do not shrink further.
NORMALIZER_SHRINK = 4


def max_prompt_chars(tokenizer: PreTrainedTokenizerBase, max_model_len: int) -> int:
    """The longest prompt text that could tokenize to fewer than ``max_model_len`` tokens.

    Why: tokenizing is linear but slow (16 MB of text took 16 s of a core here, and the gRPC limit
    lets a prompt be that long), and the context check can only run after it. Every token spells
    at most ``longest`` characters of the normalized text (byte-level BPE: one per byte; SentencePiece:
    one per character; the vocabulary's own strings, added tokens included), and these tokenizers
    spell every character, so a text of n characters has at least n / (NORMALIZER_SHRINK * longest)
    tokens: longer than this, it cannot fit, whatever it says."""
    longest = max(len(token) for token in tokenizer.get_vocab())
    return max_model_len * longest * NORMALIZER_SHRINK


#: A prompt longer than the context in characters is first counted in pieces of this many
#: characters (``count_exceeds``).
COUNT_PIECE_CHARS = 8192
#: Tokens a cut between two pieces may add to their count: a word cut in two, a SentencePiece
#: word-start marker, a combining mark cut from its base letter (tested: ``test_prompt_token_bound``).
CUT_TOKENS = 4


def count_exceeds(tokenizer: PreTrainedTokenizerBase, prompt: str, max_model_len: int) -> bool:
    """Whether ``prompt`` surely has more than ``max_model_len`` tokens, found by tokenizing it in
    pieces and stopping once their count, less what the cuts may have added, is past the limit.

    Why: below ``max_prompt_chars`` a text may still hold millions of tokens (600,000 emoji are
    1.8 million), and tokenizing it whole to refuse it took 480 MiB and 2 s a request (found by
    review). The caller counts only a text longer than ``max_model_len`` characters and than one
    piece: a shorter one has at most 4 tokens a character (byte fallback), so tokenizing it whole is
    bounded anyway."""
    counted = 0
    for number, start in enumerate(range(0, len(prompt), COUNT_PIECE_CHARS), start=1):
        counted += len(tokenizer.encode(prompt[start:start + COUNT_PIECE_CHARS], add_special_tokens=False))
        if counted - CUT_TOKENS * (number - 1) > max_model_len:
            return True
    return False


class InputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, limits: Limits, guides: GuideCompiler,
                 role: RoleCheck, loras: LoraRegistry, media: MediaInputs | None = None,
                 handle_backends: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.max_prompt_chars = max_prompt_chars(tokenizer, limits.max_model_len)
        self.loras = loras
        self.media = media
        self.handle_backends = handle_backends  # what embedding handles can be pulled with here
        self.limits = limits
        self.guides = guides
        self.role = role

    def process(self, params: GenerationRequest) -> Request:
        validate_inputs(params)
        validate_sampling(params, self.limits)
        validate_stopping(params, self.limits)
        validate_logprobs(params, self.limits)
        if params.prompt is not None:
            self._check_prompt_chars(params.prompt)
            # A prompt of at most one piece is tokenized whole at once (at most 4 tokens a character):
            # counting it first would only tokenize it twice.
            if len(params.prompt) > max(self.limits.max_model_len, COUNT_PIECE_CHARS) \
                    and count_exceeds(self.tokenizer, params.prompt, self.limits.max_model_len):
                raise InvalidRequestError(f"the prompt has more than {self.limits.max_model_len} tokens, the "
                                          "context limit")
            prompt_ids = list(self.tokenizer.encode(params.prompt, add_special_tokens=False))
        else:
            prompt_ids = list(params.prompt_token_ids or [])
        # R4 before the media: an unknown adapter is refused without decoding and encoding any image.
        lora = None if params.lora_name is None else self.loras.get(params.lora_name)
        media: tuple[MediaRun, ...] = ()
        if params.media or params.media_handles:
            validate_context(params, len(prompt_ids), self.limits)  # before any image is fetched or encoded
            prompt_ids, media = self._media(params, prompt_ids)
        elif self.media is not None:  # G19: a placeholder with no item to fill it is refused too
            self.media.check_placeholders(prompt_ids)
        max_tokens = validate_prompt(params, prompt_ids, self.limits)
        self.role.check(params, prompt_ids, tuple((run.start, run.identity) for run in media),
                        "" if lora is None else lora.cache_key)
        return Request(params, prompt_ids, max_tokens, guide=self._compile(params), lora=lora, media=media)

    def _check_prompt_chars(self, prompt: str) -> None:
        """G7 before tokenizing, for a text too long to fit whatever its tokens (max_prompt_chars)."""
        if len(prompt) > self.max_prompt_chars:
            raise InvalidRequestError(
                f"the prompt has {len(prompt)} characters, more than the context limit of "
                f"{self.limits.max_model_len} tokens can hold (at most {self.max_prompt_chars} characters "
                "with this tokenizer)")

    def _media(self, params: GenerationRequest, prompt_ids: list[int]) -> tuple[list[int], tuple[MediaRun, ...]]:
        """The expanded prompt and its media (G19, D9; ENC10): only a model with a vision path.
        A decode engine only learns each item's identity (it never computes the prompt)."""
        if self.media is None:
            raise InvalidRequestError("this model does not accept media (supports_multimodal=false)")
        decode = self.role.role == "decode"
        if not decode:  # a decode engine never pulls a handle's rows
            for index, handle in enumerate(params.media_handles):
                self.role.sources.check((e for t in handle.transfers for e in t.endpoints),
                                        f"extra media handle {index}")
        return self.media.prepare(prompt_ids, params.media, params.media_handles, need_rows=not decode,
                                  pull_backends=None if decode else self.handle_backends,
                                  cache_salt=params.kv.cache_salt,
                                  check_expanded=lambda expanded: validate_prompt(params, expanded, self.limits))

    def _compile(self, params: GenerationRequest) -> CompiledGuide | None:
        """Last, as the costliest check: a compile may wait for a worker, up to its time limit."""
        if params.guided is None:
            return None
        try:
            return self.guides.compile(params.guided)
        except GuidedSpecError as exc:
            raise InvalidRequestError(str(exc)) from None
