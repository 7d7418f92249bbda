"""Request and output types shared by every layer (the bottom of the layer order).

These are the only types that cross the boundary between the engine and an edge
(the gRPC server, the CLI, tests), and the request parameters the sampler reads.
They hold plain Python values, never tensors or protobuf messages, and import
nothing of refengine but each other. One idea per module: ``requests`` (what a request
asks for), ``outputs`` (what comes back, faults and load figures), ``errors`` (refusals
before acceptance), ``kv_events`` (what the prefix cache published); import them from here.
"""

from refengine.types.errors import (
    DuplicateRequestError,
    EngineStoppedError,
    FeatureDisabledError,
    InvalidRequestError,
    KvSessionMismatch,
    KvSessionNotFound,
    LoraConflictError,
    LoraDisabledError,
    LoraNotFoundError,
    OverloadedError,
    RequestError,
)
from refengine.types.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
)
from refengine.types.outputs import (
    Candidate,
    EngineFault,
    EngineStats,
    FinishInfo,
    FinishReason,
    MediaStats,
    RequestOutput,
    SequenceDelta,
    TokenInfo,
    Usage,
)
from refengine.types.requests import (
    CandidateSpec,
    EmbeddingHandleSpec,
    EmbeddingTransferSpec,
    GenerationRequest,
    GuidedMode,
    GuidedSpec,
    KvEndpointSpec,
    KvParams,
    KvSessionSpec,
    LogprobParams,
    LoraAdapterSpec,
    MediaInput,
    SamplingParams,
    StoppingParams,
)

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Candidate",
    "CandidateSpec",
    "DuplicateRequestError",
    "EmbeddingHandleSpec",
    "EmbeddingTransferSpec",
    "EngineFault",
    "EngineStats",
    "FinishInfo",
    "FinishReason",
    "GenerationRequest",
    "GuidedMode",
    "GuidedSpec",
    "InvalidRequestError",
    "KvEndpointSpec",
    "KvEvent",
    "KvEventBatch",
    "KvParams",
    "KvSessionMismatch",
    "KvSessionNotFound",
    "KvSessionSpec",
    "LogprobParams",
    "LoraAdapterSpec",
    "LoraConflictError",
    "FeatureDisabledError",
    "LoraDisabledError",
    "LoraNotFoundError",
    "MediaInput",
    "MediaStats",
    "EngineStoppedError",
    "OverloadedError",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "SequenceDelta",
    "StoppingParams",
    "TokenInfo",
    "Usage",
]
