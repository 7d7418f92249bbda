"""The encoder role's handles seen as KV sessions: what the KV pull service and the NIXL backend
call on an engine (``read_kv_session`` and the rest), over ``EncoderEngine``'s handle store and
embedding arena (``engine/encoder.py`` says why handles are sessions)."""

from __future__ import annotations

from collections.abc import Sequence

from refengine.kv.transfer.base import KvTransferBackend, read_identity
from refengine.kv.transfer.sessions import KvSessionStore, expecting
from refengine.model.embedding_io import EmbeddingArena
from refengine.types import InvalidRequestError


class HandleSessions:
    """Mixed into ``EncoderEngine``, which sets ``handles``, ``arena`` and ``backends`` and
    defines ``release_handles`` and ``_free_due``."""

    handles: KvSessionStore
    arena: EmbeddingArena
    backends: dict[str, KvTransferBackend]

    def release_handles(self, handle_ids: Sequence[str]) -> int:
        raise NotImplementedError

    def _free_due(self) -> None:
        raise NotImplementedError

    def read_kv_session(self, session_id: str, first_block_index: int, num_blocks: int) -> bytes:
        """Rows ``first … first + num - 1`` of a live handle (the KV pull service's read)."""
        rows = self.handles.begin_read(session_id)
        try:
            if first_block_index + num_blocks > len(rows) or num_blocks == 0:
                raise InvalidRequestError(f"rows {first_block_index}..{first_block_index + num_blocks - 1} "
                                          f"requested; the handle has {len(rows)}")
            return self.arena.read(rows[first_block_index:first_block_index + num_blocks])
        finally:
            self.handles.end_read(session_id)

    def kv_session_content(self, session_id: str) -> str:
        return self.handles.content(session_id)

    def kv_session_blocks(self, session_id: str) -> int:
        return self.handles.num_blocks(session_id)

    def block_nbytes(self) -> int:
        return self.arena.block_nbytes

    def kv_layout(self) -> str:
        return self.arena.layout

    def pin_kv_session(self, session_id: str, seconds: float, expected_content: str = "") -> tuple[int, ...]:
        return self.handles.pin(session_id, seconds, expecting(expected_content, self.kv_read_identity()))

    def unpin_kv_session(self, session_id: str) -> None:
        self.handles.unpin(session_id)

    def kv_read_identity(self) -> str:
        return read_identity(self.backends.values())

    def confirm_kv_session(self, session_id: str, pinned: bool = False) -> bool:
        """A consumer pulled the handle: it is released (ENC6), and its pin ends if it pinned one."""
        released = self.handles.release(session_id, "consumed", pulled=True, pinned=pinned)
        self._free_due()
        return released

    def abort_kv_session(self, session_id: str) -> bool:
        return self.release_handles([session_id]) == 1

    def release_all_kv_sessions(self) -> int:
        released = self.handles.release_all("drain")
        self._free_due()
        return released
