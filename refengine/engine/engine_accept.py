"""Accepting work (any thread): ``add_request``, ``abort``, ``abort_all``. A mixin of ``Engine``
(it uses the front end's lock, inbox and id sets), kept apart so ``engine.py`` stays short.

A request is accepted in three moves, so that an abort can never miss it (found by review: an
``Abort`` arriving while a guided request's grammar compiled answered NOT_FOUND, and the request
then ran to its end):

1. under the lock, the checks that need no work (a duplicate id, a stopped engine, overload)
   and the id's reservation in ``_accepting``;
2. outside it, ``InputProcessor.process`` (tokenizing, compiling a grammar: up to seconds);
3. under the lock again, the request joins the inbox. An abort that came during step 2 was
   recorded on the reservation and now joins the aborts: the step that admits the request
   cancels it (A4: ``CANCELLED``, its KV freed).

A refusal in step 2 drops the reservation; nothing else was allocated, and an abort recorded
on it finds no request (``ended_by_abort``: False at once, found by review: it waited out the
abort confirmation and answered ABORTED).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from refengine.engine.interface import OutputSink
from refengine.engine.stream import RequestStream
from refengine.types import DuplicateRequestError, EngineStoppedError, GenerationRequest, OverloadedError

if TYPE_CHECKING:
    from refengine.engine.engine import Engine

#: Health probes in flight at once, beside (never instead of) the clients' max_active_requests: a
#: load balancer polling a saturated server must not take a client's slot (found by review).
PROBE_SLOTS = 4


class EngineAcceptMixin:
    def add_request(self: Engine, params: GenerationRequest, sink: OutputSink | None = None) -> RequestStream | None:
        """Validate and enqueue; returns the default stream when no sink is given. A refusal
        raises a ``RequestError`` subclass, with nothing allocated."""
        request_id = params.request_id
        with self._lock:
            self._check_room(params)
            self._accepting[request_id] = (params.health_probe, False)
        try:
            request = self.input_processor.process(params)
        except BaseException:
            with self._lock:
                del self._accepting[request_id]
            raise
        stream = RequestStream(request_id, params.sampling.num_sequences) if sink is None else None
        with self._lock:
            _, aborted = self._accepting.pop(request_id)
            if self._stopping:
                raise EngineStoppedError("the engine is shut down")
            self._active_ids.add(request_id)
            self._finished_ids.pop(request_id, None)  # accepted: a finished namesake no longer answers
            if params.health_probe:
                self._probe_ids.add(request_id)
            if aborted:
                self._abort_ids.add(request_id)
            self._inbox.append(request)
            self._new_sinks[request_id] = sink or stream
            self._lock.notify_all()
        return stream

    def _check_room(self: Engine, params: GenerationRequest) -> None:
        """Lock held: refuse a duplicate id, a stopped engine, or one request too many."""
        if params.request_id in self._active_ids or params.request_id in self._accepting:
            raise DuplicateRequestError(f"request_id {params.request_id!r} is already active")
        if self._stopping:
            raise EngineStoppedError("the engine is shut down")
        accepting_probes = sum(probe for probe, _ in self._accepting.values())
        if params.health_probe and len(self._probe_ids) + accepting_probes >= PROBE_SLOTS:
            raise OverloadedError(f"{PROBE_SLOTS} health probes already in flight")
        num_client = len(self._active_ids) - len(self._probe_ids) + len(self._accepting) - accepting_probes
        if not params.health_probe and num_client >= self.config.scheduler.max_active_requests:
            raise OverloadedError("too many requests in flight; retry later")

    def abort(self: Engine, request_id: str) -> bool:
        """Ask to cancel a request, also one still being accepted. False when no such request is active."""
        with self._lock:
            if request_id in self._accepting:
                self._accepting[request_id] = (self._accepting[request_id][0], True)
            elif request_id in self._active_ids:
                self._abort_ids.add(request_id)
                self._lock.notify_all()
            else:
                return False
            return True

    def abort_all(self: Engine) -> list[str]:
        """Cancel every client request (not health probes), those still being accepted too."""
        with self._lock:
            ids = list(self._active_ids - self._probe_ids)
            self._abort_ids.update(ids)
            for request_id, (probe, _) in self._accepting.items():
                if not probe:
                    self._accepting[request_id] = (False, True)
                    ids.append(request_id)
            self._lock.notify_all()
            return ids
