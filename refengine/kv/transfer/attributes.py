"""A KV session's ``attributes_struct``: everything a decode engine needs and checks.

Written by the prefill engine into ``KvSessionRef.attributes_struct``, read back by the
decode engine before it accepts the request (any mismatch is INVALID_ARGUMENT there).
JSON types are kept (K9): a protobuf ``Struct`` carries numbers as doubles, so integers
that may exceed 2^53 (the prompt hash, the lease expiry in ns, memory addresses) travel
as decimal strings, and non-finite logprobs as the strings "Infinity"/"-Infinity"/"NaN".

Keys (schema ``refengine.kv-session/3``; 2 added ``first_token_options``; 3 widened
``prompt_hash`` from 64 to 256 bits: with 64, a client choosing both prompts could find two with
equal hashes in about 2^32 tries and have a decode server cache one prompt's KV under the other's
keys, found by review):

- ``schema``; ``model_fingerprint``: the weights that computed the KV;
- ``block_size``, ``kv_dtype``, ``kv_layout`` (the attention backend's layout name and per-block shapes),
  ``block_nbytes``: the bytes of one block over all layers (``BlockStore``);
- ``num_prompt_tokens``, ``prompt_hash`` (256 bits of the prompt's token ids, media and LoRA
  adapter, decimal string), ``num_blocks``: the session holds the prompt's KV, ``num_blocks`` blocks;
- ``first_token``: ``{token_id, logprob, rank, candidates: [[token_id, logprob, rank], …]}``
  — the token the prefill engine sampled (the decode engine emits it first);
- ``first_token_options``: the prefill request's options that shaped that draw and its info
  (``engine/first_token_options.py``), which the decode request must repeat;
- ``lease_expires_unix_nanos`` (decimal string) and ``lease_seconds``;
- ``transfer``: the backend's own keys (``KvTransferBackend.source_attributes``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

SCHEMA = "refengine.kv-session/3"


def prompt_hash(token_ids: Sequence[int], media: Sequence[tuple[int, str]] = (), adapter: str = "") -> int:
    """256 bits of the prompt's token ids (blake2b-32 over little-endian u32s) and, after them, of
    each media item's first position and identity (its placeholder ids say nothing of the image)
    and of the LoRA adapter's cache key (``adapter``, "" for the base model): both change the KV,
    and a decode engine caches what it pulls under its own request's keys."""
    data = b"".join(int(t).to_bytes(4, "little") for t in token_ids)
    data += b"".join(f"\0media:{start}:{identity}".encode() for start, identity in media)
    data += f"\0lora:{adapter}".encode() if adapter else b""
    return int.from_bytes(hashlib.blake2b(data, digest_size=32).digest(), "little")


def json_int(value: Any) -> int | None:
    """An integer as a protobuf ``Struct`` carries it — a double with no fraction, below
    2^53 — or as plain JSON; None for anything else (bools included)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return None


@dataclass(frozen=True)
class FirstToken:
    token_id: int
    logprob: float | None = None
    rank: int | None = None
    candidates: tuple[tuple[int, float, int], ...] = ()


@dataclass(frozen=True)
class SessionAttributes:
    model_fingerprint: str
    block_size: int
    kv_dtype: str
    kv_layout: str
    block_nbytes: int
    num_prompt_tokens: int
    prompt_hash: int
    num_blocks: int
    first_token: FirstToken
    lease_expires_unix_nanos: int
    lease_seconds: float
    transfer: Mapping[str, Any] = field(default_factory=dict)
    first_token_options: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        first = self.first_token
        return {
            "schema": SCHEMA,
            "model_fingerprint": self.model_fingerprint,
            "block_size": self.block_size,
            "kv_dtype": self.kv_dtype,
            "kv_layout": self.kv_layout,
            "block_nbytes": self.block_nbytes,
            "num_prompt_tokens": self.num_prompt_tokens,
            "prompt_hash": str(self.prompt_hash),
            "num_blocks": self.num_blocks,
            "first_token": {
                "token_id": first.token_id,
                "logprob": _float_out(first.logprob),
                "rank": first.rank,
                "candidates": [[t, _float_out(lp), r] for t, lp, r in first.candidates],
            },
            "lease_expires_unix_nanos": str(self.lease_expires_unix_nanos),
            "lease_seconds": self.lease_seconds,
            "transfer": dict(self.transfer),
            "first_token_options": dict(self.first_token_options),
        }

    @classmethod
    def from_json(cls, attrs: Mapping[str, Any]) -> SessionAttributes:
        """Parse and type-check; ``ValueError`` names the first bad key."""
        reader = _Reader(attrs, "kv.session.attributes_struct")
        if reader.str("schema") != SCHEMA:
            raise ValueError(f"kv.session.attributes_struct.schema must be {SCHEMA!r}, got {attrs.get('schema')!r}: "
                             "not a session of a compatible refengine prefill engine")
        first = _Reader(reader.map("first_token"), "kv.session.attributes_struct.first_token")
        return cls(
            model_fingerprint=reader.str("model_fingerprint"),
            block_size=reader.int("block_size"),
            kv_dtype=reader.str("kv_dtype"),
            kv_layout=reader.str("kv_layout"),
            block_nbytes=reader.int("block_nbytes"),
            num_prompt_tokens=reader.int("num_prompt_tokens"),
            prompt_hash=reader.decimal("prompt_hash"),
            num_blocks=reader.int("num_blocks"),
            first_token=FirstToken(first.int("token_id"), first.optional_float("logprob"),
                                   first.optional_int("rank"), first.candidates("candidates")),
            lease_expires_unix_nanos=reader.decimal("lease_expires_unix_nanos"),
            lease_seconds=reader.float("lease_seconds"),
            transfer=reader.map("transfer"),
            first_token_options=reader.map("first_token_options"),
        )


def _float_out(value: float | None) -> float | str | None:
    if value is None or math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


class _Reader:
    """Typed access to one JSON object, with the key path in every error."""

    def __init__(self, attrs: Any, path: str) -> None:
        if not isinstance(attrs, Mapping):
            raise ValueError(f"{path} must be an object, got {type(attrs).__name__}")
        self.attrs, self.path = attrs, path

    def _get(self, key: str) -> Any:
        if key not in self.attrs:
            raise ValueError(f"{self.path}.{key} is missing")
        return self.attrs[key]

    def _bad(self, key: str, what: str) -> ValueError:
        return ValueError(f"{self.path}.{key} must be {what}, got {self.attrs.get(key)!r}")

    def str(self, key: str) -> str:
        value = self._get(key)
        if not isinstance(value, str):
            raise self._bad(key, "a string")
        return value

    def int(self, key: str) -> int:
        value = json_int(self._get(key))
        if value is None or value < 0:
            raise self._bad(key, "a non-negative integer")
        return value

    def optional_int(self, key: str) -> int | None:
        return None if self.attrs.get(key) is None else self.int(key)

    def float(self, key: str) -> float:
        value = self._get(key)
        if isinstance(value, str) and value in ("Infinity", "-Infinity", "NaN"):
            return float(value.replace("Infinity", "inf"))
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._bad(key, "a number")
        return float(value)

    def optional_float(self, key: str) -> float | None:
        return None if self.attrs.get(key) is None else self.float(key)

    def decimal(self, key: str) -> int:
        value = self._get(key)
        if not isinstance(value, str) or not value.isdigit():
            raise self._bad(key, "a decimal string (K9: integers above 2^53 travel as strings)")
        return int(value)

    def map(self, key: str) -> Mapping[str, Any]:
        value = self._get(key)
        if not isinstance(value, Mapping):
            raise self._bad(key, "an object")
        return value

    def candidates(self, key: str) -> tuple[tuple[int, float, int], ...]:
        value = self._get(key)
        if not isinstance(value, list | tuple):
            raise self._bad(key, "a list of [token_id, logprob, rank]")
        out = []
        for i, item in enumerate(value):
            row = _Reader(dict(zip(("token_id", "logprob", "rank"), item, strict=False))
                          if isinstance(item, list | tuple) and len(item) == 3 else None, f"{self.path}.{key}[{i}]")
            out.append((row.int("token_id"), row.float("logprob"), row.int("rank")))
        return tuple(out)
