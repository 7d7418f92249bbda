"""How ``refengine generate`` shows a stream: text (the default) or JSON lines (``--json``).

Text: output 0 streams to stdout as it arrives, flushed per delta. With several outputs
each is labelled: ``[0] `` before the streamed output 0, then one ``[i] text`` line per
other output once the stream ended (they arrive interleaved, so they are collected).
``--logprobs`` / ``--prompt-logprobs`` each add a per-token table (position, token, logprob,
rank, candidates) on stderr after the text -- a prompt table's positions start at
``--prompt-logprob-start`` -- and a usage line ends stderr.

JSON (``--json``): one JSON object per line on stdout, nothing on stderr but errors. From a
server each ``GenerateResponse`` in proto3 JSON (``json_format``, lowerCamelCase names);
in-process each engine ``RequestOutput`` with the field names of
``refengine/types/outputs.py``, unset (None) and empty fields left out, a finish reason as
its string value ("stop", "length", "cancelled").
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from refengine.client import oe
    from refengine.types import RequestOutput, TokenInfo

__all__ = ["JsonPrinter", "Printer", "TextPrinter", "engine_output_json"]


@dataclasses.dataclass(frozen=True)
class TokenRow:
    """One line of a logprob table, whichever path the token came by."""

    token: str
    logprob: float | None
    rank: int | None
    candidates: tuple[tuple[str, float], ...]


def _wire_row(info: oe.TokenInfo) -> TokenRow:
    return TokenRow(info.token, info.logprob if info.HasField("logprob") else None,
                    info.rank if info.HasField("rank") else None,
                    tuple((c.token, c.logprob) for c in info.candidates))


def _engine_row(info: TokenInfo) -> TokenRow:
    return TokenRow(info.text, info.logprob, info.rank, tuple((c.text, c.logprob) for c in info.candidates))


def _print_table(title: str, rows: list[TokenRow], first_position: int = 0) -> None:
    print(f"{title}:\n  pos token                logprob  rank  candidates", file=sys.stderr)
    for position, row in enumerate(rows, start=first_position):
        logprob = "-" if row.logprob is None else f"{row.logprob:.4f}"
        rank = "-" if row.rank is None else str(row.rank)
        top = ", ".join(f"{text!r} {value:.3f}" for text, value in row.candidates)
        print(f"{position:>5} {row.token!r:<20} {logprob:>8} {rank:>5}  {top}".rstrip(), file=sys.stderr)


class TextPrinter:
    """Streams output 0, collects the others; tables and the usage line go to stderr.

    ``output_tables``: collect the output tokens' logprob tables (``--logprobs``);
    ``prompt_start``: the first prompt position the server reports (``--prompt-logprob-start``).
    """

    def __init__(self, num_sequences: int, output_tables: bool, prompt_start: int = 0) -> None:
        self.others = {index: "" for index in range(1, num_sequences)}
        self.tables = output_tables
        self.prompt_start = prompt_start
        self.prompt_rows: list[TokenRow] | None = None
        self.rows: dict[int, list[TokenRow]] = {}
        self.completion_tokens: int | None = None
        self.start = time.perf_counter()
        self.label = "[0] " if num_sequences > 1 else ""  # printed with output 0's first text
        self.mid_line = False  # output 0's text is on the line: an error message starts a new one

    def wire(self, event: oe.GenerateResponse) -> None:
        kind = event.WhichOneof("event")
        if kind == "prompt":
            self.prompt_rows = [_wire_row(t) for t in event.prompt.tokens]
        elif kind == "token":
            self._token(event.token.output_index, event.token.text, [_wire_row(t) for t in event.token.tokens])
        if event.HasField("usage"):
            self.completion_tokens = event.usage.completion_tokens

    def engine(self, out: RequestOutput) -> None:
        if out.prompt_tokens is not None:
            self.prompt_rows = [_engine_row(t) for t in out.prompt_tokens]
        for delta in out.deltas:
            self._token(delta.index, delta.text, [_engine_row(t) for t in delta.tokens])
        if out.usage is not None:
            self.completion_tokens = out.usage.completion_tokens

    def _token(self, index: int, text: str, rows: list[TokenRow]) -> None:
        if index == 0:
            piece, self.label = self.label + text, ""
            print(piece, end="", flush=True)
            self.mid_line = not piece.endswith("\n") if piece else self.mid_line
        else:
            self.others[index] = self.others.get(index, "") + text
        if self.tables:
            self.rows.setdefault(index, []).extend(rows)

    def close(self) -> None:
        """After a successful stream: the collected outputs, then stderr's tables and usage."""
        print(self.label)
        for index in sorted(self.others):
            print(f"[{index}] {self.others[index]}")
        sys.stdout.flush()
        if self.prompt_rows is not None:
            _print_table("prompt logprobs", self.prompt_rows, self.prompt_start)
        for index in sorted(self.rows):
            _print_table(f"output {index} logprobs", self.rows[index])
        if self.completion_tokens is not None:
            elapsed = time.perf_counter() - self.start
            print(f"[{self.completion_tokens} tokens in {elapsed:.2f} s, "
                  f"{self.completion_tokens / elapsed:.1f} tok/s]", file=sys.stderr)


def _compact(value: Any) -> Any:
    """Plain JSON values: no empty fields, named tuples (``Candidate``) as objects, and a
    non-finite float (a candidate the grammar forbids has logprob -inf) as proto3 JSON writes
    it, the string "-Infinity", since JSON has no such number."""
    if isinstance(value, dict):
        return {key: _compact(item) for key, item in value.items() if item is not None and item not in ((), [], {})}
    if isinstance(value, tuple) and hasattr(value, "_asdict"):
        return _compact(value._asdict())
    if isinstance(value, list | tuple):
        return [_compact(item) for item in value]
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


def engine_output_json(out: RequestOutput) -> dict[str, Any]:
    """One engine output as ``--json`` prints it in-process (see the module docstring)."""
    return _compact(dataclasses.asdict(out))


class JsonPrinter:
    """One JSON object per event, flushed per line."""

    mid_line = False  # every line is whole

    def wire(self, event: oe.GenerateResponse) -> None:
        from google.protobuf import json_format

        print(json_format.MessageToJson(event, indent=None), flush=True)

    def engine(self, out: RequestOutput) -> None:
        print(json.dumps(engine_output_json(out), allow_nan=False), flush=True)

    def close(self) -> None:
        """Nothing follows the events."""


Printer = TextPrinter | JsonPrinter
