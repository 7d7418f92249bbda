"""The grammar-backend interface: compile a ``GuidedSpec`` once, then one matcher per output.

Invariants a backend keeps:
- ``compile`` raises ``GuidedSpecError`` (never anything else) for a spec the backend cannot
  compile or express, with a message that says what is wrong;
- a ``CompiledGuide`` is immutable and shared by every output (and request) that uses it;
- a ``GuideMatcher`` belongs to one output: ``fill_bitmask`` sets, in row ``row`` of a
  ``[rows, ceil(vocab / 32)]`` int32 bitmask, bit ``t`` iff token ``t`` may come next; once
  the grammar is complete only the stop tokens are allowed. Bitmasks of all backends share
  this layout, so one call applies the whole batch's masks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from refengine.types import GuidedSpec


class GuidedSpecError(ValueError):
    """The spec cannot be compiled (invalid, too large, too slow, or not expressible)."""


class GuideMatcher(ABC):
    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]``."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance past ``token_id``; False when the grammar does not allow it."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: nothing may follow."""

    def error(self) -> str:
        """Why the matcher can go no further, when the backend says ("" otherwise): a limit it
        hit (llguidance: its lexer's or parser's), reported instead of a bare rejected token."""
        return ""


class CompiledGuide(ABC):
    @abstractmethod
    def new_matcher(self) -> GuideMatcher:
        """A fresh matcher at the start of the grammar."""

    @property
    def memory_bytes(self) -> int:
        """Memory the compiled form holds (its precomputed token masks), which bounds the
        compile cache; 0 for a backend that computes masks as it goes (llguidance)."""
        return 0


class GrammarBackend(ABC):
    """One grammar engine (xgrammar, llguidance) bound to one tokenizer and vocabulary."""

    name: str
    modes: tuple[str, ...]  # the GuidedSpec modes this backend can express

    @abstractmethod
    def compile(self, spec: GuidedSpec) -> CompiledGuide:
        """Compile ``spec`` (its ``mode`` is one of ``modes``); raises ``GuidedSpecError``."""
