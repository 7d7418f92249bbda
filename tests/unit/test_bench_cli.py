"""``refengine bench`` (and ``generate``) as a user meets them: Ctrl-C cancels the streams and
exits 130, a closed stdout exits 141 quietly, bad flags and files are one-line usage errors
found before the run, and vllm's flag spellings are accepted."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from refengine.bench import runner, workload
from refengine.bench.progress import Progress
from refengine.cli import build_parser, main
from refengine.client import OpenEngineClient
from tests.unit.test_bench import REPO, Toy


@pytest.fixture
def toy() -> Iterator[Toy]:
    server = Toy()
    yield server
    server.stop()


def until(condition: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


#: Runs the CLI with Ctrl-C raising KeyboardInterrupt. A process started in the background by a
#: non-interactive shell (as CI may run the suite) inherits SIGINT ignored, and Python then installs
#: no handler; set here, after exec (a preexec_fn ran between fork and exec in this threaded
#: process, where gRPC's fork handlers once aborted the child: epoll_wait EBADF, SIGABRT).
LAUNCH = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
          "from refengine.cli import main; sys.exit(main(sys.argv[1:]))")


def refengine(*args: str, stdout: int = subprocess.PIPE) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", LAUNCH, *args], cwd=REPO, stdout=stdout,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})


def interrupted(toy: Toy, streams: int, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``refengine args``, Ctrl-C it once the server streams ``streams`` requests; its
    result and the seconds it took to exit."""
    proc = refengine(*args)
    try:
        assert until(lambda: toy.inference.in_flight >= streams or proc.poll() is not None), "no streams started"
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        out, err = proc.communicate(timeout=30)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.monotonic() - sent
    finally:
        proc.kill()
        proc.wait()


LONG = ("--input-len", "4", "--output-len", "900", "--ignore-eos", "--no-progress")  # ~18 s a request on the toy


def test_ctrl_c_cancels_the_streams_and_exits_promptly(toy: Toy) -> None:
    done, took = interrupted(toy, 2, "bench", "--target", toy.address, "--num-prompts", "20", "--request-rate", "20",
                             *LONG)
    assert done.returncode == 130 and took < 5, (took, done.stderr)
    assert until(lambda: toy.inference.in_flight == 0 and not toy.engine.jobs, timeout=5)  # aborted, not finished
    assert len(toy.inference.ids) < 20  # what was still to come was never sent


@pytest.fixture
def sigint_raises() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt in this process, even when the suite runs with SIGINT
    ignored (see ``_default_sigint``)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("sigint_raises")
def test_an_interrupted_run_cancels_its_calls(toy: Toy) -> None:
    """In the runner itself: the channel stays open, yet the server's streams end at once;
    the progress bar, closed, does not draw the cancelled requests after its last line."""
    requests = [workload.BenchRequest(i, 900, token_ids=(11, 12)) for i in range(4)]
    main_thread = threading.get_ident()
    threading.Thread(target=lambda: until(lambda: toy.inference.in_flight == 2)
                     and signal.pthread_kill(main_thread, signal.SIGINT), daemon=True).start()
    bar = Progress(4, io.StringIO())
    with OpenEngineClient(toy.address) as client:
        send = runner.GrpcSender(client, workload.RequestOptions("toy", ignore_eos=True))
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            runner.run(requests, [0.0, 0.0, 30.0, 30.0], send, progress=bar, cancel=send.cancel)
        assert time.monotonic() - start < 5
        assert until(lambda: toy.inference.in_flight == 0, timeout=5) and len(toy.inference.ids) == 2
        assert until(lambda: bar.done == 2, timeout=5) and bar.stream.getvalue() == f"\r[{'.' * 30}] 0/4\n"


def test_ctrl_c_ends_any_subcommand_without_a_traceback(toy: Toy) -> None:
    done, _ = interrupted(toy, 1, "generate", "--remote", toy.address, "--max-tokens", "900", "--ignore-eos", "hi")
    assert done.returncode == 130 and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("command", ["bench", "generate"])
def test_a_closed_stdout_exits_quietly(toy: Toy, command: str) -> None:
    read, write = os.pipe()
    os.close(read)  # `| head -1` that has already exited: every write to stdout fails
    args = (["bench", "--target", toy.address, "--num-prompts", "2", "--input-len", "4", "--output-len", "3",
             "--json"] if command == "bench" else ["generate", "--remote", toy.address, "--max-tokens", "3", "hi"])
    proc = refengine(*args, stdout=write)
    os.close(write)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141 and "BrokenPipeError" not in err and "Traceback" not in err, err


def test_a_closed_stdout_still_gets_the_json_file_written(toy: Toy, tmp_path: Path) -> None:
    """The file asked for is written before the table (found by review: `bench --json F | true`
    lost the run's results, the table's print failing first)."""
    read, write = os.pipe()
    os.close(read)
    path = tmp_path / "result.json"
    proc = refengine("bench", "--target", toy.address, "--num-prompts", "2", "--input-len", "4", "--output-len", "3",
                     "--json", str(path), stdout=write)
    os.close(write)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141, err
    assert json.loads(path.read_text())["completed"] == 2


def test_an_unwritable_json_path_stops_the_run_before_it_starts(toy: Toy, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    for path in (tmp_path / "missing" / "out.json", tmp_path):
        assert main(["bench", "--target", toy.address, "--num-prompts", "2", "--json", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"refengine bench: --json {path}: ") and err.count("\n") == 1
    assert toy.inference.ids == []  # nothing was sent
    assert list(tmp_path.iterdir()) == []  # and the check left no file behind


def bad_flag(capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    """argparse's complaint about ``flags``, which must be a usage error."""
    with pytest.raises(SystemExit) as exited:
        main(["bench", "--target", "127.0.0.1:1", *flags])
    assert exited.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_a_guided_json_file_that_is_not_utf8_is_a_usage_error(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    schema = tmp_path / "schema.json"
    schema.write_bytes('{"title": "caf\u00e9"}'.encode("latin-1"))
    assert bad_flag(capsys, "--guided-json", str(schema)).endswith(
        f"argument --guided-json: {schema}: not UTF-8 text (byte 14 of the file)")


@pytest.mark.parametrize(("flags", "says"), [
    (("--output-len", "4294967296"), "argument --output-len/--random-output-len: must be an integer in "
                                     "[1, 4294967295], got '4294967296'"),
    (("--logprobs", "4294967296"), "argument --logprobs: must be an integer in [0, 4294967295], got '4294967296'"),
    (("--num-prompts", "many"), "argument --num-prompts: must be an integer >= 1, got 'many'"),
    (("--max-concurrency", "0"), "argument --max-concurrency: must be an integer >= 1, got '0'"),
    (("--request-rate", "fast"), "argument --request-rate: must be a number > 0, got 'fast'"),
    (("--range-ratio", "nan"), "argument --range-ratio/--random-range-ratio: must be a number in [0, 1), got 'nan'"),
    # inf (or 1e12) passed and every request then failed DEADLINE_EXCEEDED at once
    (("--timeout", "inf"), "argument --timeout: must be seconds in (0, 1e+07], got 'inf'"),
])
def test_bad_numbers_say_what_is_expected(capsys: pytest.CaptureFixture[str], flags: tuple[str, ...],
                                          says: str) -> None:
    complaint = bad_flag(capsys, *flags)
    assert complaint.endswith(says) and "_positive" not in complaint and "invalid" not in complaint


def test_vllm_flag_spellings() -> None:
    args = build_parser().parse_args(["bench", "--target", "t:1", "--random-input-len", "7", "--random-output-len", "9",
                                      "--random-range-ratio", "0.25", "--disable-tqdm", "--num-prompts", "3",
                                      "--request-id-prefix", "x-"])
    assert (args.input_len, args.output_len, args.range_ratio, args.no_progress, args.num_prompts,
            args.request_id_prefix) == (7, 9, 0.25, True, 3, "x-")
