"""The session API: pooled sessions for frameworks that drive their own agent loops. Its
wire shapes, its session entries, the API and the routes the app mounts.

    POST   /v1/sessions               attach (201; 429 + Retry-After when the gate refuses)
    GET    /v1/sessions               list the sessions made here
    GET    /v1/sessions/{id}          one session
    POST   /v1/sessions/{id}/turns    append text and generate (JSON, or SSE with "stream")
    DELETE /v1/sessions/{id}          detach (204)

Request models forbid unknown fields and use strict types (``"5"`` is not a number). Errors
are JSON ``{"error": {"code", "message"}}``, 4xx for a client's mistake: a body that is not
JSON 400 ``bad_json``, an invalid request 422, empty input 400, a turn while one runs 409,
a detached or failed session 404/410.

Every session made here holds an admission ticket until it is deleted, fails, or sits idle
longer than ``idle_s`` (``--session-idle-s``): then it is detached, its ticket released,
and a later call on it answers 404 ``expired`` with the reason. Each authenticated caller
holds at most ``max_per_caller`` sessions (429 past it), the place taken before anything is
awaited, so concurrent creates cannot pass the cap together; the anonymous caller (auth
off) may use the whole pool, counted as :func:`attachable` (parked sessions included). A
streamed turn whose client goes away is stopped; the tokens generated so far stay in the
session. The engine is reached only through its :class:`~mesh.engine.interface.Session`
protocol, so no request can stop the pool.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from mesh.api.admit import Periodic, Refusal, admit, caller_of
from mesh.api.capacity import capacity_routes
from mesh.engine.config import SamplingParams
from mesh.engine.interface import (
    ContextOverflow,
    Engine,
    EngineError,
    Generation,
    PoolFull,
    Session,
    SessionFailed,
    SessionLoad,
    TurnResult,
)
from mesh.gate.queue import Admission, Hold

__all__ = [
    "DEFAULT_IDLE_S", "DEFAULT_MAX_TOKENS", "MAX_STOP_LEN", "AttachRequest", "BadRequest", "Entry",
    "EventStream", "SessionAPI", "TurnRequest", "api_routes", "attachable", "body_error",
    "describe", "error_response", "parse_body", "sse_event", "stop_turn", "too_busy",
    "turn_json",
]


# -------------------- wire shapes ---------------------------------------------

MAX_STOP_LEN = 256
DEFAULT_MAX_TOKENS = 128
M = TypeVar("M", bound=BaseModel)


class AttachRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    key: str = Field(default="session-api", min_length=1, max_length=200)  # queue label
    max_wait_s: float | None = Field(default=None, ge=0, le=3600)  # None: wait in the queue


class TurnRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    text: str
    max_tokens: int | None = Field(default=None, ge=1)  # None: 128, within the budget
    stream: bool = False
    temperature: float = Field(default=0.0, ge=0, le=100)
    top_k: int = Field(default=0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: list[str] = Field(default_factory=list, max_length=16)
    stop_at_eos: bool = True

    def sampling_params(self, budget: int, n_vocab: int) -> SamplingParams:
        """The turn's sampling parameters within the session ``budget`` and the vocabulary
        (0: unknown); raises BadRequest (422) naming the field."""
        max_tokens = min(DEFAULT_MAX_TOKENS, budget) if self.max_tokens is None else self.max_tokens
        if max_tokens > budget:
            raise BadRequest(422, "invalid_request", f"max_tokens {max_tokens} exceeds the "
                             f"session budget of {budget} tokens")
        if n_vocab and self.top_k > n_vocab:
            raise BadRequest(422, "invalid_request", f"top_k exceeds the vocabulary ({n_vocab})")
        if any(not s or len(s) > MAX_STOP_LEN for s in self.stop):
            raise BadRequest(422, "invalid_request",
                             f"stop strings must be 1..{MAX_STOP_LEN} characters")
        params = SamplingParams(max_tokens=max_tokens, temperature=self.temperature,
                                top_k=self.top_k, top_p=self.top_p, seed=self.seed,
                                stop=tuple(self.stop), stop_at_eos=self.stop_at_eos)
        try:
            params.validate()
        except ValueError as exc:
            raise BadRequest(422, "invalid_request", str(exc)) from None
        return params


class BadRequest(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def error_response(status: int, code: str, message: str,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status, headers)


def too_busy(code: str, message: str, retry_after_s: float) -> JSONResponse:
    retry = str(max(1, math.ceil(retry_after_s)))
    return error_response(429, code, message, {"Retry-After": retry})


async def parse_body(request: Request, model: type[M], *, allow_empty: bool = False) -> M:
    body = await request.body()
    if allow_empty and not body.strip():
        body = b"{}"
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        message, _ = body_error(exc)
        if message is None:
            raise BadRequest(400, "bad_json", "the body is not valid JSON") from None
        raise BadRequest(422, "invalid_request", message) from None


def body_error(exc: ValidationError) -> tuple[str | None, str | None]:
    """What pydantic refused of a body: ``(None, None)`` when it is not JSON at all, else
    its first five field errors as one message, and the first one's field."""
    errors = exc.errors(include_url=False)
    if any(e["type"] == "json_invalid" for e in errors):
        return None, None
    parts = [f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in errors[:5]]
    return "; ".join(parts), ".".join(map(str, errors[0]["loc"])) if errors else None


def turn_json(session_id: str, result: TurnResult, context_len: int) -> dict[str, Any]:
    return {
        "id": session_id,
        "text": result.text,
        "finish_reason": result.finish_reason,
        "stop": result.stop,
        "num_prompt_tokens": result.num_prompt_tokens,
        "num_generated": result.num_generated,
        "decode_s": result.decode_s,
        "context_len": context_len,
    }


def sse_event(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


async def stop_turn(generation: Generation | None, iterator: AsyncIterator[Any] | None) -> bool:
    """Stop an unfinished generation and close its iterator, shielded from cancellation;
    False when either raised an engine error."""
    ok = True
    with anyio.CancelScope(shield=True):
        if generation is not None and generation.result is None:
            try:
                await generation.aclose()
            except EngineError:
                ok = False
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            try:
                await aclose()
            except EngineError:
                ok = False
    return ok


class EventStream(StreamingResponse):
    """An SSE response that always closes ``events`` and runs ``cleanup``, however it ends
    (even never iterated)."""

    def __init__(self, events: AsyncIterator[str], cleanup: Callable[[], Awaitable[None]]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
                await self._cleanup()

# -------------------- entries -------------------------------------------------

@dataclass
class Entry:
    """A session made here. ``hold`` owns its ticket and its pool session: closing it
    detaches the session and releases the ticket."""

    session: Session
    hold: Hold
    created_at: float
    owner: str = ""  # the authenticated caller that created it ("" without auth)
    generation: Generation | None = None
    iterator: AsyncIterator[Any] | None = None
    last_used: float = 0.0


def describe(sid: str, entry: Entry, load: SessionLoad | None, now: float) -> dict[str, Any]:
    """``GET /v1/sessions/{id}``'s body (``load``: the pool's row, None once detached)."""
    return {
        "id": sid,
        "context_len": entry.session.context_len,
        "state": load.state.value if load else "detached",
        "private_cells": load.private_cells if load else 0,
        "decode_tps": load.decode_tps if load else None,
        "num_generated": load.num_generated if load else 0,
        "age_s": now - entry.created_at,
        "idle_s": now - entry.last_used,
        "in_turn": entry.generation is not None,
    }


def _status_code(exc: EngineError) -> tuple[int, str]:
    if isinstance(exc, ContextOverflow):
        return 422, "context_overflow"
    if isinstance(exc, SessionFailed):
        return 410, "session_failed"
    return 503, "engine_error"

# -------------------- the session api -----------------------------------------

DEFAULT_IDLE_S = 300.0
_EXPIRED_KEPT = 1024  # reasons remembered for expired sessions (oldest forgotten first)


def attachable(engine: Engine) -> int:
    """Sessions ``engine`` can hold attached at once: its resident slots
    (``max_sessions``), or with parking on the attached limit, resident and parked
    (``max_attached`` in its load; 0 where an engine does not park)."""
    return max(engine.info.max_sessions, engine.load().max_attached)


class SessionAPI:
    """The routes above over one engine and one admission gate; :meth:`aclose` at shutdown.
    ``idle_s``: a session with no request (and no turn running) this long is expired.
    ``max_per_caller``: sessions one authenticated caller may hold (default: half of
    :attr:`capacity`); the anonymous caller may hold all of them."""

    def __init__(self, engine: Engine, admission: Admission, *, idle_s: float = DEFAULT_IDLE_S,
                 max_per_caller: int | None = None, clock: Any = time.monotonic) -> None:
        if idle_s <= 0:
            raise ValueError(f"session idle timeout must be > 0 s, got {idle_s}")
        self.engine = engine
        self.admission = admission
        self.idle_s = idle_s
        self.capacity = attachable(engine)
        if max_per_caller is None:
            max_per_caller = max(1, self.capacity // 2)
        self.max_per_caller = max_per_caller
        if self.max_per_caller < 1:
            raise ValueError(f"max_per_caller must be >= 1, got {self.max_per_caller}")
        self._clock = clock
        self._entries: dict[str, Entry] = {}
        # Sessions each caller holds or is creating: taken before the first await of a
        # create, given back when the create fails or the session is dropped.
        self._held: Counter[str] = Counter()
        self._expired: OrderedDict[str, tuple[str, str]] = OrderedDict()  # sid -> owner, why
        self._reaper = Periodic(self.expire_idle, lambda: min(self.idle_s / 4, 5.0))

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
        """Stop the idle reaper; detach every session made here and release its ticket."""
        await self._reaper.aclose()
        for sid in list(self._entries):
            await self._drop(sid)

    async def expire_idle(self) -> list[str]:
        """Expire every session idle longer than ``idle_s`` (the reaper calls this)."""
        now = self._clock()
        stale = [sid for sid, e in self._entries.items()
                 if e.generation is None and now - e.last_used > self.idle_s]
        for sid in stale:
            entry = self._entries[sid]
            why = (f"session {sid} expired after {now - entry.last_used:.0f} s idle "
                   f"(the limit is {self.idle_s:g} s, --session-idle-s); attach a new one")
            self._expired[sid] = (entry.owner, why)
            while len(self._expired) > _EXPIRED_KEPT:
                self._expired.popitem(last=False)
            await self._drop(sid)
        return stale

    # ------------------------------------------------------------------ handlers

    async def _create(self, request: Request) -> Response:
        try:
            req = await parse_body(request, AttachRequest, allow_empty=True)
        except BadRequest as exc:
            return error_response(exc.status, exc.code, exc.message)
        caller = caller_of(request)
        held = self._held[caller]
        if held >= (self.max_per_caller if caller else self.capacity):
            return too_busy("too_many_sessions", self._cap_message(caller, held),
                            min(self.idle_s, 60.0))
        self._held[caller] += 1  # taken before any await: concurrent creates see it
        created = False
        try:
            created, answer = await self._attach(req.key, req.max_wait_s, caller)
        finally:
            if not created:
                self._give_back(caller)
        return answer

    def _cap_message(self, caller: str, held: int) -> str:
        parking = self.capacity > self.engine.info.max_sessions
        pool = (f"the {self.capacity} sessions the pool can hold attached, parked ones "
                "included (mesh serve --max-attached)" if parking else
                f"the pool's {self.capacity} session slots (mesh serve --max-sessions; "
                "--max-attached above it parks idle sessions to hold more)")
        share = (f"{self.max_per_caller} (max_per_caller, of {pool})" if caller
                 else f"all of {pool}")
        return (f"this caller holds (or is creating) {held} sessions; one caller may hold "
                f"{share}. Delete one (DELETE /v1/sessions/{{id}}) or let it expire")

    def _give_back(self, caller: str) -> None:
        self._held[caller] -= 1
        if not self._held[caller]:
            del self._held[caller]

    async def _attach(self, key: str, max_wait_s: float | None, caller: str
                      ) -> tuple[bool, Response]:
        """Admit and attach one session for ``caller`` (whose place in ``_held`` is
        taken): (True, 201) or (False, the 429)."""
        try:
            hold = await admit(self.admission, key, max_wait_s, caller)
        except Refusal as exc:
            return False, too_busy(exc.code, exc.message, exc.retry_after_s)
        full: PoolFull | None = None
        async with hold:  # closed (ticket released) on every exit but the kept one
            try:
                session = await hold.attach(self.engine)
            except PoolFull as exc:
                full = exc
            else:
                now = self._clock()
                self._entries[session.id] = Entry(session, hold.keep(), now, owner=caller,
                                                  last_used=now)
        if full is not None:
            return False, too_busy("pool_full", str(full),
                                   self.admission.check_queue().retry_after_s)
        self._reaper.ensure_started()
        body = {
            "id": session.id,
            "context_len": session.context_len,
            "session_budget": self.engine.info.session_budget,
        }
        return True, JSONResponse(body, 201, {"Location": f"/v1/sessions/{session.id}"})

    async def _list(self, request: Request) -> Response:
        loads = {s.id: s for s in self.engine.load().sessions}
        caller, now = caller_of(request), self._clock()
        mine = [(sid, e) for sid, e in self._entries.items() if e.owner == caller]
        return JSONResponse({"sessions": [describe(sid, e, loads.get(sid), now)
                                          for sid, e in mine]})

    def _entry(self, request: Request) -> Entry | None:
        """The session named in the path, if it exists and belongs to this caller (another
        caller's session answers 404 too: its existence is not revealed)."""
        entry = self._entries.get(request.path_params["id"])
        if entry is None or entry.owner != caller_of(request):
            return None
        entry.last_used = self._clock()
        return entry

    def _not_found(self, request: Request) -> JSONResponse:
        sid = request.path_params["id"]
        expired = self._expired.get(sid)
        if expired is not None and expired[0] == caller_of(request):
            return error_response(404, "expired", expired[1])
        return error_response(404, "not_found", f"no session {sid!r}")

    async def _get(self, request: Request) -> Response:
        sid = request.path_params["id"]
        entry = self._entry(request)
        if entry is None:
            return self._not_found(request)
        load = next((s for s in self.engine.load().sessions if s.id == sid), None)
        return JSONResponse(describe(sid, entry, load, self._clock()))

    async def _delete(self, request: Request) -> Response:
        sid = request.path_params["id"]
        if self._entry(request) is None:
            return self._not_found(request)
        await self._drop(sid)
        return Response(status_code=204)

    async def _turn(self, request: Request) -> Response:
        sid = request.path_params["id"]
        entry = self._entry(request)
        if entry is None:
            return self._not_found(request)
        try:
            req = await parse_body(request, TurnRequest)
            params = req.sampling_params(self.engine.info.session_budget,
                                         self.engine.info.n_vocab)
        except BadRequest as exc:
            return error_response(exc.status, exc.code, exc.message)
        if entry.generation is not None:
            return error_response(409, "session_busy", f"session {sid} is already in a turn")
        try:
            if req.text:
                entry.session.append(req.text)
            generation = entry.session.generate(params)
        except EngineError as exc:
            return await self._turn_error(sid, exc)
        entry.generation = generation
        entry.iterator = generation.__aiter__()
        try:
            # Register the turn now, so its refusals (no input, a turn still running, a
            # detached session) are a 4xx before any stream starts.
            start = getattr(generation, "start", None)
            if start is not None:
                await start()
        except (EngineError, ValueError, RuntimeError) as exc:
            await self._end_turn(entry)
            return await self._turn_error(sid, exc)
        except BaseException:
            await self._end_turn(entry)
            raise
        if req.stream:
            return EventStream(self._events(sid, entry), lambda: self._end_turn(entry))
        try:
            async for _ in entry.iterator:
                pass
        except (EngineError, ValueError, RuntimeError) as exc:
            return await self._turn_error(sid, exc)
        finally:
            await self._end_turn(entry)
        result = generation.result
        if result is None:
            return error_response(503, "engine_error", "the turn ended without a result")
        return JSONResponse(turn_json(sid, result, entry.session.context_len))

    # ------------------------------------------------------------------ helpers

    async def _turn_error(self, sid: str, exc: Exception) -> Response:
        """The answer to a turn the engine refused or failed; a failed session is dropped."""
        if isinstance(exc, SessionFailed):
            await self._drop(sid)
        if isinstance(exc, EngineError):
            return error_response(*_status_code(exc), str(exc))
        if isinstance(exc, ValueError):
            return error_response(400, "empty_input", f"{exc} (send non-empty \"text\")")
        return error_response(409, "session_busy",
                              f"{exc}; the previous turn is still stopping, retry shortly")

    async def _events(self, sid: str, entry: Entry) -> AsyncIterator[str]:
        assert entry.iterator is not None and entry.generation is not None
        try:
            async for piece in entry.iterator:
                if piece.paused_s:  # the decode gate paused the turn to keep the floor
                    yield sse_event("paused", {"paused_s": round(piece.paused_s, 4)})
                    continue
                yield sse_event("token", {"token": piece.token, "text": piece.text})
        except EngineError as exc:
            if isinstance(exc, SessionFailed):
                await self._drop(sid)
            yield sse_event("error", {"code": _status_code(exc)[1], "message": str(exc)})
            return
        result = entry.generation.result
        if result is None:
            yield sse_event("error", {"code": "engine_error", "message": "no result"})
        else:
            yield sse_event("done", turn_json(sid, result, entry.session.context_len))

    async def _end_turn(self, entry: Entry) -> None:
        """Stop an unfinished generation and free the session for the next turn."""
        generation, iterator = entry.generation, entry.iterator
        entry.generation = entry.iterator = None
        entry.last_used = self._clock()
        await stop_turn(generation, iterator)

    async def _drop(self, sid: str) -> None:
        """Forget a session: stop its turn, detach it, release its ticket.

        A turn in progress is only told to stop (``Generation.aclose``); the task iterating
        it finishes the iteration and closes the iterator itself.
        """
        entry = self._entries.pop(sid, None)
        if entry is None:
            return
        self._give_back(entry.owner)
        try:
            await stop_turn(entry.generation, None)
        finally:
            with anyio.CancelScope(shield=True):
                await entry.hold.aclose()  # detach, then release the ticket


def api_routes(engine: Engine, admission: Admission,
               sessions: SessionAPI | None = None) -> list[BaseRoute]:
    """Every route of this package, ready to mount in a Starlette app (pass ``sessions`` to
    keep the handle whose ``aclose`` the app's lifespan should call)."""
    api = SessionAPI(engine, admission) if sessions is None else sessions
    return [*capacity_routes(admission), *api.routes]
