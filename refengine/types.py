"""Request and output types shared by every layer (the bottom of the layer order).

These are the only types that cross the boundary between the engine and an edge
(the gRPC server, the CLI, tests), and the request parameters the sampler reads.
They hold plain Python values, never tensors or protobuf messages, and import
nothing of refengine.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token.

    ``temperature`` 0 means greedy. ``top_k`` 0 or -1 disables top-k. ``seed``
    ``None`` draws from the engine's generator; a set seed gives a per-request
    generator, so the output does not depend on what else is in the batch.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    num_sequences: int = 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class StoppingParams:
    """When an output ends.

    ``max_tokens`` ``None`` = until the context limit. ``min_tokens`` suppresses EOS
    and stop tokens (not stop strings' matching, which cannot happen before any
    text exists) until that many tokens were produced.
    """

    max_tokens: int | None = None
    min_tokens: int = 0
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_in_output: bool = False


@dataclass(frozen=True)
class CandidateSpec:
    """Which alternative tokens to report next to each token's logprob."""

    mode: Literal["top_n", "token_ids", "all"]
    top_n: int = 0
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class LogprobParams:
    """Logprob reporting for prompt and output positions.

    ``prompt_logprob_start`` skips prompt positions before it (position 0 never has
    a logprob: nothing predicts the first token).
    """

    prompt_logprobs: bool = False
    prompt_candidates: CandidateSpec | None = None
    prompt_logprob_start: int = 0
    # The most prompt positions one response may carry (an edge's message-size limit);
    # None = no limit. Checked once the prompt is tokenized.
    max_prompt_positions: int | None = None
    output_logprobs: bool = False
    output_candidates: CandidateSpec | None = None


@dataclass(frozen=True)
class KvParams:
    """Per-request prefix-cache options."""

    bypass_prefix_cache: bool = False
    cache_salt: str | None = None
    session: KvSessionSpec | None = None  # a decode request: the KV prefilled elsewhere (K5)


@dataclass(frozen=True)
class KvEndpointSpec:
    host: str
    port: int
    protocol: str


@dataclass(frozen=True)
class KvSessionSpec:
    """A KV session: a prefilled prompt's KV held by the prefill engine under a lease
    (``KvSessionRef``). ``attributes`` are JSON values, encoded as K9 says (integers above
    2^53 as decimal strings, bytes as base64): ``refengine.kv.transfer.attributes``."""

    session_id: str
    transfer_backend: str
    endpoints: tuple[KvEndpointSpec, ...] = ()
    dp_rank: int = 0
    attributes: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EmbeddingTransferSpec:
    """One way to fetch a handle's rows (draft profile ``encoder``, ``EmbeddingTransfer``):
    ``backend`` "grpc" or "nixl"; ``attributes`` JSON values (K9 encoding)."""

    backend: str
    endpoints: tuple[KvEndpointSpec, ...] = ()
    attributes: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EmbeddingHandleSpec:
    """Leased embeddings of one media item on an encoder (``refengine.v1alpha1.EmbeddingHandle``).

    ``shape`` is (num_tokens, hidden_size); ``identity`` is the media's prefix-cache key, the
    same an aggregated engine derives from the item itself (``uuid:…`` or ``sha256:…``)."""

    handle_id: str
    mm_hash: str
    mm_hash_algorithm: str  # "refengine-rgb8-sha256" or "uuid"
    modality: str
    shape: tuple[int, ...]
    dtype: str
    layout: str
    fingerprint: str
    transfers: tuple[EmbeddingTransferSpec, ...] = ()
    lease_expires_unix_nanos: int = 0
    cached: bool = False

    @property
    def num_tokens(self) -> int:
        return self.shape[0] if self.shape else 0

    @property
    def identity(self) -> str:
        return f"{'uuid' if self.mm_hash_algorithm == 'uuid' else 'sha256'}:{self.mm_hash}"


GUIDED_MODES = ("json_schema", "json_object", "regex", "ebnf_grammar", "structural_tag", "choice")
GuidedMode = Literal["json_schema", "json_object", "regex", "ebnf_grammar", "structural_tag", "choice"]


@dataclass(frozen=True)
class GuidedSpec:
    """Grammar-constrained generation (``GenerateRequest.guided``).

    ``mode`` names the constraint; ``spec`` is its text: a JSON Schema (``json_schema``), a
    regular expression (``regex``), an EBNF grammar in xgrammar's GBNF dialect
    (``ebnf_grammar``: ``root ::= ...``), an xgrammar structural-tag JSON
    (``structural_tag``), empty for ``json_object``. ``choices`` holds the allowed strings
    of ``choice``. ``backend`` "" = the engine's default (``xgrammar``), or ``llguidance``.
    """

    mode: GuidedMode
    spec: str = ""
    choices: tuple[str, ...] = ()
    backend: str = ""


@dataclass(frozen=True)
class MediaInput:
    """One ``GenerateRequest.media`` item: exactly one source (``url``, ``data_uri`` or
    ``raw_bytes``); ``mime_type`` is a hint; ``uuid``, when given, is the item's identity
    (prefix-cache key, encoder cache) instead of a digest of its content."""

    modality: str  # "image", "video", "audio" (only what the model supports is accepted)
    url: str | None = None
    data_uri: str | None = None
    raw_bytes: bytes | None = None
    mime_type: str = ""
    uuid: str = ""


@dataclass
class GenerationRequest:
    """One request as the engine sees it. Exactly one of ``prompt`` /
    ``prompt_token_ids`` is set; the engine tokenizes ``prompt``.

    ``priority``: higher runs sooner; FCFS within a priority.
    """

    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stopping: StoppingParams = field(default_factory=StoppingParams)
    logprobs: LogprobParams = field(default_factory=LogprobParams)
    kv: KvParams = field(default_factory=KvParams)
    priority: int = 0
    guided: GuidedSpec | None = None
    detokenize: bool = True  # False: token ids only, no text (stop strings still match internally)
    lora_name: str | None = None  # a loaded LoRA adapter to generate with (None: the base model)
    media: tuple[MediaInput, ...] = ()  # item i fills the prompt's i-th media placeholder
    # or (never both) encoded elsewhere: handle i fills the i-th placeholder (draft profile "encoder")
    media_handles: tuple[EmbeddingHandleSpec, ...] = ()


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class FinishInfo:
    """Why one output ended. For STOP exactly one of the three match fields is set."""

    reason: FinishReason
    stop_token_id: int | None = None
    stop_text: str | None = None
    eos_token_id: int | None = None
    message: str = ""


@dataclass(frozen=True)
class Candidate:
    token_id: int
    logprob: float
    rank: int  # 1-based rank in the distribution the token was drawn from
    text: str


@dataclass(frozen=True)
class TokenInfo:
    """One token with its (optional) logprob, rank and candidates, all together."""

    token_id: int
    text: str
    logprob: float | None = None
    rank: int | None = None
    candidates: tuple[Candidate, ...] = ()


@dataclass(frozen=True)
class SequenceDelta:
    """What one output (``index``) produced this step: new tokens and new text only.

    ``finish`` is set on the output's last delta; nothing follows it for this index.
    """

    index: int
    tokens: tuple[TokenInfo, ...] = ()
    text: str = ""
    finish: FinishInfo | None = None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class RequestOutput:
    """Everything a request produced in one engine step.

    ``prompt_tokens`` (prompt logprobs) appears at most once, before any output
    token. ``usage`` is set exactly on the final output (``finished`` True).
    ``error`` is set when the engine failed the request after acceptance; it is then
    also the final output.
    """

    request_id: str
    deltas: tuple[SequenceDelta, ...] = ()
    prompt_tokens: tuple[TokenInfo, ...] | None = None
    finished: bool = False
    usage: Usage | None = None
    error: EngineFault | None = None
    # A prefill engine's terminal success (K4): the session to pass to a decode engine; no
    # token deltas come with it. The edge adds the routable endpoints.
    prefill: KvSessionSpec | None = None


@dataclass(frozen=True)
class EngineFault:
    """A failure after acceptance. ``retryable``: the unchanged request could succeed later."""

    code: Literal["overloaded", "internal", "cancelled", "kv_transfer_failed", "kv_session_not_found"]
    message: str
    retryable: bool


class RequestError(Exception):
    """A request refused before acceptance. Nothing was allocated for it."""


class InvalidRequestError(RequestError, ValueError):
    """The request is malformed or out of range; the message says what is wrong."""


class DuplicateRequestError(RequestError):
    """``request_id`` is already in use by an active request."""


class KvSessionNotFound(LookupError):
    """No such KV session here: never made, released, or its lease expired (K7, A2)."""


@dataclass(frozen=True)
class LoraAdapterSpec:
    """A LoRA adapter as the lifecycle RPCs name it (R1): ``lora_id`` > 0, a non-empty
    ``lora_name``, ``source_path`` an absolute directory in PEFT layout."""

    lora_id: int
    lora_name: str
    source_path: str


class LoraDisabledError(RequestError):
    """LoRA is not enabled on this engine (R5)."""


class LoraNotFoundError(RequestError, LookupError):
    """No loaded adapter has that name (R4): unload, or ``lora_name`` in a request."""


class LoraConflictError(RequestError):
    """A load whose id, name or path collides with a different loaded adapter (R3)."""


class OverloadedError(RequestError):
    """The engine cannot take more work now; retrying later may succeed."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of live load figures."""

    running_requests: int
    waiting_requests: int
    used_kv_blocks: int
    total_kv_blocks: int
    cached_kv_blocks: int
    running_tokens: int
    waiting_tokens: int
    prefill_batch_size: int  # sequences that computed prompt tokens in the last step
    decode_batch_size: int  # sequences that decoded in the last step
    active_kv_sessions: int = 0  # prefill role: sessions held for decode engines (K7)
    kv_pulled_bytes: int = 0  # decode role: KV received by successful pulls, in total
    kv_pull_seconds: float = 0.0  # ... and the time those pulls took
    media: MediaStats | None = None  # encoder role: its handles and rows
    embedding_pulled_bytes: int = 0  # consumers: embedding rows received from encoders, in total
    embedding_pull_seconds: float = 0.0  # ... and the time those pulls took


@dataclass(frozen=True)
class MediaStats:
    """An encoder's embedding memory: rows held by live handles, kept for reuse (the encoder
    cache, evictable) and free (held + cached + free = total), and its counters."""

    held_handles: int
    held_rows: int
    cached_rows: int
    free_rows: int
    total_rows: int
    cached_entries: int
    cache_hits: int
    cache_misses: int


# -- KV events ------------------------------------------------------------------
# KV events: what the prefix cache published or forgot, in the order it happened.
#
# The block pool appends events to a queue (only when built with
# ``record_events=True``) and the engine core drains it once per step with
# ``BlockPool.take_events()``. A subscriber (a KV-aware router) replays the stream
# into its view of the published blocks, ``{block_hash: parent_hash}``:
#
# - ``BlockStored``: add ``block_hash``. Its parent is always already in the view
#   (or ``None`` for a first block): the pool never publishes a child before its parent.
# - ``BlockRemoved``: remove ``block_hash`` (a cached block was evicted for reuse).
# - ``AllBlocksCleared``: empty the whole view (``reset_prefix_cache``).
#
# After replaying every event taken so far, the view's keys equal the pool's
# published hashes (``BlockPool.hash_to_block``). Removals are not guaranteed
# child-first: a block whose parent hash was published by a concurrent duplicate
# may outlive that parent, so a subscriber must tolerate removing an inner node.


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A full block was published under ``block_hash`` (chained from ``parent_hash``)."""

    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    extra_keys: tuple[str, ...]
    lora: LoraAdapterSpec | None = None  # the adapter its KV was computed under (E4)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """The block published under ``block_hash`` was evicted; the hash is no longer a hit."""

    block_hash: bytes


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every published hash is forgotten (the prefix cache was reset)."""


KvEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KvEventBatch:
    """The KV events of one engine step (or a snapshot), numbered per data-parallel rank.

    Live batches are numbered 1, 2, 3, … without gaps. A snapshot batch (the blocks cached
    when a subscription started, as ``BlockStored`` events in publication order, parents
    first) carries the number of the last live batch whose effects it includes (0 before
    any), so the live batches that follow it start at the next number: no gap, no duplicate.
    """

    sequence_number: int
    timestamp_unix_nanos: int
    data_parallel_rank: int
    events: tuple[KvEvent, ...]
    snapshot: bool = False
