"""``mesh serve --ray``: pools as Ray actors behind the engine interface (docs/cluster.md:
the routing rule, addresses, what happens when a pool dies, and why Ray Core rather than
Ray Serve). The pure routing rule, connecting to a cluster (:func:`connect`), then the
engine over the actors.

**Routing** (:func:`route`, pure), first rule first: a pool whose actor died is never
chosen again; only a pool whose prefix hash equals the session's may take it; its last
report said ``check_attach`` is ok and it has attach room left after the sessions this
coordinator holds and is attaching there; pools whose decode gate holds no turn waiting
(room at the floor) come first; then the fewest running turns, the most attach room, the
most free cells, and the name. A session stays on its pool: routing runs once, at attach
(and again only if the pool dies).

**The engine** (:class:`RayPools`): an :class:`~mesh.engine.interface.Engine` over N
:class:`~mesh.cluster.pool_actor.PoolActor` actors. Beyond the interface's contract:

* ``load()`` and ``check_attach()`` read the pools' latest reports (each actor is asked
  every ``poll_s``, and sends one with every turn's end), never Ray inline; every step a
  pool measured reaches ``load().recent_steps`` once.
* The gate's budgets are shipped to every pool as one pair (:meth:`PoolActor.set_budgets`).
* A pool actor that dies is never routed to again. Each of its sessions moves at its next
  use (or at once if a turn is streaming): it attaches to another pool, recomputes its
  context from the text it holds, and the turn goes on for the tokens it has left (see
  :meth:`RayPools.move`). Held-back text (a possible stop string's start) dies with its
  pool.
* A session whose handle is dropped without ``detach`` is detached on its pool by the
  next poll (the pool's own reaper cannot see a coordinator's handles).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import socket
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from mesh.cluster.pool_actor import Budgets, Chunk, HostedPool, PoolActor, PoolReport, TurnEnd
from mesh.engine.config import SamplingParams
from mesh.engine.interface import (
    AttachCheck,
    ContextOverflow,
    Piece,
    PoolFull,
    PoolInfo,
    PoolLoad,
    PrefillBudget,
    SessionFailed,
    SessionState,
    StepSample,
    TurnAdmission,
    TurnResult,
)

__all__ = [
    "PoolHandle", "PoolPlacement", "PoolView", "RayAddress", "RayGeneration", "RayPools",
    "RaySession", "Route", "connect", "disconnect", "parse_ray_address", "route"
]


# -------------------- routing -------------------------------------------------

@dataclass(frozen=True)
class PoolView:
    """What the coordinator knows of one pool, from its latest report."""

    name: str
    is_alive: bool
    prefix_hash: str  # "" until the pool has built (or restored) its prefix
    can_attach: bool
    attach_reason: str  # why not, when ``can_attach`` is False
    attach_room: int  # sessions it may attach, less those held and attaching there
    waiting_turns: int  # turns its decode gate holds
    running_turns: int  # turns prefilling or decoding
    cells_free: int


@dataclass(frozen=True)
class Route:
    """The answer of :func:`route`: ``pool`` (None: no pool can take a session now) and
    ``reason`` (why that one, or why none: each pool's reason, named)."""

    pool: str | None
    reason: str


def _why_not(v: PoolView, prefix_hash: str) -> str:
    if not v.is_alive:
        return "its actor died"
    if v.prefix_hash != prefix_hash:
        held = v.prefix_hash[:12] or "no prefix yet"
        return f"holds {held}, not the session's prefix {prefix_hash[:12]}"
    if not v.can_attach:
        return v.attach_reason or "it refuses attaches"
    if v.attach_room <= 0:
        return "no attach room left"
    return ""


def route(pools: Sequence[PoolView], prefix_hash: str, exclude: Iterable[str] = ()) -> Route:
    """The pool a new session of ``prefix_hash`` should attach to (see the module
    docstring); pools named in ``exclude`` (tried and refused just now) are skipped."""
    skip = set(exclude)
    fit: list[PoolView] = []
    refusals: list[str] = []
    for v in pools:
        why = "refused this session just now" if v.name in skip else _why_not(v, prefix_hash)
        if why:
            refusals.append(f"{v.name}: {why}")
        else:
            fit.append(v)
    if not fit:
        detail = "; ".join(refusals) or "there are no pools"
        return Route(None, f"no pool can take a session ({detail})")
    best = min(fit, key=lambda v: (v.waiting_turns > 0, v.running_turns, -v.attach_room,
                                   -v.cells_free, v.name))
    floor = "room at the floor" if best.waiting_turns == 0 else "no pool has room at the floor"
    return Route(best.name, f"{best.name}: holds the prefix, {floor}, "
                            f"{best.running_turns} turns running")

# -------------------- connecting ----------------------------------------------

PROBE_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class RayAddress:
    """A parsed ``--ray`` value: ``auto`` or a host and port (``client``: ``ray://``)."""

    value: str
    host: str = ""
    port: int = 0
    client: bool = False

    @property
    def is_auto(self) -> bool:
        return self.value == "auto"


def parse_ray_address(value: str) -> RayAddress:
    """``--ray`` → :class:`RayAddress`; ValueError naming the fix. Does no I/O."""
    value = value.strip()
    if value == "auto":
        return RayAddress("auto")
    client = value.startswith("ray://")
    rest = value.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--ray must be 'auto' or the head's HOST:PORT (as `ray start --head` "
                         f"prints it; ray://HOST:PORT for Ray Client), got {value!r}")
    return RayAddress(value, host.strip("[]"), int(port), client)


def _probe(address: RayAddress) -> None:
    try:
        with socket.create_connection((address.host, address.port), timeout=PROBE_TIMEOUT_S):
            pass
    except OSError as exc:
        raise ValueError(
            f"--ray {address.value}: no Ray cluster answers at {address.host}:{address.port} "
            f"({exc.strerror or exc}); start its head with `ray start --head --port "
            f"{address.port}` there, or use --ray auto to start one here") from None


def connect(address: RayAddress, *, namespace: str = "mesh") -> str:
    """Join the cluster (``auto``: this machine's, else start a local one with this process
    its head; an address after a TCP probe); returns a line saying which. ValueError naming
    ``--ray`` when it cannot be reached, so a wrong address fails at start in one line."""
    if ray.is_initialized():
        return "Ray: already connected in this process"
    if not address.is_auto:
        _probe(address)
    started = False
    # ray.init sets a SIGTERM handler that exits at once (sys.exit): the server's own
    # handler (uvicorn's graceful shutdown, which closes the pools) is put back after it.
    on_term = (signal.getsignal(signal.SIGTERM)
               if threading.current_thread() is threading.main_thread() else None)
    try:
        try:
            ctx = ray.init(address="auto" if address.is_auto else address.value,
                           namespace=namespace, log_to_driver=False, configure_logging=False)
        except ConnectionError:
            if not address.is_auto:
                raise
            # auto, and no cluster runs here: start one (this process is its head)
            ctx = ray.init(address="local", include_dashboard=False, namespace=namespace,
                           log_to_driver=False, configure_logging=False)
            started = True
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ValueError(f"--ray {address.value}: cannot join the Ray cluster ({exc}); check "
                         "that its Ray version matches this one "
                         f"({ray.__version__})") from None
    finally:
        if on_term is not None:
            signal.signal(signal.SIGTERM, on_term)
    nodes = [n for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call]
    where = getattr(ctx, "address_info", {}).get("gcs_address") or address.value
    how = "started a local cluster at" if started else "joined"
    return f"Ray {ray.__version__}: {how} {where} ({len(nodes)} nodes alive)"


def disconnect() -> None:
    """Leave the cluster (and stop it, if this process started it)."""
    if ray.is_initialized():
        ray.shutdown()

# -------------------- the engine over the actors ------------------------------

logger = logging.getLogger(__name__)

STEP_WINDOW = 64  # the merged step window load() carries (the pools' newest steps)
CLOSE_TIMEOUT_S = 10.0
MOVE_WAIT_S = 60.0  # how long a session of a dead pool waits for room on the others

# The counts RayPools._merge sums: held now (live pools), totals since start (every pool).
_HELD = ("cells_used", "cells_total", "prefix_cells", "naive_cells", "free_seq_ids",
         "max_sessions", "max_attached", "parked_tokens", "parked_bytes", "park_memory")
_SINCE_START = ("sessions_attached", "prefill_tokens", "sessions_reaped", "parks", "resumes",
                "resume_tokens", "swaps", "compactions", "compacted_cells")


@dataclass(frozen=True)
class PoolPlacement:
    """What each pool actor asks Ray for: it is placed on a node that has it free."""

    num_cpus: float = 1.0  # the pool's threads (the engine thread, llama.cpp's workers)
    num_gpus: float = 0.0  # 1 for a pool on its own GPU
    memory: int = 0  # bytes of RAM reserved for the actor (0: none reserved)

    def options(self) -> dict[str, Any]:
        out: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.memory > 0:
            out["memory"] = self.memory
        return out


@dataclass(eq=False)
class PoolHandle:
    """One pool actor as the coordinator sees it."""

    name: str
    actor: Any  # a Ray actor handle of PoolActor
    info: PoolInfo | None = None
    report: PoolReport | None = None
    is_alive: bool = True
    error: str = ""
    attaching: int = 0  # attaches in flight to it
    num_sessions: int = 0  # this coordinator's sessions on it now (exact, unlike a report)
    num_routed: int = 0

    def view(self) -> PoolView:
        prefix_hash = self.info.prefix_hash if self.info is not None else ""
        # Attach room is counted here: a pool's report lags its attaches (its snapshot is
        # taken between steps).
        held = self.num_sessions + self.attaching
        if self.report is None:
            return PoolView(name=self.name, is_alive=self.is_alive, prefix_hash=prefix_hash,
                            can_attach=False, attach_reason="no report yet", attach_room=-held,
                            waiting_turns=0, running_turns=0, cells_free=0)
        load, check = self.report.load, self.report.check
        return PoolView(
            name=self.name, is_alive=self.is_alive, prefix_hash=prefix_hash,
            can_attach=check.ok, attach_reason=check.reason,
            attach_room=max(load.max_attached, load.max_sessions) - held,
            waiting_turns=load.count(SessionState.WAITING),
            running_turns=load.count(SessionState.DECODING) + load.count(SessionState.PREFILLING),
            cells_free=load.cells_free)


async def _get(ref: Any) -> Any:
    """Await a Ray call; an error the actor raised comes back as itself (``PoolFull``,
    ``ContextOverflow``...), not wrapped in Ray's task error."""
    try:
        return await ref
    except RayTaskError as exc:
        cause = exc.cause
        if isinstance(cause, Exception) and not isinstance(cause, RayTaskError):
            raise cause from None
        raise


def _attached(h: PoolHandle, _: asyncio.Future[Any]) -> None:
    h.attaching -= 1


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


class RayPools:
    """Pools as Ray actors, one engine (see the module docstring). ``make`` builds one
    pool in an actor's process (picklable); ``tokenize`` is the model's vocabulary here,
    for ``count_tokens`` and the session budgets; ``on_close`` frees it."""

    def __init__(self, make: Callable[[], HostedPool], *, num_pools: int,
                 tokenize: Callable[[str], list[int]],
                 placement: PoolPlacement | None = None, prefix_hash: str | None = None,
                 poll_s: float = 0.1, start_timeout_s: float = 900.0,
                 on_close: Callable[[], None] | None = None) -> None:
        if num_pools < 1:
            raise ValueError(f"--ray-pools must be at least 1, got {num_pools}")
        self._make = make
        self.num_pools = num_pools
        self.placement = placement or PoolPlacement()
        self.prefix_hash = prefix_hash or ""
        self.poll_s = poll_s
        self._start_timeout_s = start_timeout_s
        self._tokenize = tokenize
        self._on_close = on_close
        self._tag = uuid.uuid4().hex[:8]
        self.pools: list[PoolHandle] = []
        self._info: PoolInfo | None = None
        self._budgets: Budgets = (None, None)
        self._steps: deque[StepSample] = deque(maxlen=STEP_WINDOW)
        self._load: PoolLoad | None = None  # cached until a report arrives
        self._places: dict[str, int] = {}  # the cached load's held turns' places
        self._poller: asyncio.Task[None] | None = None
        self._closed = False
        # Sessions by id: the handles callers hold (weak: a dropped one is detached by
        # the poll) and where each one's pool-side session is.
        self._handles: weakref.WeakValueDictionary[str, RaySession] = (
            weakref.WeakValueDictionary())
        self._where: dict[str, tuple[PoolHandle, str]] = {}
        self._ids: dict[tuple[str, str], str] = {}  # (pool, pool-side id) -> session id
        self.num_moved = 0  # sessions resumed on another pool after theirs died
        self.num_lost = 0  # sessions whose pool died and that no pool could take
        self.turn_overheads: deque[float] = deque(maxlen=4096)  # s per turn: wall - pool's

    # ------------------------------------------------------------------ lifecycle

    async def start(self, progress: Callable[[int, int], None] | None = None) -> PoolInfo:
        """Place ``num_pools`` actors (``ValueError`` naming ``--ray-gpus`` /
        ``--ray-pools`` when the cluster cannot hold them) and build every pool; their
        :class:`~mesh.engine.interface.PoolInfo` summed under ``engine="ray:N"``."""
        self._check_resources()
        cls = ray.remote(PoolActor)
        for i in range(self.num_pools):
            actor = cls.options(name=f"mesh-pool-{self._tag}-{i}", max_restarts=0,
                                **self.placement.options()).remote(self._make)
            self.pools.append(PoolHandle(name=f"p{i}", actor=actor))
        try:
            infos = await asyncio.wait_for(
                asyncio.gather(*(_get(h.actor.start.remote()) for h in self.pools)),
                self._start_timeout_s)
        except TimeoutError:
            await self.aclose()
            raise ValueError(
                f"the {self.num_pools} pool actors did not start within "
                f"{self._start_timeout_s:.0f} s: the cluster may lack free resources for "
                f"them ({self.placement}); lower --ray-pools or add nodes") from None
        except BaseException:
            await self.aclose()
            raise
        for h, info in zip(self.pools, infos, strict=True):
            h.info = info
        first: PoolInfo = infos[0]
        self.prefix_hash = self.prefix_hash or first.prefix_hash
        self._info = replace(
            first, n_ctx=sum(i.n_ctx for i in infos), n_seq_max=sum(i.n_seq_max for i in infos),
            max_sessions=sum(i.max_sessions for i in infos),
            session_budget=min(i.session_budget for i in infos),
            build_s=max(i.build_s for i in infos), engine=f"ray:{self.num_pools}")
        if progress is not None:
            progress(first.prefix_tokens, first.prefix_tokens)
        self._ship()
        await asyncio.gather(*(self._refresh(h) for h in self.pools))
        self._poller = asyncio.get_running_loop().create_task(self._poll(), name="mesh-ray-poll")
        return self._info

    def _check_resources(self) -> None:
        """ValueError naming the flag when the cluster has fewer GPUs or CPUs in all than
        the pools ask for (they would wait for ever to be placed)."""
        total: dict[str, float] = ray.cluster_resources()  # type: ignore[no-untyped-call]
        p = self.placement
        for key, each, flag in (("GPU", p.num_gpus, "--ray-gpus"),
                                ("CPU", p.num_cpus, "--threads")):
            need = each * self.num_pools
            if need > total.get(key, 0.0):
                raise ValueError(
                    f"{self.num_pools} pools x {each:g} {key} = {need:g} {key}, but the Ray "
                    f"cluster has {total.get(key, 0.0):g}: lower --ray-pools or {flag}, "
                    "or add nodes")

    async def aclose(self) -> None:
        """Stop polling, close every live pool (its sessions' cells freed), kill the
        actors. Idempotent."""
        self._closed = True
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None
        for h in self.pools:
            if h.is_alive:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(_get(h.actor.close.remote()), CLOSE_TIMEOUT_S)
            with contextlib.suppress(Exception):
                ray.kill(h.actor)
            h.is_alive = False
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    @property
    def info(self) -> PoolInfo:
        if self._info is None:
            raise RuntimeError("the Ray pools are not started; await pools.start() first")
        return self._info

    # ------------------------------------------------------------------ the gate's budgets

    def set_prefill_budget(self, budget: PrefillBudget | None) -> None:
        self._budgets = (budget, self._budgets[1])
        self._ship()

    def set_turn_admission(self, gate: TurnAdmission | None) -> None:
        self._budgets = (self._budgets[0], gate)
        self._ship()

    def _ship(self) -> None:
        for h in self.pools:
            if h.is_alive and h.info is not None:
                h.actor.set_budgets.remote(self._budgets)  # ordered before later calls

    # ------------------------------------------------------------------ reports

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await asyncio.gather(*(self._refresh(h) for h in self.pools if h.is_alive))
            self._detach_dropped()

    async def _refresh(self, h: PoolHandle) -> None:
        try:
            self.take_report(h, await _get(h.actor.report.remote()))
        except RayActorError as exc:
            self.pool_died(h, exc)
        except Exception as exc:  # the pool answered with an error: keep its last report
            h.error = _first_line(exc)

    def take_report(self, h: PoolHandle, report: PoolReport) -> None:
        h.report = report
        self._steps.extend(report.new_steps)
        self._load = None

    def pool_died(self, h: PoolHandle, exc: BaseException) -> None:
        """Ray reported ``h``'s actor dead (or unavailable: treated alike, and the actor
        killed, so a pool that comes back never serves a session that moved): route
        nothing to it again."""
        if not h.is_alive:
            return
        h.is_alive = False
        h.error = _first_line(exc)
        self._load = None
        logger.warning("pool %s died (%s); its %d sessions move to the other pools at their "
                       "next turn", h.name, h.error, h.num_sessions)
        with contextlib.suppress(Exception):
            ray.kill(h.actor)

    def _detach_dropped(self) -> None:
        for sid in [s for s in self._where if s not in self._handles]:
            h, rid = self._where[sid]
            self._unplace(sid)
            if h.is_alive:
                logger.warning("session %s was dropped without a detach; detaching it on %s",
                               sid, h.name)
                h.actor.detach.remote(rid)

    def views(self) -> list[PoolView]:
        return [h.view() for h in self.pools]

    # ------------------------------------------------------------------ Engine

    def check_attach(self) -> AttachCheck:
        r = route(self.views(), self.prefix_hash)
        return AttachCheck(r.pool is not None, "" if r.pool is not None else r.reason)

    async def attach(self) -> RaySession:
        if self._closed:
            raise SessionFailed("the Ray pools are closed")
        h, rid = await self.attach_on_pool(exclude=())
        session = RaySession(self, h, rid, f"{h.name}/{rid}")
        self._handles[session.id] = session
        self._place(session.id, h, rid)
        return session

    def _place(self, sid: str, h: PoolHandle, rid: str) -> None:
        self._where[sid] = (h, rid)
        self._ids[(h.name, rid)] = sid
        h.num_sessions += 1

    def _unplace(self, sid: str) -> None:
        where = self._where.pop(sid, None)
        if where is not None:
            h, rid = where
            self._ids.pop((h.name, rid), None)
            h.num_sessions -= 1

    async def attach_on_pool(self, exclude: Sequence[str]) -> tuple[PoolHandle, str]:
        """A new pool-side session on the pool :func:`route` names (the next one when a
        pool refuses or dies meanwhile); ``PoolFull`` with every pool's reason."""
        tried = set(exclude)
        while True:
            r: Route = route(self.views(), self.prefix_hash, tried)
            if r.pool is None:
                raise PoolFull(r.reason)
            h = next(p for p in self.pools if p.name == r.pool)
            h.attaching += 1
            pending = asyncio.ensure_future(_get(h.actor.attach.remote()))
            pending.add_done_callback(functools.partial(_attached, h))
            try:
                rid: str = await asyncio.shield(pending)
            except asyncio.CancelledError:
                # The pool may still attach it: detach it there once it has.
                def undo(fut: asyncio.Future[Any], h: PoolHandle = h) -> None:
                    if not fut.cancelled() and fut.exception() is None and h.is_alive:
                        h.actor.detach.remote(fut.result())
                pending.add_done_callback(undo)
                raise
            except PoolFull:
                tried.add(h.name)
                continue
            except RayActorError as exc:
                self.pool_died(h, exc)
                continue
            h.num_routed += 1
            return h, rid

    def load(self) -> PoolLoad:
        if self._load is None:
            self._load = self._merge()
            self._places = {s.id: s.turn_place for s in self._load.sessions
                            if s.turn_place is not None}
        return self._load

    def turn_place(self, session_id: str) -> int | None:
        """From the pools' latest reports (each pool's own line: a place is within the
        pool that holds the session)."""
        self.load()
        return self._places.get(session_id)

    def _merge(self) -> PoolLoad:
        """The pools' latest reports as one load: what is held now (sessions, cells,
        rates) from the live pools; the totals since start from every pool, a dead one's
        as it last reported them."""
        loads = [(h, h.report.load) for h in self.pools if h.report is not None]
        live = [(h, ld) for h, ld in loads if h.is_alive]
        sessions = tuple(replace(s, id=self._ids.get((h.name, s.id), f"{h.name}/{s.id}"))
                         for h, load in live for s in load.sessions)
        steps_ms = [ld.step_ms for _, ld in live if ld.step_ms is not None]
        held = {f: sum(int(getattr(ld, f)) for _, ld in live) for f in _HELD}
        since_start = {f: sum(int(getattr(ld, f)) for _, ld in loads) for f in _SINCE_START}
        return PoolLoad(
            taken_at=time.monotonic(), sessions=sessions,
            step_ms=sum(steps_ms) / len(steps_ms) if steps_ms else None,
            agg_tps=sum(ld.agg_tps for _, ld in live),
            session_budget=self._info.session_budget if self._info is not None else 0,
            recent_steps=tuple(self._steps), **held, **since_start)

    def tokenize(self, text: str) -> list[int]:
        return self._tokenize(text)

    def count_tokens(self, text: str) -> int:
        return len(self._tokenize(text))

    def backend_metrics(self) -> dict[str, Any]:
        """Each pool for ``/capacity``'s engine block: where it runs, alive or why not."""
        rows = []
        for h in self.pools:
            load = h.report.load if h.report is not None else None
            rows.append({"name": h.name, "alive": h.is_alive, "error": h.error or None,
                         "sessions": h.num_sessions, "routed": h.num_routed,
                         "cellsUsed": load.cells_used if load is not None else None,
                         "cellsTotal": load.cells_total if load is not None else None})
        overheads = sorted(self.turn_overheads)
        p50 = overheads[len(overheads) // 2] * 1e3 if overheads else None
        return {"pools": rows, "sessionsMoved": self.num_moved, "sessionsLost": self.num_lost,
                "turnOverheadMsP50": p50}

    # ------------------------------------------------------------------ sessions

    async def stream(self, h: PoolHandle, rid: str, text: str,
                     params: SamplingParams) -> AsyncGenerator[Chunk]:
        """One turn on pool ``h``: its chunks, the last with its :class:`TurnEnd` (whose
        report is taken here, and the hop's overhead recorded)."""
        started = time.perf_counter()
        gen = h.actor.generate.options(num_returns="streaming").remote(rid, text, params)
        async for ref in gen:
            chunk: Chunk = await _get(ref)
            if chunk.end is not None:
                self.take_report(h, chunk.end.report)
                self.turn_overheads.append(max(0.0, time.perf_counter() - started
                                               - chunk.end.turn_s))
            yield chunk

    async def move(self, session: RaySession, why: str) -> None:
        """``session``'s pool died: attach it to another (its context is recomputed by its
        next turn). While live pools hold its prefix but are full, it waits for room (up
        to :data:`MOVE_WAIT_S`: a slow turn, not a lost one); otherwise SessionFailed
        naming why no pool could take it."""
        old = session.pool
        self._unplace(session.id)
        deadline = time.monotonic() + MOVE_WAIT_S
        while True:
            try:
                h, rid = await self.attach_on_pool(exclude=(old.name,))
                break
            except PoolFull as exc:
                holders = [p for p in self.pools if p.is_alive and p.info is not None
                           and p.info.prefix_hash == self.prefix_hash]
                if not holders or self._closed or time.monotonic() >= deadline:
                    self.num_lost += 1
                    session.is_detached = True
                    waited = "" if not holders else f" within {MOVE_WAIT_S:.0f} s"
                    raise SessionFailed(f"pool {old.name} died ({why}) and session "
                                        f"{session.id} could not move to another pool"
                                        f"{waited}: {exc}") from None
                await asyncio.sleep(self.poll_s)  # the live pools are full: wait for room
        session.pool, session.remote_id, session.on_pool = h, rid, 0
        self._place(session.id, h, rid)
        self.num_moved += 1
        logger.warning("session %s moved from dead pool %s to %s (%d characters to "
                       "recompute)", session.id, old.name, h.name, len(session.history))

    async def detach_on_pool(self, session: RaySession) -> None:
        h, rid = session.pool, session.remote_id
        self._unplace(session.id)
        self._handles.pop(session.id, None)
        if h.is_alive:
            try:
                await _get(h.actor.detach.remote(rid))
            except RayActorError as exc:
                self.pool_died(h, exc)


@dataclass(eq=False)
class RaySession:
    """A caller's handle on a session of a pool actor (see
    :class:`~mesh.engine.interface.Session`). ``history`` is every text the session's
    context holds past the prefix, in order; the first ``on_pool`` characters of it are on
    its pool now (all of them, unless it just moved)."""

    pools: RayPools
    pool: PoolHandle
    remote_id: str
    id: str
    history: str = ""
    on_pool: int = 0
    pending: str = ""
    num_tokens: int = 0  # tokens of ``history`` (counted here)
    num_pending: int = 0
    is_detached: bool = False
    in_turn: bool = False

    @property
    def context_len(self) -> int:
        return self.pools.info.prefix_tokens + self.num_tokens + self.num_pending

    def check_attached(self) -> None:
        if self.is_detached:
            raise SessionFailed(f"session {self.id} is detached")

    def append(self, text: str) -> None:
        self.check_attached()
        n = self.pools.count_tokens(text)
        budget = self.pools.info.session_budget
        if self.num_tokens + self.num_pending + n > budget:
            raise ContextOverflow(f"appending {n} tokens would exceed session {self.id}'s "
                                  f"budget of {budget} tokens")
        self.pending += text
        self.num_pending += n

    def generate(self, params: SamplingParams) -> RayGeneration:
        params.validate()
        return RayGeneration(self, params)

    async def compact(self, text: str) -> bool:
        """The history after the prefix becomes ``text`` on its pool (queued text stays
        queued, after it); on a dead pool, in the history the move recomputes."""
        self.check_attached()
        if self.in_turn:
            return False
        n = self.pools.count_tokens(text)
        budget = self.pools.info.session_budget
        if n + self.num_pending > budget:
            raise ContextOverflow(f"session {self.id}: a compacted history of {n} tokens with "
                                  f"{self.num_pending} queued exceeds its budget of {budget}")
        on_pool = 0
        if self.pool.is_alive:
            try:
                if not await _get(self.pool.actor.compact.remote(self.remote_id, text)):
                    return False
                on_pool = len(text)
            except RayActorError as exc:
                self.pools.pool_died(self.pool, exc)
        self.history, self.on_pool, self.num_tokens = text, on_pool, n
        return True

    async def detach(self) -> None:
        if not self.is_detached:
            self.is_detached = True
            await self.pools.detach_on_pool(self)


class RayGeneration:
    """One turn of a :class:`RaySession`, moved to another pool if its pool dies (see the
    module docstring)."""

    def __init__(self, session: RaySession, params: SamplingParams) -> None:
        self._session = session
        self._params = params
        self._closed = False
        self._iterated = False
        self.result: TurnResult | None = None

    def __aiter__(self) -> AsyncIterator[Piece]:
        if self._iterated:
            raise RuntimeError("a generation can be iterated once")
        self._iterated = True
        return self._run()

    async def aclose(self) -> None:
        self._closed = True

    async def _run(self) -> AsyncIterator[Piece]:
        s = self._session
        s.check_attached()
        started = time.monotonic()
        s.in_turn = True
        try:  # aclosing: a consumer that leaves closes the turn at once (it stops the pool's)
            async with contextlib.aclosing(self._turn(started)) as pieces:
                async for piece in pieces:
                    yield piece
        finally:
            s.in_turn = False

    async def _turn(self, started: float) -> AsyncGenerator[Piece]:
        s, params = self._session, self._params
        prompt_tokens = s.num_pending
        s.history += s.pending
        s.num_tokens += s.num_pending
        s.pending, s.num_pending = "", 0
        texts: list[str] = []
        generated, before, wait_s = 0, 0, 0.0  # tokens so far; before this attempt
        end: TurnEnd | None = None
        while end is None:
            if not s.pool.is_alive:
                await s.pools.move(s, s.pool.error or "its actor died")
            left = params.max_tokens - generated
            if left <= 0:
                break
            h, rid, before = s.pool, s.remote_id, generated
            send = s.history[s.on_pool:]
            s.on_pool = len(s.history)
            stream = s.pools.stream(h, rid, send, replace(params, max_tokens=left))
            try:
                async with contextlib.aclosing(stream) as chunks:
                    async for chunk in chunks:
                        for piece in chunk.pieces:
                            generated += piece.token >= 0
                            texts.append(piece.text)
                            s.history += piece.text
                            s.on_pool = len(s.history)
                            yield piece
                        if chunk.end is not None:
                            end = chunk.end
                            break
                        if self._closed:
                            h.actor.stop.remote(rid)
            except RayActorError as exc:
                s.pools.pool_died(h, exc)
            except SessionFailed:
                await s.detach()
                raise
            except BaseException:
                if h.is_alive:  # the consumer left mid-turn: end it on the pool too
                    h.actor.stop.remote(rid)
                raise
        last = end.result if end is not None else None
        if last is not None:
            generated = before + last.num_generated
            if last.stop:  # the stop string stays in the context, as in a pool
                s.history += last.stop
                s.on_pool = len(s.history)
            wait_s += last.wait_s
        s.num_tokens += generated
        self.result = TurnResult(
            text="".join(texts), num_prompt_tokens=prompt_tokens, num_generated=generated,
            finish_reason=last.finish_reason if last is not None else "length",
            decode_s=time.monotonic() - started, stop=last.stop if last is not None else None,
            wait_s=wait_s)
