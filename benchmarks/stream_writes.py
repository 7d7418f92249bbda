"""Server CPU per streamed event: ``WriteWatch.send`` (the Generate handler's write) vs a bare
``context.write``, the floor.

A grpc.aio server on loopback streams small events to a client in a subprocess, which reads
as fast as it can; each form streams ``--events`` events, ``--rounds`` times, alternating. It
prints the server process's CPU time per event (all its threads: the write path's event-loop
work and gRPC's) for each form, the median over the rounds, and the ratio to the floor.

    python benchmarks/stream_writes.py              # 20,000 events x 6 rounds (about a minute)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from refengine.server.stream_bridge import OutputBridge  # noqa: E402
from refengine.server.write_watch import WriteWatch  # noqa: E402

EVENT = b"x" * 40  # about a one-token GenerateResponse
FORMS = ("bare", "watched")

CLIENT = """
import sys, grpc
channel = grpc.insecure_channel(sys.argv[1])
read = channel.unary_stream("/bench/stream", request_serializer=lambda b: b, response_deserializer=lambda b: b)
for form in sys.argv[2:]:
    for _ in read(form.encode()):
        pass
"""


def _handler(events: int, cpu_per_event: dict[str, list[float]]):  # noqa: ANN202 - a gRPC method handler
    async def stream(request: bytes, context: grpc.aio.ServicerContext) -> None:
        form = request.decode()
        bridge = OutputBridge(asyncio.get_running_loop(), "bench", 16, 30.0, lambda bridge: None)
        watch = WriteWatch(context, bridge, asyncio.current_task())
        started = time.process_time()
        try:
            for _ in range(events):
                if form == "bare":
                    await context.write(EVENT)
                else:
                    await watch.send(EVENT)
        finally:
            watch.close()
        cpu_per_event[form].append((time.process_time() - started) / events * 1e6)

    return grpc.unary_stream_rpc_method_handler(stream, lambda b: b, lambda b: b)


async def run(events: int, rounds: int) -> dict[str, list[float]]:
    cpu_per_event: dict[str, list[float]] = {form: [] for form in FORMS}
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "bench", {"stream": _handler(events, cpu_per_event)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = await asyncio.create_subprocess_exec(sys.executable, "-c", CLIENT, f"127.0.0.1:{port}",
                                                  *(FORMS * rounds))
    await client.wait()
    await server.stop(0)
    return cpu_per_event


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    cpu_per_event = asyncio.run(run(args.events, args.rounds))
    floor = statistics.median(cpu_per_event["bare"])
    print("| form | server CPU per event, median (us) | rounds (us) | vs bare |")
    print("|---|---:|---|---:|")
    for form in FORMS:
        median = statistics.median(cpu_per_event[form])
        rounds = ", ".join(f"{value:.0f}" for value in sorted(cpu_per_event[form]))
        print(f"| {form} | {median:.1f} | {rounds} | {median / floor:.2f}x |")


if __name__ == "__main__":
    main()
