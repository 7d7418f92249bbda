"""Images on a LLaVA-style model: time to first token of an image request (encoder run, encoder-cache
hit, text-only of the same length) and the output throughput of a mixed image/text batch against
the same batch all text.

No LLaVA checkpoint is available offline, so a synthetic one is built in a temporary directory:
the LM is SmolLM2-135M-Instruct (the embedded default, fp32) with its tensors renamed to LLaVA's
checkpoint names (``language_model.model.*``; its embeddings are tied, ``text_config.
tie_word_embeddings`` true, so there is no ``lm_head``), a seeded randomly initialised CLIP vision
tower of ViT-B/16 size (224 px, 16 px patches, hidden 768, 12 layers, 12 heads, MLP 3072: 86 M
parameters; ``vision_feature_layer`` -2, the CLS dropped → 196 image positions), a two-layer
projector (768 → 576, gelu, 576 → 576), a ``CLIPImageProcessor`` (resize 224, crop 224) and
SmolLM2's tokenizer. The image placeholder is ``image_token_index`` 49151 (the last vocabulary
id, the word piece "ectable", which the prompts below never contain: checked). Images are 224x224
PNGs of seeded random pixels. Weights are random, so only the timings mean anything.

In-process ``Engine`` (CPU, fp32, 16-token KV blocks, 2,048 batched tokens per step), loaded
with ``MediaInputs.from_model`` as ``Engine.from_config`` does. One engine serves every
configuration (text-only requests run on the same LM).

1. **TTFT**: one request, ``max_tokens`` 1, a 32-token chat-formatted prompt with one
   placeholder (227 prompt positions once expanded). Timed from ``add_request`` (where the image
   is decoded, preprocessed and encoded, on the caller's thread) to the end of the step that
   makes the token. The prefix cache is reset before every request, so the KV of the whole
   prompt is recomputed each time:

   - **cold**: a new image each round, so the vision tower and projector run;
   - **encoder-cache hit**: the cold round's image again: ``MediaInputs`` finds its embedding
     rows in the encoder cache (checked with its hit counter); only the encoder is saved;
   - **text-only**: the same prompt with 196 text tokens in place of the image positions.

   Rounds interleaved (cold, hit, text-only), after one untimed warm-up of each; medians over
   ``--rounds`` (default 5). The encoder's share is (cold − hit) / cold; "encode" is the time
   inside ``VisionEncoder.encode`` (tower + projector), "prepare" all of ``add_request``
   (PNG decode, ``CLIPImageProcessor``, encode, placeholder expansion).

2. **Throughput**: 16 requests submitted at once, ``max_tokens`` 64 with EOS ignored (1,024
   output tokens), greedy. Each prompt is a 23- or 24-token chat-formatted question of its own
   around one placeholder (218 or 219 positions expanded) or, in a text-only request, the same
   question around 196 random text tokens (the same length).

   - **mixed, cold images**: requests 0, 2, 4, … carry one image each (8 new images every
     round, so 8 encodes per run), the others are text-only;
   - **mixed, cached images**: the same 8 images as that round's cold run (encoder-cache hits:
     the difference to cold is the encoder's cost in the batch);
   - **all text-only**: the 8 image requests replaced by text prompts of equal expanded length.

   Timed from the first ``add_request`` to the last output (encoding included), prefix cache
   reset before each run. Configurations interleaved over ``--batch-rounds`` (default 3); rates
   are of the **best** round (every round shown), per wall second and per CPU second of this
   process.

    HF_HUB_OFFLINE=1 python benchmarks/multimodal.py --threads 1   # the full run (~4 min on 2 cores)
    python benchmarks/multimodal.py --quick                        # 2 TTFT rounds, 4 requests of 8 tokens

With ``--threads 1`` every step and every encode runs on the calling thread, so CPU time measures
the work even when another job shares the machine.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from PIL import Image  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from refengine.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from refengine.engine.engine import Engine  # noqa: E402
from refengine.engine.media import MediaInputs  # noqa: E402
from refengine.model.loader import (  # noqa: E402
    load_model_config,
    load_tokenizer,
    load_weights,
    model_fingerprint,
    resolve_model,
)
from refengine.types import GenerationRequest, MediaInput, SamplingParams, StoppingParams  # noqa: E402

IMAGE_TOKEN = 49151
IMAGE_SIZE, PATCH = 224, 16
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2  # 196: the CLS is dropped
TOWER = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
         "image_size": IMAGE_SIZE, "patch_size": PATCH, "projection_dim": 512, "hidden_act": "quick_gelu",
         "layer_norm_eps": 1e-5, "num_channels": 3, "model_type": "clip_vision_model"}
TTFT_QUESTION = "Describe this picture in one short sentence: what is in it, and which two colours stand out most?"


# -- the synthetic checkpoint ----------------------------------------------------------------------
def build_llava(lm_dir: Path, out: Path) -> None:
    """SmolLM2 under LLaVA's names + a random CLIP ViT-B/16 tower + projector, saved to ``out``."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    text = json.loads((lm_dir / "config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(lm_dir / "model.safetensors", framework="pt") as f:
        for name in f.keys():
            assert name.startswith(("model.", "lm_head.")), name
            tensors[f"language_model.{name}"] = f.get_tensor(name)
    torch.manual_seed(0)
    tower = CLIPVisionModel(CLIPVisionConfig(**{k: v for k, v in TOWER.items() if k != "model_type"}))
    for name, w in tower.state_dict().items():
        if not name.endswith("position_ids"):
            tensors[f"vision_tower.vision_model.{name.removeprefix('vision_model.')}"] = w.contiguous()
    hidden, width = text["hidden_size"], TOWER["hidden_size"]
    tensors["multi_modal_projector.linear_1.weight"] = torch.randn(hidden, width) * width ** -0.5
    tensors["multi_modal_projector.linear_1.bias"] = torch.zeros(hidden)
    tensors["multi_modal_projector.linear_2.weight"] = torch.randn(hidden, hidden) * 0.02
    tensors["multi_modal_projector.linear_2.bias"] = torch.zeros(hidden)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
              "text_config": text, "vision_config": TOWER, "image_token_index": IMAGE_TOKEN,
              "projector_hidden_act": "gelu", "vision_feature_layer": -2,
              "vision_feature_select_strategy": "default", "tie_word_embeddings": text["tie_word_embeddings"],
              "eos_token_id": text.get("eos_token_id")}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (lm_dir / name).is_file():
            shutil.copy(lm_dir / name, out / name)
    CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                       crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(out)


def make_engine(directory: Path, max_num_seqs: int) -> Engine:
    config = EngineConfig(cache=CacheConfig(num_blocks=1024),
                          scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=max_num_seqs))
    model_config, weights = load_model_config(directory), load_weights(directory, torch.float32)
    media = MediaInputs.from_model(directory, model_config, weights, torch.float32, "cpu", config.media)
    assert media is not None and media.encoder.config.num_image_tokens == NUM_IMAGE_TOKENS
    return Engine(config, model_config, weights, load_tokenizer(directory),
                  model_fingerprint=model_fingerprint(directory), media=media)


def png(seed: int) -> bytes:
    """A 224x224 PNG of seeded random RGB noise (a new seed: new pixels, a new encoder identity)."""
    data = random.Random(seed).randbytes(IMAGE_SIZE * IMAGE_SIZE * 3)
    buffer = io.BytesIO()
    Image.frombytes("RGB", (IMAGE_SIZE, IMAGE_SIZE), data).save(buffer, format="PNG")
    return buffer.getvalue()


# -- prompts -----------------------------------------------------------------------------------------
def chat_ids(tokenizer: Any, question: str) -> tuple[list[int], list[int]]:
    """The token ids before and after the image in a one-turn chat (no system prompt)."""
    before = tokenizer.encode("<|im_start|>user\n", add_special_tokens=False)
    after = tokenizer.encode(f"\n{question}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert IMAGE_TOKEN not in before + after
    return before, after


def filler(seed: int, n: int = NUM_IMAGE_TOKENS) -> list[int]:
    """``n`` random text token ids (never the placeholder): what stands in for an image."""
    rng = random.Random(seed)
    return [rng.randrange(100, IMAGE_TOKEN) for _ in range(n)]


def request(rid: str, ids: list[int], image: bytes | None, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(rid, prompt_token_ids=ids, sampling=SamplingParams(temperature=0.0),
                             stopping=StoppingParams(max_tokens=max_tokens, ignore_eos=True),
                             media=(MediaInput("image", raw_bytes=image),) if image is not None else ())


# -- timing ------------------------------------------------------------------------------------------
class EncodeTimer:
    """Wraps the engine's ``VisionEncoder.encode`` (this process only): seconds per call."""

    def __init__(self, engine: Engine) -> None:
        assert engine.media is not None
        self.seconds: list[float] = []
        encode: Callable[[torch.Tensor], torch.Tensor] = engine.media.encoder.encode

        def timed(pixels: torch.Tensor) -> torch.Tensor:
            t0 = time.perf_counter()
            try:
                return encode(pixels)
            finally:
                self.seconds.append(time.perf_counter() - t0)

        engine.media.encoder.encode = timed  # type: ignore[method-assign]

    def take(self) -> float:
        total, self.seconds = sum(self.seconds), []
        return total


@dataclass
class Timed:
    wall: float
    cpu: float
    prepare: float  # seconds in add_request (all requests)
    encode: float  # seconds in VisionEncoder.encode
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int


def timed_run(engine: Engine, encodes: EncodeTimer, reqs: list[GenerationRequest]) -> Timed:
    """Reset the prefix cache (not the encoder cache), add every request, step until all finish."""
    assert engine.media is not None
    encoder_cache = engine.media.cache
    encoder_cache.clear = lambda: None  # reset_prefix_cache forgets encoded images too (since 72dfa2a)
    try:
        engine.reset_prefix_cache()
    finally:
        del encoder_cache.clear  # the class's own clear again
    encodes.take()
    start, cpu = time.perf_counter(), time.process_time()
    streams = [engine.add_request(r) for r in reqs]
    prepared = time.perf_counter()
    while engine.has_unfinished_requests:
        engine.step()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    results = [s.result() for s in streams if s is not None]
    assert all(r.error_message is None and r.usage is not None for r in results)
    return Timed(wall, cpu, prepared - start, encodes.take(), sum(r.usage.prompt_tokens for r in results),
                 sum(len(r.outputs[0].token_ids) for r in results), sum(r.usage.cached_prompt_tokens for r in results))


@dataclass
class Series:
    label: str
    runs: list[Timed] = field(default_factory=list)

    def median(self, key: Callable[[Timed], float]) -> float:
        return statistics.median(key(r) for r in self.runs)


# -- 1. time to first token -------------------------------------------------------------------------
def measure_ttft(engine: Engine, encodes: EncodeTimer, rounds: int) -> tuple[dict[str, Series], int]:
    assert engine.media is not None
    cache = engine.media.cache
    before, after = chat_ids(engine.tokenizer, TTFT_QUESTION)
    image_ids, text_ids = before + [IMAGE_TOKEN] + after, before + filler(7) + after
    series = {name: Series(name) for name in ("cold (encoder runs)", "encoder-cache hit", "text-only")}
    timed_run(engine, encodes, [request("warm-i", image_ids, png(10_000), 1)])  # untimed warm-up
    timed_run(engine, encodes, [request("warm-t", text_ids, None, 1)])
    for r in range(rounds):
        image = png(r + 1)
        misses, hits = cache.misses, cache.hits
        series["cold (encoder runs)"].runs.append(timed_run(engine, encodes, [request(f"c{r}", image_ids, image, 1)]))
        assert cache.misses == misses + 1 and cache.hits == hits, "the cold request must encode"
        series["encoder-cache hit"].runs.append(timed_run(engine, encodes, [request(f"h{r}", image_ids, image, 1)]))
        assert cache.hits == hits + 1, "the repeated image must hit the encoder cache"
        series["text-only"].runs.append(timed_run(engine, encodes, [request(f"t{r}", text_ids, None, 1)]))
    for s in series.values():
        assert all(run.cached_tokens == 0 and run.output_tokens == 1 for run in s.runs)
    lengths = {run.prompt_tokens for s in series.values() for run in s.runs}
    assert len(lengths) == 1, f"prompt lengths differ: {lengths}"
    return series, len(image_ids)


def print_ttft(series: dict[str, Series], prompt_len: int, rounds: int) -> None:
    cold = series["cold (encoder runs)"]
    base = series["text-only"].median(lambda t: t.wall)
    print(f"\nTTFT: 1 request, max_tokens 1, {prompt_len}-token prompt with one placeholder → "
          f"{prompt_len - 1 + NUM_IMAGE_TOKENS} positions; prefix cache reset before each; medians of {rounds} rounds")
    print("\n| request | TTFT ms (median) | rounds, ms | CPU ms (median) | prepare ms | encode ms | × text-only |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for s in series.values():
        spread = " / ".join(f"{r.wall * 1e3:.0f}" for r in s.runs)
        wall = s.median(lambda t: t.wall)
        print(f"| {s.label} | {wall * 1e3:.0f} | {spread} | {s.median(lambda t: t.cpu) * 1e3:.0f} "
              f"| {s.median(lambda t: t.prepare) * 1e3:.1f} | {s.median(lambda t: t.encode) * 1e3:.1f} "
              f"| {wall / base:.2f} |")
    hit = series["encoder-cache hit"].median(lambda t: t.wall)
    c = cold.median(lambda t: t.wall)
    print(f"\nencoder's share of the cold TTFT: (cold − hit) / cold = {(c - hit) / c * 100:.0f} %; "
          f"encode alone (tower + projector, median) = {cold.median(lambda t: t.encode) / c * 100:.0f} %; "
          f"the rest of prepare (PNG decode, CLIPImageProcessor, expansion) = "
          f"{cold.median(lambda t: t.prepare - t.encode) * 1e3:.1f} ms")


# -- 2. throughput ---------------------------------------------------------------------------------
def batch(engine: Engine, n: int, max_tokens: int, images: list[bytes] | None, tag: str) -> list[GenerationRequest]:
    """``n`` requests; with ``images``, the even ones carry ``images[i // 2]``, the rest (and all,
    without ``images``) have 196 random text tokens where the image would be."""
    reqs = []
    for i in range(n):
        before, after = chat_ids(engine.tokenizer, f"Question {i + 1}: what does this show? Answer briefly.")
        if images is not None and i % 2 == 0:
            reqs.append(request(f"{tag}{i}", before + [IMAGE_TOKEN] + after, images[i // 2], max_tokens))
        else:
            reqs.append(request(f"{tag}{i}", before + filler(1000 + i) + after, None, max_tokens))
    return reqs


def measure_batches(engine: Engine, encodes: EncodeTimer, n: int, max_tokens: int,
                    rounds: int) -> dict[str, Series]:
    names = ("mixed, cold images", "mixed, cached images", "all text-only")
    series = {name: Series(name) for name in names}
    timed_run(engine, encodes, batch(engine, n, 4, [png(20_000 + i) for i in range(n)], "w"))  # warm-up
    for r in range(rounds):
        images = [png(100_000 * (r + 1) + i) for i in range((n + 1) // 2)]
        series[names[0]].runs.append(timed_run(engine, encodes, batch(engine, n, max_tokens, images, f"c{r}-")))
        series[names[1]].runs.append(timed_run(engine, encodes, batch(engine, n, max_tokens, images, f"h{r}-")))
        series[names[2]].runs.append(timed_run(engine, encodes, batch(engine, n, max_tokens, None, f"t{r}-")))
    for s in series.values():
        assert all(run.cached_tokens == 0 for run in s.runs)
    assert len({(run.prompt_tokens, run.output_tokens) for s in series.values() for run in s.runs}) == 1
    return series


def print_batches(series: dict[str, Series], n: int, max_tokens: int, rounds: int) -> None:
    def best(s: Series) -> Timed:
        return min(s.runs, key=lambda t: t.wall)

    base = best(series["all text-only"])
    any_run = base
    print(f"\nThroughput: {n} requests at once, {any_run.prompt_tokens} prompt positions in all, {max_tokens} "
          f"output tokens each (ignore_eos, {any_run.output_tokens} in all); prefix cache reset before each run; "
          f"best of {rounds} interleaved rounds")
    print("\n| batch | output tok/s (best) | rounds, tok/s | tok per CPU-s (best) | prepare s | encode s "
          "| × all text-only (wall / CPU) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for s in series.values():
        b = best(s)
        spread = " / ".join(f"{r.output_tokens / r.wall:.1f}" for r in s.runs)
        cpu_best = max(r.output_tokens / r.cpu for r in s.runs)
        cpu_base = max(r.output_tokens / r.cpu for r in series["all text-only"].runs)
        print(f"| {s.label} | {b.output_tokens / b.wall:.1f} | {spread} | {cpu_best:.1f} | {b.prepare:.2f} "
              f"| {b.encode:.2f} | {base.wall / b.wall:.2f} / {cpu_best / cpu_base:.2f} |")
    print("(prepare: all add_request calls of the best round, encode included; encode: VisionEncoder.encode)")


# -- main --------------------------------------------------------------------------------------------
def commit() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head} (uncommitted changes in tracked files)" if dirty else head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0: torch's default)")
    parser.add_argument("--rounds", type=int, default=5, help="TTFT rounds (medians)")
    parser.add_argument("--batch-rounds", type=int, default=3, help="throughput rounds (best)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="2 TTFT rounds, 1 round of 4 requests x 8 tokens")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.batch_rounds, args.requests, args.max_tokens = 2, 1, 4, 8
    if args.threads:
        torch.set_num_threads(args.threads)

    started = commit()  # read before the engine code runs: a commit landing during the run is flagged below
    lm_dir = resolve_model("smollm2-135m-instruct").path
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "synthetic-llava-smollm2"
        t0 = time.perf_counter()
        build_llava(lm_dir, directory)
        engine = make_engine(directory, max(args.requests, 16))
        setup = time.perf_counter() - t0
        encodes = EncodeTimer(engine)
        ttft, prompt_len = measure_ttft(engine, encodes, args.rounds)
        batches = measure_batches(engine, encodes, args.requests, args.max_tokens, args.batch_rounds)

    ended = commit()
    changed = "" if ended == started else f" (the checkout changed during the run: now {ended})"
    print(f"\n{datetime.datetime.now():%Y-%m-%d %H:%M}, commit {started}{changed}, torch threads "
          f"{torch.get_num_threads()}, torch {torch.__version__}, fp32 CPU")
    print(f"model: synthetic LLaVA = SmolLM2-135M-Instruct + random CLIP ViT-B/16 tower "
          f"({IMAGE_SIZE} px, {TOWER['num_hidden_layers']} layers x {TOWER['hidden_size']}) → {NUM_IMAGE_TOKENS} "
          f"image positions, image_token_index {IMAGE_TOKEN}; built and loaded in {setup:.1f} s")
    print_ttft(ttft, prompt_len, args.rounds)
    print_batches(batches, args.requests, args.max_tokens, args.batch_rounds)


if __name__ == "__main__":
    main()
