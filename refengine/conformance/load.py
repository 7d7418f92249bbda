"""Load mode (``--load N --duration S``): the rules must hold under concurrency too.

N client threads send requests for S seconds. Each request is, by a seeded draw, one of:
read to the end, cancelled by the client mid-stream, aborted with ``Abort`` mid-stream, or
malformed (no input, a negative temperature, top_p above 1, num_sequences 0). Afterwards the
target must report no running or queued request and no more used KV blocks than before the
run (GetLoad). Every outcome is counted by kind (``ok``, ``cancelled``, ``aborted``,
``refused:INVALID_ARGUMENT``, ``status:RESOURCE_EXHAUSTED``, ``engine_error:ERROR_CODE_OVERLOADED``, ...).

Three results join the report, in profile ``load``:
- ``X1:load_malformed_refused``: every malformed request was refused before acceptance,
  with INVALID_ARGUMENT and zero events;
- ``G12:load_streams_valid``: every stream that ended, ended by the structural rules (one
  finish, usage on the final event, nothing after an EngineError);
- ``H4:load_idle_after``: GetLoad is back to idle after the run.
Overload refusals (RESOURCE_EXHAUSTED, UNAVAILABLE) and overload EngineErrors are allowed: a
server may shed load, it must do it by the rules.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import grpc

from refengine.conformance.assertions import stream_violations
from refengine.conformance.options import MAX_DEADLINE_SECONDS
from refengine.conformance.registry import CheckFailed, CheckSkipped, Status
from refengine.conformance.runner import Report, Result
from refengine.conformance.streams import StreamResult
from refengine.conformance.target import Options, Target
from refengine.protocol import oe

KINDS = ("complete", "cancel", "abort", "malformed")
WEIGHTS = (0.55, 0.2, 0.1, 0.15)
SHED = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
MAX_PROBLEMS = 5  # kept per result: enough to act on, bounded however long the run
#: Client threads at most: one process's threads past that judge the client's scheduling, not the
#: server (found by review: 20,000 streams hit their own deadlines, blamed on G12).
MAX_STREAMS = 256


@dataclass(frozen=True)
class LoadOptions:
    streams: int
    duration_s: float
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.streams <= MAX_STREAMS or not 0 < self.duration_s <= MAX_DEADLINE_SECONDS:  # nan, inf
            raise ValueError(f"--load needs 1 <= N <= {MAX_STREAMS} and --duration > 0 (got {self.streams}, "
                             f"{self.duration_s})")


def _malformed(t: Target, rng: random.Random) -> Any:
    req = t.request("load-bad", max_tokens=4)
    how = rng.randrange(4)
    if how == 0:
        req.ClearField("prompt")
        req.ClearField("token_ids")
    elif how == 1:
        req.sampling.temperature = -1.0
    elif how == 2:
        req.sampling.top_p = 2.0
    else:
        req.sampling.num_sequences = 0
    return req


class _Tally:
    """Outcomes by kind and the problems found, shared by the client threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()
        self.malformed_sent = 0
        self.malformed: list[str] = []
        self.streams: list[str] = []

    def add(self, outcome: str, malformed: bool = False, malformed_problem: str = "",
            stream_problems: list[str] = ()) -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            self.malformed_sent += malformed
            if malformed_problem and len(self.malformed) < MAX_PROBLEMS:
                self.malformed.append(malformed_problem)
            self.streams.extend(stream_problems[: max(0, MAX_PROBLEMS - len(self.streams))])


def _outcome(res: StreamResult, kind: str) -> str:
    errors = res.of("error")
    if errors:
        code = errors[0].code
        return f"engine_error:{oe.ErrorCode.Name(code) if code in oe.ErrorCode.values() else code}"
    if not res.ok:
        cut = kind == "cancel" and res.code == grpc.StatusCode.CANCELLED
        return "cancelled" if cut else f"{'refused' if not res.events else 'status'}:{res.code.name}"
    return "aborted" if kind == "abort" else "ok"


def _one(t: Target, rng: random.Random, tally: _Tally) -> None:
    kind = rng.choices(KINDS, WEIGHTS)[0]
    if kind == "malformed":
        res = t.generate(_malformed(t, rng))
        problem = "" if (res.code == grpc.StatusCode.INVALID_ARGUMENT and not res.events) else \
            f"{res.request_id}: malformed request answered {res.describe()}"
        tally.add(f"refused:{res.code.name}" if not res.ok else "accepted_malformed", True, problem)
        return
    req = t.request("load", max_tokens=rng.randint(4, 32), ignore_eos=True)
    after = rng.randint(1, 3)
    on_event = None
    if kind == "cancel":
        on_event = t.canceller(after)
    elif kind == "abort":
        on_event = t.aborter(req.request_id, after)
    res = t.generate(req, on_event=on_event)
    outcome = _outcome(res, kind)
    # Shed before acceptance, or ended by this client's own deadline: counted, not judged.
    if (res.code in SHED and not res.events) or res.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        tally.add(outcome)
        return
    problems = stream_violations(res, cancelled_ok=kind == "cancel")
    if kind == "cancel":  # a cut stream has no finish: only the other structural rules apply
        problems = [p for p in problems if not p.startswith("G12")]
    tally.add(outcome, stream_problems=[f"{res.request_id}: {p}" for p in problems])


def _client(t: Target, seed: int, deadline: float, tally: _Tally) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        _one(t, rng, tally)


def _result(rule: str, name: str, title: str, problems: list[str], ok_note: str, seconds: float,
            status: Status | None = None) -> Result:
    status = status or (Status.FAIL if problems else Status.PASS)
    return Result(rule, rule.rstrip("0123456789"), title, f"{rule}:{name}", status,
                  "; ".join(problems) if problems else ok_note, seconds, "load")


def run_load(report: Report, address: str, options: Options, load: LoadOptions) -> Report:
    """Run the load against ``address`` and return ``report`` with its results and counts added."""
    start = time.perf_counter()
    tally = _Tally()
    with Target(address, dataclasses.replace(options, stream_timeout_s=max(options.stream_timeout_s, load.duration_s)),
                options.control_address) as t:
        deadline = time.monotonic() + load.duration_s
        threads = [threading.Thread(target=_client, args=(t, load.seed * 1000 + i, deadline, tally), daemon=True)
                   for i in range(load.streams)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(load.duration_s + options.stream_timeout_s)
        unobserved = ""  # GetLoad is optional: without it the idle result is not claimed, not a crash
        idle: list[str] = []
        try:
            after = t.wait_idle("after the load")
            idle_note = f"idle: running 0, queued 0, used_kv_blocks {after.used_kv_blocks}"
        except CheckFailed as exc:
            idle, idle_note = [str(exc)], ""
        except CheckSkipped as exc:
            idle_note = unobserved = str(exc)
    seconds = time.perf_counter() - start
    total = sum(tally.outcomes.values())
    nothing = Status.SKIP  # a run too short to send any: nothing observed is no pass (found by review)
    results = [
        _result("X1", "load_malformed_refused", "load: malformed requests refused before acceptance",
                tally.malformed, f"{tally.malformed_sent} malformed refused" if tally.malformed_sent
                else "no malformed request was sent in the run", seconds, None if tally.malformed_sent else nothing),
        _result("G12", "load_streams_valid", "load: every stream ends by the structural rules",
                tally.streams, f"{total} requests" if total else "no request was sent in the run", seconds,
                None if total else nothing),
        _result("H4", "load_idle_after", "load: GetLoad back to idle, no used KV block held", idle, idle_note,
                seconds, Status.NOT_CLAIMED if unobserved else None),
    ]
    counts = {"streams": load.streams, "duration_s": load.duration_s, "seed": load.seed, "requests": total,
              "outcomes": dict(sorted(tally.outcomes.items()))}
    return dataclasses.replace(report, results=[*report.results, *results], load=counts)
