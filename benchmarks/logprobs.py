"""Output logprobs over gRPC: what each candidate mode costs per token.

One ``refengine serve`` (the embedded default, SmolLM2-135M-Instruct: 49,152 vocabulary
entries; fp32, CPU, 1 torch thread) on loopback. One stream at a time, greedy, ``ignore_eos``,
``--tokens`` output tokens (default 48), in each of these modes, interleaved over ``--rounds``
rounds (the median round is reported):

- **none**: no logprobs (the baseline of the ratios);
- **logprob**: the sampled token's logprob and rank;
- **top 5**, **top 20**: that many candidates per token;
- **all**: the whole vocabulary per token (49,152 ``LogProb`` entries, ~1.3 MB an event).

Reports the time per event after the first (what a streaming client waits between tokens:
the step, the engine's candidate records, the server's messages, the transport and this
client's parsing, together), its ratio to **none** measured in the same run, and the
bytes per event.

    python benchmarks/logprobs.py            # ~2 min on 2 cores
    python benchmarks/logprobs.py --quick    # 1 round of 12 tokens: a smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from benchmarks.serving import start_server  # noqa: E402
from refengine.protocol import oe  # noqa: E402

MODES = ("none", "logprob", "top 5", "top 20", "all")


def request(mode: str, tokens: int, tag: str) -> Any:
    req = oe.GenerateRequest(request_id=tag, prompt="Write a short story about a lighthouse keeper.")
    req.sampling.temperature = 0.0
    req.stopping.max_tokens = tokens
    req.stopping.ignore_eos = True
    if mode != "none":
        req.response.return_output_logprobs = True
    if mode.startswith("top"):
        req.response.output_candidates.top_n = int(mode.split()[1])
    elif mode == "all":
        req.response.output_candidates.all.SetInParent()
    return req


def one_stream(stub: Any, req: Any) -> tuple[float, float]:
    """(seconds per token event after the first, bytes per token event) of one whole stream. Only
    token events are timed: the ``finished`` event follows the last token at once, and counting it
    took 1/N off the time between tokens."""
    times, sizes = [], []
    for event in stub.Generate(req, timeout=600):
        if event.WhichOneof("event") == "token":
            times.append(time.perf_counter())
            sizes.append(event.ByteSize())
    return (times[-1] - times[0]) / (len(times) - 1), statistics.fmean(sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    tokens, rounds = (12, 1) if args.quick else (args.tokens, args.rounds)
    proc, address, _ = start_server(["--max-model-len", "1024"], threads=1)  # serving.py's: no server left behind
    try:
        channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", -1)])
        stub = oe.InferenceStub(channel)
        one_stream(stub, request("all", 4, "warm"))  # first use: token texts, allocator
        per_event: dict[str, list[float]] = {m: [] for m in MODES}
        size: dict[str, float] = {}
        for r in range(rounds):
            for mode in MODES:
                seconds, size[mode] = one_stream(stub, request(mode, tokens, f"{mode}-{r}"))
                per_event[mode].append(seconds)
        channel.close()
    finally:
        proc.terminate()
        proc.wait(60)
    base = statistics.median(per_event["none"])
    print(f"{tokens} tokens a stream, median of {rounds} rounds\n")
    print("| mode | ms / event | × none | bytes / event |")
    print("|---|---:|---:|---:|")
    for mode in MODES:
        ms = statistics.median(per_event[mode])
        print(f"| {mode} | {ms * 1e3:.1f} | {ms / base:.2f} | {size[mode]:,.0f} |")


if __name__ == "__main__":
    main()
