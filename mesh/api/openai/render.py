"""A request's text after the pool's prefix: chat messages rendered in the model's chat
format, or a raw prompt, on top of the pool's system text.

Two rules, picked per request (:func:`is_strict`):

* **drop-in** (the default): any OpenAI client's messages are served on top of the pool's
  prefix. Messages that already start with the pool's system message (``GET /v1/prefix``'s
  ``system``, exactly) render as they are; any other list is rendered after it, and a
  client's own system message follows the pool's system text as the head of the next user
  message: the pool's prefix ends where the first user message's content starts (inside
  the user turn, in every chat format), so a system turn of its own cannot follow it, and
  some templates (Gemma 3's) refuse a second system turn anyway. A raw ``/v1/completions``
  prompt that does not start with the prefix is the text after it.
* **strict**: the text must start with the pool's prefix, else a 400 ``prefix_mismatch``
  naming the first differing token. Picked by a model name ending in ``:strict``
  (``/v1/models`` lists one) or for every request by ``OpenAIAPI(strict_prefix=True)``.

Rendering and tokenizing grow with the request: the API calls this module off the event
loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mesh.api.openai.schema import ChatMessage
from mesh.api.openai.tools import ToolChoice, ToolSpec, render_calls, tools_prompt
from mesh.api.openai.turns import Bad
from mesh.template.chat import ChatFormat

__all__ = ["STRICT_SUFFIX", "Prompter", "is_strict", "template_messages"]

STRICT_SUFFIX = ":strict"

Tokenize = Callable[[str], list[int]]
Msg = dict[str, str]


def is_strict(model: str, default: bool) -> bool:
    """Whether a request wants the strict prefix rule (a model name ending ``:strict``)."""
    return default or model.endswith(STRICT_SUFFIX)


def template_messages(messages: Sequence[ChatMessage], specs: tuple[ToolSpec, ...] = (),
                      choice: ToolChoice | None = None) -> list[Msg]:
    """OpenAI messages as the chat template's ``{"role", "content"}`` (``developer`` is
    ``system``, a ``tool`` result a user message, calls in the grammar's markup, the tools'
    description before the first user message's content)."""
    out: list[Msg] = []
    described = not specs or choice is None or choice.mode == "none"
    for i, m in enumerate(messages):
        if m.has_non_text():
            raise Bad(400, f"messages[{i}] has a non-text part; only text is supported",
                      "unsupported", "messages")
        role, text = m.role, m.text()
        if role == "developer":
            role = "system"
        elif role == "tool":
            role, text = "user", f"Tool result ({m.name or m.tool_call_id or 'tool'}):\n{text}"
        elif role == "assistant" and m.tool_calls:
            text = "\n".join(t for t in (text, render_calls(m.tool_calls)) if t)
        if role == "user" and not described and choice is not None:
            text, described = f"{tools_prompt(specs, choice)}\n\n{text}", True
        out.append({"role": role, "content": text})
    return out


class Prompter:
    """The pool's prefix rule over one chat format and system text."""

    def __init__(self, chat: ChatFormat, system_text: str, tokenize: Tokenize) -> None:
        self.chat, self.system_text, self.tokenize = chat, system_text, tokenize
        self.prefix = chat.prefix_text(system_text)

    def chat_rest(self, messages: list[Msg], *, strict: bool) -> str:
        """The rendered conversation after the prefix (:class:`Bad` 400 under the strict
        rule when it does not start with it; ChatFormatError when the template fails)."""
        first = messages[0] if messages else None
        own = first is not None and first == {"role": "system", "content": self.system_text}
        if strict or own:
            return self._rest(self._render(messages), "messages")
        pool = {"role": "system", "content": self.system_text}
        return self._rest(self._render([pool, *_fold_system(messages)]), "messages")

    def completion_rest(self, prompt: str, *, strict: bool) -> str:
        """A raw prompt's text after the prefix (drop-in: all of it, if it lacks one)."""
        text = self._strip_bos(prompt)
        if strict or text.startswith(self.prefix):
            return self._rest(text, "prompt")
        return text

    def _render(self, messages: list[Msg]) -> str:
        return self._strip_bos(self.chat.render(messages))

    def _strip_bos(self, text: str) -> str:
        bos = self.chat.bos_token
        if self.chat.add_bos and bos and text.startswith(bos):
            return text[len(bos):]
        return text

    def _rest(self, text: str, param: str) -> str:
        """The text after the prefix, or a 400 naming the first differing token."""
        if text.startswith(self.prefix):
            return text[len(self.prefix):]
        want = self.tokenize(self.prefix)
        got = self.tokenize(text[: len(self.prefix) + 64])
        tok = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b),
                   min(len(want), len(got)))
        ch = next((i for i, (a, b) in enumerate(zip(self.prefix, text, strict=False)) if a != b),
                  min(len(self.prefix), len(text)))
        raise Bad(400, (
            f"the request does not start with the pool's prefix: they differ at token {tok} "
            f"(character {ch}: the prefix has {self.prefix[ch:ch + 24]!r}, the request "
            f"{text[ch:ch + 24]!r}); send a first system message whose content is the "
            "'system' text of GET /v1/prefix, exactly (or, unless the server is strict, drop "
            "the ':strict' model suffix to have the pool's system text put first)"),
            "prefix_mismatch", param)


def _fold_system(messages: list[Msg]) -> list[Msg]:
    """System messages folded into the head of the next user message (one at the end
    becomes a user message)."""
    out: list[Msg] = []
    pending: list[str] = []
    for m in messages:
        if m["role"] == "system":
            pending.append(m["content"])
            continue
        if pending and m["role"] == "user":
            m = {"role": "user", "content": "\n\n".join([*pending, m["content"]])}
            pending = []
        out.append(m)
    if pending:
        out.append({"role": "user", "content": "\n\n".join(pending)})
    return out
