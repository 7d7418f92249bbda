"""Online serving: N concurrent streaming gRPC clients vs the same workload in-process.

Starts ``refengine serve`` (the embedded default model, SmolLM2-135M-Instruct) on
loopback as a subprocess, then for each concurrency N (default 1, 16, 64) runs N
client threads that each send Generate requests one after another from a shared,
fixed-seed workload (prompt lengths uniform in 32-256 token ids, outputs uniform in
32-128 tokens, EOS ignored, greedy) and read the streams. Reports output tokens/s,
time to first token (TTFT) and inter-token latency (ITL) at p50/p99.

Then it stops the server and runs the identical workload, with the same engine flags
and the same client pattern, through an in-process ``Engine`` (``add_request`` +
the background step loop): the ratio gRPC / in-process throughput is the cost of the
server edge (target >= 0.9). Prints a markdown table.

    python benchmarks/serving.py            # N = 1, 16, 64 (a few minutes on 2 cores)
    python benchmarks/serving.py --quick    # a smoke run: N = 1, 4, short outputs
"""

from __future__ import annotations

import argparse
import os
import queue
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import grpc  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from refengine.protocol import oe  # noqa: E402

MODEL = "smollm2-135m-instruct"
VOCAB_LOW, VOCAB_HIGH = 100, 32000  # prompt ids drawn from here (inside every Llama-family vocabulary)


@dataclass(frozen=True)
class Item:
    prompt: list[int]
    max_tokens: int


@dataclass
class Trace:
    """One request as its client saw it: send time, then the arrival time of each token."""

    sent: float
    token_times: list[float] = field(default_factory=list)


@dataclass
class LevelResult:
    path: str
    concurrency: int
    requests: int
    tokens: int
    seconds: float
    ttft: list[float]
    itl: list[float]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def make_workload(n: int, seed: int, prompt_range: tuple[int, int], output_range: tuple[int, int]) -> list[Item]:
    rng = random.Random(seed)
    return [Item([rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randint(*prompt_range))],
                 rng.randint(*output_range)) for _ in range(n)]


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))]


def run_clients(workload: list[Item], concurrency: int, send: Callable[[str, Item, Trace], None],
                path: str) -> LevelResult:
    """``concurrency`` threads drain the workload; ``send`` streams one request into a Trace."""
    todo: queue.Queue[tuple[int, Item]] = queue.Queue()
    for i, item in enumerate(workload):
        todo.put((i, item))
    traces: list[Trace] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def client() -> None:
        while True:
            try:
                i, item = todo.get_nowait()
            except queue.Empty:
                return
            trace = Trace(sent=time.perf_counter())
            try:
                send(f"{path}-{concurrency}-{i}", item, trace)
            except BaseException as exc:  # noqa: BLE001 - reported after the run
                errors.append(exc)
            with lock:
                traces.append(trace)

    start = time.perf_counter()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} {path} request(s) failed, first: {errors[0]!r}")
    ttft = [tr.token_times[0] - tr.sent for tr in traces if tr.token_times]
    itl = [b - a for tr in traces for a, b in zip(tr.token_times, tr.token_times[1:], strict=False)]
    tokens = sum(len(tr.token_times) for tr in traces)
    expected = sum(item.max_tokens for item in workload)
    if tokens != expected:
        raise RuntimeError(f"{path}: {tokens} output tokens received, {expected} expected")
    return LevelResult(path, concurrency, len(workload), tokens, seconds, ttft, itl)


def _stamp(trace: Trace, count: int) -> None:
    now = time.perf_counter()
    trace.token_times.extend([now] * count)  # tokens of one event arrive together


# -- gRPC ---------------------------------------------------------------------------------
def start_server(engine_flags: list[str], threads: int) -> tuple[subprocess.Popen, str, Path]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"refengine-serving-bench-{port}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "refengine.cli", "serve", "--model", MODEL, "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "WARNING", *engine_flags]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    channel = grpc.insecure_channel(address)
    stub = oe.ControlStub(channel)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"refengine serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if stub.Health(oe.HealthRequest(), timeout=2).state == oe.HEALTH_STATE_READY:
                channel.close()
                return proc, address, log
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError("refengine serve not READY after 600 s")


def grpc_sender(channel: grpc.Channel) -> Callable[[str, Item, Trace], None]:
    stub = oe.InferenceStub(channel)

    def send(request_id: str, item: Item, trace: Trace) -> None:
        req = oe.GenerateRequest(request_id=request_id, token_ids=oe.TokenIds(ids=item.prompt))
        req.sampling.temperature = 0.0
        req.stopping.max_tokens = item.max_tokens
        req.stopping.ignore_eos = True
        for event in stub.Generate(req, timeout=1800):
            if event.WhichOneof("event") == "token" and event.token.tokens:
                _stamp(trace, len(event.token.tokens))
            elif event.WhichOneof("event") == "error":
                raise RuntimeError(f"EngineError: {event.error.message}")

    return send


# -- in-process -------------------------------------------------------------------------
def inprocess_sender(engine) -> Callable[[str, Item, Trace], None]:  # noqa: ANN001 - Engine
    from refengine.types import GenerationRequest, SamplingParams, StoppingParams

    def send(request_id: str, item: Item, trace: Trace) -> None:
        stream = engine.add_request(GenerationRequest(
            request_id=request_id, prompt_token_ids=list(item.prompt), sampling=SamplingParams(temperature=0.0),
            stopping=StoppingParams(max_tokens=item.max_tokens, ignore_eos=True)))
        for out in stream:
            count = sum(len(d.tokens) for d in out.deltas)
            if count:
                _stamp(trace, count)
            if out.error is not None:
                raise RuntimeError(f"engine fault: {out.error.message}")

    return send


def load_engine(engine_flags: list[str], threads: int):  # noqa: ANN201 - Engine
    import torch

    from refengine.args import add_engine_args, engine_config_from_args
    from refengine.engine.engine import Engine

    torch.set_num_threads(threads)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    engine = Engine.from_config(engine_config_from_args(parser.parse_args(["--model", MODEL, *engine_flags])))
    engine.start()
    return engine


# -- report -------------------------------------------------------------------------------
def table(results: list[LevelResult]) -> str:
    inproc = {r.concurrency: r for r in results if r.path == "in-process"}
    rows = ["| N | path | requests | output tokens | out tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | "
            "ITL p99 ms | gRPC / in-process |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(results, key=lambda r: (r.concurrency, r.path)):
        ratio = ""
        if r.path == "gRPC" and r.concurrency in inproc:
            ratio = f"{r.tokens_per_s / inproc[r.concurrency].tokens_per_s:.2f}"
        rows.append(f"| {r.concurrency} | {r.path} | {r.requests} | {r.tokens} | {r.tokens_per_s:.1f} | "
                    f"{1000 * percentile(r.ttft, 50):.0f} | {1000 * percentile(r.ttft, 99):.0f} | "
                    f"{1000 * percentile(r.itl, 50):.1f} | {1000 * percentile(r.itl, 99):.1f} | {ratio} |")
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
    prompt_range, output_range = ((32, 64), (8, 16)) if args.quick else ((32, 256), (32, 128))
    engine_flags = args.engine_flags.split()
    workloads = {n: make_workload(max(8 if not args.quick else 4, round(n * args.requests_per_client)),
                                  args.seed + n, prompt_range, output_range) for n in levels}
    warmup = make_workload(2, 12345, (16, 16), (4, 4))
    results: list[LevelResult] = []

    proc, address, log = start_server(engine_flags, args.threads)
    try:
        channel = grpc.insecure_channel(address)
        send = grpc_sender(channel)
        run_clients(warmup, 2, send, "warmup-grpc")
        for n in levels:
            results.append(run_clients(workloads[n], n, send, "gRPC"))
            print(f"gRPC N={n}: {results[-1].tokens_per_s:.1f} tok/s", file=sys.stderr, flush=True)
        channel.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    engine = load_engine(engine_flags, args.threads)
    try:
        send = inprocess_sender(engine)
        run_clients(warmup, 2, send, "warmup-inproc")
        for n in levels:
            results.append(run_clients(workloads[n], n, send, "in-process"))
            print(f"in-process N={n}: {results[-1].tokens_per_s:.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        engine.shutdown()

    print(f"SmolLM2-135M-Instruct, {'quick' if args.quick else 'full'} workload (seed {args.seed}): prompts "
          f"{prompt_range[0]}-{prompt_range[1]} ids, outputs {output_range[0]}-{output_range[1]} tokens, greedy, "
          f"ignore_eos; engine flags `{args.engine_flags}`, torch threads {args.threads}, {os.cpu_count()} CPUs\n")
    print(table(results))
    ratios = [r.tokens_per_s for r in results if r.path == "gRPC"]
    base = [r.tokens_per_s for r in results if r.path == "in-process"]
    if ratios and base:
        print(f"\ngRPC / in-process throughput: min {min(a / b for a, b in zip(ratios, base, strict=True)):.2f} "
              "(target >= 0.9)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
