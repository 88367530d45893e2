"""What the engine hands back: a turn's pieces and result, an attach answer, the pool's
facts, and the load snapshot (sessions, step samples) the gate and ``/capacity`` read.
Pure data."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = ["AttachCheck", "Piece", "PoolInfo", "PoolLoad", "SessionLoad", "SessionState",
           "StepSample", "TurnResult"]




@dataclass(frozen=True)
class Piece:
    """One generated token and the text it released.

    ``text`` may be empty (mid-UTF-8 character, or held back as a possible start of a stop
    string). Held text released when a turn ends without a token of its own (``eos``,
    ``context_full``, ``cancelled``) comes as a last piece with ``token == -1``. The pieces'
    texts always join to ``TurnResult.text``. A turn the decode gate paused (shed, to keep
    the floor) gets, when it runs again, a piece with ``token == -1``, no text and
    ``paused_s``: how long it waited, so a client can tell a pause from slow decoding.
    """

    token: int
    text: str
    paused_s: float = 0.0


@dataclass(frozen=True)
class TurnResult:
    """How a turn ended.

    ``finish_reason`` is one of ``stop`` (a stop string matched: ``stop`` names it, and no
    part of it is in ``text``), ``eos`` (the model ended its turn), ``length``
    (``max_tokens`` reached), ``context_full`` (the session's budget or the KV buffer has no
    room for another token) or ``cancelled`` (the consumer stopped early). Only ``stop`` and
    ``eos`` are turns the model finished; the others were cut.
    """

    text: str
    num_prompt_tokens: int
    num_generated: int
    finish_reason: str
    decode_s: float
    stop: str | None = None
    # Seconds the turn waited for the decode gate before its first step (turn-start
    # latency; 0.0 where no gate runs or the turn was admitted at once).
    wait_s: float = 0.0


@dataclass(frozen=True)
class AttachCheck:
    """Answer of :meth:`Engine.check_attach`: ``ok`` or the reason it would be refused."""

    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class PoolInfo:
    """Facts learned when the pool was built; immutable for the pool's life."""

    model_path: str
    model_name: str
    n_ctx: int
    n_seq_max: int
    max_sessions: int
    session_budget: int
    n_vocab: int
    prefix_tokens: int
    prefix_hash: str  # sha256 of the prefix token ids
    warm_started: bool
    build_s: float
    # Which engine runs the sessions: "llama.cpp" (the local pool) or "openai:URL" (a
    # serving cluster behind an OpenAI-compatible API, mesh.backends.openai).
    engine: str = "llama.cpp"
    n_params: int = 0  # the model's parameter count; 0 where the engine cannot tell
    # The attention path the pool resolved (llama.cpp pools; "" where it does not apply):
    # the flash-attention mode handed to llama.cpp (on | off | auto: llama.cpp's choice) and
    # shared-prefix attention (shared | off).
    flash_attn: str = ""
    prefix_attention: str = ""


# --------------------------------------------------------------------------- load


class SessionState(enum.StrEnum):
    PREFILLING = "prefilling"  # has appended text not yet decoded
    DECODING = "decoding"  # generating tokens
    IDLE = "idle"  # waiting for input (a tool call, the next turn)
    WAITING = "waiting"  # a turn was asked for; the decode gate has not let it run yet


@dataclass(frozen=True)
class SessionLoad:
    """One session in a :class:`PoolLoad` snapshot."""

    id: str
    state: SessionState
    private_cells: int  # suffix cells this session owns (appended + generated)
    context_len: int  # prefix + private cells: what attention reads per token
    decode_tps: float | None  # EWMA of this session's decode tokens/s; None until measured
    duty_cycle: float | None  # observed share of wall time spent prefilling or decoding
    age_s: float
    num_generated: int
    parked: bool = False  # its private cells are off the cache (re-prefilled on resume)


@dataclass(frozen=True)
class StepSample:
    """Timing of one engine step, for the gate's online throughput model."""

    num_decode: int  # sessions that decoded a token in the step
    num_prefill_tokens: int
    sum_context: int  # Σ context_len of the decoding sessions
    step_s: float  # wall time of the whole step (host work + llama_decode)
    # Cells in use in the whole cache during the step (prefix + every session's private
    # cells, idle sessions' included): with one unified cache every decoding row attends
    # over all of them (masked), so step time grows with num_decode × cells_used.
    cells_used: int = 0


@dataclass(frozen=True)
class PoolLoad:
    """A consistent snapshot of the pool, taken between steps. Pure data."""

    taken_at: float  # time.monotonic() of the snapshot
    sessions: tuple[SessionLoad, ...]
    step_ms: float | None  # EWMA of step wall time
    agg_tps: float  # decode tokens/s over the recent window, all sessions
    cells_used: int  # prefix + Σ private cells
    cells_total: int  # n_ctx
    prefix_cells: int
    naive_cells: int  # what the same sessions would hold with a private prefix copy each
    free_seq_ids: int
    max_sessions: int
    session_budget: int
    recent_steps: tuple[StepSample, ...] = field(default_factory=tuple)
    # Totals since the pool started (0 where an engine does not count them): sessions that
    # attached, and suffix tokens prefilled in steps (appended text, tool results; with a
    # private prefix per session, the prefix copies too). Deltas of the two, with
    # prefix_cells, say what the shared prefix saved: prefix × sessions not prefilled.
    sessions_attached: int = 0
    prefill_tokens: int = 0
    # Sessions the pool released because no handle held them any more (an owner that was
    # cancelled or crashed without detaching): the safety net's count; 0 when nothing leaks.
    sessions_reaped: int = 0
    # Parking (0 where an engine does not park): attached sessions allowed at once
    # (resident + parked), the suffix tokens parked sessions hold off the cache, and since
    # start: parks, resumes and the suffix tokens resumes re-prefilled (their recompute;
    # a swapped resume re-prefills none).
    max_attached: int = 0
    parked_tokens: int = 0
    parks: int = 0
    resumes: int = 0
    resume_tokens: int = 0
    parked_bytes: int = 0  # host RAM held by swapped suffixes (at most park_memory)
    swaps: int = 0  # parks that swapped (the rest recompute on resume)
    park_memory: int = 0  # the host RAM swapped suffixes may hold (--park-memory, bytes)

    @property
    def num_parked(self) -> int:
        return sum(1 for s in self.sessions if s.parked)

    @property
    def num_resident(self) -> int:
        """Attached sessions whose cells are in the cache (they hold a sequence id)."""
        return len(self.sessions) - self.num_parked

    @property
    def attach_room(self) -> int:
        """Sessions that may still attach: free sequence ids, or with parking on, the
        attached limit left (cells aside)."""
        if self.max_attached > self.max_sessions:
            return max(0, self.max_attached - len(self.sessions))
        return self.free_seq_ids

    @property
    def reduction(self) -> float:
        """naive / pooled cell count (1.0 with no sessions)."""
        if not self.sessions or not self.cells_used:
            return 1.0
        return self.naive_cells / self.cells_used

    @property
    def cells_free(self) -> int:
        return self.cells_total - self.cells_used

    def count(self, state: SessionState) -> int:
        return sum(1 for s in self.sessions if s.state is state)
