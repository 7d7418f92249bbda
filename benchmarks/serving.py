"""Online serving: ``refengine bench``'s load against ``refengine serve`` vs the same load in-process.

Starts ``refengine serve`` (the embedded default model, SmolLM2-135M-Instruct) on
loopback as a subprocess, then for each concurrency N (default 1, 16, 64) sends a
fixed-seed random workload with :mod:`refengine.bench` (random token-id prompts, lengths
uniform in [len*(1-R), len*(1+R)], EOS ignored, greedy; all requests arrive at once and
N are in flight: N closed-loop clients). Reports output tokens/s, time to first token
(TTFT) and inter-token latency (ITL) at p50/p99, as ``refengine bench`` computes them.

Then it stops the server and runs the identical requests, with the same engine flags
and the same runner (scheduling, recording, metrics), through an in-process ``Engine``
(``add_request`` + the background step loop): the ratio gRPC / in-process throughput is
the cost of the server edge (target >= 0.9). Prints a markdown table.

    python benchmarks/serving.py            # N = 1, 16, 64 (a few minutes on 2 cores)
    python benchmarks/serving.py --quick    # a smoke run: N = 1, 4, short outputs
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from refengine.bench import report, runner, target, workload  # noqa: E402
from refengine.client import OpenEngineClient  # noqa: E402
from refengine.protocol.addresses import announced_listeners  # noqa: E402

MODEL = "smollm2-135m-instruct"
#: (input_len, output_len, range_ratio): prompts 57-231 ids and outputs 32-128 tokens; quick: 33-63 and 8-16.
FULL, QUICK = (144, 80, 0.6), (48, 12, 0.3)


def start_server(engine_flags: list[str], threads: int) -> tuple[subprocess.Popen, str, Path]:
    """A ``refengine serve`` on a port it picks itself (``--port 0``), READY; no port chosen
    here beforehand, which another socket could take before the server binds it."""
    fd, name = tempfile.mkstemp(prefix="refengine-serving-bench-", suffix=".log", dir=os.environ.get("TMPDIR"))
    log = Path(name)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "refengine.cli", "serve", "--model", MODEL, "--host", "127.0.0.1",
           "--port", "0", "--log-level", "WARNING", *engine_flags]
    with os.fdopen(fd, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while not (announced := announced_listeners(log.read_text(errors="replace"))):
            _check_running(proc, log)
            if time.monotonic() > deadline:
                raise TimeoutError("refengine serve not listening after 600 s")
            time.sleep(0.05)
        address = announced["Inference"]
        with OpenEngineClient(address, timeout=2) as client:
            while time.monotonic() < deadline:
                _check_running(proc, log)
                try:
                    client.wait_until_ready(timeout=2)
                    return proc, address, log
                except TimeoutError:
                    pass
        raise TimeoutError("refengine serve not READY after 600 s")
    except BaseException:  # not READY, or Ctrl-C while it loads: no server left behind
        proc.kill()
        proc.wait()
        raise


def _check_running(proc: subprocess.Popen, log: Path) -> None:
    if proc.poll() is not None:
        raise RuntimeError(f"refengine serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")


def inprocess_sender(engine, prefix: str) -> runner.Sender:  # noqa: ANN001 - Engine
    """What ``runner.grpc_sender`` does, on the engine's own stream instead of the wire."""
    from refengine.types import GenerationRequest, SamplingParams, StoppingParams

    def send(request: workload.BenchRequest, record: runner.RequestRecord) -> None:
        stream = engine.add_request(GenerationRequest(
            request_id=f"{prefix}-{request.index}", prompt_token_ids=list(request.token_ids or ()),
            sampling=SamplingParams(temperature=0.0),
            stopping=StoppingParams(max_tokens=request.output_len, ignore_eos=True)))
        for out in stream:
            count = sum(len(d.tokens) for d in out.deltas)
            if count:
                record.tokens(count, runner.clock())
            if out.usage is not None:
                record.usage(out.usage.prompt_tokens, out.usage.completion_tokens)
            if out.error is not None:
                record.fail(out.error.code)
            record.finished = record.finished or out.finished

    return send


def measure(path: str, n: int, requests: list[workload.BenchRequest], send: runner.Sender) -> dict[str, Any]:
    """One level: all requests at once, ``n`` in flight; every request must complete in full."""
    result = runner.run(requests, [0.0] * len(requests), send, max_concurrency=n)
    summary = report.summarize(result, {"path": path, "max_concurrency": n, "num_prompts": len(requests)})
    expected = sum(r.output_len for r in requests)
    if summary["failed"] or summary["errors"] or summary["output_tokens"] != expected:
        raise RuntimeError(f"{path} N={n}: errors {summary['errors']}, {summary['output_tokens']} output tokens "
                           f"of {expected} expected")
    print(f"{path} N={n}: {summary['output_throughput']:.1f} tok/s", file=sys.stderr, flush=True)
    return summary


def load_engine(engine_flags: list[str], threads: int):  # noqa: ANN201 - Engine
    import torch

    from refengine.args import add_engine_args
    from refengine.args_config import engine_config_from_args
    from refengine.engine.engine import Engine

    torch.set_num_threads(threads)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    engine = Engine.from_config(engine_config_from_args(parser.parse_args(["--model", MODEL, *engine_flags])))
    engine.start()
    return engine


def table(results: list[dict[str, Any]]) -> str:
    inproc = {r["max_concurrency"]: r for r in results if r["path"] == "in-process"}
    rows = ["| N | path | requests | output tokens | out tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | "
            "ITL p99 ms | gRPC / in-process |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(results, key=lambda r: (r["max_concurrency"], r["path"])):
        n, ratio = r["max_concurrency"], ""
        if r["path"] == "gRPC" and n in inproc:
            ratio = f"{r['output_throughput'] / inproc[n]['output_throughput']:.2f}"
        rows.append(f"| {n} | {r['path']} | {r['completed']} | {r['output_tokens']} | {r['output_throughput']:.1f} | "
                    f"{r['median_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | {r['median_itl_ms']:.1f} | "
                    f"{r['p99_itl_ms']:.1f} | {ratio} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: N = 1, 4; short outputs")
    parser.add_argument("--concurrency", default=None, help="comma-separated N (default 1,16,64)")
    parser.add_argument("--requests-per-client", type=float, default=2.0,
                        help="workload size per level = max(8, N x this) (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the engine, in both paths (default: %(default)s)")
    parser.add_argument("--engine-flags", default="--max-num-seqs 64 --kv-memory-mib 2048",
                        help="refengine engine flags, used for the server and the in-process engine alike")
    args = parser.parse_args(argv)
    levels = [int(x) for x in (args.concurrency or ("1,4" if args.quick else "1,16,64")).split(",")]
    input_len, output_len, ratio = QUICK if args.quick else FULL
    engine_flags = args.engine_flags.split()
    results: list[dict[str, Any]] = []

    proc, address, _ = start_server(engine_flags, args.threads)
    try:
        with OpenEngineClient(address) as client:
            vocab = target.discover(client, MODEL).vocab_size
            sizes = {n: max(4 if args.quick else 8, round(n * args.requests_per_client)) for n in levels}
            workloads = {n: workload.random_requests(sizes[n], input_len, output_len, ratio, args.seed + n, vocab)
                         for n in levels}
            warmup = workload.random_requests(2, 16, 4, 0.0, 12345, vocab)
            warm = workload.RequestOptions(MODEL, ignore_eos=True)
            measure("warmup-gRPC", 2, warmup, runner.GrpcSender(client, warm))
            for n in levels:  # a fresh request-id prefix per level (RequestOptions draws one)
                options = workload.RequestOptions(MODEL, ignore_eos=True)
                results.append(measure("gRPC", n, workloads[n], runner.GrpcSender(client, options)))
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    engine = load_engine(engine_flags, args.threads)
    try:
        measure("warmup-in-process", 2, warmup, inprocess_sender(engine, "warmup"))
        for n in levels:
            results.append(measure("in-process", n, workloads[n], inprocess_sender(engine, f"inproc-{n}")))
    finally:
        engine.shutdown()

    print(f"SmolLM2-135M-Instruct, {'quick' if args.quick else 'full'} workload (seed {args.seed}): random token-id "
          f"prompts, input_len {input_len}, output_len {output_len}, range_ratio {ratio}, greedy, ignore_eos; engine "
          f"flags `{args.engine_flags}`, torch threads {args.threads}, {os.cpu_count()} CPUs\n")
    print(table(results))
    grpc_rates = [r["output_throughput"] for r in results if r["path"] == "gRPC"]
    base = [r["output_throughput"] for r in results if r["path"] == "in-process"]
    print(f"\ngRPC / in-process throughput: min {min(a / b for a, b in zip(grpc_rates, base, strict=True)):.2f} "
          "(target >= 0.9)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
