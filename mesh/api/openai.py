"""An OpenAI-compatible API on the pool, so agent frameworks share its prefix unchanged.

    POST /v1/chat/completions   messages rendered in the model's chat format
    POST /v1/completions        a raw prompt
    GET  /v1/prefix             the exact system text (and prefix) every request must start with
    GET  /v1/models             the one model

A request's text (the rendered messages, or the prompt) must start with the pool's prefix:
the chat format's rendering of :attr:`OpenAIAPI.system_text`, i.e. a first ``system``
message whose content is ``GET /v1/prefix``'s ``system``. Otherwise the answer is a 400 that
names the first differing token. The rest of the text lands on the idle cached conversation
whose text is its longest prefix (:mod:`mesh.api.conversations`), so a multi-turn agent
prefills only its new messages; ``usage.prompt_tokens_details.cached_tokens`` says how many
prompt tokens were already in the pool (prefix included). Without a match a new session
is attached (the prefix is shared, never prefilled again).

Every request passes the gate's queue check (429 + Retry-After when it refuses). A request
that starts a new conversation is a new worker: it waits for the gate's ``admit`` (429 past
``max_wait_s``) and holds the ticket for its turn. A request that continues a cached
conversation resumes a worker the gate already counts (its session is in the pool's load,
like a worker back from a tool call), so it is not admitted again. While a new conversation
waits, and whenever the pool has no session slot or cells left, idle conversations are
evicted least-recently-used, and any idle past ``idle_ttl_s`` (120 s) is detached.

``tools`` / ``tool_choice``: see :mod:`mesh.api.openai_tools` (the tools are described
before the first user message, the reply is sampled under a grammar of their calls and
parsed into ``tool_calls``); ``tool`` messages are rendered as user messages that carry the
result. Not supported: ``n > 1``, ``logprobs``, non-text parts.

This module holds the routes, the rendering and the request checks; a turn's admission,
attach, append and end are :mod:`mesh.api.openai_turns`, its reply bodies and stream
:mod:`mesh.api.openai_replies`, the gate helpers shared with the session API
:mod:`mesh.api.admit`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from mesh.api.admit import Periodic, queue_refusal, release
from mesh.api.conversations import ConversationCache
from mesh.api.openai_replies import reply_body, reply_stream
from mesh.api.openai_tools import (
    ToolChoice,
    ToolsError,
    ToolSpec,
    parse_tool_choice,
    parse_tools,
    render_calls,
    tools_grammar,
    tools_prompt,
)
from mesh.api.openai_turns import Bad, OpenAITurns, engine_error
from mesh.api.openai_wire import ChatRequest, CompletionRequest, SamplingFields, oa_error
from mesh.api.wire import DEFAULT_MAX_TOKENS, MAX_STOP_LEN, TurnStream
from mesh.engine.types import Engine, EngineError, SamplingParams
from mesh.gate.types import Admission, Ticket
from mesh.template.chat import ChatFormat, ChatFormatError

__all__ = ["OpenAIAPI"]

Tokenize = Callable[[str], list[int]]


class OpenAIAPI:
    """The routes above over one engine, one gate and the pool's chat format."""

    def __init__(
        self,
        engine: Engine,
        admission: Admission,
        chat: ChatFormat,
        system_text: str,
        *,
        tokenize: Tokenize,
        max_wait_s: float = 30.0,
        max_idle: int | None = None,
        idle_ttl_s: float = 120.0,
    ) -> None:
        self.engine, self.admission, self.chat = engine, admission, chat
        self.system_text = system_text
        self.prefix = chat.prefix_text(system_text)
        self.tokenize = tokenize
        self.max_wait_s = max_wait_s
        self.cache = ConversationCache(max_idle or engine.info.max_sessions)
        self.idle_ttl_s = idle_ttl_s
        self.turns = OpenAITurns(engine, admission, self.cache, max_wait_s)
        # Detaches conversations idle past ``idle_ttl_s``: an idle session holds a pool
        # slot that A2A workers may need too.
        self._sweeper = Periodic(lambda: self.cache.evict_idle(self.idle_ttl_s),
                                 lambda: max(0.05, min(5.0, self.idle_ttl_s / 4)))

    @property
    def routes(self) -> list[BaseRoute]:
        return [
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/completions", self._completion, methods=["POST"]),
            Route("/v1/prefix", self._prefix, methods=["GET"]),
            Route("/v1/models", self._models, methods=["GET"]),
        ]

    async def aclose(self) -> None:
        """Stop the idle sweeper and detach every idle conversation (app shutdown)."""
        await self._sweeper.aclose()
        await self.cache.aclose()

    # ------------------------------------------------------------------ handlers

    async def _prefix(self, request: Request) -> Response:
        info = self.engine.info
        return JSONResponse({
            "system": self.system_text,
            "prefix_text": self.prefix,
            "prefix_tokens": info.prefix_tokens,
            "prefix_hash": info.prefix_hash,
            "chat_format": self.chat.name,
            "messages": [{"role": "system", "content": self.system_text}],
        })

    async def _models(self, request: Request) -> Response:
        name = self.engine.info.model_name
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "mesh"}]})

    async def _chat(self, request: Request) -> Response:
        try:
            req = await _parse(request, ChatRequest)
            specs = parse_tools(req.tools or [])
            choice = parse_tool_choice(req.tool_choice, specs)
            rendered = self._strip_bos(self.chat.render(self._messages(req, specs, choice)))
            rest = self._rest(rendered, "messages")
            grammar = tools_grammar(specs, choice, parallel=req.parallel_tool_calls)
        except Bad as exc:
            return exc.response()
        except ToolsError as exc:
            return oa_error(400, str(exc), "invalid_tools", param=exc.param)
        except ChatFormatError as exc:
            return oa_error(400, str(exc), "invalid_messages", param="messages")
        return await self._run(req, rest, chat=True, grammar=grammar,
                               tools=specs if grammar else ())

    async def _completion(self, request: Request) -> Response:
        try:
            req = await _parse(request, CompletionRequest)
            if req.echo or req.suffix:
                raise Bad(400, "echo and suffix are not supported", "unsupported")
            rest = self._rest(self._strip_bos(req.prompt), "prompt")
        except Bad as exc:
            return exc.response()
        return await self._run(req, rest, chat=False)

    # ------------------------------------------------------------------ rendering

    def _messages(self, req: ChatRequest, specs: tuple[ToolSpec, ...] = (),
                  choice: ToolChoice | None = None) -> list[dict[str, str]]:
        out: list[dict[str, str]] = []
        described = not specs or choice is None or choice.mode == "none"
        for i, m in enumerate(req.messages):
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
            "'system' text of GET /v1/prefix, exactly"), "prefix_mismatch", param)

    # ------------------------------------------------------------------ turns

    def _params(self, req: SamplingFields, grammar: str | None = None) -> SamplingParams:
        if req.logprobs:
            raise Bad(400, "logprobs are not supported", "unsupported", "logprobs")
        budget = self.engine.info.session_budget
        asked = req.max_completion_tokens or req.max_tokens
        max_tokens = min(DEFAULT_MAX_TOKENS, budget) if asked is None else asked
        if max_tokens > budget:
            raise Bad(400, f"max_tokens {max_tokens} exceeds the session budget of {budget} "
                       "tokens", "context_length_exceeded", "max_tokens")
        stop = req.stop_list()
        if len(stop) > 16 or any(not s or len(s) > MAX_STOP_LEN for s in stop):
            raise Bad(400, f"stop: at most 16 strings of 1..{MAX_STOP_LEN} characters",
                       "invalid_value", "stop")
        return SamplingParams(max_tokens=max_tokens, temperature=req.temperature,
                              top_p=req.top_p, seed=req.seed, stop=stop, grammar=grammar)

    async def _run(self, req: SamplingFields, rest: str, *, chat: bool,
                   grammar: str | None = None, tools: tuple[ToolSpec, ...] = ()) -> Response:
        self._sweeper.ensure_started()
        try:
            params = self._params(req, grammar)
        except Bad as exc:
            return exc.response()
        refusal = queue_refusal(self.admission)
        if refusal is not None:
            return Bad.refused(refusal).response()
        conv = self.cache.take(rest)
        if conv is None and not rest:
            return oa_error(400, "the request adds nothing after the pool's prefix; send "
                            "text after it (a user message, or more prompt)", "empty_input")
        ticket: Ticket | None = None
        if conv is None:  # a new conversation is a new worker: the gate admits it
            try:
                ticket = await self.turns.admit()
            except Bad as exc:
                return exc.response()
        try:
            turn = await self.turns.start(conv, rest, params, ticket)
        except Bad as exc:
            await release(ticket)
            return exc.response()
        except BaseException:
            await release(ticket)
            raise
        turn.tools = tools
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if req.stream:
            events = reply_stream(turn, rid, chat, req.include_usage(),
                                  self.engine.info.model_name)
            return TurnStream(events, lambda: self.turns.end(turn))
        try:
            async for _ in turn.iterator:
                pass
        except EngineError as exc:
            turn.failed = True
            return engine_error(exc)
        except ValueError as exc:  # nothing new to read: the same conversation sent again
            turn.failed = True
            return oa_error(400, f"{exc}; the request adds nothing to the conversation",
                            "empty_input")
        finally:
            await self.turns.end(turn)
        result = turn.generation.result
        if result is None:
            return oa_error(503, "the turn ended without a result", "engine_error")
        return JSONResponse(reply_body(turn, result, rid, chat, self.engine.info.model_name))


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    body = await request.body()
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        if any(e["type"] == "json_invalid" for e in errors):
            raise Bad(400, "the body is not valid JSON", "bad_json") from None
        parts = [f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in errors[:5]]
        param = ".".join(map(str, errors[0]["loc"])) if errors else None
        raise Bad(400, "; ".join(parts), "invalid_value", param) from None
