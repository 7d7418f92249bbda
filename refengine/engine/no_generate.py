"""The ``EngineClient`` surface of a server that runs no Generate (the encoder role): every
request refused before acceptance as a role mismatch, nothing to abort, no KV events, no LoRA."""

from __future__ import annotations

from collections.abc import Callable

from refengine.engine.interface import OutputSink
from refengine.engine.kv_events import KvEventSubscription
from refengine.types import (
    FeatureDisabledError,
    GenerationRequest,
    InvalidRequestError,
    LoraAdapterSpec,
    LoraDisabledError,
)

ROLE_MISMATCH = ("role mismatch: this is an encoder server; send media to refengine.v1alpha1.Media/Encode and "
                 "Generate to an aggregated, prefill or decode server")
NO_LORA = "an encoder server has no language model: LoRA is disabled"


class NoGenerate:
    def add_request(self, params: GenerationRequest, sink: OutputSink) -> None:
        raise InvalidRequestError(ROLE_MISMATCH)

    def abort(self, request_id: str) -> bool:
        return False

    def on_stopped(self, callback: Callable[[str], None]) -> None:
        """No step loop: nothing here stops by itself."""

    def abort_all(self) -> list[str]:
        return []

    def was_finished(self, request_id: str) -> bool:
        return False

    def ended_by_abort(self, request_id: str) -> bool | None:
        return False  # no request is ever known here

    @property
    def has_unfinished_requests(self) -> bool:
        return False

    def subscribe_kv_events(self, on_ready: Callable[[], None], include_snapshot: bool = False,
                            start_sequence_number: int = 0) -> KvEventSubscription:
        raise FeatureDisabledError("an encoder server has no KV cache, so no KV events")

    def load_lora(self, spec: LoraAdapterSpec) -> tuple[LoraAdapterSpec, bool]:
        raise LoraDisabledError(NO_LORA)

    def unload_lora(self, name: str) -> LoraAdapterSpec:
        raise LoraDisabledError(NO_LORA)

    def list_loras(self) -> list[LoraAdapterSpec]:
        raise LoraDisabledError(NO_LORA)
