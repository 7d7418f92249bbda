"""KV events: what publishing costs the step loop, and how fast one subscriber drains.

1. Step-time overhead: the engine half of ``throughput.py``'s workload (same requests,
   same engine config) with KV events off (``KvEventsConfig(enabled=False)``: the pool
   records nothing) against on with 0, 1 and 8 in-process subscribers, each draining on a
   thread of its own (woken by ``on_ready``). Rounds are interleaved (off, 0, 1, 8, off, …)
   and the best run of each is compared (target: ≤ 2 % slower than off). Also the time the
   step thread spends handing batches to the hub (publish, all subscribers' pushes).
2. Drain rate: a synthetic burst of batches of 16 ``BlockStored`` each through
   ``KvEventHub.publish`` with one subscriber taking on a thread, and the same batches
   over gRPC through the real ``SubscribeKvEvents`` handler (``kv_events_service``) on a
   loopback server: live (published while the client reads) and as a replay.

    python benchmarks/kv_events.py            # full (~10 min on 2 cores)
    python benchmarks/kv_events.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from types import SimpleNamespace

import grpc
import torch
from throughput import make_workload

from refengine.config import CacheConfig, EngineConfig, KvEventsConfig, SchedulerConfig
from refengine.engine.engine import Engine
from refengine.engine.kv_events import KvEventHub, KvEventSubscription
from refengine.model.loader import load_model_config, load_tokenizer, load_weights, model_fingerprint, resolve_model
from refengine.protocol import oe
from refengine.server import kv_events_service
from refengine.server.options import ServerOptions
from refengine.server.state import ServerState
from refengine.types import BlockStored, GenerationRequest, KvEvent, SamplingParams, StoppingParams

CONFIGS = ("off", "0 subscribers", "1 subscriber", "8 subscribers")


# -- 1. step-time overhead --------------------------------------------------------------
class Drainer:
    """An in-process subscriber taking whatever is ready on a thread of its own."""

    def __init__(self, engine: Engine) -> None:
        self.ready, self.done = threading.Event(), threading.Event()
        self.sub: KvEventSubscription = engine.subscribe_kv_events(self.ready.set)
        self.batches = self.events = 0
        self.failure: str | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            self.ready.wait()  # no timeout: a thread that wakes only for batches
            self.ready.clear()
            self._take()

    def _take(self) -> None:
        batches, failure = self.sub.take()
        self.batches += len(batches)
        self.events += sum(len(b.events) for b in batches)
        self.failure = self.failure or failure

    def stop(self) -> None:
        self.done.set()
        self.ready.set()
        self.thread.join()
        self._take()


@dataclass
class EngineRun:
    seconds: float
    cpu_seconds: float  # the whole process (step thread, torch workers, subscriber threads)
    tokens: int
    steps: int
    publish_seconds: float
    batches: int
    events: int


def build_engine(parts: tuple, enabled: bool) -> Engine:
    """``throughput.run_engine``'s engine, with KV events on or off."""
    config, weights, tokenizer, fingerprint = parts
    return Engine(EngineConfig(cache=CacheConfig(num_blocks=4096), max_sequences_per_request=16,
                               scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64),
                               kv_events=KvEventsConfig(enabled=enabled)),
                  config, weights, tokenizer, model_fingerprint=fingerprint)


def timed_sink(engine: Engine, spent: list[float]) -> None:
    """Wrap the step thread's KV event sink (the hub's publish) to add its time to ``spent``."""
    sink = engine.core.kv_event_sink
    if sink is None:
        return

    def timed(events: list[KvEvent]) -> None:
        t0 = time.perf_counter()
        sink(events)
        spent[0] += time.perf_counter() - t0

    engine.core.kv_event_sink = timed


def run_engine(parts: tuple, workload: list, config: str) -> EngineRun:
    engine = build_engine(parts, enabled=config != "off")
    drainers = [Drainer(engine) for _ in range({"1 subscriber": 1, "8 subscribers": 8}.get(config, 0))]
    spent = [0.0]
    timed_sink(engine, spent)
    requests = [GenerationRequest(request_id=f"r{i}", prompt_token_ids=ids, sampling=SamplingParams(temperature=0.0),
                                  stopping=StoppingParams(max_tokens=out_len, ignore_eos=True))
                for i, (ids, out_len) in enumerate(workload)]
    steps = 0
    streams = [engine.add_request(r) for r in requests]
    start, cpu_start = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests:
        engine.step()
        steps += 1
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    for d in drainers:
        d.stop()
        assert d.failure is None and d.batches == engine.kv_events.last_sequence_number, (d.failure, d.batches)
    tokens = sum(len(s.result().outputs[0].tokens) for s in streams)
    events = drainers[0].events if drainers else 0
    return EngineRun(elapsed, cpu, tokens, steps, spent[0], engine.kv_events.last_sequence_number, events)


def step_overhead(parts: tuple, workload: list, rounds: int) -> dict[str, list[EngineRun]]:
    runs: dict[str, list[EngineRun]] = {c: [] for c in CONFIGS}
    for r in range(rounds):
        for config in CONFIGS:
            run = run_engine(parts, workload, config)
            runs[config].append(run)
            print(f"  round {r + 1}, {config}: {run.seconds:.2f} s (CPU {run.cpu_seconds:.2f} s), {run.steps} steps, "
                  f"{run.batches} batches, "
                  f"publish {run.publish_seconds * 1e3:.1f} ms", flush=True)
    return runs


def print_overhead(runs: dict[str, list[EngineRun]]) -> None:
    base = min(r.seconds for r in runs["off"])
    cpu_base = min(r.cpu_seconds for r in runs["off"])
    print("\n| KV events | best wall s | mean wall s | best wall / off | best CPU s | best CPU / off | "
          "step-thread publish ms (per step µs, share of wall) | batches | events drained per subscriber |"
          "\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for config, rs in runs.items():
        best = min(rs, key=lambda r: r.seconds)
        mean = sum(r.seconds for r in rs) / len(rs)
        cpu = min(r.cpu_seconds for r in rs)
        publish = sum(r.publish_seconds for r in rs) / len(rs)
        per_step, share = publish / best.steps * 1e6, publish / mean
        print(f"| {config} | {best.seconds:.2f} | {mean:.2f} | {best.seconds / base:.3f} | {cpu:.2f} | "
              f"{cpu / cpu_base:.3f} | {publish * 1e3:.1f} ({per_step:.0f} µs, {share:.3%}) | {best.batches} | "
              f"{best.events} |")


# -- 2. drain rate ----------------------------------------------------------------------
def synthetic_batches(num_batches: int, per_batch: int) -> list[list[KvEvent]]:
    """Batches of ``per_batch`` chained BlockStored events (16 tokens, one 64-hex extra key)."""
    out, n = [], 0
    for _ in range(num_batches):
        events: list[KvEvent] = []
        for _ in range(per_batch):
            key = n.to_bytes(32, "little")
            parent = (n - 1).to_bytes(32, "little") if n % per_batch else None
            events.append(BlockStored(key, parent, tuple(range(n, n + 16)), 16, ("f" * 64,)))
            n += 1
        out.append(events)
    return out


def hub_rates(batches: list[list[KvEvent]]) -> tuple[float, float]:
    """(events/s published with no subscriber, events/s one thread subscriber drained)."""
    total = sum(len(b) for b in batches)
    hub = KvEventHub(retained_batches=len(batches), subscriber_buffer=len(batches))
    t0 = time.perf_counter()
    for events in batches:
        hub.publish(events)
    publish_only = total / (time.perf_counter() - t0)
    hub = KvEventHub(retained_batches=len(batches), subscriber_buffer=len(batches))
    ready, got = threading.Event(), [0]

    def drain(sub: KvEventSubscription) -> None:
        while got[0] < total:
            ready.wait()
            ready.clear()
            taken, failure = sub.take()
            assert failure is None, failure
            got[0] += sum(len(b.events) for b in taken)

    sub = hub.subscribe(ready.set)
    thread = threading.Thread(target=drain, args=(sub,))
    t0 = time.perf_counter()
    thread.start()
    for events in batches:
        hub.publish(events)
    thread.join()
    return publish_only, total / (time.perf_counter() - t0)


class _HubEngine:
    """What ``kv_events_service.subscribe`` needs of an engine: ``info.device`` and ``subscribe_kv_events``."""

    def __init__(self, hub: KvEventHub) -> None:
        self.hub = hub
        self.info = SimpleNamespace(device="cpu")

    def subscribe_kv_events(self, on_ready: Callable[[], None], include_snapshot: bool = False,
                            start_sequence_number: int = 0) -> KvEventSubscription:
        return self.hub.subscribe(on_ready, [] if include_snapshot else None, start_sequence_number)


class _Control(oe.ControlServicer):
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def SubscribeKvEvents(self, request, context):  # noqa: ANN001, ANN201, N802
        await kv_events_service.subscribe(self.state, request, context)


def serve_hub(hub: KvEventHub) -> tuple[str, Callable[[], None]]:
    """A loopback grpc.aio server running the real SubscribeKvEvents handler over ``hub``."""
    state = ServerState(ServerOptions(), EngineConfig())
    state.engine = _HubEngine(hub)
    loop = asyncio.new_event_loop()

    async def start() -> tuple[grpc.aio.Server, str]:
        server = grpc.aio.server(futures.ThreadPoolExecutor(max_workers=4))
        oe.add_ControlServicer_to_server(_Control(state), server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        return server, address

    server, address = loop.run_until_complete(start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def stop() -> None:
        try:
            asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(timeout=5)
        except TimeoutError:
            print("  (the benchmark server did not stop within 5 s; left to the process exit)")
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)

    return address, stop


def grpc_rate(batches: list[list[KvEvent]], replay: bool) -> float:
    """Events/s one gRPC subscriber receives: published while it reads, or replayed from 1."""
    total = sum(len(b) for b in batches)
    hub = KvEventHub(retained_batches=len(batches), subscriber_buffer=len(batches) + 1)
    address, stop = serve_hub(hub)
    if replay:
        for events in batches:
            hub.publish(events)
    channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", -1)])
    stub = oe.ControlStub(channel)
    request = oe.SubscribeKvEventsRequest(start_sequence_number=1 if replay else 0, include_snapshot=not replay)
    call = stub.SubscribeKvEvents(request, timeout=600)
    got, t0 = 0, time.perf_counter()
    for response in call:
        if response.WhichOneof("event") != "batch":
            raise RuntimeError(f"subscriber failed: {response.error}")
        got += len(response.batch.events)
        if not replay and response.batch.sequence_number == 0:  # the (empty) snapshot: live from here
            t0 = time.perf_counter()
            threading.Thread(target=lambda: [hub.publish(e) for e in batches], daemon=True).start()
        if got == total:
            break
    elapsed = time.perf_counter() - t0
    call.cancel()
    channel.close()
    stop()
    return total / elapsed


def print_drain(num_batches: int, per_batch: int) -> None:
    batches = synthetic_batches(num_batches, per_batch)
    total = num_batches * per_batch
    publish_only, hub_drain = hub_rates(batches)
    live, replay = grpc_rate(batches, replay=False), grpc_rate(batches, replay=True)
    print(f"\nDrain rate: {num_batches} batches x {per_batch} BlockStored = {total} events\n"
          "\n| path | events/s | batches/s |\n|---|---:|---:|")
    for name, rate in (("KvEventHub.publish, no subscriber", publish_only),
                       ("KvEventHub, 1 subscriber thread draining", hub_drain),
                       ("gRPC SubscribeKvEvents, live (loopback)", live),
                       ("gRPC SubscribeKvEvents, replay from 1 (loopback)", replay)):
        print(f"| {name} | {rate:,.0f} | {rate / per_batch:,.0f} |")


def load_parts() -> tuple:
    """The model as ``throughput.py`` loads it: config, weights, tokenizer, fingerprint."""
    resolved = resolve_model("smollm2-135m-instruct")
    return (load_model_config(resolved.path), load_weights(resolved.path), load_tokenizer(resolved.path),
            model_fingerprint(resolved.path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 short requests, one round, a small burst")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-engine", action="store_true", help="drain rates only")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    if not args.skip_engine:
        parts = load_parts()
        if args.quick:
            workload, rounds = make_workload(8, args.seed, parts[0].vocab_size, 64, 32), 1
        else:
            workload, rounds = make_workload(64, args.seed, parts[0].vocab_size, 512, 256), args.rounds
        print(f"torch threads: {torch.get_num_threads()}, requests: {len(workload)}, "
              f"output tokens: {sum(o for _, o in workload)}, rounds: {rounds}")
        print_overhead(step_overhead(parts, workload, rounds))
    print_drain(*((200, 16) if args.quick else (5000, 16)))


if __name__ == "__main__":
    main()
