"""What an edge (the gRPC server, the CLI) may know of the engine: the ``EngineClient``
protocol and the frozen ``EngineInfo``. Nothing else of the engine is reachable
from an edge, so a second protocol could be served by writing only a new edge.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from refengine.engine.kv_events import KvEventSubscription
from refengine.types import EngineStats, GenerationRequest, LoraAdapterSpec, RequestOutput

OutputSink = Callable[[RequestOutput], None]  # called on the engine thread; must not block


@dataclass(frozen=True)
class EngineInfo:
    """Static facts of a loaded engine: model, limits, capacity. Never changes."""

    served_model_name: str
    served_model_aliases: tuple[str, ...]
    model_id: str  # the canonical model and tokenizer source (manifest name or path)
    vocab_size: int
    max_model_len: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    max_sequences_per_request: int
    max_logprobs: int
    kv_block_size: int
    total_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    device: str
    dtype: str
    kv_cache_dtype: str = ""  # the KV cache's dtype (EngineConfig.kv_dtype); "" = no KV cache (an encoder)
    guided_modes: tuple[str, ...] = ()  # GuidedDecoding modes of the default backend (advertised)
    guided_backends: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (backend name, its modes), default first
    role: str = "aggregated"  # aggregated, prefill or decode (EngineConfig.role)
    # KV transfer backends: a prefill engine's offered one first; a decode engine pulls with any.
    kv_transfer_backends: tuple[str, ...] = ()
    max_loras: int = 0  # LoRA adapter slots (DeploymentCapacity.max_loras); 0: LoRA disabled
    supports_multimodal: bool = False  # D9: image media accepted (a vision model)
    attention_backend: str = ""  # the registry name of the backend that runs, and why (info.kernel_paths)
    attention_backend_reason: str = ""
    cpu_bf16_path: str = ""  # --dtype bfloat16 on CPU: which path runs, and whether the CPU computes bf16 natively


class EngineClient(Protocol):
    """The thread-safe surface of an engine (``refengine.engine.engine.Engine``)."""

    info: EngineInfo

    def add_request(self, params: GenerationRequest, sink: OutputSink) -> None:
        """Validate, tokenize once and enqueue; raises a ``RequestError`` (nothing allocated)."""

    def abort(self, request_id: str) -> bool:
        """Cancel an active request; False when there is none with this id."""

    def abort_all(self) -> list[str]:
        """Cancel every active request; returns their ids."""

    def was_finished(self, request_id: str) -> bool:
        """Whether ``request_id`` finished recently (a bounded window)."""

    def ended_by_abort(self, request_id: str) -> bool | None:
        """None while the request is being accepted or runs; once it finished (recently): whether
        an abort ended it (an output CANCELLED) rather than its own stop; False when it is not
        known (never accepted, refused during acceptance, or finished too long ago)."""

    @property
    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> EngineStats:
        """Live load figures, safe from any thread."""

    def subscribe_kv_events(self, on_ready: Callable[[], None], include_snapshot: bool = False,
                            start_sequence_number: int = 0) -> KvEventSubscription:
        """Numbered KV event batches (snapshot, replay or live); raises ``InvalidRequestError``."""

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; returns the blocks freed."""

    # -- KV sessions (prefill role); unknown or expired ones raise ``KvSessionNotFound`` --
    def read_kv_session(self, session_id: str, first_block_index: int, num_blocks: int) -> bytes:
        """Some of a live session's blocks, region-major (``BlockStore.read``)."""

    def kv_session_content(self, session_id: str) -> str:
        """What a live session holds (``KvSessionStore.content``): said to its puller, who checks it."""

    def kv_session_blocks(self, session_id: str) -> int:
        """How many blocks a live session holds (an embedding handle: rows), for a pull's range check."""

    def block_nbytes(self) -> int:
        """Bytes of one KV block over all layers."""

    def kv_layout(self) -> str:
        """The KV cache layout (``BlockStore.layout``): equal strings = compatible blocks."""

    def pin_kv_session(self, session_id: str, seconds: float, expected_content: str = "") -> tuple[int, ...]:
        """Keep a live session's blocks for a one-sided remote read of up to ``seconds``;
        returns their ids. ``expected_content``: the digest of what the reader will READ
        (``pinned_content``); another one raises ``KvSessionMismatch`` and pins nothing."""

    def unpin_kv_session(self, session_id: str) -> None:
        """End one pin whose reader will not end it (its READ failed, or it gave up on its Pin
        call before hearing of the pin): the session stays offered. Nothing when none is counted."""

    def kv_read_identity(self) -> str:
        """What a one-sided reader of this engine's sessions reads from (its NIXL agent and
        regions, ``nixl_source.source_identity``); a pin says it, "" when none is offered."""

    def confirm_kv_session(self, session_id: str, pinned: bool = False) -> bool:
        """A decode engine has pulled it: free it. ``pinned``: that pull had pinned it (a
        one-sided READ), and this ends its pin; a pull that pinned nothing (gRPC ``Release``)
        ends no other engine's pin. False when unknown."""

    def abort_kv_session(self, session_id: str) -> bool:
        """Free a session (``Abort(kv_session)``). False when unknown."""

    def release_all_kv_sessions(self) -> int:
        """Free every session (drain, shutdown); returns how many."""

    # -- LoRA (R1–R5): raise the refengine.types LoRA errors, InvalidRequestError, OverloadedError --
    def load_lora(self, spec: LoraAdapterSpec) -> tuple[LoraAdapterSpec, bool]:
        """Load an adapter (slow: reads its files); returns it and whether it was loaded already."""

    def unload_lora(self, name: str) -> LoraAdapterSpec:
        """Stop accepting requests for an adapter; those accepted finish on it."""

    def list_loras(self) -> list[LoraAdapterSpec]:
        """The loaded adapters, by id."""

    def start(self) -> None:
        """Run the step loop on a background thread."""

    def on_stopped(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)``, on the engine's thread, if the engine stops by itself (a
        fault it could not end its requests after); it then refuses all new work."""

    def shutdown(self) -> None:
        """Stop the step loop; requests still active then end with one terminal error (CANCELLED,
        retryable), and ``add_request`` refuses new ones (EngineStoppedError) for good: a shut-down
        engine cannot ``start`` again."""
