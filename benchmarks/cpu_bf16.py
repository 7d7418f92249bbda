"""The CPU bf16 path against float32, each next to its roofline measured in the same run.

SmolLM2-135M-Instruct on this CPU, ``--threads`` torch threads (default 2). Two engines (float32,
bfloat16: bf16 weights in the native AVX512-BF16 GEMM, or the native AMX GEMM where the CPU has AMX, and a
bf16 KV cache read by the native attention kernel), the same mixed workload as ``throughput.py``
(64 requests, prompts 32–512, outputs 16–256, EOS ignored, greedy).

- **Throughput**: output tok/s per dtype, and the ratio bf16 / fp32 (target ≥ 1.6 on a CPU
  with native bf16). The **roof**: the workload's matmul FLOPs (2 × the layers' projection
  parameters × every token position computed, prompts once and each output token once, plus
  2 × the LM head's parameters × the rows whose logits were computed, plus attention's
  4 × heads × head_dim × layers per query-key pair attended) ÷ the prepacked GEMM
  rate of that dtype measured here at the workload's typical step shape (2048 × 576 × 1536) just
  before and just after the workload (the larger of the two),
  and a memory roof: every step reads the weights once and each sequence's KV (counted over the
  run's steps) at the read bandwidth measured here (the best of the readings before and after
  each workload). No step can beat the larger of its own two
  (its FLOPs at the GEMM rate, its bytes at the read bandwidth), so the **per-step roof**, the sum
  over steps of that larger one, bounds the run; the table gives the fraction of it achieved
  (target ≥ 60 % for bf16), and also the looser fraction of the larger of the two totals, which
  earlier tables reported. A second table splits the steps: those with prompt tokens (mostly
  compute-bound) and decode-only ones (memory-bound at a few rows, compute-bound from about a
  dozen under this roof), each with its ``execute`` time, and beside the roof the **serial
  bound**: each step's compute time plus its memory time, what a step needs when its reads do
  not overlap its arithmetic. On two cores they barely do: a decode step's projections compute
  and its attention streams the KV, one after the other.
  Attention's FLOPs are part of the workload's (about 7 % of them here, and 10 % of a decode step's
  at 400 positions); tables before 2026-12-04 left them out, so the first table also gives the
  fraction of the per-step roof without them.
- **Decode step**: one decode step (build + execute) at batch 1/32/64 and context 128 and 1,024,
  next to its memory roof: (weight bytes + the batch's KV bytes) ÷ the memory read bandwidth
  measured here (a large ``sum`` over a 1 GiB tensor).

    python benchmarks/cpu_bf16.py [--threads 2] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from benchmarks.throughput import make_workload  # noqa: E402
from refengine.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from refengine.engine.engine import Engine  # noqa: E402
from refengine.engine.info import bf16_attention_path  # noqa: E402
from refengine.engine.input_builder import build_model_input  # noqa: E402
from refengine.kernels.cpu_features import bf16_path  # noqa: E402
from refengine.kernels.linear import Linear, bf16_gemm  # noqa: E402
from refengine.model.loader import (  # noqa: E402
    load_model_config,
    load_tokenizer,
    load_weights,
    model_fingerprint,
    resolve_model,  # noqa: E402
)
from refengine.scheduler.scheduler import ScheduledSequence, SchedulerOutput  # noqa: E402
from refengine.scheduler.sequence import Sequence  # noqa: E402
from refengine.types import GenerationRequest, SamplingParams, StoppingParams  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def gemm_rate(dtype: torch.dtype, rows: int = 2048, k: int = 576, n: int = 1536, repeats: int = 10) -> float:
    """FLOP/s of one prepacked projection of this shape (the engine's own ``Linear``)."""
    layer = Linear(torch.randn(n, k).to(dtype))
    x = torch.randn(rows, k).to(dtype)
    layer(x)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        layer(x)
        best = min(best, time.perf_counter() - started)
    return 2 * rows * k * n / best


def read_bandwidth(gib: float = 1.0) -> float:
    data = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    data.sum()
    best = min(_timed(data.sum) for _ in range(5))
    return data.numel() * 4 / best


def _timed(fn) -> float:  # noqa: ANN001
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def engine(parts, dtype: str, num_blocks: int = 4096, max_num_seqs: int = 64) -> Engine:
    config, weights, tokenizer, fingerprint = parts
    cast = {name: w.to(DTYPES[dtype]) for name, w in weights.items()}
    return Engine(EngineConfig(dtype=dtype, cache=CacheConfig(num_blocks=num_blocks),
                               max_sequences_per_request=16,
                               scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=max_num_seqs)),
                  config, cast, tokenizer, model_fingerprint=fingerprint)


@dataclass(frozen=True)
class StepCounts:
    """What one engine step computed: the token positions run through the layers, the KV
    positions its attention read, the (query, key) pairs it attended (causal), the rows given
    logits, and the seconds ``execute`` took."""

    tokens: int
    kv_positions: int
    attention_pairs: int
    logit_rows: int
    seconds: float

    @property
    def decode_only(self) -> bool:
        return self.tokens == self.logit_rows


def attention_pairs(model_input) -> int:  # noqa: ANN001
    """The (query, key) pairs a step's causal attention computes: a sequence's q new rows each
    attend to the s - q cached positions and to the new ones up to their own."""
    starts = model_input.query_start_loc
    pairs = 0
    for i, seq_len in enumerate(model_input.seq_lens):
        new = starts[i + 1] - starts[i]
        pairs += new * (seq_len - new) + new * (new + 1) // 2
    return pairs


def throughput(parts, dtype: str, workload) -> tuple[float, int, list[StepCounts]]:
    """(seconds, output tokens, every step's counts) of the workload."""
    eng = engine(parts, dtype)
    requests = [GenerationRequest(f"r{i}", prompt_token_ids=ids, sampling=SamplingParams(temperature=0.0),
                                  stopping=StoppingParams(max_tokens=n, ignore_eos=True))
                for i, (ids, n) in enumerate(workload)]
    eng.run_until_done(requests[:2])  # warm-up (kernels built, weights touched)
    eng.reset_prefix_cache()  # else the timed run's first two prompts were cache hits (found by review: ~5 %)
    steps: list[StepCounts] = []
    execute = eng.core.runner.execute

    def counted(model_input, **options):  # noqa: ANN001, ANN003, ANN202
        started = time.perf_counter()
        result = execute(model_input, **options)
        steps.append(StepCounts(model_input.input_ids.numel(), sum(model_input.seq_lens), attention_pairs(model_input),
                                model_input.logit_row_indices.numel(), time.perf_counter() - started))
        return result

    eng.core.runner.execute = counted
    started = time.perf_counter()
    results = eng.run_until_done(requests)
    return time.perf_counter() - started, sum(len(r.outputs[0].tokens) for r in results), steps


def decode_step(parts, dtype: str, batch: int, context: int, repeats: int = 5) -> float:
    eng = engine(parts, dtype, num_blocks=batch * (context // 16 + 2) + 8)
    runner, kv = eng.core.runner, eng.core.kv
    seqs = []
    for b in range(batch):
        seq = Sequence(f"d{b}", 0, list(range(100, 100 + context)), context)
        kv.allocate(seq, context + 1)
        seq.num_computed_tokens = context - 1
        seqs.append(seq)
    sched = SchedulerOutput([ScheduledSequence.of(s, 1) for s in seqs])
    step = lambda: runner.execute(build_model_input(sched, runner.block_size, [1] * batch))  # noqa: E731
    step()
    return min(_timed(step) for _ in range(repeats))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="8 short requests, one decode shape")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model("smollm2-135m-instruct").path
    config = load_model_config(path)
    parts = (config, load_weights(path), load_tokenizer(path), model_fingerprint(path))
    print(f"bf16 path: {bf16_path(bf16_gemm(), bf16_attention_path('cpu'))}")
    layer_params = sum(w.numel() for name, w in parts[1].items() if name.endswith("proj.weight"))
    head_params = config.vocab_size * config.hidden_size  # the LM head (tied to the embeddings)
    params = layer_params + head_params
    workload = make_workload(8 if args.quick else 64, 0, config.vocab_size, 128 if args.quick else 512,
                             32 if args.quick else 256)
    bandwidths = [read_bandwidth()]
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    attention_flops_per_pair = 4 * config.num_attention_heads * config.head_dim * config.num_hidden_layers
    rows, splits, measured_rates = {}, {}, {}
    for dtype in DTYPES:
        rate_before = gemm_rate(DTYPES[dtype])
        seconds, tokens, steps = throughput(parts, dtype, workload)
        # This VM's speed drifts by 20-30 % within minutes: the roof takes the faster of the rates
        # measured just before and just after the workload, so a slow spell during a measurement
        # cannot inflate the roof time and flatter the fraction.
        measured_rates[dtype] = (rate_before, gemm_rate(DTYPES[dtype]))
        bandwidths.append(read_bandwidth())
        rate, bandwidth, size = max(measured_rates[dtype]), max(bandwidths), DTYPES[dtype].itemsize
        projections = [2 * (layer_params * step.tokens + head_params * step.logit_rows) / rate for step in steps]
        compute = [p + attention_flops_per_pair * step.attention_pairs / rate
                   for p, step in zip(projections, steps, strict=True)]
        memory = [(params + step.kv_positions * kv_per_token) * size / bandwidth for step in steps]
        per_step = [max(c, m) for c, m in zip(compute, memory, strict=True)]
        without_attention = sum(max(p, m) for p, m in zip(projections, memory, strict=True))
        totals = max(sum(compute), sum(memory))
        rows[dtype] = (tokens / seconds, rate, sum(compute), sum(memory), sum(per_step), sum(per_step) / seconds,
                       without_attention / seconds, totals / seconds)
        for decode_only in (False, True):
            chosen = [i for i, step in enumerate(steps) if step.decode_only == decode_only]
            spent = sum(steps[i].seconds for i in chosen)
            splits[dtype, decode_only] = (len(chosen), spent, sum(per_step[i] for i in chosen),
                                          sum(compute[i] + memory[i] for i in chosen))
        print(f"{dtype}: {tokens / seconds:.1f} tok/s in {seconds:.1f} s, {len(steps)} steps", flush=True)
    bandwidth = max(bandwidths)
    print(f"\nmemory read bandwidth {bandwidth / 1e9:.1f} GB/s (the best of "
          f"{', '.join(f'{b / 1e9:.1f}' for b in bandwidths)}, measured before and after each workload)")
    for dtype, (before, after) in measured_rates.items():
        print(f"{dtype} GEMM GFLOP/s before and after its workload: {before / 1e9:.0f}, {after / 1e9:.0f} "
              "(the roof takes the larger)")
    print("| dtype | output tok/s | × float32 | prepacked GEMM GFLOP/s | compute roof s | memory roof s "
          "| per-step roof s | fraction of the per-step roof | the same without attention FLOPs "
          "| fraction of max(compute, memory) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for dtype, (tok_s, rate, compute, memory, per_step, fraction, fraction_without, fraction_of_totals) in rows.items():
        print(f"| {dtype} | {tok_s:.1f} | {tok_s / rows['float32'][0]:.2f} | {rate / 1e9:.0f} | {compute:.1f} "
              f"| {memory:.1f} | {per_step:.1f} | {fraction:.2f} | {fraction_without:.2f} | {fraction_of_totals:.2f} |")
    print("\n| dtype | steps | count | execute s | per-step roof s | roof / execute | serial bound s "
          "| serial bound / execute |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for (dtype, decode_only), (count, spent, roof, serial) in splits.items():
        kind = "decode only" if decode_only else "with prompt tokens"
        print(f"| {dtype} | {kind} | {count} | {spent:.2f} | {roof:.2f} | {roof / max(spent, 1e-9):.2f} "
              f"| {serial:.2f} | {serial / max(spent, 1e-9):.2f} |")
    weight_bytes = {dtype: params * DTYPES[dtype].itemsize for dtype in DTYPES}
    print("\n| dtype | batch | context | decode step ms | roof ms (weights + KV ÷ bandwidth) | roof / step |")
    print("|---|---:|---:|---:|---:|---:|")
    shapes = [(1, 128)] if args.quick else [(1, 128), (32, 128), (64, 128), (1, 1024), (32, 1024), (64, 1024)]
    for dtype in DTYPES:
        for batch, context in shapes:
            step = decode_step(parts, dtype, batch, context)
            roof = (weight_bytes[dtype] + batch * context * kv_per_token * DTYPES[dtype].itemsize) / bandwidth
            print(f"| {dtype} | {batch} | {context} | {step * 1e3:.1f} | {roof * 1e3:.1f} | {roof / step:.2f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
