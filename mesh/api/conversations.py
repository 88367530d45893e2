"""Idle conversations kept as live pooled sessions, found by the longest matching prefix.

Each cached conversation is a session and the exact text it holds after the pool's prefix
(every message appended so far and every token generated). A request whose rendered text
after the prefix starts with a cached conversation's text continues that session, so only
its new messages are prefilled. A conversation in a turn is taken out of the cache (a second
request with the same history gets a new session); it goes back when the turn ends.
Idle conversations are evicted least-recently-used when the pool needs the room.

The cache is scoped by caller (:attr:`Conversation.owner`, the authenticated caller's name,
"" without auth): a request continues only its own caller's conversations, so what one
caller can observe of another's (through ``cached_tokens`` or timing) is the shared prefix
and nothing more.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import anyio

from mesh.engine.interface import EngineError, Session

__all__ = ["Conversation", "ConversationCache"]


@dataclass
class Conversation:
    session: Session
    text: str = ""  # what the session holds after the prefix, exactly
    owner: str = ""  # the caller whose requests may continue it ("" without auth)
    last_used: float = field(default_factory=time.monotonic)


class ConversationCache:
    """The idle conversations; bounded by ``max_idle`` (older ones are detached)."""

    def __init__(self, max_idle: int) -> None:
        self.max_idle = max(1, max_idle)
        self._idle: dict[str, Conversation] = {}
        self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._idle)

    def take(self, owner: str, rest: str) -> Conversation | None:
        """Remove and return ``owner``'s idle conversation whose text is the longest prefix
        of ``rest`` with at least one character left to append; None if there is none."""
        best: Conversation | None = None
        for conv in self._idle.values():
            fits = (conv.owner == owner and len(conv.text) < len(rest)
                    and rest.startswith(conv.text))
            if fits and (best is None or len(conv.text) > len(best.text)):
                best = conv
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        del self._idle[best.session.id]
        return best

    async def put(self, conv: Conversation) -> None:
        """Keep ``conv`` for the next turn (the least recently used go past ``max_idle``)."""
        conv.last_used = time.monotonic()
        self._idle[conv.session.id] = conv
        while len(self._idle) > self.max_idle:
            await self.evict_lru()

    async def evict_lru(self) -> bool:
        """Detach the least recently used idle conversation; False when none is idle."""
        if not self._idle:
            return False
        sid = min(self._idle, key=lambda k: self._idle[k].last_used)
        conv = self._idle.pop(sid)
        self.evictions += 1
        await discard(conv)
        return True

    async def evict_idle(self, older_than_s: float) -> int:
        """Detach every conversation idle longer than ``older_than_s``; how many."""
        cutoff = time.monotonic() - older_than_s
        old = [sid for sid, c in self._idle.items() if c.last_used < cutoff]
        for sid in old:
            conv = self._idle.pop(sid)
            self.evictions += 1
            await discard(conv)
        return len(old)

    async def aclose(self) -> None:
        while await self.evict_lru():
            pass


async def discard(conv: Conversation) -> None:
    """Detach a conversation's session (shielded: it always completes)."""
    with anyio.CancelScope(shield=True), contextlib.suppress(EngineError):
        await conv.session.detach()
