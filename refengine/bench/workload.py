"""What the benchmark sends: the requests (random or from a JSONL dataset), their arrival
times, and the ``GenerateRequest`` each becomes.

Everything random is drawn from ``random.Random`` seeded by ``--seed``, so a seed names one
workload: the same prompts, the same lengths and the same arrival schedule on every run
and against every server (the point of comparing engines through one contract). The request
ids are not part of the workload: each run draws a prefix of its own, so that two runs of
one seed can load the same server at once (it refuses a request id that is still active).
"""

from __future__ import annotations

import json
import math
import random
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refengine.bench import UINT32_MAX
from refengine.protocol import oe

__all__ = ["BenchRequest", "RequestOptions", "WorkloadError", "arrival_times", "dataset_requests",
           "random_requests", "random_request_id_prefix", "to_message"]

LOWEST_TOKEN_ID = 10  # below are the special tokens of most vocabularies (BOS, EOS, padding)
#: Random text prompts (for servers that take no token ids): common words, each about one
#: token for the usual BPE vocabularies, so ``--input-len`` words are close to that many tokens.
WORDS = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on",
         "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "had", "they",
         "you", "were", "their", "one", "all", "we", "can", "her", "has", "there", "been", "if", "more",
         "when", "will", "would", "who", "so", "no", "time", "people", "year", "way", "day", "man", "world")


class WorkloadError(ValueError):
    """A workload that cannot be built from the given flags or dataset (a usage error)."""


@dataclass(frozen=True)
class BenchRequest:
    """One request of the workload; exactly one of ``prompt`` and ``token_ids`` is set."""

    index: int
    output_len: int
    prompt: str | None = None
    token_ids: tuple[int, ...] | None = None


def random_request_id_prefix() -> str:
    """``bench-<8 hex>-``, vllm's default ``--request-id-prefix``: fresh for every run."""
    return f"bench-{secrets.token_hex(4)}-"


@dataclass(frozen=True)
class RequestOptions:
    """What every request of a run shares (the flags that are not about the workload)."""

    model: str
    request_id_prefix: str = field(default_factory=random_request_id_prefix)
    temperature: float = 0.0
    ignore_eos: bool = False
    guided_regex: str | None = None
    guided_json: str | None = None
    guided_choice: tuple[str, ...] = ()
    logprobs: int | None = None
    lora_name: str = ""


def _lengths(rng: random.Random, n: int, mean: int, range_ratio: float) -> list[int]:
    """``n`` lengths uniform in [mean*(1-R), mean*(1+R)] (vllm's random dataset), at least 1 and
    at most what a uint32 field holds (max_tokens)."""
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = min(UINT32_MAX, max(1, math.ceil(mean * (1 + range_ratio))))
    return [rng.randint(low, high) for _ in range(n)]


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float, seed: int,
                    vocab_size: int, text: bool = False) -> list[BenchRequest]:
    """Random prompts: token ids from [10, vocab_size), or (``text``) words, one per input token."""
    if not 0 <= range_ratio < 1:
        raise WorkloadError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    if vocab_size <= LOWEST_TOKEN_ID:
        raise WorkloadError(f"a vocabulary of {vocab_size} leaves no ids at or above {LOWEST_TOKEN_ID}")
    rng = random.Random(seed)
    inputs = _lengths(rng, num_prompts, input_len, range_ratio)
    outputs = _lengths(rng, num_prompts, output_len, range_ratio)
    requests = []
    for i, (n_in, n_out) in enumerate(zip(inputs, outputs, strict=True)):
        if text:
            requests.append(BenchRequest(i, n_out, prompt=" ".join(rng.choice(WORDS) for _ in range(n_in))))
        else:
            ids = tuple(rng.randrange(LOWEST_TOKEN_ID, vocab_size) for _ in range(n_in))
            requests.append(BenchRequest(i, n_out, token_ids=ids))
    return requests


def _is_uint32(value: Any, low: int = 0) -> bool:
    """An integer in [low, UINT32_MAX]; JSON's true and false are not (Python's bool is an int)."""
    return type(value) is int and low <= value <= UINT32_MAX


def _dataset_request(index: int, line: str, where: str, output_len: int) -> BenchRequest:
    try:
        row = json.loads(line)
    except ValueError as exc:
        raise WorkloadError(f"{where}: not JSON ({exc})") from None
    if not isinstance(row, dict) or ("prompt" in row) == ("token_ids" in row):
        raise WorkloadError(f"{where}: expected an object with exactly one of \"prompt\" and \"token_ids\"")
    key = "output_len" if "output_len" in row else "max_tokens"
    n_out = row.get(key, output_len)
    if not _is_uint32(n_out, low=1):
        raise WorkloadError(f"{where}: \"{key}\" must be an integer in [1, {UINT32_MAX}], got {json.dumps(n_out)}")
    if "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise WorkloadError(f"{where}: \"prompt\" must be a non-empty string")
        return BenchRequest(index, n_out, prompt=row["prompt"])
    ids = row["token_ids"]
    if not isinstance(ids, list) or not ids:
        raise WorkloadError(f"{where}: \"token_ids\" must be a non-empty list of token ids")
    for position, token in enumerate(ids):
        if not _is_uint32(token):
            raise WorkloadError(f"{where}: \"token_ids\"[{position}] must be an integer in [0, {UINT32_MAX}], "
                                f"got {json.dumps(token)}")
    return BenchRequest(index, n_out, token_ids=tuple(ids))


def dataset_requests(path: Path, num_prompts: int, output_len: int) -> list[BenchRequest]:
    """The first ``num_prompts`` non-blank lines of a JSONL file, in file order. Each line is
    ``{"prompt": text}`` or ``{"token_ids": [...]}``, optionally with ``output_len`` or
    ``max_tokens`` (else ``output_len``)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise WorkloadError(f"--dataset {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise WorkloadError(f"--dataset {path}: not UTF-8 text (byte {exc.start} of the file)") from None
    requests: list[BenchRequest] = []
    for number, line in enumerate(lines, start=1):
        if len(requests) == num_prompts:
            break
        if line.strip():
            requests.append(_dataset_request(len(requests), line, f"{path}:{number}", output_len))
    if not requests:
        raise WorkloadError(f"--dataset {path}: no requests in the file")
    return requests


def arrival_times(n: int, request_rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Send offsets (s from the start) of ``n`` requests, the first at 0; all at 0 when the rate is
    infinite. The gaps are gamma-distributed with shape ``burstiness`` and mean 1 / ``request_rate``
    (vllm's ``--burstiness``): 1 is a Poisson process (exponential gaps), below 1 burstier, above 1
    more even. They have an RNG of their own so that they do not depend on the prompts drawn."""
    if request_rate == math.inf:
        return [0.0] * n
    rng = random.Random(f"arrivals-{seed}")
    times, now = [], 0.0
    for _ in range(n):
        times.append(now)
        now += rng.gammavariate(burstiness, 1 / (request_rate * burstiness))
    return times


def _guided(options: RequestOptions) -> oe.GuidedDecoding | None:
    if options.guided_regex is not None:
        return oe.GuidedDecoding(regex=options.guided_regex)
    if options.guided_json is not None:
        return oe.GuidedDecoding(json_schema=options.guided_json)
    if options.guided_choice:
        return oe.GuidedDecoding(choice=oe.ChoiceConstraint(choices=list(options.guided_choice)))
    return None


def to_message(request: BenchRequest, options: RequestOptions) -> oe.GenerateRequest:
    """The wire request; its id ``{request_id_prefix}{index}`` is unique within a run."""
    message = oe.GenerateRequest(request_id=f"{options.request_id_prefix}{request.index}", model=options.model,
                                 lora_name=options.lora_name)
    if request.token_ids is not None:
        message.token_ids.ids.extend(request.token_ids)
    else:
        message.prompt = request.prompt or ""
    message.sampling.temperature = options.temperature
    message.stopping.max_tokens = request.output_len
    if options.ignore_eos:  # set only when asked: the request stays minimal for every server
        message.stopping.ignore_eos = True
    if options.logprobs is not None:
        message.response.return_output_logprobs = True
        if options.logprobs > 0:
            message.response.output_candidates.top_n = options.logprobs
    guided = _guided(options)
    if guided is not None:
        message.guided.CopyFrom(guided)
    return message
