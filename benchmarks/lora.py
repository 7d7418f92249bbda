"""Multi-LoRA throughput: 32 requests, each on one of 8 adapters, against the same 32 requests
on the base model; and the time to load one adapter.

SmolLM2-135M-Instruct (the embedded default), fp32, CPU, in-process ``Engine``. Adapters:
random rank-16 PEFT adapters on all seven projections of every layer (q, k, v, o, gate, up,
down), written in PEFT's layout by the conformance suite's own writer. Workload: fixed
seed, prompt lengths uniform in 64–256 random tokens, ``max_tokens`` uniform in 64–128,
EOS ignored, all 32 requests submitted at once (``max_num_seqs`` 32, ``max_loras`` 8, so
every adapter is resident and a decode step mixes all 8).

Configurations, interleaved over ``--rounds`` (rates of the best round; prefix cache reset
before each run):

- **base, LoRA off**: an engine without LoRA (no adapter slots), requests without adapters;
- **base, LoRA on**: the LoRA engine, requests without adapters (the cost of being able to);
- **8 adapters**: the LoRA engine, request ``i`` on adapter ``i % 8``.

Load time: ``Engine.load_lora`` per adapter (read, check, fuse) and the copy into a slot
(``ModelRunner.set_lora_slot``), medians over the 8 adapters.

    python benchmarks/lora.py --threads 1     # what benchmarks/README.md shows
    python benchmarks/lora.py --quick         # 8 requests, short outputs: a smoke run
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from refengine.config import CacheConfig, EngineConfig, LoraConfig, SchedulerConfig  # noqa: E402
from refengine.conformance.lora_files import ModelShape, write_random_adapter  # noqa: E402
from refengine.engine.engine import Engine  # noqa: E402
from refengine.model.loader import (  # noqa: E402
    load_model_config,
    load_tokenizer,
    load_weights,
    model_fingerprint,
    resolve_model,
)
from refengine.types import GenerationRequest, LoraAdapterSpec, SamplingParams, StoppingParams  # noqa: E402

NUM_ADAPTERS, RANK = 8, 16
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def workload(num_requests: int, max_output: int, vocab_size: int) -> list[tuple[list[int], int]]:
    rng = random.Random(0)
    return [([rng.randrange(100, vocab_size) for _ in range(rng.randint(64, 256))],
             rng.randint(max_output // 2, max_output)) for _ in range(num_requests)]


def make_engine(parts, root: Path | None) -> Engine:
    config, weights, tokenizer, fingerprint = parts
    lora = LoraConfig(enabled=root is not None, roots=(str(root),) if root else (), max_loras=NUM_ADAPTERS,
                      max_lora_rank=RANK)
    return Engine(EngineConfig(cache=CacheConfig(num_blocks=2048), lora=lora,
                               scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=32)),
                  config, weights, tokenizer, model_fingerprint=fingerprint)


def run(engine: Engine, jobs: list[tuple[list[int], int]], with_adapters: bool) -> tuple[float, int]:
    engine.reset_prefix_cache()
    requests = [GenerationRequest(f"r{i}", prompt_token_ids=ids, sampling=SamplingParams(temperature=0.0),
                                  stopping=StoppingParams(max_tokens=n, ignore_eos=True),
                                  lora_name=f"a{i % NUM_ADAPTERS}" if with_adapters else None)
                for i, (ids, n) in enumerate(jobs)]
    start = time.perf_counter()
    results = engine.run_until_done(requests)
    return time.perf_counter() - start, sum(len(r.outputs[0].tokens) for r in results)


def load_adapters(engine: Engine, root: Path) -> tuple[list[float], list[float]]:
    load_s, slot_s = [], []
    for i in range(NUM_ADAPTERS):
        start = time.perf_counter()
        engine.load_lora(LoraAdapterSpec(i + 1, f"a{i}", str(root / f"a{i}")))
        load_s.append(time.perf_counter() - start)
        loaded = engine.loras.get(f"a{i}")
        start = time.perf_counter()
        engine.core.runner.set_lora_slot(i, loaded.adapter.layers)
        slot_s.append(time.perf_counter() - start)
    return load_s, slot_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model("smollm2-135m-instruct").path
    config = load_model_config(path)
    parts = (config, load_weights(path, torch.float32), load_tokenizer(path), model_fingerprint(path))
    shape = ModelShape.from_model_config_json(path / "config.json")
    jobs = workload(8 if args.quick else 32, 24 if args.quick else 128, config.vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for i in range(NUM_ADAPTERS):
            write_random_adapter(root / f"a{i}", shape, rank=RANK, modules=MODULES, seed=i)
        plain, lora = make_engine(parts, None), make_engine(parts, root)
        load_s, slot_s = load_adapters(lora, root)
        rates: dict[str, list[float]] = {"base, LoRA off": [], "base, LoRA on": [], "8 adapters": []}
        for _ in range(args.rounds):
            for name, engine, adapters in (("base, LoRA off", plain, False), ("base, LoRA on", lora, False),
                                           ("8 adapters", lora, True)):
                seconds, tokens = run(engine, jobs, adapters)
                rates[name].append(tokens / seconds)
    best = {name: max(values) for name, values in rates.items()}
    print(f"threads {torch.get_num_threads()}, {len(jobs)} requests, {args.rounds} rounds (best shown)")
    print("| configuration | output tok/s | × base (LoRA off) |")
    print("|---|---:|---:|")
    for name, rate in best.items():
        print(f"| {name} | {rate:.1f} | {rate / best['base, LoRA off']:.2f} |")
    print(f"adapter load (read + check + fuse): median {statistics.median(load_s) * 1e3:.1f} ms, "
          f"max {max(load_s) * 1e3:.1f} ms; copy into a slot: median {statistics.median(slot_s) * 1e3:.1f} ms "
          f"({(root / 'a0' / 'adapter_model.safetensors').name}: rank {RANK}, {len(MODULES)} modules x "
          f"{config.num_hidden_layers} layers)")


if __name__ == "__main__":
    main()
