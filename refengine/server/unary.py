"""One way every unary RPC of the server reports failure (X2: a non-OK status only).

``run_unary`` awaits the reply and maps what the engine or
the edge raised to a status: a ``RequestError`` by its kind (``errors.REFUSAL_CODES``), a
``Rejection`` as it says, ``KvSessionNotFound`` to NOT_FOUND, anything else (a bug) to
INTERNAL with the error logged; the server keeps serving.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from refengine.server.errors import Rejection, abort_call, rejection_from_engine
from refengine.types import KvSessionNotFound, RequestError

logger = logging.getLogger(__name__)
Reply = TypeVar("Reply")


async def run_unary(context: grpc.aio.ServicerContext, build: Callable[[], Awaitable[Reply]], what: str) -> Reply:
    """``await build()``, failures as statuses; ``what`` names the service in the log."""
    try:
        return await build()
    except RequestError as exc:
        rejection = rejection_from_engine(exc)
        await abort_call(context, rejection.code, rejection.message)
    except KvSessionNotFound as exc:
        await abort_call(context, grpc.StatusCode.NOT_FOUND, str(exc))
    except Rejection as rejection:
        await abort_call(context, rejection.code, rejection.message)
    except Exception as exc:  # a bug: report it as INTERNAL, keep serving
        logger.exception("%s RPC failed", what)
        await abort_call(context, grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
