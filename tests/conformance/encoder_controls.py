"""The negative controls of the draft encoder profile (ENC): refengine's encoder and a consumer
(an aggregated server) on the tiny LLaVA model, one of them behind a ``FaultProxy`` that breaks
exactly one ENC rule. tests/integration/test_encoder_conformance.py runs the ENC checks against
each and asserts that exactly that rule fails; tests/conformance/test_negative_controls.py counts
these controls among those of every rule.

Each control is built fresh (``make()``): a fault may keep state (ENC9's remembers handles).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import json_format

from refengine.conformance.encoder_support import EXTRA_MEDIA_HANDLES, LOAD_PREFIX, PROFILES_KEY
from refengine.protocol import oe
from refengine.protocol.v1alpha1 import media_pb2 as media
from tests.conformance.fault_proxy import Fault, Override, each

Forward = Callable[[Any], Any]


def _profiles_status_stable(request: Any, context: grpc.ServicerContext, forward: Forward) -> Any:
    """ENC1: the encoder v1alpha1 entry says status "stable" (a draft profile must say "draft")."""
    info = forward(request)
    extra = json_format.MessageToDict(info.extra)
    for entry in extra.get(PROFILES_KEY, []):
        entry["status"] = "stable"
    info.extra.Clear()
    info.extra.update(extra)
    return info


def _encoder_takes_text(request: Any, context: grpc.ServicerContext, forward: Forward) -> Any:
    """ENC2: the encoder's ModelInfo says supports_text_input = true (an encoder generates nothing)."""
    info = forward(request)
    info.supports_text_input = True
    return info


def _empty_encode_accepted(request: Any, context: grpc.ServicerContext, forward: Forward) -> Any:
    """ENC3: Encode without items answers OK with no handle instead of INVALID_ARGUMENT."""
    return media.EncodeResponse() if not request.items else forward(request)


def _cache_hit_unreported(request: Any, context: grpc.ServicerContext, forward: Forward) -> Any:
    """ENC4: every handle says cached = false, also a hit."""
    reply = forward(request)
    for handle in reply.handles:
        handle.cached = False
    return reply


def _salt_ignored(request: Any, context: grpc.ServicerContext, forward: Forward) -> Any:
    """ENC4: Encode's cache_salt is dropped: salted and unsalted Encodes share cache entries."""
    request.cache_salt = ""
    return forward(request)


class UnsaltedFindsSalted:
    """ENC4: an unsalted Encode of an image encoded before under a cache_salt finds that salt's
    entry (the proxy sends it under the salt it remembers), as an encoder whose unsalted lookup
    matches entries of any salt would."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.salt_of: dict[bytes, str] = {}  # the items of a salted Encode -> its salt

    def encode(self, request: Any, context: grpc.ServicerContext, forward: Forward) -> Any:
        items = b"".join(item.SerializeToString() for item in request.items)
        with self.lock:
            if request.cache_salt:
                self.salt_of[items] = request.cache_salt
            else:
                request.cache_salt = self.salt_of.get(items, "")
        return forward(request)


def _lease_unbounded(request: Any, context: grpc.ServicerContext, forward: Forward) -> Any:
    """ENC5: a lease above the maximum is granted in full: each handle's lease ends lease_seconds from now."""
    reply = forward(request)
    if request.HasField("lease_seconds"):
        for handle in reply.handles:
            handle.lease_expires_unix_nanos = time.time_ns() + int(request.lease_seconds * 1e9)
    return reply


def _zero_lease_default(request: Any, context: grpc.ServicerContext, forward: Forward) -> Any:
    """ENC5: lease_seconds 0 is read as "not given" (the default lease) instead of refused."""
    if request.HasField("lease_seconds") and request.lease_seconds == 0:
        request.ClearField("lease_seconds")
    return forward(request)


def _abort_keeps_handle(request: Any, context: grpc.ServicerContext, forward: Forward) -> Any:
    """ENC6: Abort(kv_session) naming a handle answers ABORTED and releases nothing."""
    if request.WhichOneof("target") == "kv_session":
        return oe.AbortResponse(status=oe.ABORT_STATUS_ABORTED)
    return forward(request)


def _zero_renewal_accepted(request: Any, context: grpc.ServicerContext, forward: Forward) -> Any:
    """ENC7: RenewLease(lease_seconds = 0) answers OK (the lease ends now) instead of INVALID_ARGUMENT."""
    if request.lease_seconds == 0:
        return media.RenewLeaseResponse(lease_expires_unix_nanos=time.time_ns())
    return forward(request)


class PulledStayLive:
    """ENC9: a handle a consumer pulled stays held: RenewLease extends it and Release counts it
    until its lease ends, as if the consumer had not released it. (The proxy stands between the
    suite and the encoder; it knows a handle it issued that the suite did not release (by Release or
Abort), and answers
    for it as the encoder would for a handle still held.)"""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.issued: dict[str, int] = {}  # handle id -> lease end (unix ns), handles not released via the proxy

    def encode(self, request: Any, context: grpc.ServicerContext, forward: Forward) -> Any:
        reply = forward(request)
        with self.lock:
            self.issued.update({h.handle_id: h.lease_expires_unix_nanos for h in reply.handles})
        return reply

    def live(self, handle_id: str) -> bool:
        with self.lock:
            return self.issued.get(handle_id, 0) > time.time_ns()

    def renew(self, request: Any, context: grpc.ServicerContext, forward: Forward) -> Any:
        try:
            return forward(request)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND or not self.live(request.handle_id):
                raise
            end = time.time_ns() + int(request.lease_seconds * 1e9)
            with self.lock:
                self.issued[request.handle_id] = end
            return media.RenewLeaseResponse(lease_expires_unix_nanos=end)

    def release(self, request: Any, context: grpc.ServicerContext, forward: Forward) -> Any:
        pulled = [i for i in set(request.handle_ids) if self.live(i)]
        reply = forward(request)
        with self.lock:
            for handle_id in request.handle_ids:
                self.issued.pop(handle_id, None)
        return media.ReleaseResponse(released=max(reply.released, len(pulled)))

    def abort(self, request: Any, context: grpc.ServicerContext, forward: Forward) -> Any:
        """Abort(kv_session) naming a handle releases it, as Release does (ENC6)."""
        reply = forward(request)
        if request.WhichOneof("target") == "kv_session":
            with self.lock:
                self.issued.pop(request.kv_session.session_id, None)
        return reply

    def fault(self) -> Fault:
        return Fault({"Media/Encode": self.encode, "Media/RenewLease": self.renew, "Media/Release": self.release,
                      "Control/Abort": self.abort})


def _with_handles(request: Any) -> bool:
    return EXTRA_MEDIA_HANDLES in request.extra


def _handle_ignored(request: Any, context: grpc.ServicerContext, forward: Forward) -> Iterator[Any]:
    """ENC10: a request carrying a handle generates other tokens than the raw image gives (as if
    the placeholder were filled with something else)."""
    def shift(event: Any) -> None:
        if event.WhichOneof("event") == "token":
            for info in event.token.tokens:
                info.token_id += 1

    return each(forward(request), shift) if _with_handles(request) else forward(request)


def _refusal_names_no_field(request: Any, context: grpc.ServicerContext, forward: Forward) -> Iterator[Any]:
    """ENC11: a handle refused before acceptance is refused without saying which field is wrong."""
    try:
        yield from forward(request)
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.INVALID_ARGUMENT and _with_handles(request):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "this media item cannot be used")
        raise


def _gone_handle_retryable(request: Any, context: grpc.ServicerContext, forward: Forward) -> Iterator[Any]:
    """ENC13: the EngineError of a handle gone before the pull says retryable = true."""
    def retryable(event: Any) -> None:
        if event.WhichOneof("event") == "error":
            event.error.retryable = True

    return each(forward(request), retryable)


def _rows_miscounted(request: Any, context: grpc.ServicerContext, forward: Forward) -> Any:
    """ENC15: cached_rows counts one row more than there is (held + cached + free != total)."""
    load = forward(request)
    key = f"{LOAD_PREFIX}cached_rows"
    if key in load.attributes:
        load.attributes[key] = load.attributes[key] + 1
    return load


@dataclass(frozen=True)
class EncoderControl:
    """One ENC rule broken: ``encoder`` stands in front of the encoder, ``consumer`` in front of
    the consumer (the suite's target); "" = nothing broken."""

    id: str
    rule: str
    encoder: dict[str, Override] = field(default_factory=dict)
    consumer: dict[str, Override] = field(default_factory=dict)


def controls() -> list[EncoderControl]:
    """Every ENC control, freshly made."""
    pulled = PulledStayLive()
    return [
        EncoderControl("unbroken", ""),
        EncoderControl("profile-status-stable", "ENC1", encoder={"Control/GetServerInfo": _profiles_status_stable}),
        EncoderControl("encoder-takes-text", "ENC2", encoder={"Control/GetModelInfo": _encoder_takes_text}),
        EncoderControl("empty-encode-accepted", "ENC3", encoder={"Media/Encode": _empty_encode_accepted}),
        EncoderControl("cache-hit-unreported", "ENC4", encoder={"Media/Encode": _cache_hit_unreported}),
        EncoderControl("cache-salt-ignored", "ENC4", encoder={"Media/Encode": _salt_ignored}),
        EncoderControl("unsalted-finds-salted", "ENC4", encoder={"Media/Encode": UnsaltedFindsSalted().encode}),
        EncoderControl("zero-lease-default", "ENC5", encoder={"Media/Encode": _zero_lease_default}),
        EncoderControl("lease-unbounded", "ENC5", encoder={"Media/Encode": _lease_unbounded}),
        EncoderControl("abort-keeps-handle", "ENC6", encoder={"Control/Abort": _abort_keeps_handle}),
        EncoderControl("zero-renewal-accepted", "ENC7", encoder={"Media/RenewLease": _zero_renewal_accepted}),
        EncoderControl("pulled-handle-stays-live", "ENC9", encoder=pulled.fault().overrides),
        EncoderControl("handle-ignored", "ENC10", consumer={"Inference/Generate": _handle_ignored}),
        EncoderControl("refusal-names-no-field", "ENC11", consumer={"Inference/Generate": _refusal_names_no_field}),
        EncoderControl("gone-handle-retryable", "ENC13", consumer={"Inference/Generate": _gone_handle_retryable}),
        EncoderControl("rows-miscounted", "ENC15", encoder={"Control/GetLoad": _rows_miscounted}),
    ]
