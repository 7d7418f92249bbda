"""The remote NIXL agents a decode engine READs from: their metadata loaded into the local
agent, and the source identities a pin has vouched for.

Both are bounded by ``MAX_REMOTE_AGENTS`` so that requests naming many agents cannot grow
them for good. Invariant: an agent a pull is reading from (``use`` without its ``done_with``)
is never forgotten; beyond the bound, the least recently loaded idle agents are.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

from refengine.kv.transfer.nixl_read import nixl_call
from refengine.kv.transfer.nixl_source import NixlSource, fail

logger = logging.getLogger(__name__)

#: Remote agents kept loaded (and source identities remembered as vouched for by a pin).
MAX_REMOTE_AGENTS = 64


class RemoteAgents:
    """Thread-safe: any number of pulls may ``use`` agents at once."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent  # the local nixl_agent
        self._loaded: dict[str, bytes] = {}  # remote agent name -> the metadata loaded for it
        self._vouched: OrderedDict[str, None] = OrderedDict()  # source identities a pin confirmed
        self._reading: dict[str, int] = {}  # remote agent name -> pulls using it now
        self._lock = threading.Lock()

    def use(self, source: NixlSource) -> str:
        """The source's agent name, its metadata loaded (again, when it changed: NIXL replaces
        it); counted as read from until ``done_with``."""
        with self._lock:
            if self._loaded.get(source.agent_name) != source.metadata:
                loaded = nixl_call("load the source's metadata", self._agent.add_remote_agent, source.metadata)
                loaded = loaded.decode() if isinstance(loaded, bytes) else loaded  # bytes in nixl 1.5
                if loaded != source.agent_name:
                    if self._loaded.pop(loaded, None) is None:  # a peer we use: reloaded next time instead
                        self._forget(loaded)
                    raise fail(f"the NIXL metadata is agent {loaded!r}'s, not {source.agent_name!r}'s")
                self._loaded[loaded] = source.metadata
                idle = [name for name in self._loaded if name != loaded and not self._reading.get(name)]
                for name in idle[:max(0, len(self._loaded) - MAX_REMOTE_AGENTS)]:  # least recently loaded first
                    del self._loaded[name]
                    self._forget(name)
            self._reading[source.agent_name] = self._reading.get(source.agent_name, 0) + 1
        return source.agent_name

    def done_with(self, name: str) -> None:
        with self._lock:
            self._reading[name] -= 1
            if not self._reading[name]:
                del self._reading[name]

    def vouch(self, identity: str) -> None:
        """A pin confirmed this source: its later pulls READ while their pins are in flight."""
        with self._lock:
            self._vouched[identity] = None
            self._vouched.move_to_end(identity)
            while len(self._vouched) > MAX_REMOTE_AGENTS:
                self._vouched.popitem(last=False)

    def vouched(self, identity: str) -> bool:
        with self._lock:
            return identity in self._vouched

    def forget_all(self) -> None:
        """Remove every loaded agent (at close, once no pull runs)."""
        with self._lock:
            for name in list(self._loaded):
                self._forget(name)
            self._loaded.clear()

    def _forget(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception:  # already gone: nothing left to remove
            logger.debug("removing NIXL agent %s failed", name, exc_info=True)
