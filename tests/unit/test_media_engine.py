"""Images through the engine on a tiny random LLaVA; transformers' ``LlavaForConditionalGeneration``
(with its own ``CLIPImageProcessor``) is the oracle.

The model is built by ``tests/tiny_llava.py`` (CLIP vision tower 56 px / 14 px patches → 16
image positions after the CLS is dropped, a 2-layer Llama LM) and saved, with its image
processor and tokenizer, to a temporary directory the engine loads like any checkpoint.
"""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch
from PIL import Image

from refengine.config import EngineConfig
from refengine.engine.engine import Engine
from refengine.types import (
    GenerationRequest,
    InvalidRequestError,
    MediaInput,
    SamplingParams,
    StoppingParams,
)
from tests import tiny_llava
from tests.tiny_llava import IMAGE_TOKEN, NUM_IMAGE_TOKENS, TOKENIZER, VOCAB, TinyLlava, png, prompt_with


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> TinyLlava:
    return tiny_llava.build_tiny_llava(tmp_path_factory.mktemp("llava"))


def make_engine(llava: TinyLlava, budget: int = 512, num_blocks: int = 256) -> Engine:
    return tiny_llava.make_engine(llava.directory, budget=budget, num_blocks=num_blocks)


IMAGES = [png(1, (56, 56)), png(2, (80, 64)), png(3, (40, 90))]


def request(rid: str, ids: list[int], images: list[bytes], n: int = 8, **media) -> GenerationRequest:
    return GenerationRequest(rid, prompt_token_ids=ids, sampling=SamplingParams(temperature=0.0),
                             stopping=StoppingParams(max_tokens=n, ignore_eos=True),
                             media=tuple(MediaInput("image", raw_bytes=b, **media) for b in images))


def hf_greedy(llava, ids: list[int], images: list[bytes], n: int = 8) -> tuple[list[int], torch.Tensor]:
    """Transformers' greedy tokens and its logits over the (expanded) prompt."""
    model, processor, _ = llava
    expanded = []
    for token in ids:
        expanded += [IMAGE_TOKEN] * NUM_IMAGE_TOKENS if token == IMAGE_TOKEN else [token]
    pixels = processor(images=[Image.open(io.BytesIO(b)) for b in images], return_tensors="pt")["pixel_values"] \
        if images else None
    seq, out = torch.tensor([expanded]), []
    with torch.no_grad():
        prompt_logits = model(input_ids=seq, pixel_values=pixels).logits[0]
        for _ in range(n):
            token = int(model(input_ids=seq, pixel_values=pixels).logits[0, -1].argmax())
            out.append(token)
            seq = torch.cat([seq, torch.tensor([[token]])], dim=1)
    return out, prompt_logits


def tokens(engine: Engine, requests: list[GenerationRequest]) -> list[list[int]]:
    return [c.outputs[0].token_ids for c in engine.run_until_done(requests)]


def assert_idle(engine: Engine) -> None:
    engine.core.check_idle()
    assert engine.core.pool.num_used == 0, "KV blocks leaked"


@pytest.mark.parametrize("num_images", [1, 2, 3])
def test_greedy_and_logits_match_transformers(llava, num_images: int) -> None:
    engine = make_engine(llava)
    ids, images = prompt_with(num_images), IMAGES[:num_images]
    expected, hf_logits = hf_greedy(llava, ids, images)
    assert tokens(engine, [request("r", ids, images)]) == [expected]
    from refengine.engine.input_builder import build_model_input
    from refengine.engine.media import step_embeds
    from refengine.scheduler.scheduler import ScheduledSequence, SchedulerOutput
    accepted = engine.input_processor.process(request("logits", ids, images))
    prompt = accepted.prompt_token_ids
    sched = SchedulerOutput([ScheduledSequence("logits", 0, 0, len(prompt), True, tuple(prompt),
                                               tuple(range(-(-len(prompt) // 4))))])
    model_input = build_model_input(sched, 4, [len(prompt)], None, step_embeds(sched, {"logits": accepted}))
    logits = engine.core.runner.execute(model_input)
    assert (logits - hf_logits).abs().max() < 1e-3
    assert_idle(engine)


def test_image_changes_the_output_and_a_mixed_batch_matches_solo_runs(llava) -> None:
    engine = make_engine(llava)
    batch = [request("text", prompt_with(0, 5), []), request("one", prompt_with(1, 6), IMAGES[:1]),
             request("two", prompt_with(2, 7), IMAGES[1:3]), request("other", prompt_with(1, 6), IMAGES[2:3])]
    solo = [tokens(make_engine(llava), [r])[0] for r in batch]
    assert solo[1] != solo[3], "a different image must change the output"
    assert tokens(engine, batch) == solo
    assert_idle(engine)


def test_chunked_prefill_and_preemption_keep_the_tokens(llava) -> None:
    """A 6-token budget splits every image run across steps; a tiny pool forces preemption."""
    batch = [request(f"r{i}", prompt_with(1 + i % 2, 10 + i), IMAGES[i % 3:i % 3 + 1 + i % 2]) for i in range(4)]
    expected = [tokens(make_engine(llava), [r])[0] for r in batch]
    chunked = make_engine(llava, budget=6)
    assert tokens(chunked, batch) == expected
    tight = make_engine(llava, num_blocks=24)
    preempted: list[str] = []
    preempt = tight.core.scheduler._preempt
    tight.core.scheduler._preempt = lambda seq: preempted.append(seq.request_id) or preempt(seq)
    assert tokens(tight, batch) == expected
    assert preempted, "the pool was meant to be too small for all four at once"
    assert_idle(chunked)
    assert_idle(tight)


def test_prefix_cache_keys_follow_the_image(llava) -> None:
    engine = make_engine(llava)
    ids = prompt_with(1, 20)
    first = engine.run_until_done([request("a", ids, IMAGES[:1])])[0]
    same = engine.run_until_done([request("b", ids, IMAGES[:1])])[0]
    other = engine.run_until_done([request("c", ids, IMAGES[1:2])])[0]
    blocks_before_image = 5 // 4  # the 5 text tokens before the placeholder: one full block
    assert first.usage.cached_prompt_tokens == 0
    assert same.usage.cached_prompt_tokens > NUM_IMAGE_TOKENS  # the same image: its blocks are hits
    assert other.usage.cached_prompt_tokens == blocks_before_image * 4  # only the text before the image
    by_uuid = [engine.run_until_done([request(f"u{i}", ids, IMAGES[i:i + 1], uuid="img-7")])[0] for i in range(2)]
    assert by_uuid[1].usage.cached_prompt_tokens > NUM_IMAGE_TOKENS  # same uuid, other bytes: the uuid decides
    assert engine.media.cache.hits >= 2  # "b" re-used "a"'s encoding, "u1" re-used "u0"'s
    assert_idle(engine)


@pytest.mark.parametrize(("change", "message"), [
    (lambda r: request("x", prompt_with(2), IMAGES[:1]), r"2 image placeholder\(s\) .* 1 media item"),
    (lambda r: request("x", prompt_with(0), IMAGES[:1]), r"0 image placeholder"),
    (lambda r: request("x", prompt_with(1)[:5] + [IMAGE_TOKEN] * 3, IMAGES[:1]), r"3 image placeholder\(s\)"),
    (lambda r: request("x", prompt_with(1)[:5] + [IMAGE_TOKEN] * 19, IMAGES[:1]), r"19 tokens long"),
    (lambda r: request("x", prompt_with(1), [b"not an image"]), r"image"),
    (lambda r: request("x", prompt_with(1), [IMAGES[0][:60]]), r"image"),
    (lambda r: GenerationRequest("x", prompt_token_ids=prompt_with(1), media=(MediaInput("video", raw_bytes=b"v"),)),
     r"modality 'video' is not supported"),
    (lambda r: request("x", prompt_with(9), IMAGES * 3), r"at most 8 per request"),
])
def test_malformed_media_is_refused_before_acceptance(llava, change, message: str) -> None:
    engine = make_engine(llava)
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request(change(None))
    assert not engine.has_unfinished_requests and engine.core.pool.num_used == 0


def test_a_text_only_model_refuses_media() -> None:
    from tests.tiny_models import hf_weights, make_tiny_hf_model, model_config_from_hf
    model = make_tiny_hf_model(vocab_size=VOCAB)
    engine = Engine(EngineConfig(max_model_len=256), model_config_from_hf(model), hf_weights(model), TOKENIZER)
    assert not engine.info.supports_multimodal
    with pytest.raises(InvalidRequestError, match="does not accept media"):
        engine.add_request(request("x", prompt_with(1), IMAGES[:1]))


def test_kv_events_and_offline_block_keys_carry_the_image(llava: TinyLlava) -> None:
    """E4: the blocks holding an image's positions publish ``media:<identity>`` in their extra
    keys (the text block before it does not), and a router recomputes every published hash
    with the public ``block_keys`` from the expanded prompt and the media spans."""
    from refengine.config import MediaConfig
    from refengine.kv.keys import block_keys, engine_extra_keys
    from refengine.types import BlockStored
    from tests.unit.media_helpers import load_image
    events: list = []
    engine = tiny_llava.make_engine(llava.directory, kv_event_sink=events.extend)
    ids = prompt_with(1, 30)  # 5 text ids, the placeholder, 3 text ids: the image is positions 5-20
    engine.run_until_done([request("e", ids, IMAGES[:1], n=8)])
    stored = [e for e in events if isinstance(e, BlockStored)]
    identity = load_image(MediaInput("image", raw_bytes=IMAGES[0]), MediaConfig()).identity
    media_key = f"media:{identity}"
    assert [media_key in e.extra_keys for e in stored[:7]] == [False, True, True, True, True, True, False]
    expanded = ids[:5] + [IMAGE_TOKEN] * NUM_IMAGE_TOKENS + ids[6:]
    assert [e.token_ids for e in stored[:6]] == [tuple(expanded[i * 4:i * 4 + 4]) for i in range(6)]
    keys = block_keys(expanded, 4, engine_extra_keys("tiny-llava"), [(5, 5 + NUM_IMAGE_TOKENS, identity)])
    assert [e.block_hash for e in stored[:len(keys)]] == keys


def test_tied_embeddings_declared_only_at_the_top_level(tmp_path) -> None:
    """A LLaVA config.json may say ``tie_word_embeddings`` at the top level only: config and
    weights must agree: a checkpoint without lm_head loads (untied, it would be refused)."""
    import json

    from safetensors.torch import load_file, save_file

    from refengine.model.loader import load_model_config, load_weights
    directory = tiny_llava.build_tiny_llava(tmp_path / "tied").directory
    config = json.loads((directory / "config.json").read_text())
    config["tie_word_embeddings"] = True
    config["text_config"].pop("tie_word_embeddings", None)
    (directory / "config.json").write_text(json.dumps(config))
    for path in directory.glob("*.safetensors"):
        tensors = load_file(path)
        save_file({k: v for k, v in tensors.items() if not k.endswith("lm_head.weight")}, path)
    assert load_model_config(directory).tie_word_embeddings
    assert "lm_head.weight" not in load_weights(directory)


def test_an_unknown_adapter_is_refused_before_any_image_is_decoded(llava) -> None:
    """R4 before the media: with an unknown lora_name, bytes that are no image get NOT_FOUND for
    the adapter (the images were decoded and encoded first, 1.7 s for 8 large ones)."""
    from refengine.types import LoraNotFoundError

    engine = make_engine(llava)
    bad = request("x", prompt_with(1), [b"not an image"])
    bad.lora_name = "no-such-adapter"
    with pytest.raises(LoraNotFoundError):
        engine.add_request(bad)


@pytest.mark.parametrize("max_tokens", [8, None])
def test_a_prompt_past_the_context_is_refused_before_any_image_is_decoded(llava, monkeypatch, max_tokens) -> None:
    """G7 before the media: a prompt whose text alone leaves no room (512-token context) is
    refused for its length, not for its image, and no image is decoded (nor fetched, nor encoded)."""
    from refengine.engine import media

    decoded: list[bytes] = []
    real = media.image_of
    monkeypatch.setattr(media, "image_of", lambda item, data, config: decoded.append(data) or real(item, data, config))
    engine = make_engine(llava)
    bad = request("long", prompt_with(1) + [5] * 600, [IMAGES[0]])
    bad = dataclasses.replace(bad, stopping=StoppingParams(max_tokens=max_tokens, ignore_eos=True))
    with pytest.raises(InvalidRequestError, match="the context limit is 512"):
        engine.add_request(bad)
    assert not decoded
    assert not engine.has_unfinished_requests and engine.core.pool.num_used == 0
    fits = request("fits", prompt_with(1), [IMAGES[0]])
    engine.add_request(fits)  # the same image in a prompt that fits: decoded, accepted
    assert decoded


def test_no_image_processor_code_from_the_model_directory_runs(tmp_path, monkeypatch) -> None:
    """An ``auto_map`` in preprocessor_config.json names a class in the model directory; its code
    must never run. The processor loads with trust_remote_code=False (without it, transformers
    asks on stdin whether to run such code when it has no class of its own for the model, and runs
    it on "y"), so the model's own processor type is used."""
    import json

    from transformers import AutoImageProcessor

    directory = tiny_llava.build_tiny_llava(tmp_path / "evil").directory
    marker = tmp_path / "ran"
    (directory / "evil_mod.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n"
                                           "from transformers import CLIPImageProcessor\n"
                                           "class EvilProcessor(CLIPImageProcessor):\n    pass\n")
    config_path = directory / "preprocessor_config.json"
    config = json.loads(config_path.read_text()) | {"auto_map": {"AutoImageProcessor": "evil_mod.EvilProcessor"}}
    config_path.write_text(json.dumps(config))
    calls: list[dict] = []
    load = AutoImageProcessor.from_pretrained
    monkeypatch.setattr(AutoImageProcessor, "from_pretrained", lambda *args, **kwargs: calls.append(kwargs)
                        or load(*args, **kwargs))
    engine = tiny_llava.make_engine(directory)
    assert type(engine.media.image_processor).__module__.startswith("transformers.")
    assert [call.get("trust_remote_code") for call in calls] == [False]
    assert not marker.exists()


def test_at_most_two_requests_hold_decoded_images_at_once(llava, monkeypatch) -> None:
    """Pre-acceptance media work runs on the server's worker threads; each request's decoded
    pixels live until they are encoded. Without a bound, 3 requests of 8 large PNGs took 2 GB;
    now at most MEDIA_DECODES requests are between decoding and encoding at once."""
    import threading
    import time

    from refengine.engine import media as media_module

    engine = make_engine(llava)
    inside, most, lock = [0], [0], threading.Lock()
    decode = media_module.MediaInputs.decode

    def slow_decode(self, items, data):  # noqa: ANN001, ANN202 - the method it wraps
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.05)
        with lock:
            inside[0] -= 1
        return decode(self, items, data)

    monkeypatch.setattr(media_module.MediaInputs, "decode", slow_decode)
    streams = []
    threads = [threading.Thread(target=lambda i=i: streams.append(engine.add_request(
        request(f"r{i}", prompt_with(1), [IMAGES[i % 3]], n=2)))) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert most[0] <= media_module.MEDIA_DECODES == 2 and len(streams) == 6
    while engine.has_unfinished_requests:
        engine.step()
    assert_idle(engine)


def test_cached_encodings_own_their_memory(llava) -> None:
    """The encoder cache is bounded in entries; an entry that was a row of a batch's output
    kept the whole batch alive (up to max_items images per entry), so evicting an entry freed
    nothing while another of its batch stayed cached. Each entry now owns exactly its rows."""
    media = make_engine(llava).media
    _, runs = media.prepare(prompt_with(3), [MediaInput("image", raw_bytes=b) for b in IMAGES])
    _, single = media.prepare(prompt_with(1), [MediaInput("image", raw_bytes=tiny_llava.png(9, (56, 56)))])
    runs += single
    assert len(runs) == 4 and len(media.cache) == 4
    for run in runs:
        cached = media.cache.get(run.identity)
        assert cached is not None and torch.equal(cached, run.embeds)
        assert cached.untyped_storage().nbytes() == cached.numel() * cached.element_size()


def test_a_refusal_names_the_item_and_comes_before_any_url_is_fetched(llava, monkeypatch) -> None:
    """G19: with several items, the refusal says which one is wrong; and every item is checked as
    far as it can be without the network before any URL is fetched, so a malformed item at the
    end of a request costs no download (nor a url_timeout_seconds wait) first."""
    from refengine.config import MediaConfig
    from refengine.multimodal import sources

    fetched: list[str] = []
    monkeypatch.setattr(sources, "fetch_url", lambda url, config: fetched.append(url) or IMAGES[0])
    media = make_engine(llava).media
    media.config = MediaConfig(url_allow_hosts=("img.test",))
    url = MediaInput("image", url="http://img.test/a.png")
    cases = [
        ([url, MediaInput("image", raw_bytes=b"x" * 10, uuid="u" * 300)], r"^media item 1: media uuid"),
        ([url, MediaInput("image", data_uri="data:image/png;base64,@@@@")], r"^media item 1: data_uri payload"),
        ([url, MediaInput("image", url="http://elsewhere.test/b.png")], r"^media item 1: media url host"),
        ([url, MediaInput("image")], r"^media item 1: a media item needs exactly one source"),
        ([MediaInput("image", raw_bytes=IMAGES[0]), MediaInput("image", raw_bytes=b"not an image")],
         r"^media item 1: media bytes are not an image"),
    ]
    for items, message in cases:
        with pytest.raises(InvalidRequestError, match=message):
            media.prepare(prompt_with(len(items)), items)
    assert fetched == []
    _, runs = media.prepare(prompt_with(2), [url, MediaInput("image", raw_bytes=IMAGES[1])])
    assert fetched == [url.url] and len(runs) == 2


@pytest.mark.parametrize("expanded", [False, True])
def test_adjacent_placeholders_are_one_image_each_as_in_transformers(llava, expanded: bool) -> None:
    """G19 ordered placeholders: "<image><image>" (two adjacent markers), and the same prompt as
    an HF processor expands it (one run of 2 x num_image_tokens), are two images filled in
    order, as transformers' LLaVA reads them; they were refused as one placeholder of 2 (or 32)
    tokens. A run that is neither (e.g. num_image_tokens + 1) is still refused."""
    marker = [IMAGE_TOKEN] * (NUM_IMAGE_TOKENS if expanded else 1)
    ids = [5, 6, 7] + marker * 2 + [8, 9] + marker + [10]
    images = IMAGES[:3]
    expected, _ = hf_greedy(llava, [5, 6, 7, IMAGE_TOKEN, IMAGE_TOKEN, 8, 9, IMAGE_TOKEN, 10], images)
    engine = make_engine(llava)
    assert tokens(engine, [request("adjacent", ids, images)]) == [expected]
    with pytest.raises(InvalidRequestError, match=r"placeholder 0 is 17 tokens long"):
        engine.add_request(request("odd", [5] + [IMAGE_TOKEN] * (NUM_IMAGE_TOKENS + 1) + [6], images[:2]))
    assert_idle(engine)


def test_a_uuid_does_not_cross_cache_salts(llava) -> None:
    """K2: tenant B (salt "b") names a different image with tenant A's uuid: it gets its own
    image's output, not A's rows from the encoder cache (it got A's, found by review). Without
    salts a uuid still names one image (the client's assertion, as documented)."""
    from refengine.types import KvParams

    engine = make_engine(llava)
    prompt = prompt_with(1)

    def salted(rid: str, image: bytes, salt: str | None) -> GenerationRequest:
        return dataclasses.replace(request(rid, prompt, [image], uuid="u"), kv=KvParams(cache_salt=salt))

    alone = tokens(make_engine(llava), [salted("b-alone", IMAGES[1], "b")])
    assert tokens(engine, [salted("a", IMAGES[0], "a")]) != alone
    assert tokens(engine, [salted("b", IMAGES[1], "b")]) == alone
    assert_idle(engine)
