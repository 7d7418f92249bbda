"""Running the negative controls (tests/conformance/toy_controls.py): the WHOLE suite against each
control's own servers, every control at once.

The controls run at once (about 25 s each alone, mostly waiting on the toy's paced streams):
PROCESSES worker processes (forkserver: no gRPC state inherited from this one) take them from
one queue, THREADS at a time each, every control with servers of its own. Those processes run at
niceness NICE, so that the other pytest worker's servers are not starved meanwhile.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

from refengine.conformance import Options, run
from tests.conformance.toy_controls import Control
from tests.conformance.toy_kv_events import serve_kv
from tests.conformance.toy_media import PLACEHOLDER
from tests.conformance.toy_roles import serve_pair

#: 48 at once: the controls (126 on 2026-12-06) run in rounds of 48 (with ~80 controls, 48 at once
#: took 73-76 s here against 89 s for 40 at once).
PROCESSES, THREADS = 8, 6
#: The niceness of those processes (their threads inherit it). Together they take more than the
#: 2 cores of the CI machine (~200-300 s of CPU in ~180-220 s), and at the default priority their
#: dozens of runnable threads starved the other pytest worker: beside them, the real-engine G13,
#: G14, G17 and G18 checks and the X1 stall test of test_conformance.py took 173-217 s against
#: 114 s beside controls at niceness 10, which themselves took 204 s against 180-217 s (2026-12-07).
#: At niceness 10 their 48 threads still outweighed the other worker's one thread (CFS weights 110
#: each against 1024); at 19 (15 each) it keeps most of a core, and the controls take what it
#: leaves idle: the whole suite took 847 s (controls 253 s) against 1,052 s (277 s) at 10, one
#: run each on the same tree, 2026-12-07 (this machine's speed varies by about 10 %).
NICE = 19
#: The served model's config.json for the R checks' adapters: tiny shapes (the toy reads no weights).
MODEL_CONFIG = {"model_type": "llama", "hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2,
                "num_key_value_heads": 2, "head_dim": 4, "num_hidden_layers": 1}
#: E3's eviction check fills the toy's cache (4,096 blocks of 4) with ~20 fresh prompts: it runs
#: for the unbroken toy and the E3 controls; for the rest it skips (over its budget of 0 tokens).
EVICTION_BUDGET = 16384
#: A post-acceptance failure on demand: the toy sheds a request after 3 tokens (X1, X3).
SHED_AFTER = {"toy_fail_after": 3}

Outcome = tuple[str, str, str, str]  # check name, rule, status (its value), message
#: The controls' patience: 3 times the suite's default KV-event wait and unary deadline, and its
#: default idle timeout (it was 3 s). Found in CI: at niceness 19 beside the other pytest worker,
#: six controls' toys sent no snapshot within 10 s, and each failed E4 besides its own rule; a
#: unary RPC or a return to idle in such a stall fails a check the same way. A toy answers every
#: RPC, so only a wait for what a fault withholds runs out: 190 s for all 131 alone, as before.
EVENT_WAIT, RPC_TIMEOUT = 30.0, 30.0
#: Controls that take longest (their fault makes later checks wait out the idle timeout or the
#: event wait, or runs a long request to its end, or they fill the cache for E3): started first.
SLOW = ("kv-block-leaked-after-cancel", "context-off-by-one", "unbroken", "partial-block-stored",
        "eviction-unannounced", "recomputed-block-unannounced", "lagging-event-stream", "token-granular-cache",
        "salt-not-in-block-hash", "media-not-in-block-hash")


def run_control(control: Control) -> list[Outcome]:
    """The whole suite against ``control``'s servers; every check's outcome."""
    with tempfile.TemporaryDirectory() as tmp:
        config, lora_dir = os.path.join(tmp, "config.json"), os.path.join(tmp, "lora")
        os.mkdir(lora_dir)
        with open(config, "w") as f:
            json.dump(MODEL_CONFIG, f)
        server, address, engine = serve_kv(control.kv, control.faults)
        pair, prefill, decode, pair_engines = serve_pair(control.faults)
        options = Options(rpc_timeout_s=RPC_TIMEOUT, event_wait_s=EVENT_WAIT, prefill_address=prefill,
                          decode_address=decode, lora_dir=lora_dir, lora_model_config=config,
                          slow_reader_s=0.2, slow_reader_extra=SHED_AFTER,
                          media_placeholder_token_id=PLACEHOLDER if control.faults.images else None,
                          eviction_budget_tokens=EVICTION_BUDGET if control.rule in ("", "E3") else 0)
        try:
            results = run(address, None, options)
        finally:
            for s in (server, *pair):
                s.stop(0)
            for e in (engine, *pair_engines):
                e.running = False
    return [(r.name, r.rule, r.status.value, r.message) for r in results]


_work: Any = None  # a worker process's queue of controls to run (None: no more)


def take_work(queue: Any) -> None:
    """A worker process's initializer: before it starts any thread (Linux: a thread's niceness
    is inherited by the threads it starts)."""
    global _work
    os.nice(NICE)
    _work = queue


def run_queued() -> dict[str, list[Outcome]]:
    """One worker process's share: THREADS threads taking controls from the queue until it is empty."""
    found: dict[str, list[Outcome]] = {}

    def drain() -> None:
        while (control := _work.get()) is not None:
            found[control.id] = run_control(control)

    with ThreadPoolExecutor(THREADS) as pool:
        for done in [pool.submit(drain) for _ in range(THREADS)]:
            done.result()
    return found


def run_all(controls: list[Control]) -> dict[str, list[Outcome]]:
    """Every control's outcomes, run at once: PROCESSES worker processes take them from one
    queue (the slow ones first, so that none of them starts last)."""
    context = multiprocessing.get_context("forkserver")
    queue = context.Queue()
    for control in sorted(controls, key=lambda c: c.id not in SLOW) + [None] * (PROCESSES * THREADS):
        queue.put(control)
    found: dict[str, list[Outcome]] = {}
    with ProcessPoolExecutor(PROCESSES, mp_context=context, initializer=take_work, initargs=(queue,)) as pool:
        for part in [pool.submit(run_queued) for _ in range(PROCESSES)]:
            found.update(part.result())
    return found
