"""Command-line mistakes found by a review of the CLI (2026-12-06): each is a one-line error
naming the flag, exit 2, no traceback, before anything loads or connects."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from refengine.args_config import engine_config_from_args
from refengine.cli import build_parser
from refengine.server.args import options_from_args

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "refengine.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        yield taken.getsockname()[1]


@pytest.mark.parametrize("flag", ["--port", "--control-port"])
def test_a_port_in_use_is_a_usage_error(busy_port: int, flag: str) -> None:
    ports = ["--port", str(busy_port)] if flag == "--port" else ["--port", "0", "--control-port", str(busy_port)]
    result = cli("serve", "--host", "127.0.0.1", *ports)
    assert "Traceback" not in result.stderr, result.stderr[-600:]
    assert result.returncode == 2 and f"{flag} {busy_port}: cannot listen" in result.stderr, result.stderr[-600:]
    # Found by review: the Inference listener's port was announced, then the process exited.
    assert "listening on" not in result.stdout, "a port announced that never served"


@pytest.mark.parametrize(("argv", "flag"), [
    (["--stream-buffer", "0"], "--stream-buffer"),
    (["--stream-buffer-mib", "0"], "--stream-buffer-mib"),
    (["--stream-buffer-mib", "4096"], "--stream-buffer-mib"),
    (["--shutdown-grace-seconds", "0"], "--shutdown-grace-seconds"),
    (["--stall-timeout-seconds", "0"], "--stall-timeout-seconds"),
    (["--health-probe-timeout-seconds", "0"], "--health-probe-timeout-seconds"),
    (["--max-send-message-mib", "0"], "--max-send-message-mib"),
    (["--max-receive-message-mib", "4096"], "--max-receive-message-mib"),  # beyond gRPC's C int of bytes
    (["--shutdown-grace-seconds", "inf"], "--shutdown-grace-seconds"),
    (["--stall-timeout-seconds", "1e10"], "--stall-timeout-seconds"),
    (["--health-probe-timeout-seconds", "inf"], "--health-probe-timeout-seconds"),
    (["--control-host", "127.0.0.1"], "--control-host needs --control-port"),  # was ignored
    (["--kv-events-zmq-replay", "tcp://127.0.0.1:5998"], "need --kv-events-zmq"),  # was ignored
    (["--kv-events-zmq-topic", "kv"], "need --kv-events-zmq"),
])
def test_server_option_errors_name_the_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        options_from_args(build_parser().parse_args(["serve", *argv]))


@pytest.mark.parametrize(("argv", "flag"), [
    (["--media-max-mib", "1e308"], "--media-max-mib"),  # finite, but its bytes overflow
    (["--guided-cache-mib", "1e308"], "--guided-cache-mib"),
    (["--served-model-alias", ""], "--served-model-alias"),
    (["--device", "gpu"], "--device"),
    (["--num-threads", "99999999999"], "--num-threads"),
    # Durations past MAX_SECONDS (found by review): inf crashed a prefill engine's step loop (its
    # lease in nanoseconds), and inf or 1e10 failed every guided compile, KV pull or URL fetch.
    *[([flag, value], flag) for flag in ("--kv-session-ttl", "--kv-pull-timeout", "--guided-compile-timeout",
                                         "--guided-max-token-seconds", "--media-url-timeout", "--embedding-lease",
                                         "--embedding-max-lease", "--embedding-pull-timeout")
      for value in ("inf", "1e10")],
    # Counts the wire carries as uint32 (found by review: accepted, then GetModelInfo and
    # GetKvEventSources failed with INTERNAL), and buffers beside them.
    *[([flag, str(1 << 32)], flag) for flag in ("--max-logprobs", "--max-num-seqs", "--max-num-batched-tokens",
                                                 "--max-sequences-per-request", "--kv-events-subscriber-buffer",
                                                 "--kv-events-retained-batches")],
    (["--guided-compile-threads", "65"], "--guided-compile-threads"),  # started up front: 100,000 failed the load
    (["--media-url-allow", "http://x/"], "--media-url-allow"),  # a URL never matched a request's host
    (["--attention-backend", "triton"], "--attention-backend"),  # needs CUDA: failed after listening
])
def test_engine_option_errors_name_the_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        engine_config_from_args(build_parser().parse_args(["serve", *argv]))


@pytest.mark.parametrize("argv", [
    ["bench", "--target", "", "--num-prompts", "1", "--no-progress"],
    ["bench", "--target", "localhost", "--num-prompts", "1", "--no-progress"],
    ["bench", "--target", "127.0.0.1:1", "--temperature", "nan", "--no-progress"],
    ["generate", "hi", "--remote", ""],
    ["generate", "hi", "--role", "decode"],  # in-process: loaded the model, then failed with exit 1
    ["generate", "hi", "--role", "prefill"],
    ["conformance", "--target", "127.0.0.1"],
    ["conformance", "--target", "127.0.0.1:1", "--prefill", "127.0.0.1:2"],  # half a pair
    ["conformance", "--target", "127.0.0.1:1", "--eviction-budget-tokens", "-5"],
    ["conformance", "--target", "127.0.0.1:1", "--slow-reader-seconds", "nan"],
])
def test_client_command_mistakes_exit_2_at_once(argv: list[str]) -> None:
    result = cli(*argv, timeout=30)
    assert "Traceback" not in result.stderr, result.stderr[-600:]
    assert result.returncode == 2, (result.returncode, result.stderr[-600:])


def test_an_unusable_cache_directory_is_one_line_not_a_traceback(tmp_path) -> None:  # noqa: ANN001
    """Found by review: ``REFENGINE_CACHE_DIR`` under a file ended ``generate`` in a traceback."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = subprocess.run([sys.executable, "-m", "refengine.cli", "generate", "hi", "--max-tokens", "1"],
                            capture_output=True, text=True, timeout=120,
                            env={**ENV, "REFENGINE_CACHE_DIR": str(blocker / "cache")})
    assert "Traceback" not in result.stderr, result.stderr[-600:]
    assert result.returncode == 2 and "REFENGINE_CACHE_DIR" in result.stderr and str(blocker) in result.stderr


@pytest.mark.parametrize("what", ["unknown name", "no such path", "incomplete directory", "pickle only", "empty"])
def test_a_model_that_cannot_be_found_is_refused_before_listening(tmp_path, what: str) -> None:  # noqa: ANN001
    """Found by review: the server listened, then the loader failed (exit 1 after announcing its
    ports). A model string that leads to no servable files is now exit 2, as a bad flag is."""
    directory = tmp_path / "model"
    directory.mkdir()
    if what == "pickle only":
        (directory / "pytorch_model.bin").write_bytes(b"")
    model = {"unknown name": "no-such-model", "no such path": str(tmp_path / "nowhere"), "empty": ""}.get(
        what, str(directory))
    result = cli("serve", "--host", "127.0.0.1", "--port", "0", "--model", model, timeout=60)
    assert "Traceback" not in result.stderr, result.stderr[-600:]
    assert "listening on" not in result.stdout, "a port announced for a model that cannot load"
    expected = {"unknown name": "neither a known model name", "no such path": "neither a known model name",
                "incomplete directory": "missing config.json", "pickle only": "pickle",
                "empty": "--model: empty: give a manifest name"}[what]
    assert result.returncode == 2 and "refengine serve: --model: " in result.stderr, result.stderr[-600:]
    assert expected in result.stderr, result.stderr[-600:]


def test_a_model_that_fails_to_load_ends_the_server_with_exit_1(tmp_path) -> None:  # noqa: ANN001
    """What only loading finds (here an empty weight file) still ends the server after it listened:
    exit 1, the reason in its log."""
    directory = tmp_path / "model"
    directory.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_text("{}" if name.endswith(".json") else "")
    result = cli("serve", "--host", "127.0.0.1", "--port", "0", "--model", str(directory))
    assert "listening on 127.0.0.1:" in result.stdout, result.stdout
    assert result.returncode == 1 and "the model failed to load" in result.stderr, result.stderr[-600:]


def test_the_model_check_imports_no_torch() -> None:
    """The check runs before ``serve`` listens, which is within a quarter second without torch."""
    code = ("import sys\nfrom refengine.commands.serve_model import model_problem\n"
            "assert model_problem('smollm2-135m-instruct') == ''\nassert 'torch' not in sys.modules, 'torch'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=ENV)
    assert result.returncode == 0, result.stderr[-600:]
