"""Offline throughput: refengine vs transformers ``generate`` on the same workload.

SmolLM2-135M-Instruct, fp32, CPU. 64 requests, prompt lengths uniform in 32-512,
output lengths uniform in 16-256 (EOS ignored), fixed seed. transformers runs
static batches (left-padded, each batch generates its longest output; only each
request's own output tokens count) at batch sizes 1/8/16/32 and the best rate is
the peer. Also prints the engine's decode step time at batch 1/8/32/64 next to
the time of the same step's bare weight matmuls (``torch.mm`` on the same shapes),
and next to the engine's own projections alone.

    python benchmarks/throughput.py            # the full run (~15 min on 2 cores)
    python benchmarks/throughput.py --quick    # a smoke run
    python benchmarks/throughput.py --engine-only  # refengine's rate alone (before/after a change)
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from refengine.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from refengine.engine.engine import Engine  # noqa: E402
from refengine.engine.input_builder import build_model_input  # noqa: E402
from refengine.model.loader import (  # noqa: E402
    load_model_config,
    load_tokenizer,
    load_weights,
    model_fingerprint,
    resolve_model,
)
from refengine.scheduler.scheduler import ScheduledSequence, SchedulerOutput  # noqa: E402
from refengine.scheduler.sequence import Sequence  # noqa: E402
from refengine.types import GenerationRequest, SamplingParams, StoppingParams  # noqa: E402


def make_workload(num_requests: int, seed: int, vocab_size: int, max_prompt: int, max_output: int):
    rng = random.Random(seed)
    workload = []
    for _ in range(num_requests):
        prompt_len = rng.randint(32, max_prompt)
        output_len = rng.randint(16, max_output)
        workload.append(([rng.randrange(100, vocab_size) for _ in range(prompt_len)], output_len))
    return workload


def run_engine(parts, workload, max_num_seqs: int) -> tuple[float, int]:
    config, weights, tokenizer, fingerprint = parts
    engine = Engine(
        EngineConfig(cache=CacheConfig(num_blocks=4096), max_sequences_per_request=min(16, max_num_seqs),
                     scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=max_num_seqs)),
        config, weights, tokenizer, model_fingerprint=fingerprint)
    requests = [
        GenerationRequest(request_id=f"r{i}", prompt_token_ids=ids, sampling=SamplingParams(temperature=0.0),
                          stopping=StoppingParams(max_tokens=out_len, ignore_eos=True))
        for i, (ids, out_len) in enumerate(workload)
    ]
    start = time.perf_counter()
    results = engine.run_until_done(requests)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(r.outputs[0].tokens) for r in results)


def run_transformers(model, workload, batch_size: int) -> tuple[float, int]:
    elapsed, tokens = 0.0, 0
    for start in range(0, len(workload), batch_size):
        batch = workload[start : start + batch_size]
        max_len = max(len(ids) for ids, _ in batch)
        input_ids = torch.zeros((len(batch), max_len), dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, (ids, _) in enumerate(batch):
            input_ids[row, max_len - len(ids):] = torch.tensor(ids)
            attention_mask[row, max_len - len(ids):] = 1
        new_tokens = max(out_len for _, out_len in batch)
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        elapsed += time.perf_counter() - t0
        tokens += sum(out_len for _, out_len in batch)
    return elapsed, tokens


def _run_all(calls) -> None:
    for call in calls:
        call()


def decode_step_overhead(parts, batch_sizes, context_len: int, repeats: int) -> list[tuple[int, float, float, float]]:
    """Engine decode step vs the bare matmuls of the same step, best of ``repeats`` each.

    Two baselines: ``torch.mm`` on dense weights of the same shapes (the BLAS as a
    plain torch program calls it), and the engine's own projections alone (oneDNN on
    prepacked weights), which isolates everything the step adds besides its GEMMs."""
    config, weights, tokenizer, fingerprint = parts
    engine = Engine(EngineConfig(cache=CacheConfig(num_blocks=64 * (context_len // 16 + 2))),
                    config, weights, tokenizer, model_fingerprint=fingerprint)
    runner = engine.core.runner
    kv = engine.core.kv
    model = runner.model
    projections = [p for layer in model.layers for p in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj,
                                                         layer.down_proj)]
    projections.append(model.lm_head)
    dense = [torch.randn(p.out_features, p.in_features) for p in projections]
    rows = []
    for batch in batch_sizes:
        seqs = []
        for b in range(batch):
            seq = Sequence(f"d{b}", 0, list(range(100, 100 + context_len)), context_len)
            kv.allocate(seq, context_len + 2)
            seq.num_computed_tokens = context_len - 1
            seqs.append(seq)
        sched = SchedulerOutput([ScheduledSequence.of(s, 1) for s in seqs])
        inputs = {p.in_features: torch.randn(batch, p.in_features) for p in projections}

        def step(sched: SchedulerOutput = sched, batch: int = batch) -> None:  # input building included
            runner.execute(build_model_input(sched, runner.block_size, [1] * batch))

        bare_mm = functools.partial(_run_all, [functools.partial(torch.mm, inputs[w.shape[1]], w.t()) for w in dense])
        engine_gemms = functools.partial(_run_all, [functools.partial(p, inputs[p.in_features]) for p in projections])
        timings: dict = {f: [] for f in (step, bare_mm, engine_gemms)}
        for f in timings:
            f()  # warm-up
        for _ in range(repeats):  # interleaved, so all three see the same machine state
            for f, times in timings.items():
                t0 = time.perf_counter()
                f()
                times.append(time.perf_counter() - t0)
        rows.append((batch, *(min(times) for times in timings.values())))
        for s in seqs:
            kv.free(s)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 short requests, batch sizes 1/8 only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--engine-only", action="store_true", help="the engine's rate only: no peer, no step table")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    resolved = resolve_model("smollm2-135m-instruct")
    parts = (load_model_config(resolved.path), load_weights(resolved.path), load_tokenizer(resolved.path),
             model_fingerprint(resolved.path))
    if args.quick:
        workload = make_workload(8, args.seed, parts[0].vocab_size, 64, 32)
        hf_batch_sizes = [1, 8]
    else:
        workload = make_workload(64, args.seed, parts[0].vocab_size, 512, 256)
        hf_batch_sizes = [1, 8, 16, 32]
    print(f"torch threads: {torch.get_num_threads()}, requests: {len(workload)}, "
          f"output tokens: {sum(o for _, o in workload)}")

    elapsed, tokens = run_engine(parts, workload, args.max_num_seqs)
    engine_rate = tokens / elapsed
    print(f"refengine: {tokens} tokens in {elapsed:.1f} s = {engine_rate:.1f} tok/s")
    if args.engine_only:
        return

    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(resolved.path, dtype=torch.float32).eval()
    best = (0.0, 0)
    for bs in hf_batch_sizes:
        # Batch size 1 is slow: its rate is measured on the first 8 requests.
        subset = workload if bs >= 8 else workload[:8]
        hf_elapsed, hf_tokens = run_transformers(hf, subset, bs)
        rate = hf_tokens / hf_elapsed
        print(f"transformers generate, batch {bs}: {hf_tokens} tokens in {hf_elapsed:.1f} s = {rate:.1f} tok/s")
        best = max(best, (rate, bs))
    print(f"\n| peer | tok/s |\n|---|---|\n| refengine | {engine_rate:.1f} |\n"
          f"| transformers (best: batch {best[1]}) | {best[0]:.1f} |\n"
          f"| ratio | {engine_rate / best[0]:.2f}x |")

    rows = decode_step_overhead(parts, [1, 8] if args.quick else [1, 8, 32, 64], 128, 5 if args.quick else 20)
    print("\n| decode batch | step ms | torch.mm ms | overhead vs torch.mm | engine GEMMs ms | overhead vs own GEMMs |"
          "\n|---|---|---|---|---|---|")
    for batch, step, mm, gemms in rows:
        print(f"| {batch} | {step * 1e3:.1f} | {mm * 1e3:.1f} | {step / mm:.2f}x | {gemms * 1e3:.1f} "
              f"| {step / gemms:.2f}x |")


if __name__ == "__main__":
    main()
