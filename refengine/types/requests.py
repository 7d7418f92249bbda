"""What a request asks for: sampling, stopping, logprobs, KV and guided options, media
items or embedding handles, a LoRA adapter (``GenerationRequest`` and its parts).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal


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
    and stop tokens until that many tokens were produced (RULES G15 names those two). A stop
    string completed by one of the first ``min_tokens`` tokens does not end the output either
    (vLLM's and SGLang's choice; ``engine/stop_checker.py``).
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
    # W3C trace context of the RPC (``traceparent``, ``tracestate`` pairs), sent on the calls
    # made for the request downstream (M5: the KV and embedding pulls).
    trace: tuple[tuple[str, str], ...] = ()
    # The server's own health probe (H2), never set from the wire: a decode engine runs it
    # here from its prompt, as it has no prefill engine's session to pull.
    health_probe: bool = False


@dataclass(frozen=True)
class LoraAdapterSpec:
    """A LoRA adapter as the lifecycle RPCs name it (R1): ``lora_id`` > 0, a non-empty
    ``lora_name``, ``source_path`` an absolute directory in PEFT layout."""

    lora_id: int
    lora_name: str
    source_path: str
