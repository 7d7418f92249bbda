"""Disaggregation with a LoRA adapter: the adapter changes every block of the prompt's KV, so
a session carries it (in ``prompt_hash``) and a decode request naming another adapter (or the
base model) is refused before acceptance; otherwise the decode engine would decode on the
wrong KV and cache it under its own request's keys, where a later base request would reuse it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from refengine.config import CacheConfig, EngineConfig, KvTransferConfig, LoraConfig, SchedulerConfig
from refengine.engine.engine import Engine
from refengine.kv.transfer.base import KvTransferBackend
from refengine.types import InvalidRequestError, KvParams, LoraAdapterSpec
from tests.lora_adapters import make_peft_adapter
from tests.tiny_models import hf_weights, make_tiny_hf_model, model_config_from_hf
from tests.unit.test_disagg_engine import BLOCK, PROMPTS, TOKENIZER, VOCAB, InProcessPull, request, run, wait_idle

ADAPTER = "a"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    model = make_tiny_hf_model(vocab_size=VOCAB, max_position_embeddings=256)
    root = tmp_path_factory.mktemp("loras")
    make_peft_adapter(model, root / ADAPTER, 4, ["q_proj", "v_proj", "down_proj"], seed=3)
    config, weights = model_config_from_hf(model), hf_weights(model)

    def make(role: str, backend: KvTransferBackend | None = None) -> Engine:
        engine = Engine(EngineConfig(max_model_len=256, role=role, max_sequences_per_request=4,
                                     cache=CacheConfig(block_size=BLOCK, num_blocks=64),
                                     scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
                                     kv_transfer=KvTransferConfig(session_ttl_seconds=30),
                                     lora=LoraConfig(enabled=True, roots=(str(root),), max_loras=2)),
                        config, weights, TOKENIZER, model_fingerprint="tiny",
                        transfer_backends=[backend or InProcessPull()])
        engine.load_lora(LoraAdapterSpec(1, ADAPTER, str(root / ADAPTER)))
        engine.start()
        return engine

    aggregated, prefill = make("aggregated"), make("prefill")
    decode = make("decode", InProcessPull(prefill))
    yield aggregated, prefill, decode
    for engine in (aggregated, prefill, decode):
        engine.shutdown()


def _on(adapter: str | None, rid: str):  # noqa: ANN202
    return replace(request(rid, PROMPTS[3], None, 0.0, logprobs=False), lora_name=adapter)


@pytest.mark.parametrize(("prefill_adapter", "decode_adapter"), [(ADAPTER, None), (None, ADAPTER)])
def test_a_decode_on_another_adapter_is_refused(pair, prefill_adapter: str | None,
                                                 decode_adapter: str | None) -> None:
    aggregated, prefill, decode = pair
    session = run(prefill, _on(prefill_adapter, "p")).prefill
    with pytest.raises(InvalidRequestError, match="prompt_hash .* or LoRA adapter"):
        decode.add_request(replace(_on(decode_adapter, "d"), kv=KvParams(session=session)))
    prefill.abort_kv_session(session.session_id)
    # The refused pairing left nothing behind: a base pair still gives the aggregated base tokens.
    base = run(prefill, _on(None, "p-base")).prefill
    got = run(decode, replace(_on(None, "d-base"), kv=KvParams(session=base)))
    assert got.outputs[0].token_ids == run(aggregated, _on(None, "agg-base")).outputs[0].token_ids
    wait_idle(decode)


def test_the_same_adapter_on_both_sides_equals_aggregated(pair) -> None:
    aggregated, prefill, decode = pair
    session = run(prefill, _on(ADAPTER, "p-a")).prefill
    got = run(decode, replace(_on(ADAPTER, "d-a"), kv=KvParams(session=session)))
    want = run(aggregated, _on(ADAPTER, "agg-a")).outputs[0].token_ids
    assert got.error is None and got.outputs[0].token_ids == want
    assert want != run(aggregated, _on(None, "agg-base-2")).outputs[0].token_ids  # the adapter matters here
    wait_idle(decode)
