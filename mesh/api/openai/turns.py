"""The OpenAI API's turns: from a matched (or new) conversation to a running generation,
and back into the conversation cache.

A new conversation is a new worker: :meth:`OpenAITurns.admit` waits for the gate's ticket
(a :class:`~mesh.gate.queue.Hold`, the helper every caller of the gate uses) in its caller's
place in the queue while idle conversations give way (least recently used first, one per
``_EVICT_AFTER_S``; 429 past ``max_wait_s``), and :meth:`OpenAITurns.start` attaches a
session (evicting idle ones while the pool is full), appends the new text and starts the
generation. :meth:`OpenAITurns.end` stops an unfinished generation, caches the
conversation if its text is exact (else detaches it) and releases the ticket. Refusals are
:class:`Bad` (the API renders them as OpenAI errors).
"""

from __future__ import annotations

import anyio
import anyio.to_thread
from starlette.responses import JSONResponse

from mesh.api.admit import Refusal, admit_within, release
from mesh.api.conversations import Conversation, ConversationCache, discard
from mesh.api.openai.schema import oa_error, too_busy
from mesh.api.openai.tools import ToolSpec
from mesh.engine.config import SamplingParams
from mesh.engine.interface import (
    ContextOverflow,
    Engine,
    EngineError,
    Generation,
    PoolFull,
    Session,
    SessionFailed,
)
from mesh.gate.queue import Admission, Hold, Ticket

__all__ = ["Bad", "ChatTurn", "OpenAITurns", "engine_error", "error_code"]

_EVICT_AFTER_S = 0.5  # how long a new conversation waits before an idle one gives way
# Longer appends are tokenized in a worker thread (``Session.append`` tokenizes on the
# caller's thread; a message may be ~1 MB).
_INLINE_APPEND_CHARS = 2048


class Bad(Exception):
    """A refused request: an OpenAI error (a 429 with Retry-After when ``retry_after_s``)."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.retry_after_s = retry_after_s

    @classmethod
    def refused(cls, refusal: Refusal) -> Bad:
        return cls(429, refusal.message, refusal.code, retry_after_s=refusal.retry_after_s)

    def response(self) -> JSONResponse:
        if self.retry_after_s is not None:
            return too_busy(self.message, self.code, self.retry_after_s)
        return oa_error(self.status, self.message, self.code, param=self.param)


class ChatTurn:
    """One request's hold on a conversation: its ticket, session and generation."""

    def __init__(self, conv: Conversation, ticket: Ticket | None, cached: int,
                 generation: Generation) -> None:
        self.conv, self.ticket, self.generation = conv, ticket, generation
        self.cached_tokens = cached  # prefix + the conversation's decoded cells
        self.iterator = generation.__aiter__()
        self.failed = False
        self.tools: tuple[ToolSpec, ...] = ()  # a chat turn with tools: parse its calls
        self.repeat_calls = False  # keep calls repeated word for word in the reply


class OpenAITurns:
    """Starts and ends the turns of one OpenAI API (one engine, gate and cache)."""

    def __init__(self, engine: Engine, admission: Admission, cache: ConversationCache,
                 max_wait_s: float) -> None:
        self.engine, self.admission, self.cache = engine, admission, cache
        self.max_wait_s = max_wait_s

    async def admit(self, caller: str = "") -> Hold:
        """A hold on the gate for a new conversation (one of ``caller``'s queue places);
        :meth:`end` releases it. Its session is attached by :meth:`start`, not by the hold:
        a conversation's session outlives the turn's ticket (cached idle between turns).

        Idle conversations count as workers (their sessions are in the pool), so while this
        one waits they give way, least recently used first, one per ``_EVICT_AFTER_S``
        (at once while the pool refuses an attach). The wait keeps its place in the queue
        all along: a conversation cached after it queued (another request's, just
        finished) cannot hold it back, and it never rejoins the queue at the back. 429
        past ``max_wait_s``, or at once when the queue (or ``caller``'s share) is full."""
        while not self.engine.check_attach().ok and await self.cache.evict_lru():
            pass
        hold: Hold | None = None
        refusal: Refusal | None = None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._give_way)
                try:
                    hold = await admit_within(self.admission, "openai", self.max_wait_s,
                                              caller)
                except Refusal as exc:
                    refusal = exc
                finally:
                    tg.cancel_scope.cancel()
        except BaseException:
            # Cancelled while the group wound down, after the ticket was granted: give it
            # back (shielded), so no ticket leaks.
            if hold is not None:
                await hold.aclose()
            raise
        if refusal is not None:
            raise Bad.refused(refusal)
        if hold is None:
            raise Bad(429, f"not admitted within {self.max_wait_s:g} s", "not_admitted",
                      retry_after_s=self.admission.check_queue(caller=caller).retry_after_s)
        return hold

    async def _give_way(self) -> None:
        """While a new conversation waits: detach one idle conversation (the least
        recently used) every ``_EVICT_AFTER_S``; cancelled once the wait ends."""
        while True:
            await anyio.sleep(_EVICT_AFTER_S)
            await self.cache.evict_lru()

    async def start(self, conv: Conversation | None, rest: str, params: SamplingParams,
                    ticket: Ticket | None, *, owner: str = "") -> ChatTurn:
        """Attach a conversation (``owner``'s) if none matched, append the new text, start
        generating."""
        if conv is None:
            conv = Conversation(await self._attach(), owner=owner)
        try:
            cached = conv.session.context_len
            new_text = rest[len(conv.text):]
            await self._append(conv, new_text)
            conv.text = rest
            generation = conv.session.generate(params)
        except BaseException:
            await discard(conv)
            raise
        return ChatTurn(conv, ticket, cached, generation)

    async def _attach(self) -> Session:
        while True:
            try:
                return await self.engine.attach()
            except PoolFull as exc:
                if not await self.cache.evict_lru():
                    retry = self.admission.check_queue().retry_after_s
                    raise Bad(429, str(exc), "pool_full", retry_after_s=retry) from None

    async def _append(self, conv: Conversation, text: str) -> None:
        while True:
            try:
                if len(text) > _INLINE_APPEND_CHARS:
                    await anyio.to_thread.run_sync(conv.session.append, text)
                else:
                    conv.session.append(text)
                return
            except ContextOverflow as exc:
                if "KV buffer" in str(exc) and await self.cache.evict_lru():
                    continue
                raise Bad(400, str(exc), "context_length_exceeded", "messages") from None
            except EngineError as exc:
                raise Bad(503, str(exc), "engine_error") from None

    async def end(self, turn: ChatTurn) -> None:
        """Stop an unfinished generation; cache the conversation if its text is exact."""
        with anyio.CancelScope(shield=True):
            gen = turn.generation
            try:
                if gen.result is None:
                    try:
                        await gen.aclose()
                    except EngineError:
                        turn.failed = True
                aclose = getattr(turn.iterator, "aclose", None)
                if aclose is not None:
                    try:
                        await aclose()
                    except EngineError:
                        turn.failed = True
                result = gen.result
                # After a stop string the session holds tokens its text does not show.
                if turn.failed or result is None or result.finish_reason == "stop":
                    await discard(turn.conv)
                else:
                    turn.conv.text += result.text
                    await self.cache.put(turn.conv)
            finally:
                await release(turn.ticket)


def error_code(exc: EngineError) -> str:
    """The OpenAI error code of an engine error."""
    if isinstance(exc, ContextOverflow):
        return "context_length_exceeded"
    if isinstance(exc, SessionFailed):
        return "session_failed"
    return "engine_error"


def engine_error(exc: EngineError) -> JSONResponse:
    status = 400 if isinstance(exc, ContextOverflow) else 503
    return oa_error(status, str(exc), error_code(exc))
