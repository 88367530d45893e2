"""The model's own chat format: its GGUF ``tokenizer.chat_template``, rendered as
``transformers``' ``apply_chat_template`` renders it (:class:`ChatFormat`; a model without
a template gets :meth:`ChatFormat.plain`).

A session's text is split in two: :meth:`~ChatFormat.prefix_text` (the rendered system
part up to where the first user message's content starts, shared by every session; in
Gemma 3's format the user header belongs to it too) and :meth:`~ChatFormat.continuation`
(the rest); :meth:`~ChatFormat.check` verifies the token-prefix rule that makes the split
safe.

Rendering is sandboxed (:class:`~jinja2.sandbox.ImmutableSandboxedEnvironment`: a chat
template is data from a downloaded file) and sees the names ``apply_chat_template`` gives:
``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``, ``tools`` (None),
``raise_exception``, plus ``tojson`` and ``strftime_now``.

The plain fallback (:data:`PLAIN_TEMPLATE`) serves base models such as Gemma 3 270M: the
system text and a blank line, then each message as ``### User`` / ``### Assistant``, a
newline, its content and a blank line; the generation prompt is ``### Assistant\n``.
The engine tokenizes the prefix with the model's BOS (when it adds one), so a template's
leading ``bos_token`` is dropped from :meth:`~ChatFormat.prefix_text`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["PLAIN_TEMPLATE", "ChatFormat", "ChatFormatError", "Message", "read_gguf_chat"]

Message = Mapping[str, str]
Tokenize = Callable[[str], list[int]]

PLAIN_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{{ m['content'] + '\n\n' }}"
    "{%- elif m['role'] == 'user' -%}{{ '### User\n' + m['content'] + '\n\n' }}"
    "{%- else -%}{{ '### Assistant\n' + m['content'] + '\n\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '### Assistant\n' }}{%- endif -%}"
)

# Markers no real text contains: they find where a message's content sits in a rendering.
_SYS = "\x01mesh-system\x01"
_USER = "\x01mesh-user\x01"
_REPLY = "\x01mesh-reply\x01"

# Conversations the token-prefix rule is checked on (plus the caller's own system text).
_SAMPLE_TURNS: tuple[tuple[Message, ...], ...] = (
    ({"role": "user", "content": "Task t1:\nWhich file defines Parcel?"},),
    (
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": 'Looking.\n<call>list_files(path=".")</call>'},
        {"role": "user", "content": 'list_files(path=".") returned:\nREADME.md\ncourier/'},
    ),
)


class ChatFormatError(Exception):
    """The chat template cannot be used (it fails to render, or breaks the prefix rule)."""


def _raise(message: str) -> None:
    raise ChatFormatError(message)


class ChatFormat:
    """One chat template, ready to render. Immutable after construction."""

    def __init__(self, template: str, *, name: str, bos_token: str = "", eos_token: str = "",
                 add_bos: bool = False) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda value, indent=None: json.dumps(
            value, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(template)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatFormatError(
                f"the chat template of {name} does not parse (line {exc.lineno}: {exc.message})"
            ) from exc
        self.name = name
        self.source = template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos = add_bos

    @classmethod
    def plain(cls, *, name: str = "plain", add_bos: bool = False) -> ChatFormat:
        """The documented fallback for models without a chat template."""
        return cls(PLAIN_TEMPLATE, name=name, add_bos=add_bos)

    @classmethod
    def from_gguf(cls, path: str | Path, *, model_name: str | None = None) -> ChatFormat:
        """The GGUF's own chat template, or :meth:`plain` (named ``plain``) if it has none."""
        meta = read_gguf_chat(path)
        label = model_name or str(meta.get("name") or Path(path).stem)
        add_bos = bool(meta.get("add_bos", False))
        template = meta.get("chat_template")
        if not isinstance(template, str) or not template.strip():
            return cls.plain(add_bos=add_bos)
        return cls(template, name=f"{label} (GGUF chat template)", add_bos=add_bos,
                   bos_token=str(meta.get("bos_token") or ""),
                   eos_token=str(meta.get("eos_token") or ""))

    @property
    def is_plain(self) -> bool:
        return self.source == PLAIN_TEMPLATE

    # ------------------------------------------------------------------ rendering

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str:
        """The conversation as the model's template writes it (``apply_chat_template``)."""
        try:
            return self._template.render(
                messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token, tools=None)
        except jinja2.TemplateError as exc:
            raise ChatFormatError(f"the chat template of {self.name} failed: {exc}") from exc

    def _strip_bos(self, text: str) -> str:
        if self.add_bos and self.bos_token and text.startswith(self.bos_token):
            return text[len(self.bos_token) :]
        return text

    def _split_at(self, text: str, marker: str) -> tuple[str, str]:
        head, found, tail = text.partition(marker)
        if not found:
            raise ChatFormatError(f"the chat template of {self.name} drops or rewrites message "
                                  "content; mesh cannot find where a message starts")
        return head, tail

    def prefix_text(self, system: str) -> str:
        """The shared prefix: the rendering up to the first user message's content."""
        full = self.render([{"role": "system", "content": system},
                            {"role": "user", "content": _USER}])
        head, _ = self._split_at(self._strip_bos(full), _USER)
        return head

    def continuation(
        self, system: str, messages: Sequence[Message], *, add_generation_prompt: bool = True
    ) -> str:
        """The text after :meth:`prefix_text` for ``messages`` (which start with a user one)."""
        if not messages or messages[0].get("role") != "user":
            raise ChatFormatError("a session's messages must start with a user message")
        prefix = self.prefix_text(system)
        full = self._strip_bos(self.render([{"role": "system", "content": system}, *messages],
                                           add_generation_prompt=add_generation_prompt))
        if not full.startswith(prefix):
            raise ChatFormatError(f"the chat template of {self.name} renders the system part "
                                  "differently once a conversation follows; its prefix cannot "
                                  "be shared")
        return full[len(prefix) :]

    def reply_tail(self, messages: Sequence[Message], user: str) -> str:
        """Text to append after the model's reply to ``messages``: the reply's closing
        markup, ``user`` as the next user message, and the generation prompt."""
        convo = [*messages, {"role": "assistant", "content": _REPLY}]
        full = self.continuation(_SYS, [*convo, {"role": "user", "content": user}])
        _, tail = self._split_at(full, _REPLY)
        return tail

    # ------------------------------------------------------------------ checks

    def check(self, tokenize: Tokenize, system: str = "You are a helpful agent.") -> str | None:
        """The token-prefix rule; None when it holds, else what breaks it.

        For sample conversations (and ``system``), the prefix's tokens must be an exact token
        prefix of the whole rendering's tokens, and the continuation must not depend on the
        system text (each session renders its turns without it).
        """
        try:
            for turns in _SAMPLE_TURNS:
                for sys_text in (system, "Another system prompt.\n"):
                    prefix = self.prefix_text(sys_text)
                    rest = self.continuation(sys_text, turns)
                    p_tok, f_tok = tokenize(prefix), tokenize(prefix + rest)
                    if f_tok[: len(p_tok)] != p_tok:
                        return ("the prefix's tokens are not a token prefix of a rendered "
                                f"conversation (they differ at token {_diff(p_tok, f_tok)})")
                if self.continuation(system, turns) != self.continuation("other", turns):
                    return "a session's turns render differently depending on the system text"
                if len(turns) >= 3:
                    self.reply_tail(turns[:1], "next")
        except ChatFormatError as exc:
            return str(exc)
        return None

    def resolve(self, tokenize: Tokenize, warn: Callable[[str], None]) -> ChatFormat:
        """This format if :meth:`check` passes, else a warning and :meth:`plain`."""
        problem = self.check(tokenize)
        if problem is None:
            return self
        warn(f"warning: {self.name}: {problem}; falling back to the plain chat format")
        return ChatFormat.plain(add_bos=self.add_bos)


def _diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(b))


# --------------------------------------------------------------------------- GGUF metadata

_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}
_STRING, _ARRAY = 8, 9
_WANTED = {
    "general.name": "name",
    "tokenizer.chat_template": "chat_template",
    "tokenizer.ggml.add_bos_token": "add_bos",
    "tokenizer.ggml.bos_token_id": "bos_id",
    "tokenizer.ggml.eos_token_id": "eos_id",
}


def read_gguf_chat(path: str | Path) -> dict[str, Any]:
    """The chat-relevant metadata of a GGUF file: name, chat_template, add_bos and the
    BOS/EOS token texts. Reads only the header (the ``gguf`` package's reader maps and
    parses every tensor and the whole vocabulary first: half a minute for Gemma 3's)."""
    out: dict[str, Any] = {}
    tokens: list[str] = []
    with Path(path).open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ChatFormatError(f"{path} is not a GGUF file")
        _read(f, "I")  # version
        _read(f, "Q")  # tensor count
        for _ in range(_read(f, "Q")):
            key = _string(f)
            kind = _read(f, "I")
            if key == "tokenizer.ggml.tokens" and kind == _ARRAY:
                tokens = _string_array(f)
            elif key in _WANTED:
                out[_WANTED[key]] = _value(f, kind)
            else:
                _skip(f, kind)
    for which in ("bos", "eos"):
        tid = out.get(f"{which}_id")
        if isinstance(tid, int) and 0 <= tid < len(tokens):
            out[f"{which}_token"] = tokens[tid]
    return out


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize("<" + fmt)
    data = f.read(size)
    if len(data) != size:
        raise ChatFormatError("truncated GGUF header")
    return struct.unpack("<" + fmt, data)[0]


def _string(f: BinaryIO) -> str:
    n = _read(f, "Q")
    return f.read(n).decode("utf-8", "replace")


def _value(f: BinaryIO, kind: int) -> Any:
    if kind == _STRING:
        return _string(f)
    if kind in _SCALAR:
        return _read(f, _SCALAR[kind])
    _skip(f, kind)
    return None


def _string_array(f: BinaryIO) -> list[str]:
    kind, n = _read(f, "I"), _read(f, "Q")
    if kind != _STRING:
        f.seek(struct.calcsize("<" + _SCALAR[kind]) * n, 1)
        return []
    return [_string(f) for _ in range(n)]


def _skip(f: BinaryIO, kind: int) -> None:
    if kind == _STRING:
        f.seek(_read(f, "Q"), 1)
    elif kind == _ARRAY:
        inner, n = _read(f, "I"), _read(f, "Q")
        if inner in _SCALAR:
            f.seek(struct.calcsize("<" + _SCALAR[inner]) * n, 1)
        else:
            for _ in range(n):
                _skip(f, inner)
    elif kind in _SCALAR:
        f.seek(struct.calcsize("<" + _SCALAR[kind]), 1)
    else:
        raise ChatFormatError(f"unknown GGUF value type {kind}")
