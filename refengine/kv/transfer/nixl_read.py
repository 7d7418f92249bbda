"""A NIXL READ from the decode side: a call into NIXL with its errors as transfer failures, and
the wait for a posted READ, which NIXL cannot abort: a stopped one is drained before the pull
fails, and one still running after ``DRAIN_SECONDS`` leaves its destination blocks suspect.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

from refengine.kv.transfer.nixl_source import fail

logger = logging.getLogger(__name__)

XFER_POLL_SECONDS = 0.0005
XFER_SPIN_SECONDS = 0.005  # a READ still running after transfer() is first polled without sleeping
#: How long a stopped pull (cancelled, timed out, closed) keeps polling its READ. NIXL cannot
#: abort one: release_xfer_handle on a running READ calls UCX's ucp_request_cancel, a no-op for
#: RMA, then ucp_request_free, which only detaches it: its bytes keep landing afterwards.
DRAIN_SECONDS = 10.0


def nixl_call(what: str, call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)`` with a NIXL error (its own exception types, no common base) as a failure:
    e.g. a vanished peer makes check_xfer_state raise NIXL_ERR_REMOTE_DISCONNECT."""
    try:
        return call(*args)
    except Exception as error:
        raise fail(f"NIXL could not {what}: {error!r}") from error


def wait_read(agent: Any, handle: Any, cancelled: threading.Event, closed: threading.Event, deadline: float,
              timeout: float) -> None:
    """Post the READ and poll it to its end; a cancel, the backend's close or the ``deadline``
    stops it (``timeout``: the pull's, for the message). Raises ``TransferFailure``."""
    state = nixl_call("post the READ", agent.transfer, handle)  # over CMA, the whole copy is here
    spin_until = time.monotonic() + XFER_SPIN_SECONDS
    while state == "PROC":
        stopped = cancelled.is_set() or closed.is_set()
        if stopped or time.monotonic() > deadline:
            _stop(agent, handle, stopped, timeout)
        if time.monotonic() < spin_until:
            time.sleep(0)  # a short READ ends within microseconds: poll at once (GIL released)
        else:
            cancelled.wait(XFER_POLL_SECONDS)
        state = nixl_call("check the READ", agent.check_xfer_state, handle)
    if state != "DONE":
        raise fail("the NIXL READ failed")


def _stop(agent: Any, handle: Any, cancelled: bool, timeout: float) -> NoReturn:
    """Drain a stopped READ, then fail. Even one that ends while draining past the deadline
    is no success: its last bytes were read after the pin ran out."""
    state = _drain(agent, handle)
    late = ": the READ still runs, its destination blocks may still change" if state == "PROC" else ""
    if cancelled:
        raise fail("cancelled" + late, dest_may_change=bool(late))
    # no release was sent: the source may still hold the session
    raise fail(f"timed out after {timeout:g} s{late}", retryable=True, dest_may_change=bool(late))


def _drain(agent: Any, handle: Any) -> str:
    """Poll a stopped READ until it is no longer in progress, at most ``DRAIN_SECONDS``."""
    end = time.monotonic() + DRAIN_SECONDS
    while time.monotonic() < end:
        try:
            state = agent.check_xfer_state(handle)
        except Exception:  # the request ended in an error: nothing of it is pending
            return "ERR"
        if state != "PROC":
            return state
        time.sleep(XFER_POLL_SECONDS)
    logger.error("a NIXL READ still runs %g s after it was stopped: its blocks may still change", DRAIN_SECONDS)
    return "PROC"
