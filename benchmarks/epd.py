"""Encode → prefill → decode (draft profile ``encoder``): time to first token against the aggregated
server, and the embedding transfer rate per backend.

Four ``refengine serve`` processes on loopback, all on the synthetic LLaVA of
``benchmarks/multimodal.py`` (SmolLM2-135M + a random CLIP ViT-B/16: 196 image positions of 576
float32 = 441 KiB of embeddings per image): an encoder (``--role encoder``, offering NIXL and gRPC),
an aggregated, a prefill and a decode server. Each round uses new images (so every route encodes
them once: the aggregated server itself, or the encoder) and a prompt of 1 or 4 placeholders in a
chat turn; ``max_tokens`` 1 where the route ends in a token.

- **aggregated**: the images as ``GenerateRequest.media`` on the aggregated server; TTFT = until its
  first ``TokenOutput``.
- **E → aggregated** and **E → P → D**, per backend (the client keeps only that backend's transfer in
  the handles): TTFT = ``Encode`` + the rest of the route until the first ``TokenOutput`` (for
  E → P → D: the prefill's ``PrefillReady``, then the decode server's first token).
- **embedding MB/s**: the consumers' ``LoadInfo.attributes`` ``embedding_pulled_bytes`` /
  ``embedding_pull_seconds`` over the round (time from staging rows taken to rows copied out, per
  handle: the backend's fetch, checks and release).

Best of ``--rounds`` per cell (after one untimed warm-up round); ratios are route / aggregated.

    python benchmarks/epd.py [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from google.protobuf import json_format  # noqa: E402

import benchmarks.serving as serving  # noqa: E402
from benchmarks.multimodal import IMAGE_TOKEN, build_llava, png  # noqa: E402
from refengine.client import OpenEngineClient, generate_disaggregated  # noqa: E402
from refengine.encoder_client import MediaClient, over_backend, with_handles  # noqa: E402
from refengine.model.loader import load_tokenizer, resolve_model  # noqa: E402
from refengine.protocol import oe  # noqa: E402

IMAGE_COUNTS = (1, 4)
BACKENDS = ("grpc", "nixl")
FLAGS = ["--max-model-len", "2048", "--num-kv-blocks", "256", "--max-num-batched-tokens", "2048"]


def prompt_ids(tokenizer: object, count: int) -> list[int]:
    before = tokenizer.encode("<|im_start|>user\n", add_special_tokens=False)  # type: ignore[attr-defined]
    after = tokenizer.encode("\nCompare these pictures.<|im_end|>\n<|im_start|>assistant\n",  # type: ignore[attr-defined]
                             add_special_tokens=False)
    ids = list(before)
    for index in range(count):  # one placeholder per image (expanded by the server), text between them
        ids += [IMAGE_TOKEN] + tokenizer.encode(f" (picture {index + 1})\n", add_special_tokens=False)  # type: ignore[attr-defined]
    return ids + after


def request(rid: str, ids: list[int], images: list[bytes]) -> oe.GenerateRequest:
    req = oe.GenerateRequest(request_id=rid)
    req.token_ids.ids.extend(ids)
    req.sampling.temperature = 0.0
    req.stopping.max_tokens = 1
    req.media.extend(oe.MediaItem(modality=oe.MODALITY_IMAGE, raw_bytes=data) for data in images)
    return req


def first_token(events, started: float) -> float:  # noqa: ANN001 - a response iterator
    for event in events:
        kind = event.WhichOneof("event")
        if kind == "token":
            return time.perf_counter() - started
        if kind == "error":
            raise RuntimeError(f"{oe.ErrorCode.Name(event.error.code)}: {event.error.message}")
    raise RuntimeError("the stream ended without a token")


def pulled(client: OpenEngineClient) -> tuple[float, float]:
    attributes = json_format.MessageToDict(client.load().attributes)
    return attributes.get("embedding_pulled_bytes", 0.0), attributes.get("embedding_pull_seconds", 0.0)


def one_round(clients: dict[str, OpenEngineClient], encoder: MediaClient, ids: list[int], count: int,
              seed: int) -> dict[str, float]:
    times: dict[str, float] = {}
    rng = random.Random(seed)
    fresh = lambda: [png(rng.randrange(1 << 30)) for _ in range(count)]  # noqa: E731 - new pixels each route
    req = request(f"agg-{seed}", ids, fresh())  # the PNGs made before the clock starts, as for the other routes
    started = time.perf_counter()
    times["aggregated"] = first_token(clients["aggregated"].generate(req), started)
    for backend in BACKENDS:
        for route in ("e_agg", "epd"):
            req = request(f"{route}-{backend}-{seed}", ids, fresh())
            consumers = [clients["aggregated"]] if route == "e_agg" else [clients["prefill"]]
            before = [pulled(c) for c in consumers]
            started = time.perf_counter()
            consumer_req = with_handles(req, over_backend(encoder.encode(list(req.media)), backend))
            events = (clients["aggregated"].generate(consumer_req) if route == "e_agg" else
                      generate_disaggregated(clients["prefill"], clients["decode"], consumer_req))
            times[f"{route}_{backend}"] = first_token(events, started)
            after = [pulled(c) for c in consumers]
            nbytes = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
            seconds = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
            times[f"mbps_{route}_{backend}"] = nbytes / seconds / 1e6 if seconds else 0.0
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    lm = resolve_model("smollm2-135m-instruct").path
    with tempfile.TemporaryDirectory(prefix="refengine-epd-") as tmp:
        model = Path(tmp) / "llava"
        build_llava(lm, model)
        serving.MODEL = str(model)
        roles = {"encoder": ["--role", "encoder", "--kv-transfer-backend", "nixl"], "aggregated": [],
                 "prefill": ["--role", "prefill"], "decode": ["--role", "decode"]}
        procs: dict = {}
        results = {}
        try:
            for name, flags in roles.items():  # inside the try: a server that fails to start stops the others
                procs[name] = serving.start_server(FLAGS + flags, args.threads)
            clients = {name: OpenEngineClient(address, timeout=120) for name, (_, address, _) in procs.items()}
            encoder = MediaClient(clients["encoder"])
            tokenizer = load_tokenizer(model)
            for count in IMAGE_COUNTS:
                ids = prompt_ids(tokenizer, count)
                one_round(clients, encoder, ids, count, seed=-count)  # warm-up
                rounds = [one_round(clients, encoder, ids, count, seed=1000 * count + r) for r in range(args.rounds)]
                results[count] = {key: (min if not key.startswith("mbps") else max)(r[key] for r in rounds)
                                  for key in rounds[0]}
                print(f"{count} image(s) done", flush=True)
        finally:
            for proc, _, _ in procs.values():
                proc.terminate()
            for proc, _, _ in procs.values():  # before the model directory goes
                proc.wait(60)
    print("\n| images | TTFT aggregated ms | E → agg grpc ms (×) | E → agg nixl ms (×) | E → P → D grpc ms (×) "
          "| E → P → D nixl ms (×) | embedding MB/s grpc | embedding MB/s nixl |")
    print("|---|---|---|---|---|---|---|---|")
    for count, r in results.items():
        agg = r["aggregated"]
        cells = [f"{r[key] * 1e3:.0f} ({r[key] / agg:.2f})" for key in ("e_agg_grpc", "e_agg_nixl", "epd_grpc",
                                                                       "epd_nixl")]
        rates = [f"{max(r[f'mbps_e_agg_{b}'], r[f'mbps_epd_{b}']):.0f}" for b in BACKENDS]
        print(f"| {count} | {agg * 1e3:.0f} | " + " | ".join(cells + rates) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
