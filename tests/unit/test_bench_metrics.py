"""``refengine bench``'s per-request metrics on timed streams (TPOT to the last token, one
ITL sample per event), its request ids (one prefix per run) and the dataset values it
refuses (what the wire's uint32 cannot hold, JSON booleans, text that is not UTF-8)."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from refengine.bench import UINT32_MAX, report, runner, workload
from refengine.cli import main
from refengine.protocol import oe
from tests.unit.test_bench import Toy

STEP = 0.05  # s between the events of a timed stream


@pytest.fixture
def toy() -> Iterator[Toy]:
    server = Toy()
    yield server
    server.stop()


def token_event(count: int) -> oe.GenerateResponse:
    return oe.GenerateResponse(token=oe.TokenOutput(tokens=[oe.TokenInfo(token_id=65)] * count))


def timed(events: list[tuple[float, oe.GenerateResponse]]) -> Iterator[oe.GenerateResponse]:
    """``events`` as a stream: each one after its delay (s)."""
    for delay, event in events:
        time.sleep(delay)
        yield event


def recorded(events: list[tuple[float, oe.GenerateResponse]]) -> runner.RequestRecord:
    record = runner.RequestRecord(0, sent=runner.clock())
    runner.record_stream(timed(events), record)
    record.close(runner.clock())
    return record


def test_tpot_ends_at_the_last_token_bearing_event() -> None:
    finished = oe.GenerateResponse(finished=oe.GenerationFinished(reason=oe.FINISH_REASON_STOP),
                                   usage=oe.Usage(prompt_tokens=3, completion_tokens=3))
    late = 10 * STEP  # an EOS stop: the Finished comes a (slow) step after the last token, with no token
    record = recorded([(STEP, token_event(1)), (STEP, token_event(1)), (STEP, token_event(1)), (late, finished)])
    assert record.error is None and record.output_tokens == 3
    assert record.ended - record.sent >= 3 * STEP + late  # the request itself lasts until its stream ends
    summary = report.summarize(runner.RunResult([record], 1.0), {})
    # 2 gaps of STEP over the 2 tokens after the first; not (2 STEP + late) / 2
    assert summary["mean_tpot_ms"] == pytest.approx(1000 * STEP, abs=1000 * STEP / 2)
    assert record.tpot == pytest.approx(summary["mean_tpot_ms"] / 1000)


def test_itl_is_one_gap_per_token_bearing_event() -> None:
    record = recorded([(STEP, token_event(2)), (STEP, token_event(3)), (0.0, oe.GenerateResponse()),
                       (STEP, token_event(2)), (0.0, oe.GenerateResponse(finished=oe.GenerationFinished()))])
    assert record.counted_tokens == 7
    assert len(record.itl) == 2  # three token-bearing events: two gaps, whatever the tokens per event
    assert record.itl == pytest.approx([STEP, STEP], abs=STEP / 2)  # the whole gap, not gap/k for k tokens
    summary = report.summarize(runner.RunResult([record], 1.0), {})
    assert summary["median_itl_ms"] == pytest.approx(1000 * STEP, abs=1000 * STEP / 2)


def test_each_run_has_request_ids_of_its_own() -> None:
    request = workload.BenchRequest(3, 4, prompt="x")
    first, second = (workload.to_message(request, workload.RequestOptions("m")).request_id for _ in range(2))
    assert re.fullmatch(r"bench-[0-9a-f]{8}-3", first) and first != second


def test_two_runs_of_one_seed_share_a_server(toy: Toy, tmp_path: Path) -> None:
    flags = ("--num-prompts", "3", "--input-len", "4", "--output-len", "60", "--ignore-eos", "--seed", "5")
    results: list[dict[str, Any]] = []
    barrier = threading.Barrier(2)

    def one_run(name: str) -> None:
        out = tmp_path / f"{name}.json"
        barrier.wait()
        assert main(["bench", "--target", toy.address, "--no-progress", "--json", str(out), *flags]) == 0
        results.append(json.loads(out.read_text()))

    runs = [threading.Thread(target=one_run, args=(name,)) for name in ("a", "b")]
    for run in runs:
        run.start()
    for run in runs:
        run.join(timeout=60)
    assert toy.inference.peak > 3  # the two runs overlapped on the server
    assert [(r["completed"], r["errors"]) for r in results] == [(3, {}), (3, {})]
    assert len(set(toy.inference.ids)) == 6


def test_the_request_id_prefix_option_is_honoured(toy: Toy, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "--target", toy.address, "--no-progress", "--json", str(out), "--num-prompts", "3",
                 "--input-len", "4", "--output-len", "2", "--request-id-prefix", "run7-"]) == 0
    assert sorted(toy.inference.ids) == ["run7-0", "run7-1", "run7-2"]


@pytest.mark.parametrize(("line", "says"), [
    ({"token_ids": [11, UINT32_MAX + 1]}, f'"token_ids"[1] must be an integer in [0, {UINT32_MAX}], got 4294967296'),
    ({"token_ids": [11, True]}, '"token_ids"[1] must be an integer in [0, 4294967295], got true'),
    ({"prompt": "x", "output_len": UINT32_MAX + 1}, '"output_len" must be an integer in [1, 4294967295]'),
    ({"prompt": "x", "max_tokens": True}, '"max_tokens" must be an integer in [1, 4294967295], got true'),
    ({"token_ids": [11], "output_len": False}, '"output_len" must be an integer in [1, 4294967295], got false'),
])
def test_dataset_values_beyond_uint32_or_boolean_are_refused(tmp_path: Path, line: dict[str, Any], says: str) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(workload.WorkloadError) as refused:
        workload.dataset_requests(path, 10, 4)
    assert str(refused.value).startswith(f"{path}:2: {says}")
    assert workload.dataset_requests(path, 1, UINT32_MAX)[0].output_len == UINT32_MAX  # the largest is fine


def test_a_dataset_that_is_not_utf8_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    assert main(["bench", "--target", "127.0.0.1:1", "--dataset", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"refengine bench: --dataset {path}: not UTF-8 text (byte 15 of the file)\n"
