"""Disaggregated prefill/decode: KV transfer rate per backend and time to first token.

Four ``refengine serve`` processes on loopback (the embedded SmolLM2-135M, float32 KV of
720 KiB per 16-token block): aggregated, prefill offering ``grpc``, prefill offering
``nixl``, decode. For prompt lengths 128 / 512 / 2048 tokens (random token ids, a new
prompt each round so no prefix-cache hit):

- transfer MB/s of each backend: the decode server's ``LoadInfo.attributes``
  ``kv_pulled_bytes`` / ``kv_pull_seconds`` over the round's pulls (time inside the
  backend's ``pull``: fetch, checks, write into the blocks, release);
- raw NIXL READ bandwidth between two processes for the same byte count, measured in the
  same run (``benchmarks/nixl_raw.py``), cache-hot (the same buffer read again and again)
  and cold (a different slice each time, like KV blocks written a while before), and the
  nixl backend's share of each (target ≥ 50 %);
- time to first token: aggregated (the first TokenOutput of a ``max_tokens`` 1 request)
  against prefill → decode (``PrefillReady`` plus the decode server's first TokenOutput).

Best of ``--rounds`` per cell (this machine's timings vary ±15 % between runs).

    python benchmarks/disagg.py [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.nixl_raw import raw_loopback_mb_per_s  # noqa: E402
from benchmarks.serving import start_server  # noqa: E402
from refengine.client import OpenEngineClient, prefill  # noqa: E402
from refengine.protocol import oe  # noqa: E402

LENGTHS = (128, 512, 2048)
SERVER_FLAGS = ["--max-model-len", "2304", "--num-kv-blocks", "400"]


def request(rid: str, length: int, rng: random.Random) -> oe.GenerateRequest:
    req = oe.GenerateRequest(request_id=rid)
    req.token_ids.ids.extend(rng.randrange(100, 40000) for _ in range(length))
    req.stopping.max_tokens = 1
    req.sampling.temperature = 0.0
    return req


def first_token_seconds(events, started: float) -> float:  # noqa: ANN001 - a response iterator
    for event in events:
        if event.HasField("token") or event.HasField("error"):
            assert not event.HasField("error"), event.error
            return time.perf_counter() - started
    raise RuntimeError("stream ended without a token")


def pulled(decode: OpenEngineClient) -> tuple[float, float]:
    attrs = decode.load().attributes
    return attrs["kv_pulled_bytes"], attrs["kv_pull_seconds"]


def disaggregated(prefill_client: OpenEngineClient, decode: OpenEngineClient,
                  req: oe.GenerateRequest) -> tuple[float, float, float]:
    """(TTFT s, bytes pulled, pull s) of one prefill → decode request."""
    before = pulled(decode)
    started = time.perf_counter()
    ready = prefill(prefill_client, req)
    decode_req = oe.GenerateRequest()
    decode_req.CopyFrom(req)
    decode_req.kv.session.CopyFrom(ready.prefill_ready.kv_session)
    ttft = first_token_seconds(decode.generate(decode_req), started)
    time.sleep(0.05)  # the decode server's counters are read after its step
    after = pulled(decode)
    return ttft, after[0] - before[0], after[1] - before[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    roles = {"aggregated": [], "prefill_grpc": ["--role", "prefill"],
             "prefill_nixl": ["--role", "prefill", "--kv-transfer-backend", "nixl"], "decode": ["--role", "decode"]}
    procs: dict = {}
    rng = random.Random(0)
    rows = []
    try:
        for name, flags in roles.items():  # inside the try: a server that fails to start stops the others
            procs[name] = start_server(SERVER_FLAGS + flags, args.threads)
        clients = {name: OpenEngineClient(address, timeout=120) for name, (_, address, _) in procs.items()}
        for length in LENGTHS:
            best: dict[str, list[float]] = {}
            nbytes = 0.0
            for r in range(args.rounds):
                req = request(f"agg-{length}-{r}", length, rng)
                started = time.perf_counter()
                best.setdefault("agg_ttft", []).append(first_token_seconds(clients["aggregated"].generate(req),
                                                                           started))
                for backend in ("grpc", "nixl"):
                    ttft, nbytes, seconds = disaggregated(clients[f"prefill_{backend}"], clients["decode"],
                                                          request(f"{backend}-{length}-{r}", length, rng))
                    best.setdefault(f"{backend}_ttft", []).append(ttft)
                    best.setdefault(f"{backend}_mbps", []).append(nbytes / seconds / 1e6)
            raw = (raw_loopback_mb_per_s(int(nbytes), repeats=args.rounds),
                   raw_loopback_mb_per_s(int(nbytes), repeats=args.rounds, cold=True))
            rows.append((length, nbytes, max(best["grpc_mbps"]), max(best["nixl_mbps"]), raw,
                         min(best["agg_ttft"]), min(best["grpc_ttft"]), min(best["nixl_ttft"])))
            print(f"{length} tokens done", flush=True)
    finally:
        for proc, _, _ in procs.values():
            proc.terminate()
        for proc, _, _ in procs.values():
            proc.wait(60)
    print("\n| prompt tokens | KV MiB | grpc MB/s | nixl MB/s | raw NIXL MB/s hot / cold | nixl / raw hot / cold "
          "| TTFT aggregated ms | TTFT grpc ms (×) | TTFT nixl ms (×) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for length, nbytes, grpc_mbps, nixl_mbps, (hot, cold), agg, grpc_t, nixl_t in rows:
        print(f"| {length} | {nbytes / (1 << 20):.1f} | {grpc_mbps:.0f} | {nixl_mbps:.0f} | {hot:.0f} / {cold:.0f} "
              f"| {nixl_mbps / hot:.2f} / {nixl_mbps / cold:.2f} | {agg * 1e3:.0f} | {grpc_t * 1e3:.0f} "
              f"({grpc_t / agg:.2f}) "
              f"| {nixl_t * 1e3:.0f} ({nixl_t / agg:.2f}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
