"""The encoder role and its consumers in one process (docs/profiles/encoder.md).

``EncoderEngine`` on the tiny LLaVA checkpoint, and consumer ``Engine``s whose embedding
backend reads the encoder directly (``Loopback``: the pull contract of
``KvTransferBackend`` without a network; the real backends run in
``tests/integration/test_encoder_grpc.py``). The oracle for outputs is the aggregated engine
given the images themselves.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from refengine.config import CacheConfig, EncoderConfig, EngineConfig, SchedulerConfig
from refengine.engine.encoder import EncoderEngine
from refengine.engine.engine import Engine
from refengine.engine.info import engine_info
from refengine.engine.media import MediaInputs
from refengine.kv.keys import block_keys
from refengine.kv.transfer.base import BlockStore, Cancellation, KvTransferBackend, PullOrder, TransferFailure
from refengine.model.loader import load_model_config, load_weights
from refengine.model.vision import VISION_PREFIXES
from refengine.multimodal.embedding_rows import EmbeddingEntries, RowPool
from refengine.types import (
    EmbeddingTransferSpec,
    FeatureDisabledError,
    FinishReason,
    GenerationRequest,
    InvalidRequestError,
    KvEndpointSpec,
    KvParams,
    KvSessionNotFound,
    LoraAdapterSpec,
    MediaInput,
    OverloadedError,
    SamplingParams,
    StoppingParams,
)
from tests import tiny_llava
from tests.tiny_llava import NUM_IMAGE_TOKENS, TinyLlava, png, prompt_with
from tests.unit.test_disagg_engine import InProcessPull

IMAGES = [png(1, (56, 56)), png(2, (80, 64)), png(3, (64, 64))]
ENDPOINT = (KvEndpointSpec("127.0.0.1", 1, "grpc"),)


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> TinyLlava:
    return tiny_llava.build_tiny_llava(tmp_path_factory.mktemp("tiny-llava-encoder"))


def config(role: str, **encoder: object) -> EngineConfig:
    return EngineConfig(max_model_len=512, max_sequences_per_request=4, role=role,
                        cache=CacheConfig(block_size=4, num_blocks=256),
                        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8),
                        encoder=EncoderConfig(**encoder))


def make_encoder(directory: Path, **encoder: object) -> EncoderEngine:
    cfg = config("encoder", **encoder)
    model_config = load_model_config(directory)
    weights = load_weights(directory, prefixes=VISION_PREFIXES)
    assert weights and all(name.startswith(VISION_PREFIXES) for name in weights)  # ENC2: no LM weights
    media = MediaInputs.from_model(directory, model_config, weights, torch.float32, "cpu", cfg.media)
    assert media is not None
    engine = EncoderEngine(cfg, media, engine_info(cfg, model_config, "tiny", 512, 0, multimodal=True))
    engine.start()
    return engine


class Loopback(KvTransferBackend):
    """Reads the encoder's rows in-process, then confirms (as the gRPC pull does); ``delay``
    per pull, checking ``cancelled`` meanwhile."""

    name = protocol = "grpc"

    def __init__(self, source: EncoderEngine, delay: float = 0.0) -> None:
        self.source, self.delay = source, delay
        self.store: BlockStore | None = None

    def bind(self, store: BlockStore, on_confirmed: object) -> None:
        self.store = store

    def pull(self, order: PullOrder, cancelled: Cancellation) -> None:
        if cancelled.wait(self.delay):
            raise TransferFailure("failed", "cancelled")
        try:
            data = self.source.read_kv_session(order.session.session_id, 0, len(order.dest_block_ids))
        except KvSessionNotFound as exc:
            raise TransferFailure("not_found", str(exc)) from None
        assert self.store is not None
        self.store.write(order.dest_block_ids, data)
        self.source.confirm_kv_session(order.session.session_id)

    def close(self) -> None:
        pass


def consumer(directory: Path, encoder: EncoderEngine, role: str = "aggregated", delay: float = 0.0,
             num_blocks: int = 256, kv_pull: KvTransferBackend | None = None,
             source: type[Loopback] = Loopback) -> Engine:
    cfg = replace(config(role), cache=CacheConfig(block_size=4, num_blocks=num_blocks))
    model_config, weights = load_model_config(directory), load_weights(directory)
    media = MediaInputs.from_model(directory, model_config, weights, torch.float32, "cpu", cfg.media)
    return Engine(cfg, model_config, weights, tiny_llava.TOKENIZER, model_fingerprint="tiny-llava", media=media,
                  embedding_backends=[source(encoder, delay)],
                  transfer_backends=[kv_pull or InProcessPull()] if role != "aggregated" else ())


def items(*indices: int) -> tuple[MediaInput, ...]:
    return tuple(MediaInput("image", raw_bytes=IMAGES[i]) for i in indices)


def reachable(handles):  # noqa: ANN001, ANN201 - what a server adds: its endpoint on each transfer
    return tuple(replace(h, transfers=(EmbeddingTransferSpec("grpc", ENDPOINT, {}),)) for h in handles)


def request(rid: str, count: int, seed: int = 0, max_tokens: int = 6, **fields: object) -> GenerationRequest:
    return GenerationRequest(rid, prompt_token_ids=prompt_with(count, seed), sampling=SamplingParams(temperature=0.0),
                             stopping=StoppingParams(max_tokens=max_tokens, ignore_eos=True), **fields)


def tokens(completion) -> list[int]:  # noqa: ANN001
    return [t.token_id for t in completion.outputs[0].tokens]


def idle(encoder: EncoderEngine) -> None:
    deadline = time.monotonic() + 5
    while encoder.media_stats().held_handles and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = encoder.media_stats()
    assert stats.held_handles == 0 and stats.held_rows == 0, stats
    encoder.check_integrity()


def test_row_pool_and_entries_keep_their_invariant() -> None:
    """free + cached + held = total under random acquire/add/drop, with eviction (ENC4, ENC15)."""
    entries = EmbeddingEntries(RowPool(64), max_cached_entries=3)
    holders: list[str] = []
    rng = random.Random(0)
    for step in range(3000):
        identity = f"sha256:{rng.randrange(12)}"
        if holders and rng.random() < 0.45:
            entries.drop(holders.pop(rng.randrange(len(holders))))
        elif entries.acquire(identity) is not None or entries.add(identity, rng.randrange(1, 12)) is not None:
            holders.append(identity)
        entries.check()
        assert entries.num_cached <= 3, step
    assert entries.add("sha256:big", 65) is None  # more than the whole pool: refused, nothing changed
    entries.check()


def test_encode_cache_release_expiry_and_integrity(llava: TinyLlava) -> None:
    """ENC3–ENC7: handles per item with well-formed fields; the same image again is a cache hit
    with equal rows; releases are idempotent; a lease ends by itself; renewing a gone handle fails."""
    encoder = make_encoder(llava.directory)
    first = encoder.encode(items(0, 1))
    assert [h.cached for h in first] == [False, False]
    assert all(h.shape == (NUM_IMAGE_TOKENS, 64) and h.num_tokens == NUM_IMAGE_TOKENS for h in first)
    assert first[0].fingerprint == encoder.expectation.fingerprint and first[0].layout.endswith(":64:float32")
    again = encoder.encode(items(1, 1))  # one image twice in one request, and cached
    assert [h.cached for h in again] == [True, True] and {h.mm_hash for h in again} == {first[1].mm_hash}
    rows = [encoder.read_kv_session(h.handle_id, 0, NUM_IMAGE_TOKENS) for h in (first[1], *again)]
    assert rows[0] == rows[1] == rows[2]
    assert encoder.media_stats().held_handles == 4 and encoder.media_stats().cache_hits == 2
    assert encoder.release_handles([h.handle_id for h in first + again]) == 4
    assert encoder.release_handles([first[0].handle_id, "unknown"]) == 0
    idle(encoder)
    assert encoder.media_stats().cached_entries == 2  # kept for reuse
    short, = encoder.encode(items(2), lease_seconds=0.2)
    assert encoder.renew_handle(short.handle_id, 0.4) > short.lease_expires_unix_nanos
    time.sleep(0.6)
    idle(encoder)
    with pytest.raises(KvSessionNotFound):
        encoder.renew_handle(short.handle_id, 5)
    with pytest.raises(InvalidRequestError, match="lease_seconds"):
        encoder.encode(items(2), lease_seconds=float("inf"))
    with pytest.raises(InvalidRequestError, match="at least one"):
        encoder.encode(())
    assert encoder.reset_prefix_cache() > 0 and encoder.media_stats().cached_entries == 0
    encoder.shutdown()


def test_kv_events_and_lora_are_features_an_encoder_lacks(llava: TinyLlava) -> None:
    """ENC2: SubscribeKvEvents and the LoRA RPCs are FAILED_PRECONDITION (FeatureDisabledError), as
    on a server started without them; SubscribeKvEvents was INVALID_ARGUMENT, unlike --no-kv-events."""
    encoder = make_encoder(llava.directory)
    with pytest.raises(FeatureDisabledError, match="no KV events"):
        encoder.subscribe_kv_events(lambda: None)
    with pytest.raises(FeatureDisabledError):
        encoder.load_lora(LoraAdapterSpec(1, "a", "/adapters/a"))
    encoder.shutdown()


def test_a_salt_past_the_bound_is_refused_before_anything_is_cached(llava: TinyLlava) -> None:
    """ref: an Encode's cache_salt is bounded as kv.cache_salt is (1,024 UTF-8 bytes). Found by
    review: a 4 MB salt per Encode grew the encoder by 33 MB each time, kept after release in the
    cache entries' keys."""
    encoder = make_encoder(llava.directory)
    image = [MediaInput("image", raw_bytes=IMAGES[0])]
    with pytest.raises(InvalidRequestError, match="cache_salt is 1025 bytes; at most 1024"):
        encoder.encode(image, cache_salt="s" * 1025)
    refused = encoder.media_stats()
    assert (refused.held_handles, refused.cached_entries, refused.cache_misses) == (0, 0, 0)
    handle, = encoder.encode(image, cache_salt="s" * 1024)
    assert not handle.cached and encoder.media_stats().held_handles == 1
    encoder.shutdown()


def test_a_salted_encode_uses_only_its_salt_s_cache_entries(llava: TinyLlava) -> None:
    """ENC4's salt (before it, an Encode had no salt): a uuid names an image within one salt
    alone. Another salt, or no salt, naming a different image by the same uuid gets that image's
    own rows, not the first one's; within the salt the uuid is trusted (a hit)."""
    encoder = make_encoder(llava.directory)
    named = [MediaInput("image", raw_bytes=IMAGES[i], uuid="cat") for i in (0, 1)]
    first, = encoder.encode(named[:1], cache_salt="tenant-a")
    other, = encoder.encode(named[1:], cache_salt="tenant-b")
    plain, = encoder.encode(named[1:])
    same, = encoder.encode(named[1:], cache_salt="tenant-a")
    assert [h.cached for h in (first, other, plain, same)] == [False, False, False, True]
    assert {h.mm_hash for h in (first, other, plain, same)} == {"cat"}
    rows = {h: encoder.read_kv_session(h.handle_id, 0, NUM_IMAGE_TOKENS) for h in (first, other, plain, same)}
    assert rows[other] == rows[plain] != rows[first] == rows[same]
    assert encoder.release_handles([h.handle_id for h in rows]) == 4
    idle(encoder)
    assert encoder.media_stats().cached_entries == 3
    encoder.shutdown()


def test_a_lease_ends_after_a_read_the_consumer_abandoned(llava: TinyLlava) -> None:
    """ENC7: the sweeper woke (another handle's release) while a handle was read, so it left
    that handle out of its wait; the read ended before the lease, waking nobody, and the rows
    stayed held after the lease with no client left to release them."""
    encoder = make_encoder(llava.directory)
    (short,) = encoder.encode(items(0), lease_seconds=0.5)
    (other,) = encoder.encode(items(1), lease_seconds=30)
    reading, finish = threading.Event(), threading.Event()
    read = encoder.arena.read

    def slow_read(rows):  # noqa: ANN001, ANN202 - a gRPC Pull's chunk, read slowly
        reading.set()
        finish.wait(5)
        return read(rows)

    encoder.arena.read = slow_read
    reader = threading.Thread(target=encoder.read_kv_session, args=(short.handle_id, 0, NUM_IMAGE_TOKENS))
    reader.start()
    assert reading.wait(5)
    encoder.release_handles([other.handle_id])  # wakes the sweeper during the read
    time.sleep(0.1)
    finish.set()  # the read ends; the consumer went away without a Release
    reader.join()
    time.sleep(0.6)  # past the lease
    idle(encoder)
    encoder.shutdown()


def test_the_sweeper_survives_a_failure_to_free(llava: TinyLlava, caplog: pytest.LogCaptureFixture) -> None:
    """ENC7: one failed free used to end the sweeper thread, and no lease ended after it."""
    encoder = make_encoder(llava.directory)
    drop, failures = encoder.entries.drop, []

    def drop_failing_once(content):  # noqa: ANN001, ANN202
        if not failures:
            failures.append(content)
            raise RuntimeError("injected")
        return drop(content)

    encoder.entries.drop = drop_failing_once
    encoder.encode(items(0), lease_seconds=0.2)
    deadline = time.monotonic() + 5
    while not failures:
        assert time.monotonic() < deadline, "the sweeper never freed the first handle"
        time.sleep(0.02)
    encoder.encode(items(1), lease_seconds=0.2)
    deadline = time.monotonic() + 5
    while encoder.media_stats().held_handles:
        assert time.monotonic() < deadline, "the second lease never ended: the sweeper died"
        time.sleep(0.02)
    assert "freeing expired embedding handles failed" in caplog.text
    encoder.shutdown()


def test_encode_is_all_or_nothing(llava: TinyLlava) -> None:
    """ENC3, ENC4: a bad item among good ones, or no room, leaves nothing held."""
    encoder = make_encoder(llava.directory, memory_mib=1)  # 1 MiB / 256 bytes a row = 4096 rows
    with pytest.raises(InvalidRequestError, match="not an image"):
        encoder.encode((*items(0), MediaInput("image", raw_bytes=b"\x89PNG broken")))
    idle(encoder)
    held = [encoder.encode(items(0)) for _ in range(4095 // NUM_IMAGE_TOKENS)]  # one entry, many handles
    assert encoder.media_stats().held_rows == NUM_IMAGE_TOKENS  # shared rows
    fill = [encoder.encode((MediaInput("image", raw_bytes=png(100 + i, (56, 56))),))
            for i in range(4096 // NUM_IMAGE_TOKENS - 1)]
    with pytest.raises(OverloadedError, match="full"):
        encoder.encode(items(1, 2))
    assert encoder.media_stats().held_rows == 4096 - 4096 % NUM_IMAGE_TOKENS
    encoder.release_handles([h.handle_id for group in held + fill for h in group])
    idle(encoder)
    encoder.shutdown()


def test_handles_give_the_aggregated_output_and_prefix_keys(llava: TinyLlava) -> None:
    """ENC8, ENC10, ENC12: one and three images by handle = by item, token for token; the handle's
    blocks carry the item's media key; the consumer released every handle it pulled."""
    encoder = make_encoder(llava.directory)
    oracle = tiny_llava.make_engine(llava.directory)
    engine = consumer(llava.directory, encoder)
    for count in (1, 3):
        want = oracle.run_until_done([request(f"raw-{count}", count, media=items(*range(count)))])[0]
        handles = reachable(encoder.encode(items(*range(count))))
        got = engine.run_until_done([request(f"handle-{count}", count, media_handles=handles)])[0]
        assert got.error is None and tokens(got) == tokens(want)
        expanded, runs = engine.media.prepare(prompt_with(count), (), handles, pull_backends=("grpc",))
        raw_expanded, raw_runs = oracle.media.prepare(prompt_with(count), items(*range(count)))
        spans = [(r.start, r.end, r.identity) for r in runs]
        assert expanded == raw_expanded and spans == [(r.start, r.end, r.identity) for r in raw_runs]
        assert block_keys(expanded, 4, (), spans) == block_keys(raw_expanded, 4, (), spans)
    idle(encoder)
    engine.shutdown()
    encoder.shutdown()


def test_gone_handle_and_cancel_while_pulling(llava: TinyLlava) -> None:
    """ENC13: a released handle ends the accepted request with one non-retryable
    kv_transfer_failed fault; an abort while pulling stops the pull; nothing is held after."""
    encoder = make_encoder(llava.directory)
    engine = consumer(llava.directory, encoder, delay=0.3)
    handles = reachable(encoder.encode(items(0, 1)))
    encoder.release_handles([handles[1].handle_id])
    done = engine.run_until_done([request("gone", 2, media_handles=handles)])[0]
    assert done.error is not None and done.error.code == "kv_transfer_failed" and not done.error.retryable
    assert "embedding handle" in done.error.message
    encoder.release_handles([handles[0].handle_id])
    live = reachable(encoder.encode(items(2)))
    stream = engine.add_request(request("cancel", 1, media_handles=live))
    engine.abort("cancel")
    while not stream.finished:
        engine.step()
        time.sleep(0.01)
    assert stream.result().outputs[0].finish.reason is FinishReason.CANCELLED
    time.sleep(0.4)  # the pull saw the cancel and ended; its staging rows are free again
    engine.step()
    pulls = engine.core.media_pulls
    assert pulls is not None and pulls._rows.num_free == pulls.staging.num_rows
    assert engine.stats().used_kv_blocks == 0
    encoder.release_handles([live[0].handle_id])
    idle(encoder)
    engine.shutdown()
    encoder.shutdown()


class NonFinite(Loopback):
    """A source whose rows hold NaN (the CRCs of a gRPC pull would still match)."""

    def pull(self, order: PullOrder, cancelled: Cancellation) -> None:
        assert self.store is not None
        values = len(order.dest_block_ids) * self.store.block_nbytes // 4
        self.store.write(order.dest_block_ids, torch.full((values,), float("nan")).numpy().tobytes())


def test_rows_that_are_not_finite_fail_the_request(llava: TinyLlava) -> None:
    """ENC13: pulled rows holding NaN end the request with one non-retryable kv_transfer_failed
    fault, before any KV is computed from them; nothing is held after."""
    encoder = make_encoder(llava.directory)
    engine = consumer(llava.directory, encoder, source=NonFinite)
    handles = reachable(encoder.encode(items(0)))
    done = engine.run_until_done([request("nan", 1, media_handles=handles)])[0]
    assert done.error is not None and done.error.code == "kv_transfer_failed" and not done.error.retryable
    assert "NaN or infinity" in done.error.message and engine.stats().used_kv_blocks == 0
    encoder.release_handles([handles[0].handle_id])
    idle(encoder)
    engine.shutdown()
    encoder.shutdown()


def test_incompatible_handles_are_refused_before_acceptance(llava: TinyLlava) -> None:
    """ENC11: each mismatch is an InvalidRequestError naming the field; nothing is pulled."""
    encoder = make_encoder(llava.directory)
    engine = consumer(llava.directory, encoder)
    good, = reachable(encoder.encode(items(0)))
    cases = {
        "fingerprint": replace(good, fingerprint="f" * 64),
        "shape": replace(good, shape=(NUM_IMAGE_TOKENS, 32)),
        "dtype/layout": replace(good, dtype="bfloat16"),
        "mm_hash_algorithm": replace(good, mm_hash_algorithm="md5"),
        "mm_hash must": replace(good, mm_hash="XYZ"),
        "handle_id": replace(good, handle_id=""),
        "modality": replace(good, modality="audio"),
        "offers no transfer": replace(good, transfers=()),
        # found by review: a client's own server as the source put made-up rows into the prefix
        # cache under the real image's identity, for every later client sending that image
        "is not a source this server pulls from": replace(good, transfers=(EmbeddingTransferSpec(
            "grpc", (KvEndpointSpec("10.9.9.9", 7000, "grpc"),), {}),)),
    }
    for field, bad in cases.items():
        with pytest.raises(InvalidRequestError, match=field):
            engine.add_request(request(field, 1, media_handles=(bad,)))
    with pytest.raises(InvalidRequestError, match="not both"):
        engine.add_request(request("both", 1, media=items(0), media_handles=(good,)))
    other, = reachable(encoder.encode(items(1)))
    encoder.release_handles([other.handle_id])
    with pytest.raises(InvalidRequestError, match="repeated with other fields"):  # only one copy is pulled
        engine.add_request(request("forged", 2, media_handles=(replace(good, mm_hash=other.mm_hash), good)))
    with pytest.raises(InvalidRequestError, match="placeholder"):
        engine.add_request(request("count", 2, media_handles=(good,)))
    assert encoder.media_stats().held_handles == 1  # nothing was pulled or released
    encoder.release_handles([good.handle_id])
    engine.shutdown()
    encoder.shutdown()


def test_decode_role_takes_identities_and_cannot_recompute(llava: TinyLlava) -> None:
    """ENC12, ENC14: a decode engine's media runs have identities and no rows, and its media
    sequences are not recomputable; an engine without a pull backend refuses handles."""
    encoder = make_encoder(llava.directory)
    model_config, weights = load_model_config(llava.directory), load_weights(llava.directory)
    media = MediaInputs.from_model(llava.directory, model_config, weights, torch.float32, "cpu", EngineConfig().media)
    assert media is not None
    handles = reachable(encoder.encode(items(0, 1)))
    _, runs = media.prepare(prompt_with(2), (), handles, need_rows=False, pull_backends=None)
    assert [r.embeds for r in runs] == [None, None] and [r.handle for r in runs] == [None, None]
    assert [r.identity for r in runs] == [h.identity for h in handles]
    _, raw = media.prepare(prompt_with(2), items(0, 1), need_rows=False)
    assert [r.identity for r in raw] == [h.identity for h in handles] and raw[0].embeds is None
    no_pull = tiny_llava.make_engine(llava.directory)  # an in-process engine with no embedding backend
    with pytest.raises(InvalidRequestError, match="offers no transfer"):
        no_pull.add_request(request("np", 2, media_handles=handles))
    encoder.release_handles([h.handle_id for h in handles])
    idle(encoder)
    encoder.shutdown()


def test_epd_in_process_and_decode_preemption(llava: TinyLlava) -> None:
    """E → P → D equals aggregated (ENC12); a decode request naming other media than its prefill
    is refused (the session's prompt hash covers identities); a decode engine out of KV memory
    ends a media request it would have to recompute with a retryable overloaded fault (ENC14)."""
    encoder = make_encoder(llava.directory)
    oracle = tiny_llava.make_engine(llava.directory)
    prefill = consumer(llava.directory, encoder, role="prefill")
    decode = consumer(llava.directory, encoder, role="decode", kv_pull=InProcessPull(prefill), num_blocks=14)
    for engine in (prefill, decode):
        engine.start()
    params = [request(f"pd-{i}", 1, seed=i, max_tokens=12, media=items(i)) for i in range(2)]
    want = [tokens(oracle.run_until_done([p])[0]) for p in params]
    handed = []
    for p in params:
        handles = reachable(encoder.encode(p.media))
        with_handles = replace(p, media=(), media_handles=handles)
        handoff = prefill.add_request(with_handles).result(60)
        assert handoff.prefill is not None, handoff
        handed.append(replace(with_handles, kv=KvParams(session=handoff.prefill)))
    with pytest.raises(InvalidRequestError, match="prompt_hash"):
        decode.add_request(replace(handed[0], media=items(2), media_handles=()))
    alone = decode.add_request(handed[0]).result(60)
    assert tokens(alone) == want[0]
    assert prefill.abort_kv_session(handed[1].kv.session.session_id)
    handed = []
    for p in params:  # both prefilled first, so the decodes below run at once, not one after the other
        with_handles = replace(p, media=(), media_handles=reachable(encoder.encode(p.media)))
        handoff = prefill.add_request(with_handles).result(60)
        handed.append(replace(with_handles, kv=KvParams(session=handoff.prefill)))
    both = [decode.add_request(h) for h in handed]  # 2 × 9 blocks on a 14-block engine: one is preempted
    results = [stream.result(60) for stream in both]
    lost = [r for r in results if r.error is not None]
    assert lost and all(r.error.code == "overloaded" and r.error.retryable for r in lost), results
    assert all(tokens(r) == want[i] for i, r in enumerate(results) if r.error is None)
    for engine in (prefill, decode):
        deadline = time.monotonic() + 10
        while engine.stats().used_kv_blocks or engine.stats().active_kv_sessions:
            assert time.monotonic() < deadline, engine.stats()
            time.sleep(0.01)
        engine.shutdown()
    idle(encoder)
    encoder.shutdown()


class AttributesFail(Loopback):
    """A transfer backend whose handle attributes fail from the ``fail_from``-th call on (as
    NIXL's do once closed, e.g. when an Encode runs into shutdown)."""

    def __init__(self, fail_from: int) -> None:
        super().__init__(None)  # type: ignore[arg-type] - never pulls
        self.calls, self.fail_from = 0, fail_from

    def source_attributes(self, session_id: str, block_ids: object) -> dict[str, object]:
        self.calls += 1
        if self.calls >= self.fail_from:
            raise RuntimeError("backend closed")
        return {}


@pytest.mark.parametrize("fail_from", [1, 2, 3])
def test_a_handle_that_cannot_be_made_leaves_nothing_held(llava: TinyLlava, fail_from: int) -> None:
    """ENC3 all or nothing, ENC15: when making the k-th handle fails, the handles made before
    it are released and the rows of the rest are no longer held (they leaked before)."""
    encoder = make_encoder(llava.directory)
    cfg = encoder.config
    encoder.shutdown()
    model_config = load_model_config(llava.directory)
    encoder = EncoderEngine(cfg, encoder.media, engine_info(cfg, model_config, "tiny", 512, 0, multimodal=True),
                            transfer_backends=[AttributesFail(fail_from)])
    encoder.start()
    with pytest.raises(RuntimeError, match="backend closed"):
        encoder.encode(items(0, 1, 0))  # a repeated image: two handles on one entry
    idle(encoder)
    assert encoder.media_stats().cached_entries == 2  # the encodings stay cached for a retry
    encoder.shutdown()


class SecondTimesOut(Loopback):
    """Pulls the first handle of a request, then times out (retryable) on the next."""

    def pull(self, order: PullOrder, cancelled: Cancellation) -> None:
        self.pulls = getattr(self, "pulls", 0) + 1
        if self.pulls > 1:
            raise TransferFailure("failed", "timed out", retryable=True)
        super().pull(order, cancelled)


def test_a_retryable_failure_after_a_handle_was_consumed_is_not_retryable(llava: TinyLlava) -> None:
    """ENC13: a timeout is retryable only while the unchanged request could still succeed. Once
    one of its handles was pulled, that handle is consumed (released on the encoder), so a retry
    of the same request would only find it gone: the fault says not retryable (encode again)."""
    encoder = make_encoder(llava.directory)
    engine = consumer(llava.directory, encoder, source=SecondTimesOut)
    handles = reachable(encoder.encode(items(0, 1)))
    done = engine.run_until_done([request("partial", 2, media_handles=handles)])[0]
    assert done.error is not None and done.error.code == "kv_transfer_failed" and not done.error.retryable
    assert "timed out" in done.error.message and engine.stats().used_kv_blocks == 0
    assert encoder.release_handles([h.handle_id for h in handles]) == 1  # the first was consumed
    idle(encoder)
    alone = consumer(llava.directory, encoder, source=SecondTimesOut)
    alone.core.media_pulls.backends["grpc"].pulls = 1  # type: ignore[union-attr] - the next pull times out
    handle = reachable(encoder.encode(items(2)))
    done = alone.run_until_done([request("first", 1, media_handles=handle)])[0]
    assert done.error is not None and done.error.retryable  # nothing consumed: a retry may succeed
    encoder.release_handles([handle[0].handle_id])
    idle(encoder)
    for closing in (engine, alone, encoder):
        closing.shutdown()


def test_a_probe_does_not_wait_behind_an_encode(llava: TinyLlava) -> None:
    """H3, ENC2: while an encode runs, the probe returns at once, DEGRADED (busy): it waited for
    the encode lock past its timeout and said NOT_READY, and each waiting probe held a worker
    thread that KvPull reads need (found by review)."""
    import asyncio

    from refengine.protocol import oe
    from refengine.server.health import encode_probe

    encoder = make_encoder(llava.directory)
    try:
        assert encoder.probe()
        assert asyncio.run(encode_probe(encoder, 5.0)).state == oe.HEALTH_STATE_READY
        with encoder.media._encode_lock:  # noqa: SLF001 - an encode in progress
            started = time.monotonic()
            assert not encoder.probe()
            check = asyncio.run(encode_probe(encoder, 5.0))
            assert time.monotonic() - started < 2
        assert check.state == oe.HEALTH_STATE_DEGRADED and "busy" in check.message, check
    finally:
        encoder.shutdown()
