"""A turn's output: bytes of generated tokens in, released text out, stop strings exact.

Used by the real pool and by :class:`~mesh.engine.fake.FakeEngine`, so both cut stop
strings the same way. Pure Python: no llama.cpp.

Rules:

* Token bytes are decoded incrementally (a UTF-8 character split over tokens is released
  once complete).
* Text that could be the start of a stop string is held back; when the following text shows
  it is not one, it is released in order.
* When a stop string appears, the text is cut at the earliest match (the smallest start; of
  stops starting at the same place, the shortest); no part of the stop string is released,
  and :attr:`TurnOutput.matched` names it. Nothing is accepted after a match.
"""

from __future__ import annotations

import codecs

__all__ = ["TurnOutput"]


class TurnOutput:
    """Incremental detokenizer with exact stop strings; see the module docstring."""

    def __init__(self, stops: tuple[str, ...] = ()) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = stops
        self.text = ""  # everything released so far
        self.matched: str | None = None
        self._held = ""
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    @property
    def held(self) -> str:
        """Text decoded but not yet released (a possible start of a stop string)."""
        return self._held

    def feed(self, data: bytes) -> str:
        """Add one token's bytes; return the text this releases (often ``""``)."""
        if self.matched is not None:
            return ""
        return self._take(self._decoder.decode(data))

    def feed_text(self, text: str) -> str:
        """Add already-decoded text (the fake engine's words)."""
        if self.matched is not None:
            return ""
        return self._take(text)

    def finish(self) -> str:
        """End of the turn: release whatever is held (unless a stop matched)."""
        if self.matched is not None:
            return ""
        out = self._take(self._decoder.decode(b"", final=True))
        if self.matched is None:
            out += self._held
            self.text += self._held
            self._held = ""
        return out

    def _take(self, new: str) -> str:
        held = self._held + new
        if not self.stops:
            self._held = ""
            self.text += held
            return held
        best: tuple[int, int, str] | None = None
        for s in self.stops:
            at = held.find(s)
            if at >= 0 and (best is None or (at, len(s)) < best[:2]):
                best = (at, len(s), s)
        if best is not None:
            out = held[: best[0]]
            self.matched = best[2]
            self._held = ""
            self.text += out
            return out
        keep = self._prefix_tail(held)
        out = held[: len(held) - keep]
        self._held = held[len(held) - keep :]
        self.text += out
        return out

    def _prefix_tail(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop."""
        longest = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if s.startswith(text[len(text) - k :]):
                    longest = k
                    break
        return longest
