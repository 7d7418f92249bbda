"""``refengine bench`` against the toy OpenEngine server (tests/conformance/fake_server.py):
hand-counted token totals, datasets, determinism, arrivals, the concurrency bound, error
kinds, the CLI end to end, and the metrics on known inputs.

The toy reports no ``vocab_size``, so the servers here wrap its control service to report
its real one (129; the bench would otherwise send ids up to 1000, which it refuses), or to
say it takes no token ids. Its tokens are characters: a text prompt of n characters is n
prompt tokens, and ``--ignore-eos`` makes every request produce exactly its max_tokens.
"""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from refengine.bench import report, runner, target, workload
from refengine.bench.progress import Progress
from refengine.cli import main
from refengine.client import OpenEngineClient
from refengine.protocol import oe
from tests.conformance.fake_server import Control, Inference
from tests.conformance.toy_engine import VOCAB, ToyEngine
from tests.conformance.toy_faults import Faults
from tests.conformance.toy_requests import CTX

REPO = Path(__file__).resolve().parents[2]


class ReportingControl(Control):
    """The toy's control service, with what a real server adds: ``extra.vocab_size``; or
    ``supports_token_ids_input`` false (a text-only server)."""

    def __init__(self, engine: ToyEngine, token_ids: bool = True) -> None:
        super().__init__(engine)
        self.token_ids = token_ids

    def GetModelInfo(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        info = super().GetModelInfo(request, context)
        info.extra.update({"vocab_size": VOCAB})
        info.supports_token_ids_input = self.token_ids
        return info


class WatchedInference(Inference):
    """Counts the Generate calls in flight (the peak) and keeps the input kind and the
    request id of each."""

    def __init__(self, engine: ToyEngine) -> None:
        super().__init__(engine)
        self.lock = threading.Lock()
        self.in_flight = self.peak = 0
        self.inputs: list[str] = []
        self.ids: list[str] = []

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:  # noqa: N802
        with self.lock:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            self.inputs.append(request.WhichOneof("input"))
            self.ids.append(request.request_id)
        try:
            yield from super().Generate(request, context)
        finally:
            with self.lock:
                self.in_flight -= 1


class Toy:
    def __init__(self, token_ids: bool = True) -> None:
        self.engine = ToyEngine(Faults())
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
        self.inference = WatchedInference(self.engine)
        oe.add_InferenceServicer_to_server(self.inference, self.server)
        oe.add_ControlServicer_to_server(ReportingControl(self.engine, token_ids), self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def stop(self) -> None:
        self.server.stop(0)
        self.engine.running = False


@pytest.fixture
def toy() -> Iterator[Toy]:
    server = Toy()
    yield server
    server.stop()


def bench(toy: Toy, tmp_path: Path, *flags: str) -> dict[str, Any]:
    """``refengine bench`` in this process; returns its JSON."""
    out = tmp_path / "bench.json"
    assert main(["bench", "--target", toy.address, "--no-progress", "--json", str(out), *flags]) == 0
    return json.loads(out.read_text())


def test_totals_match_a_hand_counted_run(toy: Toy, tmp_path: Path) -> None:
    flags = ("--num-prompts", "5", "--input-len", "8", "--output-len", "6", "--range-ratio", "0.5", "--seed", "3")
    result = bench(toy, tmp_path, *flags, "--ignore-eos")
    sent = workload.random_requests(5, 8, 6, 0.5, 3, VOCAB)
    assert len({len(r.token_ids) for r in sent}) > 1 and len({r.output_len for r in sent}) > 1  # lengths vary
    assert (result["completed"], result["failed"], result["errors"]) == (5, 0, {})
    assert result["input_tokens"] == sum(len(r.token_ids) for r in sent)
    assert result["output_tokens"] == result["total_output_tokens"] == sum(r.output_len for r in sent)
    assert set(toy.inference.inputs) == {"token_ids"}
    assert result["mean_ttft_ms"] > 0 and result["median_itl_ms"] > 0 and result["p99_tpot_ms"] > 0
    assert result["output_throughput"] == pytest.approx(result["output_tokens"] / result["duration"])


def test_a_dataset_of_text_and_token_ids(toy: Toy, tmp_path: Path) -> None:
    lines = [{"prompt": "hello world"}, {"token_ids": [72, 105]}, {"prompt": "abc", "max_tokens": 3},
             {"token_ids": [65, 66, 67], "output_len": 2}, {"prompt": "not sent: beyond --num-prompts"}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines[:2]) + "\n\n"
                    + "\n".join(json.dumps(line) for line in lines[2:]) + "\n")
    result = bench(toy, tmp_path, "--dataset", str(path), "--num-prompts", "4", "--output-len", "4", "--ignore-eos")
    assert (result["completed"], result["num_prompts"]) == (4, 4)
    assert result["input_tokens"] == 11 + 2 + 3 + 3
    assert result["output_tokens"] == 4 + 4 + 3 + 2
    assert toy.inference.inputs.count("prompt") == 2 and toy.inference.inputs.count("token_ids") == 2


def test_a_bad_dataset_is_a_usage_error(toy: Toy, tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": "x", "token_ids": [1]}\n')
    assert main(["bench", "--target", toy.address, "--dataset", str(path)]) == 2
    with pytest.raises(workload.WorkloadError, match="bad.jsonl:2"):
        workload.dataset_requests(path, 10, 4)


def test_a_seed_names_one_workload() -> None:
    def draw(seed: int, text: bool = False) -> list[workload.BenchRequest]:
        return workload.random_requests(20, 32, 16, 0.5, seed, 1000, text=text)

    assert draw(0) == draw(0) and draw(0, text=True) == draw(0, text=True)
    assert [(len(r.token_ids), r.output_len) for r in draw(0)] != [(len(r.token_ids), r.output_len) for r in draw(1)]
    assert all(16 <= len(r.token_ids) <= 48 and 8 <= r.output_len <= 24 for r in draw(0))
    assert all(10 <= t < 1000 for r in draw(0) for t in r.token_ids)
    assert [len(r.prompt.split()) for r in draw(0, text=True)] == [len(r.token_ids) for r in draw(0)]
    assert workload.arrival_times(10, 5.0, 0) == workload.arrival_times(10, 5.0, 0) != workload.arrival_times(
        10, 5.0, 1)


def test_a_finite_rate_spreads_the_arrivals() -> None:
    times = workload.arrival_times(2000, 50.0, 7)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert times[0] == 0 and all(g > 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 50, rel=0.1)  # exponential gaps of mean 1/rate
    assert sum(g > 1 / 50 for g in gaps) / len(gaps) == pytest.approx(math.exp(-1), abs=0.05)  # P(gap > mean)
    assert workload.arrival_times(5, math.inf, 7) == [0.0] * 5


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_burstiness_shapes_the_gaps_and_keeps_their_mean(burstiness: float) -> None:
    """Gamma-distributed gaps of shape ``burstiness`` (vllm's --burstiness): the mean stays
    1 / rate and the coefficient of variation is 1 / sqrt(shape) (1 for Poisson)."""
    times = workload.arrival_times(4000, 50.0, 3, burstiness)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    mean = sum(gaps) / len(gaps)
    spread = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert mean == pytest.approx(1 / 50, rel=0.1)
    assert spread / mean == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)


def test_the_runner_sends_on_schedule() -> None:
    def send(request: workload.BenchRequest, record: runner.RequestRecord) -> None:
        record.finished = True

    requests = [workload.BenchRequest(i, 1, prompt="x") for i in range(3)]
    start = runner.clock()
    result = runner.run(requests, [0.0, 0.15, 0.3], send)
    offsets = [r.sent - start for r in result.records]
    assert offsets == pytest.approx([0.0, 0.15, 0.3], abs=0.05)
    assert result.duration == pytest.approx(0.3, abs=0.05)


def test_max_concurrency_bounds_the_requests_in_flight(toy: Toy, tmp_path: Path) -> None:
    flags = ("--num-prompts", "8", "--input-len", "4", "--output-len", "4", "--ignore-eos")
    assert bench(toy, tmp_path, *flags, "--max-concurrency", "2")["completed"] == 8
    assert toy.inference.peak == 2
    toy.inference.peak = 0
    assert bench(toy, tmp_path, *flags)["completed"] == 8
    assert toy.inference.peak > 2  # unbounded, the same workload overlaps more: the bound was what held it


def test_failures_are_counted_by_kind(toy: Toy, tmp_path: Path) -> None:
    # prompt + max_tokens beyond the toy's context: refused before acceptance
    beyond = bench(toy, tmp_path, "--num-prompts", "3", "--input-len", str(CTX - 6), "--output-len", "10")
    assert (beyond["completed"], beyond["failed"], beyond["errors"]) == (0, 3, {"INVALID_ARGUMENT": 3})
    assert beyond["mean_ttft_ms"] is None and beyond["input_tokens"] == 0
    unknown = bench(toy, tmp_path, "--num-prompts", "2", "--input-len", "4", "--output-len", "2", "--model", "nope")
    assert unknown["errors"] == {"NOT_FOUND": 2} and unknown["model"] == "nope"
    late = bench(toy, tmp_path, "--num-prompts", "2", "--input-len", "4", "--output-len", "50", "--ignore-eos",
                 "--timeout", "0.1")
    assert late["errors"] == {"DEADLINE_EXCEEDED": 2}
    lora = bench(toy, tmp_path, "--num-prompts", "1", "--input-len", "4", "--output-len", "2", "--lora-name", "x")
    assert lora["errors"] == {"NOT_FOUND": 1}


def test_in_stream_errors_and_usage_mismatches() -> None:
    token = oe.GenerateResponse(token=oe.TokenOutput(tokens=[oe.TokenInfo(token_id=65)]))
    short = [token, token, oe.GenerateResponse(finished=oe.GenerationFinished(reason=oe.FINISH_REASON_LENGTH),
                                               usage=oe.Usage(prompt_tokens=4, completion_tokens=3))]
    mismatch = runner.RequestRecord(0)
    runner.record_stream(short, mismatch)
    mismatch.close(2.0)
    overloaded = runner.RequestRecord(1)
    runner.record_stream([oe.GenerateResponse(error=oe.EngineError(code=oe.ERROR_CODE_OVERLOADED))], overloaded)
    overloaded.close(2.0)
    cut = runner.RequestRecord(2)
    cut.close(2.0)  # a stream that ended with no terminal event
    assert (mismatch.error, mismatch.notes, mismatch.output_tokens) == (None, ["usage_mismatch"], 3)
    summary = report.summarize(runner.RunResult([mismatch, overloaded, cut], 2.0), {})
    assert (summary["completed"], summary["failed"], summary["output_tokens"]) == (1, 2, 3)
    assert summary["errors"] == {"ERROR_CODE_OVERLOADED": 1, "no_finish": 1, "usage_mismatch": 1}


def test_text_prompts_for_a_server_without_token_ids(tmp_path: Path) -> None:
    toy = Toy(token_ids=False)
    try:
        result = bench(toy, tmp_path, "--num-prompts", "3", "--input-len", "5", "--output-len", "2", "--ignore-eos")
    finally:
        toy.stop()
    sent = workload.random_requests(3, 5, 2, 0.0, 0, VOCAB, text=True)
    assert toy.inference.inputs == ["prompt"] * 3
    assert result["input_tokens"] == sum(len(r.prompt) for r in sent)  # one toy token per character


def test_guides_logprobs_and_lora_reach_the_request(toy: Toy, tmp_path: Path) -> None:
    request = workload.BenchRequest(4, 7, token_ids=(11, 12))
    options = workload.RequestOptions("m", request_id_prefix="run-", temperature=0.5, ignore_eos=True,
                                      guided_choice=("yes", "no"), logprobs=3, lora_name="ad")
    message = workload.to_message(request, options)
    assert (message.request_id, message.model, message.lora_name, list(message.token_ids.ids)) == \
        ("run-4", "m", "ad", [11, 12])
    assert (message.stopping.max_tokens, message.stopping.ignore_eos, message.sampling.temperature) == (7, True, 0.5)
    assert list(message.guided.choice.choices) == ["yes", "no"]
    assert message.response.return_output_logprobs and message.response.output_candidates.top_n == 3
    regex = bench(toy, tmp_path, "--num-prompts", "2", "--input-len", "4", "--output-len", "8", "--guided-regex",
                  "[ab]{3}", "--logprobs", "2")
    assert (regex["completed"], regex["output_tokens"]) == (2, 2 * 3)  # the toy stops where the regex is complete


def test_the_cli_end_to_end(toy: Toy, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "refengine.cli", "bench", "--target", toy.address, "--num-prompts", "4",
           "--input-len", "8", "--output-len", "5", "--ignore-eos", "--goodput", "e2el:60000", "--json", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    assert "Serving Benchmark Result" in done.stdout and "Successful requests:" in done.stdout
    result = json.loads(out.read_text())
    keys = {"completed", "failed", "duration", "input_tokens", "output_tokens", "total_input_tokens",
            "total_output_tokens", "request_throughput", "output_throughput", "total_token_throughput", "errors",
            "target", "model", "num_prompts", "seed", "max_concurrency", "request_rate"}
    keys |= {f"{q}_{m}_ms" for q in ("mean", "median", "p90", "p99") for m in ("ttft", "tpot", "itl", "e2el")}
    keys |= {"burstiness", "request_goodput"}
    assert keys <= result.keys()
    assert (result["completed"], result["input_tokens"], result["output_tokens"]) == (4, 32, 20)
    assert (result["target"], result["model"], result["request_rate"], result["max_concurrency"]) == \
        (toy.address, "toy", "inf", None)
    assert result["burstiness"] == 1.0 and result["request_goodput"] == result["request_throughput"] > 0
    assert "Request goodput (req/s):" in done.stdout


def test_json_without_a_path_replaces_the_table(toy: Toy, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--target", toy.address, "--num-prompts", "1", "--input-len", "4", "--output-len", "2",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["completed"] == 1


def test_an_unreachable_target_stops_the_run() -> None:
    with OpenEngineClient("127.0.0.1:1") as client, pytest.raises(target.TargetError, match="not reachable"):
        target.discover(client, connect_timeout=0.2)


class PrefillControl(ReportingControl):
    def GetServerInfo(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        info = super().GetServerInfo(request, context)
        info.engine_role = oe.ENGINE_ROLE_PREFILL
        return info


def test_a_prefill_server_is_refused_before_the_run(toy: Toy, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by review: each request ended "no_finish" and left its KV session held on the prefill
    server until the lease ended; the run now stops before it sends anything (exit 1)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    oe.add_InferenceServicer_to_server(toy.inference, server)
    oe.add_ControlServicer_to_server(PrefillControl(toy.engine), server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        for model in ([], ["--model", "toy"]):
            assert main(["bench", "--target", address, "--num-prompts", "2", "--no-progress", *model]) == 1
            assert "is a prefill server: bench sends whole requests" in capsys.readouterr().err
    finally:
        server.stop(0)
    assert toy.inference.ids == []


def test_percentiles_and_latencies_on_known_inputs() -> None:
    assert report.percentile([5, 1, 4, 2, 3], 50) == 3
    assert report.percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)  # numpy's linear interpolation
    assert report.percentile([0, 100], 99) == pytest.approx(99)
    assert report.percentile([7], 99) == 7 and report.percentile([], 50) is None
    record = runner.RequestRecord(0, sent=0.0, finished=True)
    record.tokens(1, 0.5)  # TTFT 0.5
    record.tokens(3, 1.1)  # one delta of 3 tokens after 0.6 s: one ITL sample of 0.6
    record.tokens(1, 1.2)
    record.usage(10, 5)
    record.close(1.3)  # the Finished, a step after the last token
    assert record.itl == pytest.approx([0.6, 0.1]) and record.notes == []
    summary = report.summarize(runner.RunResult([record], 2.0), {"request_rate": math.inf})
    assert summary["mean_ttft_ms"] == pytest.approx(500)
    assert summary["mean_tpot_ms"] == pytest.approx(1000 * (1.2 - 0.5) / 4)  # to the last token, not the end
    assert summary["median_itl_ms"] == pytest.approx(350) and summary["p99_itl_ms"] == pytest.approx(595)
    assert summary["mean_itl_ms"] == pytest.approx(350)
    assert (summary["request_throughput"], summary["total_token_throughput"]) == (0.5, 7.5)
    assert summary["mean_e2el_ms"] == pytest.approx(1300)  # send to the stream's end
    assert summary["request_rate"] == "inf" and summary["request_goodput"] is None
    table = report.format_table({**summary, "target": "t", "model": "m"})
    assert "Mean TTFT (ms):" in table and "P99 E2EL (ms):" in table and "goodput" not in table


def _record(ttft: float, tokens: int, end: float) -> runner.RequestRecord:
    """A completed request: its first token at ``ttft``, the rest 0.1 s apart, the end at ``end``."""
    record = runner.RequestRecord(0, sent=0.0, finished=True)
    for i in range(tokens):
        record.tokens(1, ttft + 0.1 * i)
    record.usage(4, tokens)
    record.close(end)
    return record


def test_goodput_counts_the_requests_meeting_every_objective() -> None:
    """vllm's --goodput: TTFT 0.2 s / TPOT 0.1 s / E2EL 1 s against objectives of 300 ms,
    150 ms and 1,200 ms. A request of one token has no TPOT (met); one of none, no TTFT (not met)."""
    fast, slow_first, long_end, one_token = _record(0.2, 3, 1.0), _record(0.5, 3, 1.0), _record(0.2, 3, 2.0), \
        _record(0.2, 1, 0.3)
    slos = {"ttft": 300.0, "tpot": 150.0, "e2el": 1200.0}
    assert [report.meets(r, slos) for r in (fast, slow_first, long_end, one_token)] == [True, False, False, True]
    assert not report.meets(_record(0.0, 0, 0.3), {"ttft": 300.0})
    assert report.meets(slow_first, {"tpot": 150.0}) and not report.meets(fast, {"tpot": 50.0})
    failed = runner.RequestRecord(0, sent=0.0)
    failed.fail("UNAVAILABLE")
    failed.close(0.1)
    summary = report.summarize(runner.RunResult([fast, slow_first, long_end, one_token, failed], 2.0),
                               {"request_rate": 1.0}, slos)
    assert summary["request_goodput"] == pytest.approx(2 / 2.0)  # fast and one_token, over 2 s
    assert "Request goodput (req/s):" in report.format_table({**summary, "target": "t", "model": "m"})


@pytest.mark.parametrize(("args", "says"), [
    (["--goodput", "ttft"], "must be METRIC:MS"),
    (["--goodput", "itl:5"], "METRIC one of ttft, tpot, e2el"),
    (["--goodput", "ttft:0"], "MS > 0"),
    (["--goodput", "ttft:nan"], "MS > 0"),
    (["--goodput", "ttft:5", "ttft:6"], "--goodput names a metric twice"),
    (["--burstiness", "0"], "--burstiness: must be a number > 0"),
])
def test_bad_goodput_and_burstiness_are_usage_errors(args: list[str], says: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        code = main(["bench", "--target", "127.0.0.1:1", *args])
        raise SystemExit(code)
    assert stop.value.code == 2 and says in capsys.readouterr().err


def test_input_tokens_without_usage_are_the_token_ids_sent() -> None:
    """A server sending no Usage (found by review: its prompts counted 0 input tokens, so
    total_token_throughput came out too low)."""
    record = runner.RequestRecord(0, sent=0.0, sent_prompt_tokens=16)
    record.tokens(1, 0.1)
    record.tokens(1, 0.2)
    record.finished = True
    record.close(0.3)
    summary = report.summarize(runner.RunResult([record], 1.0), {"request_rate": math.inf})
    assert summary["errors"] == {"usage_missing": 1}
    assert (summary["input_tokens"], summary["output_tokens"]) == (16, 2)
    assert summary["total_token_throughput"] == 18


def test_the_progress_bar() -> None:
    stream = io.StringIO()
    bar = Progress(4, stream, width=8)
    bar.advance()
    bar.advance()
    bar.close()
    assert stream.getvalue().endswith("\r[####....] 2/4\n")
