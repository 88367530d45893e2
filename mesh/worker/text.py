"""What a user reads of a turn: loops cut, echoed instructions caught, turn markup removed.

Small models fall into loops (the same clause until ``max_tokens``), restate their own
instructions, or write the turn format's tags inside their prose: :data:`PROSE` (sampling)
and :class:`LoopGuard` (streaming) keep loops short, :func:`echoed`/:func:`without_echo`
catch restated instructions, :func:`strip_markup` removes tags and :func:`fragment` says why
a text is not a whole answer. Everything here is pure and linear in the text's length
(:func:`has_loop` is the bench's measure of loops).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from mesh.engine.config import SamplingParams
from mesh.template.loader import Template

__all__ = ["ECHO_WORDS", "LOOP_TIMES", "LOOP_WORDS", "PROSE", "LoopGuard", "clean", "cut_loop",
           "echoed", "fragment", "has_loop", "instruction_sentences", "prose_params",
           "strip_markup", "template_sentences", "template_texts", "without_echo"]

LOOP_WORDS = 8  # a loop is the same phrase of this many words ...
LOOP_TIMES = 3  # ... this many times
ECHO_WORDS = 8  # an echo is an instruction sentence of at least this many words

# DRY (penalize continuing a sequence already written), mild enough that a name written
# once can be written again: the penalty starts at the 3rd token of a repeat and grows
# 1.75x a token. A plain repetition penalty was tried and rejected: it rewrote names
# ("a2a_bench.py" became "a2_bench.py": the second "a" had been seen).
PROSE = SamplingParams(dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2)

_WORD = re.compile(r"\S+")
_EDGE = ".,;:!?()[]{}\"'`*"
_TAGS = re.compile(r"</?\s*(?:answer|final_answer|call|tool_call)\s*>", re.I)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")


def prose_params(params: SamplingParams, *, opens: tuple[str, ...] = (), close: str = "",
                 first: bool = False) -> SamplingParams:
    """``params`` with :data:`PROSE`'s repetition control. Under a grammar the prose is
    where ``first``/``opens``/``close`` say (see :class:`SamplingParams`); structure is
    never penalized."""
    return replace(params, dry_multiplier=PROSE.dry_multiplier, dry_base=PROSE.dry_base,
                   dry_allowed_length=PROSE.dry_allowed_length, dry_last_n=PROSE.dry_last_n,
                   repeat_penalty=PROSE.repeat_penalty, prose_open=opens, prose_close=close,
                   prose_first=first)


def _key(word: str) -> str:
    """A word as loops and echoes compare it: no tags, no punctuation at its edges."""
    if "<" in word:
        word = _TAGS.sub("", word)
    return word.strip(_EDGE).lower()


class LoopGuard:
    """Incremental loop detection over streamed text: ``feed`` each piece; it returns the
    offset to cut the whole text at once some phrase of ``words`` words has come ``times``
    times (the start of its second copy: one copy stays), else None. O(1) per word."""

    def __init__(self, words: int = LOOP_WORDS, times: int = LOOP_TIMES) -> None:
        self.words = words
        self.times = times
        self.text = ""
        self._done = 0  # offset up to which words were read
        self._keys: list[str] = []
        self._starts: list[int] = []
        self._seen: dict[tuple[str, ...], list[int]] = {}
        self.cut: int | None = None

    def feed(self, piece: str) -> int | None:
        if self.cut is not None:
            return self.cut
        self.text += piece
        # Only words followed by whitespace are complete.
        for m in _WORD.finditer(self.text, self._done):
            if m.end() == len(self.text):
                break
            self._done = m.end()
            key = _key(m.group())
            if not key:
                continue
            self._keys.append(key)
            self._starts.append(m.start())
            if len(self._keys) < self.words:
                continue
            first = len(self._keys) - self.words
            gram = tuple(self._keys[first:])
            where = self._seen.setdefault(gram, [])
            where.append(self._starts[first])
            if len(where) >= self.times:
                self.cut = where[1]
                return self.cut
        return None

    def finish(self) -> int | None:
        """Read the last word too (the text ended); the cut offset or None."""
        if self.cut is None:
            self.feed(" ")
            self.text = self.text[:-1]
        return self.cut


def _loop_at(text: str, words: int, times: int) -> int | None:
    guard = LoopGuard(words, times)
    guard.feed(text)
    return guard.finish()


def cut_loop(text: str, words: int = LOOP_WORDS, times: int = LOOP_TIMES) -> str:
    """``text`` up to the second copy of its first phrase of ``words`` words to come
    ``times`` times (trailing blanks removed); ``text`` itself when there is none."""
    at = _loop_at(text, words, times)
    return text if at is None else text[:at].rstrip()


def has_loop(text: str, words: int = LOOP_WORDS, times: int = LOOP_TIMES) -> bool:
    """Whether some phrase of ``words`` words comes ``times`` times in ``text``."""
    return _loop_at(text, words, times) is not None


def _norm(text: str) -> str:
    return " ".join(k for k in (_key(w) for w in _WORD.findall(text)) if k)


def instruction_sentences(texts: Iterable[str], min_words: int = ECHO_WORDS) -> list[str]:
    """The sentences (split at ., !, ? and line breaks) of ``texts`` with at least
    ``min_words`` words, normalized (lower case, punctuation at word edges dropped)."""
    out: list[str] = []
    for text in texts:
        for sentence in _SENTENCE_END.split(text):
            norm = _norm(sentence)
            if norm.count(" ") + 1 >= min_words and norm not in out:
                out.append(norm)
    return out


def echoed(answer: str, sentences: Sequence[str]) -> list[str]:
    """The ``sentences`` (from :func:`instruction_sentences`) that ``answer`` holds."""
    if not sentences:
        return []
    norm = f" {_norm(answer)} "
    return [s for s in sentences if f" {s} " in norm]


def strip_markup(text: str, tags: Iterable[str] = ()) -> str:
    """``text`` without the turn format's tags: ``tags`` (a template's call and answer
    tags) and the usual ``<answer>``/``<call>``/``<tool_call>`` ones, open or closed."""
    for tag in tags:
        text = text.replace(tag, "")
    return _TAGS.sub("", text)


def clean(text: str, tags: Iterable[str] = ()) -> str:
    """What a user may read of a generated answer: markup removed, a loop cut."""
    return cut_loop(strip_markup(text, tags)).strip()


# Words a sentence does not end on: an answer ending on one was cut mid-sentence.
_DANGLING = frozenset((
    "a", "an", "the", "of", "in", "on", "at", "to", "for", "from", "by", "with", "and", "or",
    "but", "nor", "is", "are", "was", "were", "be", "been", "as", "that", "which", "who",
    "whose", "this", "these", "those", "its", "their", "his", "her", "our", "your", "my",
    "into", "onto", "than", "then", "if", "when", "where", "while", "because", "so", "not",
    "no"))
_OPEN_CALL = re.compile(r"[A-Za-z0-9_]\([^()]*$")  # name( with nothing closing it
_PAIRS = ("()", "[]", "{}")


def fragment(text: str) -> str:
    """Why ``text`` is not a whole answer, '' when it is one. Not whole: empty; holding
    markup (``<``); part of a tool call (``name(`` never closed); a bracket, quote or
    backtick left open; or cut mid-sentence (three words or more
    without a closing ``.``, ``!`` or ``?`` unless the last is a name such as a path, or
    ending on a word no sentence ends on: "the", "in", "and"...). One or two words may
    stand alone ("ok", "30 kg")."""
    body = text.strip()
    if not body:
        return "empty"
    if "<" in body:
        return "markup"
    if _OPEN_CALL.search(body):
        return "part of a tool call"
    for pair in _PAIRS:
        if body.count(pair[0]) != body.count(pair[1]):
            return f"an open {pair[0]!r}"
    if body.count("`") % 2 or body.count('"') % 2:
        return "an open quote"
    words = [w for w in (_key(w) for w in _WORD.findall(body)) if w]
    if not words:
        return "no words"
    last = body.rstrip("\"')`*]")
    if words[-1] in _DANGLING:
        return f"cut mid-sentence (ends on {words[-1]!r})"
    # A sentence may end on a name without its full stop ("... is in courier/parcels.py").
    named = any(c in words[-1].strip(".") for c in "/._") or words[-1][-1:].isdigit()
    if len(words) >= 3 and not last.endswith((".", "!", "?")) and not named:
        return "cut mid-sentence (no full stop)"
    return ""


NO_ANSWER = "(no answer: the model only restated its instructions)"


def without_echo(text: str, sentences: Sequence[str]) -> str:
    """``text`` without its sentences that reproduce one of ``sentences`` (or lie inside
    one: a long instruction sentence split by a line break); :data:`NO_ANSWER` when
    nothing of its own is left."""
    if not echoed(text, sentences):
        return text
    kept: list[str] = []
    for part in re.split(r"((?<=[.!?])\s+|\n+)", text):
        norm = f" {_norm(part)} "
        if norm.strip() and any(f" {s} " in norm or norm in f" {s} " for s in sentences):
            continue
        kept.append(part)
    rest = "".join(kept).strip()
    if echoed(rest, sentences) or len(_norm(rest).split()) < 2:
        return NO_ANSWER
    return rest


def template_texts(template: Template) -> list[str]:
    """The instruction texts a template renders into a worker's prompt (its text sections,
    its instructions and tool-result files), with every value that varies (the request,
    the project, a tool's output) rendered as a line break, so only the template's own
    sentences are left. A file that does not render so is skipped."""
    m = template.manifest
    renders: list[Callable[[], str]] = [
        lambda: template.instructions("\n", "\n"),
        lambda: template.tool_result(call="\n", output="\n", is_error=True, turn=1),
    ]
    for section in m.prefix.sections:
        if section.kind == "text":
            renders.append(functools.partial(template.render, section.file, project="\n",
                                             target_tokens=m.prefix.target_tokens))
    out: list[str] = []
    for render in renders:
        try:
            out.append(render())
        except Exception:  # a user's template may need a real value here: skip it
            continue
    return out


_SENTENCES: dict[int, tuple[Template, tuple[str, ...]]] = {}


def template_sentences(template: Template) -> tuple[str, ...]:
    """:func:`instruction_sentences` of :func:`template_texts`, rendered once per template
    (a worker is made per subtask; this keeps the rendering off each request)."""
    hit = _SENTENCES.get(id(template))
    if hit is None or hit[0] is not template:
        if len(_SENTENCES) > 64:  # templates are few; a reloading caller must not grow this
            _SENTENCES.clear()
        hit = _SENTENCES[id(template)] = (
            template, tuple(instruction_sentences(template_texts(template))))
    return hit[1]
