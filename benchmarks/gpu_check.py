"""The GPU check: kernel tests on CUDA, attention bandwidth and FLOP/s, and an 8B-shaped decode.

One script for a lent GPU machine (no network; budget: under 6 minutes on one H200), writing one
JSON file and printing a table:

1. **kernel tests**: the Triton, FlashInfer, CUDA-graph and LoRA kernel tests on CUDA
   (``pytest -m "triton or gpu"`` over their files), pass/fail counts;
2. **decode attention bandwidth**: bytes of KV read ÷ time of one decode step's attention
   (batch 64, context 4,096, 32 query / 8 KV heads of 128, bf16) per backend available, next to
   the device's measured copy bandwidth (a large ``copy_``, its read and write both counted),
   and the fraction (target ≥ 0.7);
3. **prefill attention TFLOP/s**: one 8 × 2,048-token causal prefill per backend; then the decode
   shape through the Triton kernel at 18 launch configurations (tile width, warps, pipelining
   stages: ``triton_paged.LaunchConfig``), the fastest six printed;
4. **end-to-end decode** of a Llama-3-8B-shaped model with random bf16 weights (real weights cannot
   be fetched) at batch 1 / 32 / 256 (context 512): step time next to the weight-read bound (the
   weights' bytes ÷ the copy bandwidth) and the ratio (target at batch 256: ≤ 1.5×), with CUDA
   graphs on and off where the backend supports them, the host's input building timed apart, the
   host's time to issue a step (input building and kernel launches, not waiting for them: when it
   equals the step time, the step is bound by launching),
   and a torch.profiler table of one eager step at the smallest and largest batch. A step is
   what the engine runs for greedy rows on CUDA: the forward pass, the logits left on the device
   (``EngineCore.logits_on_device``) and their argmax brought to the host; the first runs copied
   the float32 logits to the host instead (131 MB at batch 256), which the engine does not.

``--dry-run`` runs the same code on the CPU on tiny shapes (a 2-layer model, the torch and CPU
backends), so the script is tested before GPU time is spent on it.

    python benchmarks/gpu_check.py --out gpu_check.json            # on the GPU machine
    python benchmarks/gpu_check.py --dry-run --out /tmp/dry.json   # here
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from refengine.config import CacheConfig, KernelConfig, ModelConfig  # noqa: E402
from refengine.engine.input_builder import build_model_input  # noqa: E402
from refengine.kernels.attention import AttentionMetadata, registry  # noqa: E402
from refengine.kv.block_pool import BlockPool  # noqa: E402
from refengine.kv.kv_manager import KvCacheManager  # noqa: E402
from refengine.model.runner import ModelRunner  # noqa: E402
from refengine.scheduler.scheduler import ScheduledSequence, SchedulerOutput  # noqa: E402
from refengine.scheduler.sequence import Sequence  # noqa: E402

KERNEL_TESTS = ["tests/unit/test_triton_attention.py", "tests/unit/test_triton_ops.py",
                "tests/unit/test_lora_triton.py", "tests/unit/test_flashinfer_backend.py",
                "tests/unit/test_cuda_graphs.py",
                "tests/unit/test_gpu_backends_e2e.py", "tests/unit/test_device_sampling.py"]


@dataclass(frozen=True)
class Shapes:
    """Everything the check sizes: the GPU run's, or the dry run's tiny ones."""

    device: str
    dtype: torch.dtype
    model: ModelConfig
    decode_batch: int
    decode_context: int
    prefill_seqs: int
    prefill_len: int
    e2e_batches: tuple[int, ...]
    e2e_context: int
    block_size: int = 16


def llama3_8b() -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0)


def tiny() -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0)


def shapes(dry_run: bool) -> Shapes:
    if dry_run:
        return Shapes("cpu", torch.float32, tiny(), 4, 64, 2, 64, (1, 4), 32)
    return Shapes("cuda", torch.bfloat16, llama3_8b(), 64, 4096, 8, 2048, (1, 32, 256), 512)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def best_of(fn: Callable[[], object], device: str, repeats: int = 5, calls: int = 1) -> float:
    """The best time of one call, over ``repeats`` rounds of ``calls`` back-to-back calls between
    two synchronizations: with ``calls`` > 1 a kernel's launch overlaps the one before it, so a
    short kernel is not charged the host time of setting it up (found by review: 20-60 us on a
    0.4 ms decode kernel)."""
    fn()
    sync(device)
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        best = min(best, (time.perf_counter() - started) / calls)
    return best


KERNEL_CALLS = 20  # back-to-back calls per timed round of one kernel


def host_time(fn: Callable[[], object], device: str, repeats: int = 5) -> float:
    """The best time ``fn`` keeps the host busy, the device idle at its start: on CUDA the time to
    issue its work (launches return before the kernels run). Equal to the step's time when a step
    is bound by launching, not by the device."""
    best = math.inf
    for _ in range(repeats + 1):
        sync(device)
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    sync(device)
    return best


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Bytes moved per second by a device-to-device copy of ``nbytes``, read and write both counted:
    the memory's rate (an H200's ~4.3 TB/s in the issue), which a pure read such as attention's
    or the weights' can approach. (The first GPU run counted the read alone, half of this.)"""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / best_of(lambda: dst.copy_(src), device, calls=KERNEL_CALLS)


def kernel_tests(dry_run: bool) -> dict:
    files = [f for f in KERNEL_TESTS if (REPO / f).is_file()]
    # A file that cannot be imported there (a package the image lacks) must not stop the others.
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs",
               "--continue-on-collection-errors", "-m", "triton or gpu", *files]
    if dry_run:
        return {"command": " ".join(command), "skipped": "dry run (the kernel tests run in the normal suite here)"}
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-500:]
    return {"command": " ".join(command), "returncode": result.returncode, "summary": summary,
            "output_tail": (result.stdout + result.stderr)[-6000:]}


def attention_inputs(s: Shapes, num_seqs: int, query_len: int, context: int, backend) -> tuple:  # noqa: ANN001
    m = s.model
    blocks_per_seq = -(-context // s.block_size)
    num_blocks = num_seqs * blocks_per_seq
    k_shape, v_shape = backend.kv_cache_shapes(num_blocks, s.block_size, m.num_key_value_heads, m.head_dim)
    k_cache = torch.randn(k_shape, dtype=s.dtype, device=s.device)
    v_cache = torch.randn(v_shape, dtype=s.dtype, device=s.device)
    tables = torch.arange(num_blocks, device="cpu").view(num_seqs, blocks_per_seq)
    slots = [tables[i, p // s.block_size].item() * s.block_size + p % s.block_size
             for i in range(num_seqs) for p in range(context - query_len, context)]
    # On the device, as the runner passes them (model/runner.py).
    meta = AttentionMetadata([i * query_len for i in range(num_seqs + 1)], [context] * num_seqs,
                             tables.to(s.device), torch.tensor(slots, dtype=torch.int64, device=s.device),
                             s.block_size)
    rows = num_seqs * query_len
    q = torch.randn(rows, m.num_attention_heads, m.head_dim, dtype=s.dtype, device=s.device)
    k = torch.randn(rows, m.num_key_value_heads, m.head_dim, dtype=s.dtype, device=s.device)
    v = torch.randn_like(k)
    return meta, q, k, v, k_cache, v_cache


def decode_kv_bytes(s: Shapes) -> int:
    """The keys and values one decode step of the attention shape reads."""
    m = s.model
    return 2 * s.decode_batch * s.decode_context * m.num_key_value_heads * m.head_dim * s.dtype.itemsize


def attention_rates(s: Shapes, bandwidth: float) -> list[dict]:
    rows = []
    kernels = KernelConfig()
    for name in registry.available_backends(s.dtype, s.device, kernels):
        backend = registry.make_attention_backend(name, s.dtype, s.device, kernels)
        m = s.model
        meta, q, k, v, kc, vc = attention_inputs(s, s.decode_batch, 1, s.decode_context, backend)
        backend.prepare(meta)
        decode = best_of(functools.partial(backend.forward, q, k, v, kc, vc, m.head_dim ** -0.5), s.device,
                         calls=KERNEL_CALLS)
        kv_bytes = decode_kv_bytes(s)
        meta, q, k, v, kc, vc = attention_inputs(s, s.prefill_seqs, s.prefill_len, s.prefill_len, backend)
        backend.prepare(meta)
        prefill = best_of(functools.partial(backend.forward, q, k, v, kc, vc, m.head_dim ** -0.5), s.device,
                          calls=KERNEL_CALLS)
        flops = 2 * 2 * s.prefill_seqs * m.num_attention_heads * m.head_dim * s.prefill_len ** 2 / 2  # causal
        rows.append({"backend": name, "decode_ms": decode * 1e3, "decode_kv_gb_per_s": kv_bytes / decode / 1e9,
                     "decode_fraction_of_copy": kv_bytes / decode / bandwidth,
                     "prefill_ms": prefill * 1e3, "prefill_tflops": flops / prefill / 1e12})
        del kc, vc
    return rows


#: The decode attention sweep: tile width x warps x pipelining stages of the Triton kernel.
TUNING = [(block_n, num_warps, num_stages) for block_n in (32, 64, 128) for num_warps in (4, 8)
          for num_stages in (2, 3, 4)]


def decode_tuning(s: Shapes, bandwidth: float) -> list[dict] | dict:
    """The decode attention shape of ``attention_rates`` through the Triton kernel at every launch
    configuration of ``TUNING`` (``triton_paged.LaunchConfig``), the split-KV choice as served: which
    tiles reach the 0.7 x copy bandwidth target. A configuration the GPU cannot launch (too much
    shared memory) records its error."""
    from refengine.kernels.attention import triton_paged

    if reason := triton_paged.unavailable_reason(s.dtype, s.device):
        return {"skipped": f"the Triton backend cannot run here: {reason}"}
    m = s.model
    meta, q, k, v, kc, vc = attention_inputs(s, s.decode_batch, 1, s.decode_context, triton_paged.TritonPagedBackend())
    kv_bytes = decode_kv_bytes(s)
    rows = []
    for block_n, num_warps, num_stages in TUNING:
        launch = triton_paged.LaunchConfig(block_n, num_warps, num_stages)
        backend = triton_paged.TritonPagedBackend(launch=launch)
        backend.prepare(meta)
        row: dict = {"block_n": block_n, "num_warps": num_warps, "num_stages": num_stages,
                     "num_splits": backend.num_splits}
        try:
            took = best_of(functools.partial(backend.forward, q, k, v, kc, vc, m.head_dim ** -0.5), s.device,
                           calls=KERNEL_CALLS)
        except Exception as error:  # noqa: BLE001 - recorded: a launch the device refuses (shared memory)
            row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        else:
            row.update(ms=took * 1e3, kv_gb_per_s=kv_bytes / took / 1e9, fraction_of_copy=kv_bytes / took / bandwidth)
        rows.append(row)
    return rows


def random_weights(m: ModelConfig, dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=dtype, device=device) * 0.02

    weights = {"model.embed_tokens.weight": w(m.vocab_size, m.hidden_size), "lm_head.weight": w(m.vocab_size,
                                                                                                m.hidden_size),
               "model.norm.weight": torch.ones(m.hidden_size, dtype=dtype, device=device)}
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    for i in range(m.num_hidden_layers):
        p = f"model.layers.{i}."
        weights |= {p + "self_attn.q_proj.weight": w(q, m.hidden_size),
                    p + "self_attn.k_proj.weight": w(kv, m.hidden_size),
                    p + "self_attn.v_proj.weight": w(kv, m.hidden_size),
                    p + "self_attn.o_proj.weight": w(m.hidden_size, q),
                    p + "mlp.gate_proj.weight": w(m.intermediate_size, m.hidden_size),
                    p + "mlp.up_proj.weight": w(m.intermediate_size, m.hidden_size),
                    p + "mlp.down_proj.weight": w(m.hidden_size, m.intermediate_size),
                    p + "input_layernorm.weight": torch.ones(m.hidden_size, dtype=dtype, device=device),
                    p + "post_attention_layernorm.weight": torch.ones(m.hidden_size, dtype=dtype, device=device)}
    return weights


def decode_steps(s: Shapes, bandwidth: float) -> list[dict]:
    m = s.model
    weights = random_weights(m, s.dtype, s.device)
    # A step reads every weight once, but of the embedding table only its batch's rows (unless it
    # is also the LM head); and each sequence's KV of every layer (found by review: the bound
    # counted the 1 GB table and no KV, 3.88 ms where 15.0 GB of weights and the KV are read).
    weight_bytes = sum(t.numel() * t.element_size() for name, t in weights.items()
                       if name != "model.embed_tokens.weight" or m.tie_word_embeddings)
    kv_bytes_per_token = 2 * m.num_hidden_layers * m.num_key_value_heads * m.head_dim * s.dtype.itemsize
    largest = max(s.e2e_batches)
    num_blocks = largest * (-(-(s.e2e_context + 2) // s.block_size)) + 8
    rows = []
    for graphs in ((True, False) if s.device == "cuda" else (False,)):
        kernels = KernelConfig(**({"cuda_graphs": graphs} if _has_graph_switch() else {}))
        backend, _ = registry.choose_backend("auto", s.dtype, s.device, kernels)  # what `serve` would run
        runner = ModelRunner(m, weights, CacheConfig(block_size=s.block_size, num_blocks=num_blocks),
                             s.e2e_context + 8, dtype=s.dtype, device=s.device, kernels=kernels,
                             attention=registry.make_attention_backend(backend, s.dtype, s.device, kernels),
                             max_num_seqs=largest)  # graphs up to the largest batch (the default is 64)
        kv = KvCacheManager(BlockPool(num_blocks, False), s.block_size)
        for batch in s.e2e_batches:
            seqs = []
            for b in range(batch):
                seq = Sequence(f"d{b}", 0, list(range(1, 1 + s.e2e_context)), s.e2e_context)
                kv.allocate(seq, s.e2e_context + 1)
                seq.num_computed_tokens = s.e2e_context - 1
                seqs.append(seq)
            sched = SchedulerOutput([ScheduledSequence.of(seq, 1) for seq in seqs])
            replays_before = runner.graphs.num_replays if runner.graphs is not None else 0
            step = best_of(functools.partial(_step, runner, sched, s.block_size, batch), s.device)
            build = best_of(functools.partial(build_model_input, sched, s.block_size, [1] * batch), "cpu")
            issue = host_time(functools.partial(_issue, runner, sched, s.block_size, batch), s.device)
            bound = weight_bytes / bandwidth
            floor = (weight_bytes + batch * s.e2e_context * kv_bytes_per_token) / bandwidth
            rows.append({"backend": backend, "cuda_graphs": graphs, "batch": batch, "step_ms": step * 1e3,
                         "input_build_ms": build * 1e3, "host_issue_ms": issue * 1e3,
                         "weight_read_bound_ms": bound * 1e3, "ratio": step / bound,
                         "weights_and_kv_bound_ms": floor * 1e3, "ratio_to_weights_and_kv": step / floor})
            if runner.graphs is not None:  # did the steps replay a graph, and if not, why not
                rows[-1]["graph_replays"] = runner.graphs.num_replays - replays_before
                rows[-1]["graph_ineligible"] = runner.graphs.ineligible_reason(
                    build_model_input(sched, s.block_size, [1] * batch))
            else:
                rows[-1]["graphs_unavailable"] = runner.graphs_unavailable
            if not graphs and batch in (min(s.e2e_batches), largest):
                rows[-1]["profile"] = _profile(functools.partial(_step, runner, sched, s.block_size, batch), s.device)
            for seq in seqs:
                kv.free(seq)
        del runner
        if not _has_graph_switch():
            break  # no switch to turn them off: one pass
    return rows


def _profile(step: Callable[[], None], device: str) -> str:
    """The top kernels of one eager step by device time (the host's ops on the CPU), as
    torch.profiler's table: where a step's time goes, for the next run's reader."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        step()
        sync(device)
    averages = profiler.key_averages()
    # torch names the device column self_device_time_total now, self_cuda_time_total before.
    for key in ("self_device_time_total", "self_cuda_time_total") if device == "cuda" else ("self_cpu_time_total",):
        try:
            return averages.table(sort_by=key, row_limit=15)
        except (AttributeError, KeyError, ValueError):
            continue
    return averages.table(row_limit=15)


def _step(runner: ModelRunner, sched: SchedulerOutput, block_size: int, batch: int) -> None:
    _issue(runner, sched, block_size, batch).argmax(dim=-1).tolist()  # greedy tokens to the host, as sampled


def _issue(runner: ModelRunner, sched: SchedulerOutput, block_size: int, batch: int) -> torch.Tensor:
    """A step's host side alone: its input built and its kernels issued, not waited for; its logits."""
    logits = runner.execute(build_model_input(sched, block_size, [1] * batch), logits_on_device=True)
    assert logits is not None
    return logits


def _has_graph_switch() -> bool:
    return "cuda_graphs" in KernelConfig.__dataclass_fields__


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (tests the script)")
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run, or on a GPU machine", file=sys.stderr)
        return 2
    s = shapes(args.dry_run)
    started = time.perf_counter()
    report: dict = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "dry_run": args.dry_run,
                    "device": torch.cuda.get_device_name() if s.device == "cuda" else "cpu",
                    "shapes": {k: str(v) for k, v in asdict(s).items() if k != "model"}}
    bandwidth = copy_bandwidth(s.device, (1 << 30) if s.device == "cuda" else (64 << 20))
    report["copy_bandwidth_gb_per_s"] = bandwidth / 1e9
    # GPU time is scarce: a section that fails records its error and the others still run, and the
    # JSON is rewritten after each section, so a run cut short still leaves what it measured.
    sections = {"kernel_tests": lambda: kernel_tests(args.dry_run), "attention": lambda: attention_rates(s, bandwidth),
                "decode_tuning": lambda: decode_tuning(s, bandwidth), "decode": lambda: decode_steps(s, bandwidth)}
    for name, section in sections.items():
        try:
            report[name] = section()
        except Exception:  # noqa: BLE001 - reported, not swallowed: see the JSON and the table
            report[name] = {"error": traceback.format_exc()[-3000:]}
            print(f"{name} failed:\n{report[name]['error']}", file=sys.stderr, flush=True)
        report["seconds"] = time.perf_counter() - started
        args.out.write_text(json.dumps(report, indent=2))
    tests = report["kernel_tests"]
    print(f"device {report['device']}, copy bandwidth {bandwidth / 1e9:.0f} GB/s, kernel tests: "
          f"{tests.get('summary', tests.get('skipped', 'failed to run'))}")
    print("| backend | decode attention ms | KV GB/s | × copy bandwidth | prefill ms | prefill TFLOP/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in report["attention"] if isinstance(report["attention"], list) else []:
        print(f"| {row['backend']} | {row['decode_ms']:.2f} | {row['decode_kv_gb_per_s']:.0f} | "
              f"{row['decode_fraction_of_copy']:.2f} | {row['prefill_ms']:.2f} | {row['prefill_tflops']:.1f} |")
    tuned = sorted((r for r in report["decode_tuning"] if "ms" in r) if isinstance(report["decode_tuning"], list)
                   else [], key=lambda r: r["ms"])
    if tuned:
        print("| Triton decode: block_n | num_warps | num_stages | splits | ms | KV GB/s | × copy bandwidth |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for row in tuned[:6]:
            print(f"| {row['block_n']} | {row['num_warps']} | {row['num_stages']} | {row['num_splits']} "
                  f"| {row['ms']:.3f} | {row['kv_gb_per_s']:.0f} | {row['fraction_of_copy']:.2f} |")
    print("| backend | CUDA graphs | batch | step ms | of it, input building ms | host issue ms "
          "| weight-read bound ms | ratio |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for row in report["decode"] if isinstance(report["decode"], list) else []:
        print(f"| {row['backend']} | {row['cuda_graphs']} | {row['batch']} | {row['step_ms']:.2f} "
              f"| {row['input_build_ms']:.2f} | {row['host_issue_ms']:.2f} | {row['weight_read_bound_ms']:.2f} "
              f"| {row['ratio']:.2f} |")
    for row in report["decode"] if isinstance(report["decode"], list) else []:
        if "profile" in row:
            print(f"\nOne eager step at batch {row['batch']}, by device time:\n{row['profile']}")
    print(f"({report['seconds']:.0f} s; JSON in {args.out})")
    failed = [name for name in sections if isinstance(report[name], dict) and "error" in report[name]]
    tests = report.get("kernel_tests")
    if isinstance(tests, dict) and tests.get("returncode", 0) != 0:  # failing kernel tests once exited 0
        failed.append("kernel_tests")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
