"""The session API: pooled sessions for frameworks that drive their own agent loops.

    POST   /v1/sessions               attach (201; 429 + Retry-After when the gate refuses)
    GET    /v1/sessions               list the sessions made here
    GET    /v1/sessions/{id}          one session
    POST   /v1/sessions/{id}/turns    append text and generate (JSON, or SSE with "stream")
    DELETE /v1/sessions/{id}          detach (204)

Every session made here holds an admission ticket until it is deleted (or fails). Errors
are JSON ``{"error": {"code", "message"}}``. One turn runs per session at a time (409
otherwise). A streamed turn whose client goes away is stopped with ``Generation.aclose()``;
the tokens generated so far stay in the session. Nothing here touches the engine except
through its :class:`~mesh.engine.types.Session` protocol, so no request can stop the pool.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from mesh.api.wire import (
    DEFAULT_MAX_TOKENS,
    MAX_STOP_LEN,
    AttachRequest,
    BadRequest,
    TurnRequest,
    TurnStream,
    error_response,
    parse_body,
    sse_event,
    too_busy,
    turn_json,
)
from mesh.engine.types import (
    ContextOverflow,
    Engine,
    EngineError,
    Generation,
    PoolFull,
    SamplingParams,
    Session,
    SessionFailed,
    SessionLoad,
)
from mesh.gate.types import Admission, QueueFull, Ticket


@dataclass
class _Entry:
    session: Session
    ticket: Ticket
    created_at: float
    owner: str = ""  # the authenticated caller that created it ("" without auth)
    generation: Generation | None = None
    iterator: AsyncIterator[Any] | None = None


def _caller(request: Request) -> str:
    """The caller's name set by the auth middleware (``scope["user"]``), else ""."""
    user = request.scope.get("user")
    name = getattr(user, "username", None) or getattr(user, "display_name", None)
    return str(name) if name else ""


class SessionAPI:
    """The routes above over one engine and one admission gate. Build once per app."""

    def __init__(self, engine: Engine, admission: Admission) -> None:
        self.engine = engine
        self.admission = admission
        self._entries: dict[str, _Entry] = {}

    @property
    def routes(self) -> list[BaseRoute]:
        return [
            Route("/v1/sessions", self._create, methods=["POST"]),
            Route("/v1/sessions", self._list, methods=["GET"]),
            Route("/v1/sessions/{id}", self._get, methods=["GET"]),
            Route("/v1/sessions/{id}", self._delete, methods=["DELETE"]),
            Route("/v1/sessions/{id}/turns", self._turn, methods=["POST"]),
        ]

    async def aclose(self) -> None:
        """Detach every session made here and release its ticket (app shutdown)."""
        for sid in list(self._entries):
            await self._drop(sid)

    # ------------------------------------------------------------------ handlers

    async def _create(self, request: Request) -> Response:
        try:
            req = await parse_body(request, AttachRequest, allow_empty=True)
        except BadRequest as exc:
            return error_response(exc.status, exc.code, exc.message)
        check = self.admission.check_queue()
        if not check.ok:
            return too_busy("queue_full", check.reason or "the queue is full", check.retry_after_s)
        try:
            with anyio.fail_after(req.max_wait_s):
                ticket = await self.admission.admit(req.key)
        except QueueFull as exc:
            return too_busy("queue_full", str(exc), exc.retry_after_s)
        except TimeoutError:
            retry = self.admission.check_queue().retry_after_s
            return too_busy("not_admitted", f"not admitted within {req.max_wait_s} s", retry)
        try:
            session = await self.engine.attach()
        except PoolFull as exc:
            await ticket.release()
            return too_busy("pool_full", str(exc), self.admission.check_queue().retry_after_s)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await ticket.release()
            raise
        self._entries[session.id] = _Entry(session, ticket, time.monotonic(),
                                           owner=_caller(request))
        body = {
            "id": session.id,
            "context_len": session.context_len,
            "session_budget": self.engine.info.session_budget,
        }
        return JSONResponse(body, 201, {"Location": f"/v1/sessions/{session.id}"})

    async def _list(self, request: Request) -> Response:
        loads = self._loads()
        caller = _caller(request)
        mine = [sid for sid, e in self._entries.items() if e.owner == caller]
        return JSONResponse({"sessions": [self._describe(sid, loads) for sid in mine]})

    def _entry(self, request: Request) -> _Entry | None:
        """The session named in the path, if it exists and belongs to this caller (another
        caller's session answers 404 too: its existence is not revealed)."""
        entry = self._entries.get(request.path_params["id"])
        if entry is None or entry.owner != _caller(request):
            return None
        return entry

    async def _get(self, request: Request) -> Response:
        sid = request.path_params["id"]
        if self._entry(request) is None:
            return self._not_found(sid)
        return JSONResponse(self._describe(sid, self._loads()))

    async def _delete(self, request: Request) -> Response:
        sid = request.path_params["id"]
        if self._entry(request) is None:
            return self._not_found(sid)
        await self._drop(sid)
        return Response(status_code=204)

    async def _turn(self, request: Request) -> Response:
        sid = request.path_params["id"]
        entry = self._entry(request)
        if entry is None:
            return self._not_found(sid)
        try:
            req = await parse_body(request, TurnRequest)
            params = self._params(req)
        except BadRequest as exc:
            return error_response(exc.status, exc.code, exc.message)
        if entry.generation is not None:
            return error_response(409, "session_busy", f"session {sid} is already in a turn")
        try:
            if req.text:
                entry.session.append(req.text)
            generation = entry.session.generate(params)
        except EngineError as exc:
            return await self._engine_error(sid, exc)
        entry.generation = generation
        entry.iterator = generation.__aiter__()
        if req.stream:
            return TurnStream(self._events(sid, entry), lambda: self._end_turn(entry))
        try:
            async for _ in entry.iterator:
                pass
        except EngineError as exc:
            return await self._engine_error(sid, exc)
        finally:
            await self._end_turn(entry)
        result = generation.result
        if result is None:
            return error_response(503, "engine_error", "the turn ended without a result")
        return JSONResponse(turn_json(sid, result, entry.session.context_len))

    # ------------------------------------------------------------------ helpers

    async def _engine_error(self, sid: str, exc: EngineError) -> Response:
        """The answer to an engine error in a turn; a failed session is dropped."""
        if isinstance(exc, ContextOverflow):
            return error_response(422, "context_overflow", str(exc))
        if isinstance(exc, SessionFailed):
            await self._drop(sid)
            return error_response(410, "session_failed", str(exc))
        return error_response(503, "engine_error", str(exc))

    async def _events(self, sid: str, entry: _Entry) -> AsyncIterator[str]:
        assert entry.iterator is not None and entry.generation is not None
        try:
            async for piece in entry.iterator:
                yield sse_event("token", {"token": piece.token, "text": piece.text})
        except ContextOverflow as exc:
            yield sse_event("error", {"code": "context_overflow", "message": str(exc)})
            return
        except SessionFailed as exc:
            await self._drop(sid)
            yield sse_event("error", {"code": "session_failed", "message": str(exc)})
            return
        except EngineError as exc:
            yield sse_event("error", {"code": "engine_error", "message": str(exc)})
            return
        result = entry.generation.result
        if result is None:
            yield sse_event("error", {"code": "engine_error", "message": "no result"})
        else:
            yield sse_event("done", turn_json(sid, result, entry.session.context_len))

    async def _end_turn(self, entry: _Entry) -> None:
        """Stop an unfinished generation and free the session for the next turn."""
        generation, iterator = entry.generation, entry.iterator
        entry.generation = entry.iterator = None
        with anyio.CancelScope(shield=True):
            if generation is not None and generation.result is None:
                with contextlib.suppress(EngineError):
                    await generation.aclose()
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(EngineError):
                    await aclose()

    async def _drop(self, sid: str) -> None:
        """Forget a session: stop its turn, detach it, release its ticket.

        A turn in progress is only told to stop (``Generation.aclose``); the task iterating
        it finishes the iteration and closes the iterator itself.
        """
        entry = self._entries.pop(sid, None)
        if entry is None:
            return
        with anyio.CancelScope(shield=True):
            try:
                generation = entry.generation
                if generation is not None and generation.result is None:
                    with contextlib.suppress(EngineError):
                        await generation.aclose()
                with contextlib.suppress(EngineError):
                    await entry.session.detach()
            finally:
                await entry.ticket.release()

    def _params(self, req: TurnRequest) -> SamplingParams:
        budget = self.engine.info.session_budget
        max_tokens = min(DEFAULT_MAX_TOKENS, budget) if req.max_tokens is None else req.max_tokens
        if max_tokens > budget:
            raise BadRequest(
                422,
                "invalid_request",
                f"max_tokens {max_tokens} exceeds the session budget of {budget} tokens",
            )
        n_vocab = self.engine.info.n_vocab
        if n_vocab and req.top_k > n_vocab:
            raise BadRequest(422, "invalid_request", f"top_k exceeds the vocabulary ({n_vocab})")
        if any(not s or len(s) > MAX_STOP_LEN for s in req.stop):
            raise BadRequest(
                422, "invalid_request", f"stop strings must be 1..{MAX_STOP_LEN} characters"
            )
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            seed=req.seed,
            stop=tuple(req.stop),
            stop_at_eos=req.stop_at_eos,
        )
        try:
            params.validate()
        except ValueError as exc:
            raise BadRequest(422, "invalid_request", str(exc)) from None
        return params

    def _loads(self) -> dict[str, SessionLoad]:
        return {s.id: s for s in self.engine.load().sessions}

    def _describe(self, sid: str, loads: dict[str, SessionLoad]) -> dict[str, Any]:
        entry = self._entries[sid]
        load = loads.get(sid)
        return {
            "id": sid,
            "context_len": entry.session.context_len,
            "state": load.state.value if load else "detached",
            "private_cells": load.private_cells if load else 0,
            "decode_tps": load.decode_tps if load else None,
            "num_generated": load.num_generated if load else 0,
            "age_s": time.monotonic() - entry.created_at,
            "in_turn": entry.generation is not None,
        }

    @staticmethod
    def _not_found(sid: str) -> JSONResponse:
        return error_response(404, "not_found", f"no session {sid!r}")
