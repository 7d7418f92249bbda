"""What a slow reader costs the server: its memory while a stream's outputs wait for the client.

Starts ``refengine serve`` (``serving.start_server``), then sends one long request with ``all``
logprob candidates (each output about 9 MiB of Python objects on SmolLM2's 49,152 tokens), three
ways, one after the other, each on its own connection:

- ``reads``: a client that reads as fast as it can (the baseline: what the stream itself needs);
- ``stalls``: a client that reads one event, then nothing for ``--watch`` seconds;
- ``stalls, no byte bound``: the same against a server with ``--stream-buffer-mib`` at its
  largest, so that only ``--stream-buffer`` (64 outputs) and the stall timeout bound it (how the
  server was before the byte bound: 2026-12-07).

For each: the server's peak resident memory above its idle value (``/proc/<pid>/status``
sampled every 0.1 s), how the stream ended and after how long. Prints a markdown table.

    python benchmarks/slow_reader.py [--tokens 200] [--watch 20]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.serving import start_server  # noqa: E402
from refengine.client import OpenEngineClient  # noqa: E402
from refengine.protocol import oe  # noqa: E402

UNBOUNDED_MIB = 2047  # --stream-buffer-mib's largest value


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return int(status.read().split("VmRSS:")[1].split()[0]) / 1024


class PeakWatch:
    """The largest RSS of ``pid`` seen while it runs (a sampling thread)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, rss_mib(pid), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.1):
            self.peak = max(self.peak, rss_mib(self.pid))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak


def request(request_id: str, tokens: int) -> oe.GenerateRequest:
    req = oe.GenerateRequest(request_id=request_id, prompt="Once upon a time")
    req.stopping.max_tokens, req.stopping.ignore_eos = tokens, True
    req.sampling.temperature = 0.0
    req.response.return_output_logprobs = True
    req.response.output_candidates.all.SetInParent()
    return req


def one_stream(address: str, pid: int, req: oe.GenerateRequest, stall_seconds: float) -> dict:
    """Run ``req``; with ``stall_seconds``, read one event, then nothing that long, then the rest."""
    base = rss_mib(pid)
    watch = PeakWatch(pid)
    started = time.monotonic()
    with OpenEngineClient(address, channel_options=[("grpc.use_local_subchannel_pool", 1)]) as client:
        events = client.generate(req, timeout=600)
        count, last = 1, next(events)
        if stall_seconds:
            time.sleep(stall_seconds)
        for event in events:
            count, last = count + 1, event
    seconds = time.monotonic() - started
    ended = "finished" if last.WhichOneof("event") == "finished" else oe.ErrorCode.Name(last.error.code)
    if last.WhichOneof("event") == "error":  # when the server ended it: its stall timeout or the byte bound
        ended += " (" + ("the byte bound" if "slower than the engine" in last.error.message else "stall timeout") + ")"
    return {"peak": watch.stop() - base, "events": count, "ended": ended, "seconds": seconds}


def run(flags: list[str], tokens: int, stall_seconds: float, label: str) -> dict:
    proc, address, _ = start_server(["--max-model-len", "1024", *flags], threads=1)
    try:
        one_stream(address, proc.pid, request("warm", 4), 0)  # first use: token texts, allocator
        return {"label": label, **one_stream(address, proc.pid, request(label, tokens), stall_seconds)}
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--watch", type=float, default=20.0, help="how long the stalling client reads nothing")
    args = parser.parse_args()
    rows = [run([], args.tokens, 0, "reads"),
            run([], args.tokens, args.watch, "stalls"),
            run(["--stream-buffer-mib", str(UNBOUNDED_MIB)], args.tokens, args.watch, "stalls, no byte bound")]
    print(f"\n{args.tokens} tokens with all candidates; the stalling client reads nothing for {args.watch:g} s "
          "(the server's stall timeout: 30 s)\n")
    print("| client | server peak RSS above idle, MiB | events received | ended by | seconds |")
    print("|---|---:|---:|---|---:|")
    for row in rows:
        print(f"| {row['label']} | {row['peak']:.0f} | {row['events']} | {row['ended']} | {row['seconds']:.1f} |")


if __name__ == "__main__":
    main()
