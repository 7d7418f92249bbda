"""The AMX form of the CPU attention kernel against the vector form it replaces on AMX machines.

One layer's bf16 attention (bfloat16 queries on a bfloat16 cache) on SmolLM2's shapes, the shapes
of ``cpu_attention.py``: ``CpuPagedBackend(bfloat16, bfloat16)``, which takes the AMX form
(``kernels/cpu/paged_attention_amx.h``, its own cache layout), against ``CpuPagedBackend()`` given
the same dtypes, which takes the chosen vector form (``bf16_query_form``), each on its own caches
filled alike; best of ``--repeats`` calls, the two alternating. Prints both times, the ratio
(above 1 = the AMX form is faster) and the AMX form's attention GFLOP/s.

    python benchmarks/cpu_amx_attention.py [--threads 2] [--repeats 9]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import cpu_attention  # noqa: E402
import torch  # noqa: E402

from refengine.kernels.attention.cpu_paged import CpuPagedBackend, amx_form_available, bf16_query_form  # noqa: E402


def _best_times(new_tokens: list[int], cached: int, repeats: int) -> list[float]:
    """Best seconds of the vector form, then the AMX form, alternating."""
    runs = []
    for amx in (False, True):
        make = (lambda: CpuPagedBackend(torch.bfloat16, torch.bfloat16)) if amx else CpuPagedBackend
        cpu_attention._backend = lambda peer, make=make: make()  # noqa: SLF001 - its caches in this form's layout
        runs.append((make(), cpu_attention._inputs(new_tokens, cached, torch.bfloat16)))  # noqa: SLF001
    best = [float("inf")] * 2
    for _ in range(repeats):
        for index, (backend, (meta, q, k, v, k_cache, v_cache)) in enumerate(runs):
            backend.prepare(meta)
            started = time.perf_counter()
            backend.forward(q, k, v, k_cache, v_cache, cpu_attention.HEAD_DIM**-0.5)
            best[index] = min(best[index], time.perf_counter() - started)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    if not amx_form_available():
        print("no AMX form on this machine (amx_bf16, the build, or the AMX state from Linux)")
        return 1
    torch.set_num_threads(args.threads)
    form = bf16_query_form()
    print(f"vector form: {form.name if form else 'widened to float32'}")
    print("| step | shape | vector form ms | AMX form ms | vector / AMX (speed) | AMX GFLOP/s |")
    print("|---|---|---:|---:|---:|---:|")
    for kind, shapes in (("prefill", cpu_attention.PREFILL), ("decode", cpu_attention.DECODE)):
        for first, cached in shapes:
            new_tokens = [first] if kind == "prefill" else [1] * first
            label = f"{first} new after {cached}" if kind == "prefill" else f"{first} × 1 after {cached}"
            vector_s, amx_s = _best_times(new_tokens, cached, args.repeats)
            pairs = sum(n * cached + n * (n + 1) / 2 for n in new_tokens)
            flops = 4 * cpu_attention.NUM_HEADS * cpu_attention.HEAD_DIM * pairs
            print(f"| {kind} | {label} | {vector_s * 1e3:.3f} | {amx_s * 1e3:.3f} | {vector_s / amx_s:.2f} | "
                  f"{flops / amx_s / 1e9:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
