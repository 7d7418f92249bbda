"""The native bf16 GEMM against oneDNN's, on every projection of SmolLM2-135M.

One pass runs the model's 121 projections once (30 layers of QKV 960 x 576, O 576 x 576,
gate/up 3,072 x 576 and down 576 x 1,536, then the LM head 49,152 x 576) on random weights,
268 MB in bf16, so most weights come from DRAM, as in a decode step. For each row count the
kinds of ``kernels.linear.Linear`` run alternately (best of ``--repeats`` passes each), so the
machine's slow swings in speed hit them alike:

- ``amx-bf16``: ``kernels/cpu/gemm_amx.c`` (the engine's choice with AMX); not run without AMX;
- ``native-bf16``: ``kernels/cpu/gemm_bf16.c`` (AVX512-BF16, the engine's choice without AMX);
  not run on a CPU where it is unavailable (with AMX);
- ``onednn-bf16``: oneDNN's bf16 GEMM on prepacked weights as ``Linear`` runs it where neither
  native GEMM takes the weight (``--no-native-kernels``): in calls of exactly ``BF16_CALL_ROWS``
  rows, for batch invariance (G18);
- ``onednn-bf16-one-call``: the same GEMM in one call of all the rows, the faster baseline that
  is not batch-invariant (oneDNN's rounding changes with the row count, ``kernels/linear.py``);
- ``onednn-fp32``: the float32 path, for scale.

Prints ms per pass, GFLOP/s, the weight bytes read per second, and each bf16 kind's speed over
``onednn-bf16``'s.

    python benchmarks/cpu_gemm.py [--threads 2] [--repeats 5] [--rows 1 8 32 64 512 2048]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from refengine.kernels import amx_gemm, native_gemm  # noqa: E402
from refengine.kernels.linear import Linear  # noqa: E402

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out_features, in_features)
SHAPES = LAYER_SHAPES * 30 + [(49152, 576)]
NATIVE_KINDS = ("amx-bf16", "native-bf16")  # the project's own GEMMs (Linear's native kinds)


def model_projections(kind: str) -> list[Linear]:
    generator = torch.Generator().manual_seed(0)
    dtype = torch.float32 if kind == "onednn-fp32" else torch.bfloat16
    layers = []
    kind = kind.removesuffix("-one-call")
    for out_features, in_features in SHAPES:
        weight = (torch.randn(out_features, in_features, generator=generator) * 0.02).to(dtype)
        native = kind in NATIVE_KINDS
        layers.append(Linear(weight, native=native))
        assert layers[-1].kind == (kind if native else "onednn"), (kind, layers[-1].kind)
    return layers


def one_pass(layers: list[Linear], inputs: dict[int, torch.Tensor], in_one_call: bool) -> float:
    started = time.perf_counter()
    for layer in layers:
        if in_one_call:  # the GEMM on all rows at once, as Linear's fixed-count calls do per call
            layer._onednn(inputs[layer.in_features])
        else:
            layer(inputs[layer.in_features])
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 512, 2048])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kinds = []
    native_kinds = (("amx-bf16", amx_gemm.unavailable_reason()), ("native-bf16", native_gemm.unavailable_reason()))
    for kind, reason in native_kinds:
        if reason:
            print(f"{kind} does not run here: {reason}")
        else:
            kinds.append(kind)
    kinds += ["onednn-bf16", "onednn-bf16-one-call", "onednn-fp32"]
    models = {kind: model_projections(kind) for kind in kinds}
    flops_per_row = sum(2 * n * k for n, k in SHAPES)
    params = sum(n * k for n, k in SHAPES)
    print("| rows | kind | ms per pass | GFLOP/s | weight GB/s | speed / onednn-bf16 |")
    print("|---:|---|---:|---:|---:|---:|")
    for rows in args.rows:
        best = dict.fromkeys(kinds, float("inf"))
        inputs = {kind: {k: torch.randn(rows, k).to(torch.float32 if kind == "onednn-fp32" else torch.bfloat16)
                         for k in (576, 1536)} for kind in kinds}
        for _ in range(args.repeats):
            for kind in kinds:
                seconds = one_pass(models[kind], inputs[kind], kind.endswith("-one-call"))
                best[kind] = min(best[kind], seconds)
        for kind in kinds:
            size = 4 if kind == "onednn-fp32" else 2
            ratio = f"{best['onednn-bf16'] / best[kind]:.2f}" if "bf16" in kind else ""
            print(f"| {rows} | {kind} | {best[kind] * 1e3:.2f} | {flops_per_row * rows / best[kind] / 1e9:.0f} | "
                  f"{params * size / best[kind] / 1e9:.1f} | {ratio} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
