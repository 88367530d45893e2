"""A LangChain chat model over mesh's OpenAI-compatible endpoint (``pip install mesh[langchain]``).

:class:`MeshChat` sends a conversation to ``POST /v1/chat/completions``. The pool's prefix
is the system text ``GET /v1/prefix`` returns; the model fetches it once and puts it first,
so callers write only their own messages (a system message of their own becomes the
first user message's preamble: the pool's system text cannot change). The server keeps each
conversation as a live pooled session and continues it when the next request's messages
extend it, so one LangGraph thread (a growing message list) is one pooled session and each
turn prefills only its new messages. ``usage_metadata`` carries the cached-token count.

    model = MeshChat(base_url="http://127.0.0.1:8700", max_tokens=64)
    reply = await model.ainvoke([HumanMessage("Which file defines Parcel?")])

``model.bind_tools([...])`` sends OpenAI ``tools``; the server samples the reply under a
grammar of their calls, and the reply's ``tool_calls`` come back parsed (LangGraph's
``ToolNode`` runs them).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import httpx
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, SystemMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import ConfigDict, Field, PrivateAttr

__all__ = ["MeshChat", "MeshError"]


class MeshError(RuntimeError):
    """mesh answered with an error (``status`` and OpenAI-style ``code``)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"mesh {status} {code}: {message}")
        self.status, self.code = status, code


class MeshChat(BaseChatModel):
    """Chat model whose every conversation is a session in mesh's shared KV pool."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    base_url: str = "http://127.0.0.1:8700"
    api_key: str | None = None  # sent as a bearer token (mesh serve --auth-token)
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    timeout_s: float = 300.0
    # Clients to use instead of ones made here (tests pass ASGI transports).
    async_client: httpx.AsyncClient | None = Field(default=None, exclude=True)
    sync_client: httpx.Client | None = Field(default=None, exclude=True)
    _system: str | None = PrivateAttr(default=None)

    @property
    def _llm_type(self) -> str:
        return "mesh"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"base_url": self.base_url, "max_tokens": self.max_tokens,
                "temperature": self.temperature}

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: str | None = None,
        **kwargs: Any,
    ) -> Runnable[Any, AIMessage]:
        """This model with OpenAI ``tools`` (and ``tool_choice``: ``auto``, ``none``,
        ``required``/``any``, or a tool's name) sent on every request."""
        formatted = [convert_to_openai_tool(t) for t in tools]
        if tool_choice == "any":
            tool_choice = "required"
        if tool_choice in ("auto", "none", "required"):
            kwargs["tool_choice"] = tool_choice
        elif tool_choice is not None:
            kwargs["tool_choice"] = {"type": "function", "function": {"name": tool_choice}}
        return super().bind(tools=formatted, **kwargs)

    # ------------------------------------------------------------------ requests

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _body(self, system: str, messages: Sequence[BaseMessage], stop: list[str] | None,
              **kwargs: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "messages": [{"role": "system", "content": system}, *_wire(messages)],
            "max_tokens": kwargs.get("max_tokens", self.max_tokens),
            "temperature": kwargs.get("temperature", self.temperature),
            "top_p": kwargs.get("top_p", self.top_p),
        }
        if self.seed is not None:
            body["seed"] = self.seed
        if stop:
            body["stop"] = stop
        for key in ("tools", "tool_choice", "parallel_tool_calls"):
            if key in kwargs:
                body[key] = kwargs[key]
        return body

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None,
                  **kwargs: Any) -> ChatResult:
        # A given client stays open (its owner closes it); one made here is closed here.
        with nullcontext(self.sync_client) if self.sync_client else httpx.Client(
                base_url=self.base_url, timeout=self.timeout_s) as client:
            if self._system is None:
                self._system = _system_of(client.get("/v1/prefix", headers=self._headers()))
            r = client.post("/v1/chat/completions", headers=self._headers(),
                            json=self._body(self._system, messages, stop, **kwargs))
        return _result(r)

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None,
                         **kwargs: Any) -> ChatResult:
        async with nullcontext(self.async_client) if self.async_client else httpx.AsyncClient(
                base_url=self.base_url, timeout=self.timeout_s) as client:
            if self._system is None:
                self._system = _system_of(await client.get("/v1/prefix",
                                                           headers=self._headers()))
            r = await client.post("/v1/chat/completions", headers=self._headers(),
                                  json=self._body(self._system, messages, stop, **kwargs))
        return _result(r)


def _wire(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages as OpenAI chat messages; a caller's own system text leads the
    next user message (the pool's system text is fixed)."""
    out: list[dict[str, Any]] = []
    preamble = ""
    for m in messages:
        text = m.content if isinstance(m.content, str) else str(m.text)
        if isinstance(m, SystemMessage):
            preamble += text + "\n\n"
        elif isinstance(m, AIMessage):
            msg: dict[str, Any] = {"role": "assistant", "content": text}
            if m.tool_calls:
                msg["tool_calls"] = [
                    {"id": c.get("id") or f"call_{i}", "type": "function",
                     "function": {"name": c["name"],
                                  "arguments": json.dumps(c["args"], separators=(",", ":"))}}
                    for i, c in enumerate(m.tool_calls)]
            out.append(msg)
        elif isinstance(m, ToolMessage):
            out.append({"role": "tool", "content": text, "tool_call_id": m.tool_call_id})
        else:
            out.append({"role": "user", "content": preamble + text})
            preamble = ""
    if preamble:
        out.append({"role": "user", "content": preamble.rstrip()})
    return out


def _check(r: httpx.Response) -> dict[str, Any]:
    try:
        body: dict[str, Any] = r.json()
    except ValueError:
        raise MeshError(r.status_code, "bad_response", r.text[:200]) from None
    if r.status_code != 200:
        err = body.get("error") or {}
        raise MeshError(r.status_code, str(err.get("code")), str(err.get("message")))
    return body


def _system_of(r: httpx.Response) -> str:
    return str(_check(r)["system"])


def _result(r: httpx.Response) -> ChatResult:
    body = _check(r)
    choice = body["choices"][0]
    usage = body.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    calls = [{"name": c["function"]["name"], "args": json.loads(c["function"]["arguments"]),
              "id": c["id"], "type": "tool_call"}
             for c in choice["message"].get("tool_calls") or ()]
    message = AIMessage(
        content=choice["message"]["content"] or "",
        tool_calls=calls,
        response_metadata={"finish_reason": choice.get("finish_reason"),
                           "model_name": body.get("model"), "id": body.get("id")},
        usage_metadata={
            "input_tokens": usage.get("prompt_tokens", 0),
            "output_tokens": usage.get("completion_tokens", 0),
            "total_tokens": usage.get("total_tokens", 0),
            "input_token_details": {"cache_read": cached},
        },
    )
    return ChatResult(generations=[ChatGeneration(message=message)],
                      llm_output={"usage": usage})
