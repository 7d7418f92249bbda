"""A real ``refengine serve`` on loopback for the integration tests.

``server_address`` (session scope) yields ``"127.0.0.1:PORT"`` of one shared server running
the embedded default model (smollm2-135m-instruct) with a small KV pool; it is READY
(Health polled) before any test uses it. Other suites can reuse it::

    from tests.integration.conftest import refengine_server, server_address  # noqa: F401

or start their own with :func:`start_server` (any extra ``refengine serve`` flags).

The server runs with ``OMP_NUM_THREADS=1``: on a small shared CPU machine torch's intra-op
threads oversubscribe the cores and make decoding 5-10x slower.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import grpc  # noqa: E402
import pytest  # noqa: E402

from refengine.client import OpenEngineClient  # noqa: E402
from refengine.protocol import oe  # noqa: E402
from refengine.protocol.addresses import announced_listeners  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
SHARED_ALIAS = "smollm2-alias"  # a second accepted name (D8: served_model_aliases)
#: Flags of the shared server: a 2048-token context, 128 KV blocks of 16 tokens, generous
#: stall timeout (tests tighten it per request through ``extra``), a short drain, one alias.
SHARED_SERVER_ARGS = (
    "--served-model-alias", SHARED_ALIAS,
    "--max-model-len", "2048", "--num-kv-blocks", "128", "--max-num-seqs", "16",
    "--stream-buffer", "16", "--stall-timeout-seconds", "20", "--shutdown-grace-seconds", "5",
)


@dataclass
class ServerProcess:
    """A ``refengine serve`` subprocess. ``startup_states`` holds every Health state seen
    while waiting for READY (names such as ``HEALTH_STATE_STARTING``).

    It listens on port 0 (a port the kernel picks at bind) and says which: a port picked by the
    test beforehand could be taken meanwhile, and then a server of another test, or a toy, could
    answer there. ``address`` and ``control_address`` wait for that announcement."""

    proc: subprocess.Popen
    log_path: Path
    startup_states: list[str] = field(default_factory=list)
    _services: dict[str, str] = field(default_factory=dict)  # service name -> HOST:PORT

    @property
    def address(self) -> str:
        """HOST:PORT of Inference (and of Control, unless it has a listener of its own)."""
        return self.listening()["Inference"]

    @property
    def control_address(self) -> str:
        return self.listening()["Control"]

    def listening(self, timeout: float = 120.0) -> dict[str, str]:
        """Service name -> the HOST:PORT the server announced, once it bound every listener."""
        if self._services:
            return self._services
        deadline = time.monotonic() + timeout
        while not (services := announced_listeners(self.log_tail(chars=1 << 20))):
            if self.proc.poll() is not None:
                raise RuntimeError(f"refengine serve exited with {self.proc.returncode} before listening:\n"
                                   f"{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"refengine serve not listening after {timeout:g} s:\n{self.log_tail()}")
            time.sleep(0.05)
        self._services = services
        return services

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def client(self, **kwargs: object) -> OpenEngineClient:
        return OpenEngineClient(self.control_address, **kwargs)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait; SIGKILL if it does not exit. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode


def _wait_ready(server: ServerProcess, timeout: float) -> None:
    channel = grpc.insecure_channel(server.control_address)
    stub = oe.ControlStub(channel)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                code = server.proc.returncode
                raise RuntimeError(f"refengine serve exited with {code}:\n{server.log_tail()}")
            try:
                state = oe.HealthState.Name(stub.Health(oe.HealthRequest(), timeout=2).state)
            except grpc.RpcError:
                state = "NO_ANSWER"
            if not server.startup_states or server.startup_states[-1] != state:
                server.startup_states.append(state)
            if state == "HEALTH_STATE_READY":
                return
            time.sleep(0.1)
    finally:
        channel.close()
    server.stop()
    raise TimeoutError(f"refengine serve not READY after {timeout:g} s:\n{server.log_tail()}")


def start_server(log_path: Path, *extra_args: str, control_port: bool = False, wait_ready: bool = True,
                 timeout: float = 240.0, patch: str = "") -> ServerProcess:
    """Start ``python -m refengine.cli serve`` on 127.0.0.1 (port 0: see ServerProcess) and, by default,
    wait until Health is READY. ``control_port``: put Control on its own listener. ``patch``:
    Python run in the server process before the CLI (a deliberately broken server for a test)."""
    launcher = ["-c", f"{patch}\nimport sys\nfrom refengine.cli import main\nsys.exit(main(sys.argv[1:]))"] \
        if patch else ["-m", "refengine.cli"]
    args = [sys.executable, *launcher, "serve", "--model", MODEL, "--host", "127.0.0.1", "--port", "0", *extra_args]
    if control_port:
        args += ["--control-port", "0"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": os.environ.get("REFENGINE_TEST_THREADS", "1"),
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = open(log_path, "w")  # noqa: SIM115 - the child owns it while it runs
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    server = ServerProcess(proc, log_path)
    if wait_ready:
        _wait_ready(server, timeout)
    return server


def wait_ready(server: ServerProcess, timeout: float = 240.0) -> None:
    _wait_ready(server, timeout)


@contextmanager
def running_server(log_path: Path, *extra_args: str) -> Iterator[ServerProcess]:
    """A READY server for the block; it must then stop cleanly (exit code 0)."""
    server = start_server(log_path, *extra_args)
    try:
        yield server
    finally:
        code = server.stop()
        assert code == 0, f"server exited with {code}:\n{server.log_tail()}"


@pytest.fixture(scope="session")
def refengine_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("refengine-server") / "server.log", *SHARED_SERVER_ARGS) as server:
        yield server


@pytest.fixture(scope="session")
def server_address(refengine_server: ServerProcess) -> str:
    """``"127.0.0.1:PORT"`` of the shared, READY server (Inference and Control)."""
    return refengine_server.address


@pytest.fixture
def client(server_address: str) -> Iterator[OpenEngineClient]:
    with OpenEngineClient(server_address) as c:
        yield c


# -- helpers shared by the server tests ---------------------------------------------
@dataclass
class Stream:
    """One Generate call: its events and final status."""

    events: list = field(default_factory=list)  # oe.GenerateResponse
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""

    def of(self, kind: str) -> list:
        return [getattr(e, kind) for e in self.events if e.WhichOneof("event") == kind]

    def tokens(self, index: int = 0) -> list[int]:
        return [t.token_id for out in self.of("token") if out.output_index == index for t in out.tokens]

    def text(self, index: int = 0) -> str:
        return "".join(out.text for out in self.of("token") if out.output_index == index)

    def finished(self, index: int = 0):  # noqa: ANN201 - oe.GenerationFinished
        found = [f for f in self.of("finished") if f.output_index == index]
        assert len(found) == 1, f"output {index}: {len(found)} GenerationFinished"
        return found[0]


def collect(client: OpenEngineClient, request: oe.GenerateRequest, metadata: tuple = (),
            timeout: float = 120.0) -> Stream:
    stream = Stream()
    try:
        for event in client.generate(request, metadata=metadata, timeout=timeout):
            stream.events.append(event)
    except grpc.RpcError as exc:
        stream.code, stream.details = exc.code(), exc.details()
    return stream


def check_stream(stream: Stream, request: oe.GenerateRequest, success: bool = True) -> None:
    """The stream invariants every accepted Generate must keep (G9–G16, L1, X1)."""
    assert stream.code == grpc.StatusCode.OK, f"{stream.code}: {stream.details}"
    n = request.sampling.num_sequences if request.sampling.HasField("num_sequences") else 1
    finished: set[int] = set()
    seen_token = False
    for position, event in enumerate(stream.events):
        kind = event.WhichOneof("event")
        last = position == len(stream.events) - 1
        assert event.request_id == request.request_id  # G9
        assert event.HasField("usage") == last, f"usage on event {position} of {len(stream.events)}"  # G16
        if kind == "prompt":
            assert not seen_token and position == 0  # L1
        elif kind in ("token", "finished"):
            body = getattr(event, kind)
            assert body.HasField("output_index") and 0 <= body.output_index < n  # G10
            assert body.output_index not in finished  # G12: nothing after the end of an output
            if kind == "token":
                seen_token = True
            else:
                assert body.reason != oe.FINISH_REASON_UNSPECIFIED
                if body.reason == oe.FINISH_REASON_STOP:
                    assert body.stop_match.WhichOneof("match") is not None  # G13
                finished.add(body.output_index)
        elif kind == "error":
            assert last and not success, f"EngineError: {event.error}"  # X1
        else:
            raise AssertionError(f"unexpected event {kind}")
    if success:
        assert finished == set(range(n))  # G12: one GenerationFinished per output
    usage = stream.events[-1].usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.cached_prompt_tokens <= usage.prompt_tokens
    emitted = sum(len(out.tokens) for out in stream.of("token"))
    if success:
        assert usage.completion_tokens == emitted


def wait_idle(client: OpenEngineClient, used_blocks: int = 0, timeout: float = 30.0) -> oe.LoadInfo:
    """Poll GetLoad until nothing runs or queues and ``used_kv_blocks`` is back to ``used_blocks``."""
    deadline = time.monotonic() + timeout
    while True:
        load = client.load()
        if load.running_requests == 0 and load.queued_requests == 0 and load.used_kv_blocks == used_blocks:
            return load
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout:g} s: {load}")
        time.sleep(0.05)


def greedy_request(request_id: str, prompt: str | None = None, max_tokens: int = 8,
                   **stopping: object) -> oe.GenerateRequest:
    request = oe.GenerateRequest(request_id=request_id)
    if prompt is not None:
        request.prompt = prompt
    request.sampling.temperature = 0.0
    request.stopping.max_tokens = max_tokens
    for key, value in stopping.items():
        setattr(request.stopping, key, value)
    return request
