"""KV event batches (engine types) → ``SubscribeKvEventsResponse`` (E1–E5).

Each stored event is its own ``BlockStored`` with one hash (a consumer applies events in
order, parents first). Block hashes are ``KvBlockHash{value: 32-byte key, encoding:
"bytes"}`` (``refengine/kv/keys.py`` says how keys are computed). ``extra_keys`` carries the
block's hash inputs besides tokens and parent as one ``OpaqueKeyTuple``: the model
fingerprint, then ``salt:<salt>`` and ``lora:<digest>`` when the request had them, then one
``media:<identity>`` per media item with positions in the block -- everything a router needs
to recompute the key. Blocks live in host memory on CPU (medium unspecified) and in device
memory on CUDA (``STORAGE_MEDIUM_GPU``).
"""

from __future__ import annotations

from refengine.protocol import oe
from refengine.types import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch

HASH_ENCODING = "bytes"


def _hash(key: bytes) -> oe.KvBlockHash:
    return oe.KvBlockHash(value=key, encoding=HASH_ENCODING)


def storage_medium(device: str) -> int:
    return oe.STORAGE_MEDIUM_GPU if device.startswith("cuda") else oe.STORAGE_MEDIUM_UNSPECIFIED


def _event(event: KvEvent, medium: int) -> oe.KvEvent:
    if isinstance(event, BlockStored):
        stored = oe.BlockStored(block_hashes=[_hash(event.block_hash)], token_ids=list(event.token_ids),
                                block_size=event.block_size, medium=medium,
                                extra_keys=[oe.OpaqueKeyTuple(values=list(event.extra_keys))])
        if event.parent_hash is not None:
            stored.parent_block_hash.CopyFrom(_hash(event.parent_hash))
        if event.lora is not None:  # E4: the adapter its KV was computed under
            stored.lora_id, stored.lora_name = event.lora.lora_id, event.lora.lora_name
        return oe.KvEvent(block_stored=stored)
    if isinstance(event, BlockRemoved):
        return oe.KvEvent(block_removed=oe.BlockRemoved(block_hashes=[_hash(event.block_hash)], medium=medium))
    assert isinstance(event, AllBlocksCleared)
    return oe.KvEvent(all_blocks_cleared=oe.AllBlocksCleared())


def batch_response(batch: KvEventBatch, medium: int) -> oe.SubscribeKvEventsResponse:
    return oe.SubscribeKvEventsResponse(batch=oe.KvEventBatch(
        sequence_number=batch.sequence_number,
        timestamp_unix_nanos=batch.timestamp_unix_nanos,
        data_parallel_rank=batch.data_parallel_rank,
        events=[_event(e, medium) for e in batch.events],
    ))
