"""The CPU attention backend's chunk kernel against its peers, on SmolLM2's attention shapes.

One layer's attention (9 query heads, 3 KV heads, head_dim 64, block size 16) through
``CpuPagedBackend.forward``, best of ``--repeats`` calls (the two alternating), for each dtype (float32; bfloat16
queries on a bfloat16 cache), with the peers measured in the same run on the same inputs:

- **Prefill** (one sequence, a chunk of T new tokens after C cached ones): the chunk kernel
  against the path the backend takes for shapes the chunk kernel refuses, the row kernel (until
  2026-12-06 SDPA's CPU flash kernel for chunks of 64 tokens or more, which the tables in
  benchmarks/README.md up to that date compare with).
- **Decode** (B sequences of one new token after C cached ones, blocks shuffled in a pool
  allocated as an aggregated engine's is, on 4 KiB pages):
  the chunk kernel against the row kernel.

The bfloat16 rows time the vector forms (``CpuPagedBackend()``, the standard cache layout); on
a CPU with AMX the engine runs bf16 attention in the AMX form instead, which
``benchmarks/cpu_amx_attention.py`` times against them.

Prints time, attention GFLOP/s (4 x heads x head_dim per query-key pair attended), the ratio
peer / chunk kernel (above 1 = the chunk kernel is faster) and the largest difference of their
outputs.

    python benchmarks/cpu_attention.py [--threads 2] [--repeats 15]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from refengine.kernels.attention import cpu_paged  # noqa: E402
from refengine.kernels.attention.base import AttentionMetadata  # noqa: E402
from refengine.model.host_memory import zeroed_slab  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
PREFILL = [(128, 0), (512, 0), (2048, 0), (512, 1024), (16, 512)]  # (new tokens, cached tokens)
DECODE = [(1, 1024), (32, 128), (64, 512), (32, 1024)]  # (sequences, cached tokens)


def _backend(peer: bool) -> cpu_paged.CpuPagedBackend:
    """The backend; ``peer``: as it runs for a shape the chunk kernel refuses."""
    backend = cpu_paged.CpuPagedBackend()
    if peer:
        backend._chunk_kernel_takes = lambda head_dim, block_size: 0  # noqa: SLF001 - the benchmark's switch
    return backend


def _inputs(new_tokens: list[int], cached: int, dtype: torch.dtype):  # noqa: ANN202
    """Metadata, q/k/v and caches for sequences of ``cached`` + new tokens, blocks shuffled."""
    generator = torch.Generator().manual_seed(0)
    per_seq = -(-(cached + max(new_tokens)) // BLOCK_SIZE)
    num_blocks = per_seq * len(new_tokens)
    tables = torch.randperm(num_blocks, generator=generator).view(len(new_tokens), per_seq)
    k_shape, v_shape = _backend(False).kv_cache_shapes(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = zeroed_slab([k_shape, v_shape], dtype, huge_pages=False)  # as an aggregated engine's runner
    for cache in (k_cache, v_cache):
        cache.copy_(torch.randn(cache.shape, generator=generator))
    slots = [int(tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
             for i, n in enumerate(new_tokens) for p in range(cached, cached + n)]
    starts = [0]
    for n in new_tokens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(starts, [cached + n for n in new_tokens], tables, torch.tensor(slots), BLOCK_SIZE)
    rows = starts[-1]
    q, k, v = (torch.randn(rows, heads, HEAD_DIM, generator=generator).to(dtype)
               for heads in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS))
    return meta, q, k, v, k_cache, v_cache


def _timed_pair(inputs, repeats: int) -> list[tuple[float, torch.Tensor]]:  # noqa: ANN001
    """(best seconds, output) of the chunk kernel and of its peer, timed alternately so that the
    machine's slow swings in speed hit both alike."""
    meta, q, k, v, k_cache, v_cache = inputs
    backends = [_backend(False), _backend(True)]
    outputs, best = [], [float("inf")] * 2
    for backend in backends:
        backend.prepare(meta)
        outputs.append(backend.forward(q, k, v, k_cache, v_cache, HEAD_DIM**-0.5))
    for _ in range(repeats):
        for index, backend in enumerate(backends):
            backend.prepare(meta)
            started = time.perf_counter()
            backend.forward(q, k, v, k_cache, v_cache, HEAD_DIM**-0.5)
            best[index] = min(best[index], time.perf_counter() - started)
    return list(zip(best, outputs, strict=True))


def _row(kind: str, label: str, new_tokens: list[int], cached: int, dtype: torch.dtype, repeats: int,
         peer_name: str) -> str:
    inputs = _inputs(new_tokens, cached, dtype)
    (chunk_s, chunk_out), (peer_s, peer_out) = _timed_pair(inputs, repeats)
    pairs = sum(n * cached + n * (n + 1) / 2 for n in new_tokens)
    flops = 4 * NUM_HEADS * HEAD_DIM * pairs
    difference = (chunk_out.float() - peer_out.float()).abs().max().item()
    return (f"| {kind} | {str(dtype).removeprefix('torch.')} | {label} | {chunk_s * 1e3:.3f} | "
            f"{flops / chunk_s / 1e9:.0f} | {peer_name} | {peer_s * 1e3:.3f} | {flops / peer_s / 1e9:.0f} | "
            f"{peer_s / chunk_s:.2f} | {difference:.1e} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| step | dtype | shape | chunk kernel ms | GFLOP/s | peer | peer ms | peer GFLOP/s "
          "| peer / chunk | max difference |")
    print("|---|---|---|---:|---:|---|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        for new, cached in PREFILL:
            print(_row("prefill", f"{new} new after {cached}", [new], cached, dtype, args.repeats, "row kernel"),
                  flush=True)
        for batch, cached in DECODE:
            print(_row("decode", f"{batch} × 1 after {cached}", [1] * batch, cached, dtype, args.repeats,
                       "row kernel"), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
