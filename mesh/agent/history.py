"""What a context remembers: its earlier messages and answers, within a token budget.

One :class:`Conversations` per coordinator process holds, per A2A ``contextId``, the
entries (``user`` messages, the coordinator's ``answer``\\ s and ``question``\\ s) in order.
:meth:`Conversations.window` returns the newest entries that fit ``budget`` tokens — the
oldest are dropped first, and how many were dropped is returned so the status can say so.
Held in memory, bounded in contexts (least recently used forgotten first) and in entries.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Conversations", "Entry", "Window"]

_ENTRY_CHARS = 8_000  # one entry is cut to this many characters before it is stored


@dataclass(frozen=True)
class Entry:
    role: str  # "user" | "answer" | "question"
    text: str


@dataclass(frozen=True)
class Window:
    """The entries that fit the budget, oldest first, and how many older ones were left out."""

    entries: tuple[Entry, ...]
    dropped: int
    tokens: int

    def render(self) -> str:
        labels = {"user": "User", "answer": "Coordinator answered", "question": "Coordinator asked"}
        return "\n".join(f"{labels.get(e.role, e.role)}: {e.text}" for e in self.entries)


class Conversations:
    """Per-context history (see the module docstring). Not thread-safe; one event loop."""

    def __init__(self, count_tokens: Callable[[str], int], *, max_contexts: int = 1024,
                 max_entries: int = 64) -> None:
        if max_contexts < 1 or max_entries < 1:
            raise ValueError("max_contexts and max_entries must be >= 1")
        self._count = count_tokens
        self._max_contexts = max_contexts
        self._max_entries = max_entries
        self._contexts: OrderedDict[str, list[Entry]] = OrderedDict()

    def add(self, context_id: str, role: str, text: str) -> None:
        if not context_id or not text.strip():
            return
        entries = self._contexts.pop(context_id, [])
        entries.append(Entry(role, text.strip()[:_ENTRY_CHARS]))
        del entries[: -self._max_entries]
        self._contexts[context_id] = entries
        while len(self._contexts) > self._max_contexts:
            self._contexts.popitem(last=False)

    def window(self, context_id: str, budget: int) -> Window:
        """The newest entries of ``context_id`` that fit in ``budget`` tokens."""
        entries = self._contexts.get(context_id, [])
        kept: list[Entry] = []
        used = 0
        for entry in reversed(entries):
            cost = self._count(entry.text) + 4  # the role label and the newline
            if used + cost > budget:
                break
            kept.append(entry)
            used += cost
        kept.reverse()
        return Window(tuple(kept), len(entries) - len(kept), used)

    def __len__(self) -> int:
        return len(self._contexts)
