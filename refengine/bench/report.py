"""The metrics of a run, named as vllm's ``bench serve`` names them, as a table or JSON.

JSON keys (``refengine bench --json``), all at the top level:

- ``target``, ``model``, ``num_prompts``, ``seed``, ``max_concurrency`` (null: unlimited),
  ``request_rate`` (requests/s, or the string ``"inf"``: all at once), ``burstiness`` (the
  shape of the gamma-distributed gaps between arrivals: 1 = Poisson)
- ``completed``, ``failed``: requests that finished / that were refused or broke
- ``duration``: s from the first send to the end of the last stream
- ``input_tokens``, ``output_tokens`` (and vllm's aliases ``total_input_tokens``,
  ``total_output_tokens``): sums over completed requests of ``Usage.prompt_tokens`` and
  ``Usage.completion_tokens`` (where Usage is missing: the token ids sent, and the tokens
  counted in the stream)
- ``request_throughput`` (req/s), ``output_throughput`` and ``total_token_throughput``
  (tok/s, input + output): over ``duration``
- ``request_goodput`` (req/s): completed requests that met every ``--goodput`` objective
  (``ttft``, ``tpot``, ``e2el`` in ms; a request of one output token has no TPOT and meets
  that one), over ``duration``; null without objectives
- ``mean_X_ms``, ``median_X_ms``, ``p90_X_ms``, ``p99_X_ms`` for X in ``ttft`` (send to the
  first token), ``tpot`` (per request: (last token-bearing event - first token) / (output
  tokens - 1)), ``itl`` (one sample per token-bearing event after the first: the gap since
  the previous one, however many tokens it holds) and ``e2el`` (send to the stream's end);
  null when no request gave a sample
- ``errors``: kind -> count. The failure kinds are gRPC status names (``RESOURCE_EXHAUSTED``,
  ``DEADLINE_EXCEEDED``...), ``EngineError`` codes (``ERROR_CODE_OVERLOADED``...),
  ``no_finish`` (the stream ended without a terminal event) or a client exception's class
  name; ``usage_mismatch`` and ``usage_missing`` are noted on completed requests (Usage
  disagrees with the tokens streamed, or is absent), which still count as completed.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from refengine.bench.runner import RequestRecord, RunResult

__all__ = ["format_table", "meets", "percentile", "summarize"]

QUANTILES = (("mean", "Mean", None), ("median", "Median", 50.0), ("p90", "P90", 90.0), ("p99", "P99", 99.0))
LATENCIES = (("ttft", "Time to First Token", "TTFT"), ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
             ("itl", "Inter-token Latency", "ITL"), ("e2el", "End-to-end Latency", "E2EL"))


def percentile(values: Sequence[float], p: float) -> float | None:
    """The ``p``-th percentile with linear interpolation between ranks (numpy's default,
    which vllm uses); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = p / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _stats(name: str, seconds: Sequence[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for label, _, p in QUANTILES:
        value = (sum(seconds) / len(seconds) if seconds else None) if p is None else percentile(seconds, p)
        out[f"{label}_{name}_ms"] = None if value is None else 1000 * value
    return out


def meets(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """Whether a completed request met every objective (metric of ``bench.SLO_METRICS`` -> ms).
    Under two output tokens there is no TPOT, and a TPOT objective is met; with no token at all
    there is no TTFT, and a TTFT objective is not."""
    seconds = {"ttft": record.ttft, "tpot": record.tpot, "e2el": record.e2el}
    for name, limit_ms in slos_ms.items():
        value = seconds[name]
        if value is None and name == "tpot":
            continue
        if value is None or 1000 * value > limit_ms:
            return False
    return True


def summarize(result: RunResult, meta: dict[str, Any], slos_ms: dict[str, float] | None = None) -> dict[str, Any]:
    """The JSON object of a run; ``meta`` gives target, model, num_prompts, seed,
    max_concurrency, request_rate, burstiness (put first); ``slos_ms`` the ``--goodput`` objectives."""
    done = [r for r in result.records if r.error is None]
    duration = result.duration
    input_tokens = sum(r.sent_prompt_tokens or 0 if r.prompt_tokens is None else r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    rate = meta.get("request_rate")
    summary: dict[str, Any] = {**meta, "request_rate": "inf" if rate == math.inf else rate,
                               "completed": len(done), "failed": len(result.records) - len(done),
                               "duration": duration, "input_tokens": input_tokens, "output_tokens": output_tokens,
                               "total_input_tokens": input_tokens, "total_output_tokens": output_tokens}
    per_s = 1 / duration if duration > 0 else 0.0
    summary.update(request_throughput=len(done) * per_s, output_throughput=output_tokens * per_s,
                   total_token_throughput=(input_tokens + output_tokens) * per_s,
                   request_goodput=sum(meets(r, slos_ms) for r in done) * per_s if slos_ms else None)
    summary |= _stats("ttft", [r.ttft for r in done if r.ttft is not None])
    summary |= _stats("tpot", [tpot for r in done if (tpot := r.tpot) is not None])
    summary |= _stats("itl", [gap for r in done for gap in r.itl])
    summary |= _stats("e2el", [r.e2el for r in done])
    kinds = Counter(r.error for r in result.records if r.error is not None)
    kinds.update(note for r in done for note in r.notes)
    summary["errors"] = dict(sorted(kinds.items()))
    return summary


def _line(label: str, value: Any) -> str:
    if value is None:
        text = "-"
    elif isinstance(value, float):
        text = f"{value:.2f}"
    else:
        text = str(value)
    return f"{label + ':':<40}{text}"


def _section(title: str) -> str:
    return f"{title:-^50}"


def format_table(summary: dict[str, Any]) -> str:
    """vllm's "Serving Benchmark Result" block, plus the errors by kind."""
    lines = [f"{' Serving Benchmark Result ':=^50}",
             _line("Target", summary["target"]), _line("Model", summary["model"]),
             _line("Successful requests", summary["completed"]), _line("Failed requests", summary["failed"]),
             _line("Benchmark duration (s)", summary["duration"]),
             _line("Total input tokens", summary["input_tokens"]),
             _line("Total generated tokens", summary["output_tokens"]),
             _line("Request throughput (req/s)", summary["request_throughput"]),
             *([_line("Request goodput (req/s)", summary["request_goodput"])]
               if summary.get("request_goodput") is not None else []),
             _line("Output token throughput (tok/s)", summary["output_throughput"]),
             _line("Total token throughput (tok/s)", summary["total_token_throughput"])]
    for key, title, short in LATENCIES:
        lines.append(_section(title))
        lines += [_line(f"{shown} {short} (ms)", summary[f"{label}_{key}_ms"]) for label, shown, _ in QUANTILES]
    if summary["errors"]:
        lines.append(_section("Errors"))
        lines += [_line(kind, count) for kind, count in summary["errors"].items()]
    lines.append("=" * 50)
    return "\n".join(lines)
