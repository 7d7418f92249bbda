"""--kv-cache-dtype under float32 weights: decode step time with a 16-bit KV cache against the
float32 cache, in the same run, each next to its memory roof.

SmolLM2-135M-Instruct (float32 weights), ``--threads`` torch threads (default 2). One decode step
(build + execute) at each batch × context, for each attention backend and KV dtype it reads: the
native CPU kernel and the torch reference (float32, bfloat16, float16 each). The
roof is (weight bytes + the batch's KV bytes) ÷ the memory read bandwidth measured here. A 16-bit
cache halves the KV bytes, so it pays where the KV read is a large part of the step (long
contexts, large batches); ``× fp32 KV`` is the step time ratio on the same backend (below 1 =
faster). Also printed: blocks per GiB of KV memory for each dtype.

    python benchmarks/kv_cache_dtype.py [--threads 2] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from benchmarks.cpu_bf16 import _timed, read_bandwidth  # noqa: E402
from refengine.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from refengine.engine.engine import Engine  # noqa: E402
from refengine.engine.input_builder import build_model_input  # noqa: E402
from refengine.model.dtypes import DTYPES  # noqa: E402
from refengine.model.loader import (  # noqa: E402
    load_model_config,
    load_tokenizer,
    load_weights,
    model_fingerprint,
    resolve_model,
)
from refengine.model.runner import kv_bytes_per_block  # noqa: E402
from refengine.scheduler.scheduler import ScheduledSequence, SchedulerOutput  # noqa: E402
from refengine.scheduler.sequence import Sequence  # noqa: E402

#: (attention backend, KV dtypes it reads)
RUNS = (("cpu", ("float32", "bfloat16", "float16")), ("torch", ("float32", "bfloat16", "float16")))


def decode_step(parts, backend: str, kv_dtype: str, batch: int, context: int, repeats: int = 5) -> float:
    """Best of ``repeats`` decode steps of ``batch`` sequences at ``context`` cached tokens."""
    config, weights, tokenizer, fingerprint = parts
    blocks = batch * (context // 16 + 2) + 8
    eng = Engine(EngineConfig(kv_cache_dtype=kv_dtype, attention_backend=backend, max_sequences_per_request=1,
                              cache=CacheConfig(num_blocks=blocks),
                              scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=max(batch, 1))),
                 config, weights, tokenizer, model_fingerprint=fingerprint)
    runner, kv = eng.core.runner, eng.core.kv
    seqs = []
    for b in range(batch):
        seq = Sequence(f"d{b}", 0, [100 + (b + i) % 1000 for i in range(context)], context)
        kv.allocate(seq, context + 1)
        seq.num_computed_tokens = context - 1
        seqs.append(seq)
    schedule = SchedulerOutput([ScheduledSequence.of(s, 1) for s in seqs])
    step = lambda: runner.execute(build_model_input(schedule, runner.block_size, [1] * batch))  # noqa: E731
    step()
    return min(_timed(step) for _ in range(repeats))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="one shape")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model("smollm2-135m-instruct").path
    config = load_model_config(path)
    parts = (config, load_weights(path), load_tokenizer(path), model_fingerprint(path))
    params = sum(w.numel() for name, w in parts[1].items() if name.endswith("proj.weight"))
    params += config.vocab_size * config.hidden_size  # the LM head (tied to the embeddings)
    bandwidth = read_bandwidth()
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    print(f"memory read bandwidth {bandwidth / 1e9:.1f} GB/s; KV blocks (16 tokens) per GiB: "
          + ", ".join(f"{d} {(1 << 30) // kv_bytes_per_block(config, 16, DTYPES[d])}"
                      for d in ("float32", "bfloat16", "float16")))
    print("\n| backend | KV dtype | batch | context | decode step ms | × fp32 KV | roof ms | roof / step |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    shapes = [(32, 1024)] if args.quick else [(1, 1024), (32, 128), (32, 1024), (64, 1024), (16, 2048)]
    for backend, kv_dtypes in RUNS:
        for batch, context in shapes:
            base = None
            for kv_dtype in kv_dtypes:
                step = decode_step(parts, backend, kv_dtype, batch, context)
                base = base or step
                roof = (params * 4 + batch * context * kv_per_token * DTYPES[kv_dtype].itemsize) / bandwidth
                print(f"| {backend} | {kv_dtype} | {batch} | {context} | {step * 1e3:.1f} | {step / base:.2f} "
                      f"| {roof * 1e3:.1f} | {roof / step:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
