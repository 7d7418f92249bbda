"""Driving the engine: its step loop on a background thread, woken by new work, and its
shutdown, which ends what is still active. A mixin of ``Engine`` (it uses the front end's lock,
inbox and flags), kept apart so ``engine.py`` reads as the front end alone.
``Engine.run_until_done`` steps synchronously instead.

The loop steps while requests are active, unless the last step ran nothing (only pulls in
flight: ``_stalled``), in which case it waits for a wake or polls every ``STALLED_POLL_SECONDS``;
a KV session falling due wakes it too. A step that raises ends every request with one terminal
error (``fail_all``) and the loop goes on. Asked to stop, it still steps once more while aborts
are pending, so the requests a draining server cut off during a long step free their KV.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from refengine.types import EngineFault, EngineStoppedError, RequestOutput

if TYPE_CHECKING:
    from refengine.engine.engine import Engine

logger = logging.getLogger(__name__)

STALLED_POLL_SECONDS = 0.05  # a loop with requests but nothing to run looks again this often
IDLE_POLL_SECONDS = 60.0  # the longest wait for a due session: never near threading.TIMEOUT_MAX


class EngineLoopMixin:
    def start(self: Engine) -> None:
        """Run ``step`` on a background thread whenever there is work. An engine that was
        ``shutdown``, or stopped by a fault it could not end its requests after, may not start
        again (found by review: a shut-down engine's grammar compiler and pull executors are
        closed, so a restarted one failed every guided request; a broken one's ``start`` did
        nothing, and every request was refused as "shut down")."""
        if self._shut_down:
            raise EngineStoppedError("the engine was shut down and cannot be restarted: make a new one")
        if self._broken:
            raise EngineStoppedError("the engine stopped after a fault it could not recover from: make a new one")
        if self._loop_thread is not None:
            return
        self._stopping = False
        self._loop_thread = threading.Thread(target=self._loop, name="refengine-step-loop", daemon=True)
        self._loop_thread.start()

    def on_stopped(self: Engine, callback: Callable[[str], None]) -> None:
        """``callback(reason)`` when the loop stops itself after a fault (:meth:`_end_all`)."""
        self._stopped_callbacks.append(callback)

    def shutdown(self: Engine) -> None:
        """Stop the loop, then end every request still active with one terminal error, CANCELLED
        and retryable (a server drains first; an in-process caller would otherwise wait on them
        forever). Called from a sink or callback, on the loop's own thread, the loop finishes it
        on its way out (found by review: it joined itself, failed, and left every stream open)."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._loop_thread is threading.current_thread():
            self._shutdown_on_exit = True
            return
        if self._loop_thread is not None:
            self._loop_thread.join()
            self._loop_thread = None
        self._finish_shutdown()

    def _finish_shutdown(self: Engine) -> None:
        with self._lock:  # the loop is gone: this thread steps now; queued requests end too
            self._unadmitted += self._inbox
            self._inbox = []
            self._sinks.update(self._new_sinks)
            self._new_sinks = {}
        if self._active_ids:
            try:
                self.fail_all("the engine shut down", "cancelled", retryable=True)
            except Exception:  # as after a fault: the streams still end, and the pools still close
                logger.exception("ending the requests at shutdown failed")
                self._end_streams_directly("the engine shut down")
        if self.core.disagg is not None:
            self.core.disagg.loads.shutdown()
            with self._step_lock:  # the pulls' ends: their blocks leave their ``load:`` owners
                self.core.disagg.take_finished_loads()
                self._take_stats()
            for backend in self.core.disagg.backends.values():
                backend.close()
        if self.core.media_pulls is not None:
            self.core.media_pulls.shutdown()
        self.guides.close()
        self._shut_down = True

    def _loop(self: Engine) -> None:
        self.core.runner.use_device()
        while True:
            with self._lock:
                while not self._stopping and not self._wants_step():
                    if not self._lock.wait(self._wait_seconds()) and self._stalled:
                        self._stalled = False  # the wait is bounded: a missed wake costs latency only
                if self._stopping and not self._abort_ids:
                    break
                self._woken = False
            try:
                self.step()
            except Exception as exc:
                logger.exception("engine step failed")
                self._end_all(f"engine fault: {type(exc).__name__}: {exc}")
        if self._shutdown_on_exit:  # ``shutdown`` was called from a sink or callback
            self._finish_shutdown()

    def _end_all(self: Engine, message: str) -> None:
        """``fail_all``. When that raises too, the engine's state is broken: every stream still
        ends, with one terminal error sent straight to its sink, and the engine stops (new
        requests are refused; its health probe fails). Before, the loop thread died unnoticed
        and every waiting client hung."""
        try:
            self.fail_all(message)
        except Exception:
            logger.exception("ending the requests after an engine fault failed too: the engine stops")
            fault = self._end_streams_directly(f"{message}; the engine stopped")
            for callback in self._stopped_callbacks:  # the server turns NOT_READY (H3): it serves nothing now
                try:
                    callback(fault.message)
                except Exception:
                    logger.exception("an engine-stopped callback failed")

    def _end_streams_directly(self: Engine, message: str) -> EngineFault:
        """``fail_all`` failed: the engine's state is broken. One terminal error goes straight to
        each sink, and the engine stops for good (``_broken``: no restart)."""
        with self._lock:
            self._stopping = self._broken = True
            sinks = {**self._sinks, **self._new_sinks}
            self._sinks, self._new_sinks, self._inbox = {}, {}, []
            self._active_ids.clear()
            self._probe_ids.clear()  # or a restarted engine counts them for good (found by review)
            self._abort_ids.clear()
        fault = EngineFault("internal", message, retryable=False)
        for request_id, sink in sinks.items():
            try:
                sink(RequestOutput(request_id, finished=True, error=fault))
            except Exception:  # a broken consumer must not keep the others from their end
                logger.exception("output sink of request %s failed", request_id)
        return fault

    def _check_when_idle(self: Engine) -> None:
        """``--debug-kv-integrity``: the pool's integrity once no request is left. After a step's
        outputs were delivered: a failing check must not lose the end of a request it retired."""
        if self.config.debug_kv_integrity:
            with self._step_lock:
                if not self.core.requests:
                    self.core.check_idle()

    def _wait_seconds(self: Engine) -> float | None:
        due = self.kv_sessions.seconds_until_due()
        if self._stalled:
            return min(STALLED_POLL_SECONDS, due if due is not None else STALLED_POLL_SECONDS)
        return None if due is None else min(due, IDLE_POLL_SECONDS)

    def _wants_step(self: Engine) -> bool:
        """Lock held. Requests (unless the last step ran nothing and no wake came), a wake, or a due session."""
        return (bool(self._active_ids) and not self._stalled) or bool(self._inbox) or bool(self._abort_ids) \
            or self._woken or self.kv_sessions.seconds_until_due() == 0.0
