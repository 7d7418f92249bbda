"""Client side of the draft profile ``encoder`` (docs/profiles/encoder.md): E → P → D.

    with OpenEngineClient(enc) as e, OpenEngineClient(pre) as p, OpenEngineClient(dec) as d:
        for event in generate_epd(MediaClient(e), p, d, request):   # request.media: the images
            ...

``MediaClient`` wraps ``refengine.v1alpha1.Media`` on an encoder server's channel.
``with_handles`` turns a request with media items into the same request with embedding
handles instead (``extra["refengine.v1alpha1.media_handles"]``, the items removed);
``over_backend`` keeps only one transfer backend in handles.
``generate_epd`` encodes a request's media, then runs it aggregated (``decode`` None) or
through prefill and decode, and finally releases its handles (idempotent: a consumer that
pulled them has released them already; best effort: a failed Release is left to the lease).
``supports_profile`` reads discovery (ENC1).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc
from google.protobuf import json_format

from refengine.client import Metadata, OpenEngineClient, generate_disaggregated
from refengine.protocol import oe
from refengine.protocol.v1alpha1 import media_pb2 as media
from refengine.protocol.v1alpha1 import media_pb2_grpc as media_grpc

#: The GenerateRequest.extra key (ENC10); the server's refengine/server/media_wire.py names it too.
EXTRA_MEDIA_HANDLES = "refengine.v1alpha1.media_handles"
PROFILES_KEY = "refengine.profiles"


class MediaClient:
    def __init__(self, client: OpenEngineClient) -> None:
        self.client = client
        self.stub = media_grpc.MediaStub(client.channel)

    def encode(self, items: Sequence[oe.MediaItem], lease_seconds: float | None = None, model: str = "",
               timeout: float | None = None, cache_salt: str = "") -> list[media.EmbeddingHandle]:
        request = media.EncodeRequest(model=model, items=list(items), cache_salt=cache_salt)
        if lease_seconds is not None:
            request.lease_seconds = lease_seconds
        reply = self.stub.Encode(request, timeout=timeout or self.client.timeout, metadata=self.client.metadata)
        return list(reply.handles)

    def release(self, handle_ids: Sequence[str]) -> int:
        reply = self.stub.Release(media.ReleaseRequest(handle_ids=list(handle_ids)), timeout=self.client.timeout,
                                  metadata=self.client.metadata)
        return reply.released

    def renew(self, handle_id: str, lease_seconds: float) -> int:
        """The handle's new lease end, Unix nanoseconds."""
        reply = self.stub.RenewLease(media.RenewLeaseRequest(handle_id=handle_id, lease_seconds=lease_seconds),
                                     timeout=self.client.timeout, metadata=self.client.metadata)
        return reply.lease_expires_unix_nanos


def supports_profile(client: OpenEngineClient, side: str, name: str = "encoder") -> bool:
    """Whether the server lists the draft profile ``name`` with ``side`` (ENC1)."""
    extra = json_format.MessageToDict(client.server_info().extra)
    return any(p.get("name") == name and side in p.get("sides", []) for p in extra.get(PROFILES_KEY, []))


def with_handles(request: oe.GenerateRequest, handles: Sequence[media.EmbeddingHandle]) -> oe.GenerateRequest:
    """``request`` with ``handles`` in place of its media items (handle i fills placeholder i)."""
    out = oe.GenerateRequest()
    out.CopyFrom(request)
    del out.media[:]
    out.extra.update({EXTRA_MEDIA_HANDLES: [json_format.MessageToDict(h) for h in handles]})
    return out


def over_backend(handles: Sequence[media.EmbeddingHandle], backend: str) -> list[media.EmbeddingHandle]:
    """Copies of ``handles`` offering only ``backend``'s transfer: the client chooses how the rows move."""
    kept = []
    for handle in handles:
        copy = media.EmbeddingHandle()
        copy.CopyFrom(handle)
        del copy.transfers[:]
        copy.transfers.extend(t for t in handle.transfers if t.backend == backend)
        kept.append(copy)
    return kept


def generate_epd(encoder: MediaClient, prefill_client: OpenEngineClient, decode_client: OpenEngineClient | None,
                 request: oe.GenerateRequest, timeout: float | None = None,
                 metadata: Metadata | None = None) -> Iterator[oe.GenerateResponse]:
    """Encode ``request.media`` on the encoder, then generate with the handles: on
    ``prefill_client`` alone (an aggregated server) when ``decode_client`` is None, else prefill
    then decode. The decode request carries the handles too (it learns their identities; it
    never pulls them). Handles are released at the end, whatever happened (best effort: a Release
    that fails is left to the lease, ENC7). A request with a
    ``kv.cache_salt`` encodes under the same salt: its images share the encoder's cache only with
    requests of that salt, as its prompt shares the prefix cache."""
    handles = (encoder.encode(list(request.media), timeout=timeout, cache_salt=request.kv.cache_salt)
               if request.media else [])
    consumer_request = with_handles(request, handles)
    try:
        if decode_client is None:
            yield from prefill_client.generate(consumer_request, timeout=timeout, metadata=metadata)
        else:
            yield from generate_disaggregated(prefill_client, decode_client, consumer_request, timeout, metadata)
    finally:
        if handles:
            _release(encoder, [h.handle_id for h in handles])


def _release(encoder: MediaClient, handle_ids: list[str]) -> None:
    """Best effort: a failed Release (the encoder gone once the rows were pulled) must not fail a
    complete stream or replace the stream's own error; the lease frees the handles anyway (ENC7).
    Nor must a client the caller closed first (its ValueError, found by review)."""
    try:
        encoder.release(handle_ids)
    except (grpc.RpcError, ValueError):
        pass
