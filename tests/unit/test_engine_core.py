"""The engine core's seams: outputs from admission, KV-only forks, ``update_from_output``
as the one place results are applied, the step's ``ModelInput``, KV events in order,
and the idle integrity check."""

from __future__ import annotations

import random

import pytest
import torch

from refengine.config import CacheConfig, EngineConfig, SchedulerConfig
from refengine.engine.engine import Engine
from refengine.engine.input_builder import build_model_input
from refengine.engine.request import OutputStatus
from refengine.scheduler.scheduler import ScheduledSequence, SchedulerOutput
from refengine.types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    GenerationRequest,
    KvEvent,
    SamplingParams,
    StoppingParams,
)
from tests.tiny_models import hf_weights, make_tiny_hf_model, model_config_from_hf
from tests.unit.tokenizer_fixture import byte_fallback_tokenizer

TOKENIZER = byte_fallback_tokenizer()
VOCAB = len(TOKENIZER)
BLOCK = 4


@pytest.fixture(scope="module")
def tiny():
    model = make_tiny_hf_model(vocab_size=VOCAB, max_position_embeddings=256)
    return model_config_from_hf(model), hf_weights(model)


def make_engine(tiny, num_blocks: int = 64, budget: int = 512, events: list | None = None,
                debug: bool = False) -> Engine:
    config, weights = tiny
    sink = None if events is None else events.append
    return Engine(EngineConfig(max_model_len=256, debug_kv_integrity=debug,
                               cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
                               scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16)),
                  config, weights, TOKENIZER, model_fingerprint="tiny", kv_event_sink=sink)


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def request(rid: str, prompt: list[int], n: int = 1, max_tokens: int = 6, seed: int | None = None):
    return GenerationRequest(rid, prompt_token_ids=prompt,
                             sampling=SamplingParams(temperature=0.0 if seed is None else 1.0, seed=seed,
                                                     num_sequences=n),
                             stopping=StoppingParams(max_tokens=max_tokens, ignore_eos=True))


def test_outputs_exist_from_admission_and_fork_is_kv_only(tiny) -> None:
    engine = make_engine(tiny, budget=8)  # a 10-token prompt: two chunks before the first sample
    engine.add_request(request("n3", ids(1, 10), n=3, seed=5))
    engine.step()  # admission + first chunk
    core_request = engine.core.requests["n3"]
    outputs = core_request.outputs
    assert [o.status for o in outputs] == [OutputStatus.ACTIVE] + [OutputStatus.WAITING_FOR_PROMPT] * 2
    assert len({id(o.generator) for o in outputs}) == 3  # each output owns its generator
    assert all(o.seq.block_table == [] for o in outputs[1:])  # waiting outputs hold no KV
    assert outputs[0].seq.num_pending_forks == 2
    engine.step()  # the prompt completes: n tokens from one logits row, then the fork
    assert [o.status for o in outputs] == [OutputStatus.ACTIVE] * 3
    assert outputs[0].seq.num_pending_forks == 0
    prompt_blocks = outputs[0].seq.block_table[: 10 // BLOCK]
    for out in outputs[1:]:
        assert out.seq.block_table[: 10 // BLOCK] == prompt_blocks
        assert out.seq.num_output_tokens == 1 and out.seq.num_computed_tokens == 10
    assert all(engine.core.pool.blocks[b].ref_count == 3 for b in prompt_blocks)
    while engine.has_unfinished_requests:
        engine.step()
    engine.core.check_idle()


def test_abort_before_the_prompt_ends_every_output_and_frees_all(tiny) -> None:
    engine = make_engine(tiny, budget=4)
    stream = engine.add_request(request("early", ids(2, 12), n=2))
    engine.step()
    assert engine.abort("early")
    engine.step()
    result = stream.result(timeout=1)
    assert [o.finish.reason.value for o in result.outputs] == ["cancelled", "cancelled"]
    assert all(o.tokens == [] for o in result.outputs)
    engine.core.check_idle()


def test_update_from_output_applies_only_the_last_schedule(tiny) -> None:
    engine = make_engine(tiny)
    engine.add_request(request("a", ids(3, 5)))
    engine.step()
    scheduler = engine.core.scheduler
    stale = scheduler.schedule()  # one decode of "a"
    scheduler.finish(scheduler.running[0])
    assert scheduler.schedule().is_empty  # the newer schedule runs nothing
    with pytest.raises(AssertionError, match="not scheduled last"):
        scheduler.update_from_output(stale)


def _naive_positions_and_slots(items: list[ScheduledSequence]) -> tuple[list[int], list[int]]:
    positions, slots = [], []
    for item in items:
        for pos in range(item.start, item.start + item.num_new_tokens):
            positions.append(pos)
            slots.append(item.block_table[pos // BLOCK] * BLOCK + pos % BLOCK)
    return positions, slots


def test_model_input_matches_a_per_token_reference() -> None:
    rng = random.Random(0)
    items = []
    for i in range(12):
        start, num_new = rng.randrange(0, 40), rng.choice([1, 1, 3, 17])
        num_blocks = -(-(start + num_new) // BLOCK)
        table = tuple(rng.sample(range(200), num_blocks))
        items.append(ScheduledSequence(f"r{i}", 0, start, num_new, rng.random() < 0.7,
                                       tuple(rng.randrange(VOCAB) for _ in range(num_new)), table))
    rows = [item.num_new_tokens if i % 5 == 0 else int(item.samples) for i, item in enumerate(items)]
    mi = build_model_input(SchedulerOutput(items, [(1, 2)]), BLOCK, rows)
    positions, slots = _naive_positions_and_slots(items)
    assert mi.positions.tolist() == positions and mi.slot_mapping.tolist() == slots
    assert mi.input_ids.tolist() == [t for item in items for t in item.token_ids]
    assert mi.seq_lens == [item.start + item.num_new_tokens for item in items]
    expected_rows = [mi.query_start_loc[i + 1] - k for i, n in enumerate(rows) for k in range(n, 0, -1)]
    assert mi.logit_row_indices.tolist() == expected_rows
    assert [end - start for start, end in mi.logit_row_ranges()] == rows
    assert mi.block_copies == [(1, 2)] and mi.adapter_slots is None
    assert mi.block_tables.dtype == torch.int64 and mi.block_tables.shape[0] == len(items)


def _replay(events: list[list[KvEvent]]) -> dict[bytes, bytes | None]:
    """A router's view: published hash -> parent hash, from the event stream alone."""
    view: dict[bytes, bytes | None] = {}
    for batch in events:
        for event in batch:
            if isinstance(event, BlockStored):
                assert event.parent_hash is None or event.parent_hash in view, "child before parent"
                view[event.block_hash] = event.parent_hash
            elif isinstance(event, BlockRemoved):
                view.pop(event.block_hash)
            elif isinstance(event, AllBlocksCleared):
                view.clear()
    return view


def test_kv_events_reach_the_sink_in_order_once_per_step(tiny) -> None:
    events: list[list[KvEvent]] = []
    engine = make_engine(tiny, num_blocks=24, budget=6, events=events)
    steps = 0
    for round_ in range(3):  # later rounds evict earlier prefixes (24 blocks, ~7 per request)
        for i in range(3):
            engine.add_request(request(f"k{round_}-{i}", ids(10 * round_ + i, 17)))
        while engine.has_unfinished_requests:
            engine.step()
            steps += 1
            assert set(_replay(events)) == set(engine.core.pool.hash_to_block)
    assert 0 < len(events) <= steps  # at most one batch per step, never empty
    stored = [e for batch in events for e in batch if isinstance(e, BlockStored)]
    assert all(len(e.token_ids) == BLOCK and e.block_size == BLOCK and e.extra_keys == ("tiny",) for e in stored)
    assert any(isinstance(e, BlockRemoved) for batch in events for e in batch), "the pool was meant to evict"
    engine.core.check_idle()


def test_no_sink_keeps_no_events(tiny) -> None:
    engine = make_engine(tiny)
    engine.run_until_done([request("quiet", ids(4, 13))])
    assert engine.core.pool.take_events() == []


def test_debug_integrity_check_runs_when_idle(tiny) -> None:
    engine = make_engine(tiny, debug=True)
    engine.run_until_done([request("ok", ids(5, 9))])  # passes: everything was freed
    cached = next(iter(engine.core.pool.evictable))
    engine.core.pool.touch([cached])  # a reference no sequence or owner holds: a leak
    with pytest.raises(AssertionError, match="leaked"):
        engine.step()
