"""The parts of a user's request: its questions and clauses, in order. Pure.

Guided planning (:mod:`mesh.agent.plans`, ``style="guided"``) anchors each planned
subtask on one part of the request, so a small model's plan keeps what was asked::

    "In which file is the parcel weight checked, and what happens to a parcel of 40 kg?"
    -> ("In which file is the parcel weight checked?", "What happens to a parcel of 40 kg?")

A request splits between sentences, at ``;``, and before a question word that opens a new
clause (``, which ...``, ``, and what ...``, `` and how ...``). A part of fewer than
:data:`MIN_WORDS` words joins the one before it, so ``"Where, and why?"`` stays whole.
Each part starts with a capital letter and ends with its sentence's punctuation.
"""

from __future__ import annotations

import re

__all__ = ["MIN_WORDS", "request_parts"]

MIN_WORDS = 3
_WH = r"(?:what|which|where|when|who|whom|whose|why|how)\b"
_SENTENCE = re.compile(r"(?<=[?!.])\s+(?=[A-Z0-9\"'`(])")
# a clause boundary: "; ", or a comma / "and" / "then" / "also" before a question word
_CLAUSE = re.compile(
    rf"\s*;\s*|,\s*(?:and\s+|or\s+|then\s+|also\s+)?(?={_WH})|\s+(?:and|then)\s+(?={_WH})",
    re.IGNORECASE,
)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _words(text: str, span: tuple[int, int]) -> int:
    return len(text[span[0]:span[1]].split())


def _finish(part: str, end: str) -> str:
    part = part[0].upper() + part[1:]
    return part if part[-1] in ".?!" else part + end


def request_parts(message: str, max_parts: int) -> tuple[str, ...]:
    """The request's parts, at most ``max_parts`` (the tail joins the last one); the whole
    request (whitespace folded) when it has no parts to split."""
    if max_parts < 1:
        raise ValueError(f"max_parts must be >= 1, got {max_parts}")
    text = " ".join(_CONTROL.sub(" ", message).split())
    parts: list[str] = []
    for sentence in _SENTENCE.split(text) if text else ():
        end = sentence[-1] if sentence[-1] in ".?!" else "."
        # (start, stop) spans of the clauses; a short one (either side) joins its
        # neighbour with the text between them kept: "Where, and why?" stays one part
        spans: list[tuple[int, int]] = []
        at = 0
        for cut in [*_CLAUSE.finditer(sentence), None]:
            stop = cut.start() if cut else len(sentence)
            if sentence[at:stop].strip(" ,;:"):
                if spans and (_words(sentence, (at, stop)) < MIN_WORDS
                              or _words(sentence, spans[-1]) < MIN_WORDS):
                    spans[-1] = (spans[-1][0], stop)
                else:
                    spans.append((at, stop))
            at = cut.end() if cut else stop
        parts.extend(_finish(sentence[a:b].strip(" ,;:"), end) for a, b in spans)
    if len(parts) > max_parts:
        parts[max_parts - 1:] = [" ".join(parts[max_parts - 1:])]
    return tuple(parts)
