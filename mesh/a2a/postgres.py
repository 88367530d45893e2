"""Tasks in PostgreSQL: several coordinator processes on one database
(``mesh serve --task-store postgresql://...``).

Tasks, their versions and events, push configs and owners live in the a2a-sdk's own schema,
through its cluster stores: :class:`VersionedDatabaseTaskStore` (each write a compare-and-swap
on the task's version, appending its event to ``task_events``) and
``DatabasePushNotificationConfigStore``; any coordinator answers for any task. mesh adds
three things the SDK leaves to the deployment, through PostgreSQL itself (no broker):

* **Events cross processes**: :class:`NotifiedEventStream` tails ``task_events``, woken by
  the ``NOTIFY mesh_task_events`` a trigger sends at the commit (polling as a backstop).
* **Cancels cross processes**: the SDK writes CANCELED where the call lands, which the
  runner would notice only at its next write; :class:`ClusterRequestHandler` sends
  ``NOTIFY mesh_cancels`` and the runner cancels the task at once (gate wait or worker).
* **A dead coordinator's tasks are failed**: :class:`Membership` gives each coordinator a
  ``mesh_coordinators`` row and holds the advisory lock ``(LOCK_SPACE, id)`` on one session
  for its life; ``mesh_task_runs`` names the runner of each non-terminal task. A lock, not a
  heartbeat: PostgreSQL releases it however the session ends, so "can I take its lock?" is
  exact, with no timeout to tune (docs/cluster.md).

Invariants:

====================================  ================================================
what                                  how it is kept
====================================  ================================================
a non-terminal task row names its     the run row is written (:meth:`_ClaimingStore.
runner in ``mesh_task_runs``          save`) before the first write of the task by
                                      that coordinator; deleted after its terminal write
a task left by a dead coordinator     :meth:`PostgresStores.mark_interrupted`: at start
is failed, never lost, never left     (every non-terminal task without a live runner),
"working"                             then every ``sweep_s`` (the runs of coordinators
                                      whose lock is free), and at shutdown (this
                                      coordinator's own)
two sweepers never fail a live task   a runner is judged only after its run row was
                                      read, and it held its lock before it wrote one
no write is lost or doubled           the SDK's compare-and-swap: a sweeper and a runner
                                      racing on one task — one wins, the other re-reads
the event log stays bounded           the sweep deletes the events of tasks finished
                                      over a minute ago, once a minute
====================================  ================================================
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from a2a.server.cluster import (
    ConcurrentTaskModificationError,
    TaskEventStream,
    TaskVersion,
    VersionedDatabaseTaskStore,
    VersionedEvent,
)
from a2a.server.cluster.database_event_stream import stream_response_to_event
from a2a.server.context import ServerCallContext
from a2a.server.events import Event
from a2a.server.models import (
    Base,
    PushNotificationConfigModel,
    TaskEventModel,
    TaskModel,
    TaskVersionModel,
)
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.tasks import DatabasePushNotificationConfigStore, PushNotificationSender
from a2a.types import a2a_pb2 as pb
from a2a.utils.errors import TaskNotCancelableError, TaskNotFoundError
from sqlalchemy import Executable, and_, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from mesh.a2a.store import (
    INTERRUPTED_REASON,
    SETTLED_STATES,
    TERMINAL_NAMES,
    TERMINAL_STATES,
    interrupted_status,
    owner_context,
    owner_of,
)

if TYPE_CHECKING:
    import asyncpg
    from a2a.server.agent_execution import AgentExecutor

    from mesh.a2a.store import PushUrlValidator, TaskBoard

__all__ = [
    "LOCK_SPACE", "ClusterRequestHandler", "Membership", "NotifiedEventStream", "PostgresStores",
    "check_postgres", "redacted",
]

logger = logging.getLogger(__name__)

#: The first key of every advisory lock mesh takes ('mesh' in ASCII); the second is a
#: coordinator's id (its liveness), or 0 (schema changes at start).
LOCK_SPACE = 0x6D657368
EVENTS_CHANNEL = "mesh_task_events"
CANCELS_CHANNEL = "mesh_cancels"
_CONNECT_TIMEOUT_S = 10.0
_PRUNE_EVERY_S = 60.0  # how often the event log of finished tasks is pruned
_PRUNE_AFTER_S = 60.0  # how long a finished task's events are kept

# mesh's own tables and the trigger, created once (IF NOT EXISTS) under the schema lock.
_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS mesh_coordinators (
        id SERIAL PRIMARY KEY,
        host TEXT NOT NULL,
        pid INTEGER NOT NULL,
        started_at TIMESTAMPTZ NOT NULL DEFAULT now())""",
    """CREATE TABLE IF NOT EXISTS mesh_task_runs (
        task_id VARCHAR(36) PRIMARY KEY,
        coordinator_id INTEGER NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS mesh_task_runs_by_coordinator "
    "ON mesh_task_runs (coordinator_id)",
    f"""CREATE OR REPLACE FUNCTION mesh_notify_task_event() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN PERFORM pg_notify('{EVENTS_CHANNEL}', NEW.task_id); RETURN NULL; END $$""",
)
_TRIGGER = "mesh_task_events_notify"


def redacted(url: str) -> str:
    """``url`` with its password shown as ``***`` (for messages and logs)."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url.partition(":")[0] + "://..."


def _dsn(url: str) -> str:
    """The libpq-style DSN asyncpg takes, from any spelling ``--task-store`` accepts."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _unreachable(url: str, exc: BaseException) -> ValueError:
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ValueError(f"cannot reach PostgreSQL at {redacted(url)}: {reason}; check --task-store")


async def _connect(url: str) -> asyncpg.Connection:
    """One asyncpg session; ``ValueError`` naming ``--task-store`` if it cannot be had."""
    try:
        import asyncpg
    except ImportError:
        raise ValueError("--task-store postgresql://... needs asyncpg: pip install "
                         "'mesh[postgres]' (or pip install asyncpg)") from None
    try:
        conn: asyncpg.Connection = await asyncpg.connect(
            _dsn(url), timeout=_CONNECT_TIMEOUT_S,
            # Keepalives on this session: a coordinator whose host vanishes loses its
            # liveness lock within idle + interval * count seconds, not hours.
            server_settings={"application_name": "mesh coordinator",
                             "tcp_keepalives_idle": "10", "tcp_keepalives_interval": "5",
                             "tcp_keepalives_count": "3"})
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise _unreachable(url, exc) from None
    return conn


async def check_postgres(url: str) -> None:
    """Connect once and close: ``ValueError`` naming ``--task-store`` (with the reason and
    the URL, password hidden) when PostgreSQL cannot be reached or refuses the login."""
    conn = await _connect(url)
    await conn.close()


# --------------------------------------------------------------------------- liveness


class Membership:
    """This coordinator's seat: its ``mesh_coordinators`` row, the advisory lock that says
    it is alive, and the LISTEN side of both channels, on one dedicated session.
    ``on_event(task_id)`` runs for every task event committed by any coordinator,
    ``on_cancel(task_id)`` for every cancel another one announced; both on the loop that
    called :meth:`join`, and must not block."""

    def __init__(self, url: str, *, on_event: Callable[[str], None],
                 on_cancel: Callable[[str], None]) -> None:
        self.url = url
        self.id = 0  # set by join()
        self.is_lost = False  # the session dropped: the lock (so the seat) is gone
        self._on_event = on_event
        self._on_cancel = on_cancel
        self._conn: asyncpg.Connection | None = None

    async def join(self) -> int:
        """Take a new seat; returns its id. Raises ``ValueError`` naming ``--task-store``
        when PostgreSQL cannot be reached."""
        conn = await _connect(self.url)
        try:
            seat: int = await conn.fetchval(
                "INSERT INTO mesh_coordinators (host, pid) VALUES ($1, $2) RETURNING id",
                socket.gethostname(), os.getpid())
            # The seat is taken before any task is claimed under it (see the sweep).
            await conn.execute("SELECT pg_advisory_lock($1, $2)", LOCK_SPACE, seat)
            await conn.add_listener(EVENTS_CHANNEL, self._heard)
            await conn.add_listener(CANCELS_CHANNEL, self._heard)
        except BaseException:
            await conn.close()
            raise
        conn.add_termination_listener(self._dropped)
        self._conn, self.id, self.is_lost = conn, seat, False
        return seat

    async def leave(self) -> None:
        """Give the seat up: delete its row, release the lock (by closing the session)."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        conn.remove_termination_listener(self._dropped)
        try:
            if not conn.is_closed():
                await conn.execute("DELETE FROM mesh_coordinators WHERE id = $1", self.id)
        finally:
            await conn.close()

    def _heard(self, _conn: object, _pid: int, channel: str, payload: str) -> None:
        if channel == EVENTS_CHANNEL:
            self._on_event(payload)
            return
        sender, _, task_id = payload.partition(":")
        if sender != str(self.id):
            self._on_cancel(task_id)

    def _dropped(self, _conn: object) -> None:
        if self._conn is not None:
            self.is_lost = True
            logger.error("lost the PostgreSQL session holding coordinator %d's seat: other "
                         "coordinators will fail its running tasks; restart this one", self.id)


async def _dead_among(engine: AsyncEngine, seats: set[int]) -> set[int]:
    """The seats in ``seats`` whose lock nobody holds: their coordinator is gone. The locks
    taken to find out are transaction-scoped, released before this returns."""
    if not seats:
        return set()
    async with engine.begin() as conn:
        rows = await conn.execute(
            text("SELECT id FROM unnest(CAST(:ids AS integer[])) AS id "
                 "WHERE pg_try_advisory_xact_lock(:space, id)"),
            {"ids": sorted(seats), "space": LOCK_SPACE})
        return {int(seat) for (seat,) in rows}


# --------------------------------------------------------------------------- task store


class _ClaimingStore(VersionedDatabaseTaskStore):
    """The SDK's versioned store that keeps ``mesh_task_runs`` and reports each save to
    ``on_saved`` (the dashboard's board). The first non-terminal write of a task here
    claims it before the row is written; a terminal one deletes the claim after; an input-
    or auth-required one keeps the claim but forgets it here, so whichever coordinator
    resumes the task claims it again."""

    def __init__(self, engine: AsyncEngine, membership: Membership) -> None:
        super().__init__(engine, create_table=False, owner_resolver=owner_of)
        self.membership = membership
        self.on_saved: Callable[[pb.Task], None] | None = None
        self._claimed: set[str] = set()
        self._engine = engine

    async def save(self, task: pb.Task, *, event: Event | None = None,
                   prev: pb.Task | None = None, prev_version: TaskVersion,
                   context: ServerCallContext) -> TaskVersion:
        state = task.status.state
        if state not in SETTLED_STATES and task.id not in self._claimed:
            await self._claim(task.id)
            self._claimed.add(task.id)
        version = await super().save(task, event=event, prev=prev, prev_version=prev_version,
                                     context=context)
        if state in SETTLED_STATES:
            self._claimed.discard(task.id)
        if state in TERMINAL_STATES:
            await self._unclaim(task.id)
        if self.on_saved is not None:
            self.on_saved(task)
        return version

    async def delete(self, task_id: str, context: ServerCallContext) -> None:
        await super().delete(task_id, context)
        self._claimed.discard(task_id)
        await self._unclaim(task_id)

    def forget(self, task_id: str) -> None:
        """Drop ``task_id`` from the claims this process remembers (cancelled elsewhere)."""
        self._claimed.discard(task_id)

    async def _claim(self, task_id: str) -> None:
        await _execute(self._engine, "INSERT INTO mesh_task_runs (task_id, coordinator_id) "
                       "VALUES (:t, :c) ON CONFLICT (task_id) DO UPDATE "
                       "SET coordinator_id = excluded.coordinator_id",
                       t=task_id, c=self.membership.id)

    async def _unclaim(self, task_id: str) -> None:
        await _execute(self._engine, "DELETE FROM mesh_task_runs WHERE task_id = :t", t=task_id)


async def _execute(engine: AsyncEngine, *statements: str, **params: Any) -> None:
    """Run ``statements`` with ``params`` in one transaction."""
    async with engine.begin() as conn:
        for statement in statements:
            await conn.execute(text(statement), params)


async def _rows(engine: AsyncEngine, query: str | Executable, **params: Any) -> Sequence[Any]:
    """The rows ``query`` (SQL text or a SQLAlchemy statement) returns for ``params``."""
    async with engine.connect() as conn:
        return (await conn.execute(text(query) if isinstance(query, str) else query, params)).all()


# --------------------------------------------------------------------------- events


class NotifiedEventStream(TaskEventStream):
    """Tails ``task_events`` for one task, woken by ``NOTIFY`` (:meth:`wake`) and polling
    every ``poll_s`` as a backstop. ``publish`` has nothing to do: the write that produced
    the event put it in the table, and the trigger notified, at its commit."""

    def __init__(self, engine: AsyncEngine, *, poll_s: float = 2.0) -> None:
        self._engine = engine
        self._poll_s = poll_s
        self._watchers: dict[str, set[asyncio.Event]] = {}

    def wake(self, task_id: str) -> None:
        """A new event of ``task_id`` was committed (the trigger's NOTIFY)."""
        for watcher in self._watchers.get(task_id, ()):
            watcher.set()

    def wake_all(self) -> None:
        """Wake every tail (the notifications may have been missed)."""
        for watchers in self._watchers.values():
            for watcher in watchers:
                watcher.set()

    async def publish(self, task_id: str, event: VersionedEvent) -> None:
        del task_id, event

    async def subscribe(
        self, task_id: str, *, after: TaskVersion
    ) -> AsyncGenerator[VersionedEvent, None]:
        watcher = asyncio.Event()
        self._watchers.setdefault(task_id, set()).add(watcher)
        try:
            cursor = await self._start_seq(task_id, after)
            while True:
                watcher.clear()  # before the read: a NOTIFY during it is not lost
                rows = await _rows(self._engine, select(
                    TaskEventModel.seq, TaskEventModel.task_version, TaskEventModel.event_data)
                    .where(and_(TaskEventModel.task_id == task_id, TaskEventModel.seq > cursor))
                    .order_by(TaskEventModel.seq.asc()))
                for seq, task_version, data in rows:
                    cursor = seq
                    version = TaskVersion(task_version)
                    if not version.is_after(after):
                        continue
                    response = pb.StreamResponse.FromString(data)
                    yield VersionedEvent(event=stream_response_to_event(response),
                                         version=version)
                if not rows:
                    with suppress(TimeoutError):
                        async with asyncio.timeout(self._poll_s):
                            await watcher.wait()
        finally:
            watchers = self._watchers.get(task_id)
            if watchers is not None:
                watchers.discard(watcher)
                if not watchers:
                    del self._watchers[task_id]

    async def _start_seq(self, task_id: str, after: TaskVersion) -> int:
        """The last ``seq`` at or before version ``after`` (0: from the start)."""
        if after.is_missing:
            return 0
        rows = await _rows(self._engine, select(TaskEventModel.seq)
                           .where(and_(TaskEventModel.task_id == task_id,
                                       TaskEventModel.task_version <= _version_int(after)))
                           .order_by(TaskEventModel.seq.desc()).limit(1))
        return int(rows[0][0]) if rows else 0

    async def destroy(self, task_id: str) -> None:
        del task_id  # the log is kept; tails stop at a terminal event


def _version_int(version: TaskVersion) -> int:
    # The SDK's versioned store counts writes; a TaskVersion holds that int.
    value = version._value
    if not isinstance(value, int):
        raise TypeError(f"expected an integer task version, got {value!r}")
    return value


# --------------------------------------------------------------------------- handler


class ClusterRequestHandler(DefaultRequestHandler):
    """The SDK's handler, plus the cancel relay: a cancel of a task this coordinator does
    not run is announced (``NOTIFY mesh_cancels``), and an announced cancel of a task it
    does run is carried out here (:meth:`cancel_here`)."""

    def __init__(self, *args: Any, stores: PostgresStores, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stores = stores

    async def on_cancel_task(self, params: pb.CancelTaskRequest,
                             context: ServerCallContext) -> pb.Task | None:
        is_here = await self._active_task_registry.get(params.id) is not None
        task: pb.Task | None = await super().on_cancel_task(params, context)
        if not is_here:
            await self._stores.announce_cancel(params.id)
        return task

    async def cancel_here(self, task_id: str) -> None:
        """Cancel ``task_id`` if it runs here: its row already says CANCELED (written by the
        coordinator that took the call); this stops the executor (see module docstring)."""
        if await self._active_task_registry.get(task_id) is None:
            return
        self._stores.tasks.forget(task_id)
        owner = await self._stores.owner_of_task(task_id)
        if owner is None:
            return
        with suppress(TaskNotFoundError, TaskNotCancelableError):
            await self._cancel_local(task_id, owner_context(owner))


# --------------------------------------------------------------------------- the stores


class PostgresStores:
    """The engine, the stores, the event stream and the seat on the PostgreSQL at ``url``
    (``postgresql://USER:PASSWORD@HOST:PORT/DB``, libpq options such as ``?sslmode=require``
    included). No I/O until ``initialize``, which creates the schema and takes the seat;
    ``aclose`` gives it up and closes everything. ``sweep_s``: how often dead coordinators
    are looked for; ``poll_s``: the backstop poll of a cross-process tail."""

    def __init__(self, url: str, *, sweep_s: float = 1.0, poll_s: float = 2.0) -> None:
        self.url = url
        self.sweep_s = sweep_s
        dsn = _dsn(url)

        async def connect() -> Any:
            import asyncpg

            return await asyncpg.connect(dsn, timeout=_CONNECT_TIMEOUT_S)

        # asyncpg reads the URL itself (libpq's spelling: ?sslmode=require and the like);
        # SQLAlchemy's own URL parsing would hand such options to asyncpg as keywords.
        self.engine = create_async_engine("postgresql+asyncpg://", async_creator=connect,
                                          pool_size=10, max_overflow=10, pool_recycle=1800)
        self.events = NotifiedEventStream(self.engine, poll_s=poll_s)
        self.membership = Membership(url, on_event=self.events.wake,
                                     on_cancel=self._heard_cancel)
        self.tasks = _ClaimingStore(self.engine, self.membership)
        self.push_configs = DatabasePushNotificationConfigStore(
            self.engine, create_table=False, owner_resolver=owner_of)
        self._handler: ClusterRequestHandler | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()

    async def initialize(self) -> None:
        """Create the schema (idempotent; one coordinator at a time) and take the seat.
        ``ValueError`` naming ``--task-store`` when PostgreSQL cannot be reached."""
        try:
            async with self.engine.begin() as conn:
                await conn.execute(text("SELECT pg_advisory_xact_lock(:space, 0)"),
                                   {"space": LOCK_SPACE})
                await conn.run_sync(Base.metadata.create_all, tables=[
                    Base.metadata.tables[model.__tablename__] for model in (
                        TaskModel, TaskVersionModel, TaskEventModel,
                        PushNotificationConfigModel)])
                for statement in _SCHEMA:
                    await conn.execute(text(statement))
                has_trigger = (await conn.execute(
                    text("SELECT 1 FROM pg_trigger WHERE tgname = :name"),
                    {"name": _TRIGGER})).first()
                if has_trigger is None:
                    await conn.execute(text(
                        f"CREATE TRIGGER {_TRIGGER} AFTER INSERT ON task_events "
                        "FOR EACH ROW EXECUTE FUNCTION mesh_notify_task_event()"))
        except Exception as exc:
            if _is_connect_error(exc):
                raise _unreachable(self.url, exc) from None
            raise
        await self.tasks.initialize()
        await self.push_configs.initialize()
        await self.membership.join()
        logger.info("task store: PostgreSQL at %s, coordinator seat %d",
                    redacted(self.url), self.membership.id)

    def request_handler(
        self, executor: AgentExecutor, card: pb.AgentCard, *, board: TaskBoard | None,
        push_sender: PushNotificationSender, push_url_validator: PushUrlValidator,
    ) -> ClusterRequestHandler:
        """The SDK's handler over these stores, with the event stream and the cancel relay;
        ``board`` (the dashboard) sees every save this coordinator makes."""
        if board is not None:
            self.tasks.on_saved = board.observe
        self._handler = ClusterRequestHandler(
            executor, self.tasks, card, push_config_store=self.push_configs,
            push_sender=push_sender, push_url_validator=push_url_validator,
            event_stream=self.events, stores=self)
        return self._handler

    async def mark_interrupted(self, *, is_shutdown: bool = False) -> list[str]:
        """The restart sweep across coordinators; returns the ids it marked failed. At start:
        every non-terminal task whose runner is not alive, then (every ``sweep_s``) the
        runs of every coordinator that died since. At shutdown: this coordinator's own."""
        if is_shutdown:
            await self._stop_sweeper()
            return await self._mark_runs_of({self.membership.id})
        marked = await self._mark_orphans()
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep_forever(), name="task-store-sweeper")
        return marked

    async def announce_cancel(self, task_id: str) -> None:
        """Tell every other coordinator that ``task_id`` was cancelled (``NOTIFY``)."""
        await _execute(self.engine, "SELECT pg_notify(:channel, :payload)",
                       channel=CANCELS_CHANNEL, payload=f"{self.membership.id}:{task_id}")

    async def owner_of_task(self, task_id: str) -> str | None:
        """The owner column of ``task_id`` (``None``: no such task)."""
        rows = await _rows(self.engine, select(TaskModel.owner).where(TaskModel.id == task_id))
        return (rows[0][0] or "") if rows else None

    async def aclose(self) -> None:
        await self._stop_sweeper()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        try:
            await self.membership.leave()
        finally:
            await self.engine.dispose()

    # ------------------------------------------------------------------ the sweep

    async def _mark_orphans(self) -> list[str]:
        """Every non-terminal task whose runner is not alive (none, or its lock is free)."""
        rows = await _rows(self.engine, "SELECT t.id, t.owner, r.coordinator_id FROM tasks t "
                           "LEFT JOIN mesh_task_runs r ON r.task_id = t.id "
                           "WHERE NOT ((t.status ->> 'state') = ANY(:terminal))",
                           terminal=sorted(TERMINAL_NAMES))
        seats = {int(seat) for _, _, seat in rows if seat is not None}
        seats.discard(self.membership.id)
        dead = await _dead_among(self.engine, seats)
        live = (seats - dead) | {self.membership.id}
        marked = [task_id for task_id, owner, seat in rows
                  if (seat is None or seat not in live)
                  and await self._fail(task_id, owner or "")]
        await self._forget_seats(dead)
        return marked

    async def _sweep_forever(self) -> None:
        loop = asyncio.get_running_loop()
        next_prune = loop.time() + _PRUNE_EVERY_S
        while True:
            await asyncio.sleep(self.sweep_s)
            try:
                if loop.time() >= next_prune:
                    next_prune = loop.time() + _PRUNE_EVERY_S
                    await self._prune_events()
                seats = {int(seat) for (seat,) in await _rows(
                    self.engine, "SELECT id FROM mesh_coordinators WHERE id <> :me",
                    me=self.membership.id)}
                dead = await _dead_among(self.engine, seats)
                if dead:
                    marked = await self._mark_runs_of(dead)
                    logger.warning("coordinator(s) %s gone: marked %d task(s) failed: %s",
                                   sorted(dead), len(marked), INTERRUPTED_REASON)
                    await self._forget_seats(dead)
                if self.membership.is_lost:
                    self.events.wake_all()
            except asyncio.CancelledError:
                raise
            except Exception:  # a sweep that fails is retried at the next tick
                logger.exception("the task-store sweep failed; retrying in %.1f s",
                                 self.sweep_s)

    async def _prune_events(self) -> None:
        """Delete the event log of tasks finished over ``_PRUNE_AFTER_S`` ago (a finished
        task cannot be resubscribed to; its tails have read its end)."""
        await _execute(
            self.engine, "DELETE FROM task_events e USING tasks t WHERE e.task_id = t.id "
            "AND (t.status ->> 'state') = ANY(:terminal) "
            "AND t.last_updated < (now() AT TIME ZONE 'utc') - make_interval(secs => :s)",
            terminal=sorted(TERMINAL_NAMES), s=_PRUNE_AFTER_S)

    async def _mark_runs_of(self, seats: set[int]) -> list[str]:
        rows = await _rows(self.engine, "SELECT r.task_id, t.owner FROM mesh_task_runs r "
                           "JOIN tasks t ON t.id = r.task_id "
                           "WHERE r.coordinator_id = ANY(:seats)", seats=sorted(seats))
        return [task_id for task_id, owner in rows if await self._fail(task_id, owner or "")]

    async def _forget_seats(self, seats: set[int]) -> None:
        if not seats:
            return
        await _execute(self.engine, "DELETE FROM mesh_task_runs WHERE coordinator_id = ANY(:s)",
                       "DELETE FROM mesh_coordinators WHERE id = ANY(:s)", s=sorted(seats))

    async def _fail(self, task_id: str, owner: str) -> bool:
        """Write ``task_id`` failed (interrupted) unless it is terminal already; the event
        goes to ``task_events`` with it, so tails elsewhere see the end."""
        context = owner_context(owner)
        for _ in range(5):
            stored = await self.tasks.get(task_id, context)
            if stored is None or stored.task.status.state in TERMINAL_STATES:
                return False
            task = pb.Task()
            task.CopyFrom(stored.task)
            status = interrupted_status(task)
            task.status.CopyFrom(status)
            event = pb.TaskStatusUpdateEvent(task_id=task_id, context_id=task.context_id,
                                             status=status)
            try:
                await self.tasks.save(task, event=event, prev=stored.task,
                                      prev_version=stored.version, context=context)
                return True
            except ConcurrentTaskModificationError:
                continue  # its runner wrote meanwhile: read again
        return False

    async def _stop_sweeper(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None

    # ------------------------------------------------------------------ notifications

    def _heard_cancel(self, task_id: str) -> None:
        if self._handler is None:
            return
        task = asyncio.get_running_loop().create_task(self._handler.cancel_here(task_id),
                                                      name=f"cancel-{task_id}")
        self._background.add(task)
        task.add_done_callback(self._cancelled_here)

    def _cancelled_here(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("cancelling a task announced by another coordinator failed",
                         exc_info=task.exception())


def _is_connect_error(exc: BaseException) -> bool:
    """Whether ``exc`` (SQLAlchemy-wrapped or raw asyncpg) means "could not log in or
    connect" rather than a bad statement."""
    seen: BaseException | None = exc
    while seen is not None:
        name = type(seen).__name__
        if isinstance(seen, OSError | TimeoutError) or name in (
            "InvalidPasswordError", "InvalidAuthorizationSpecificationError",
            "InvalidCatalogNameError", "CannotConnectNowError", "ConnectionDoesNotExistError",
        ):
            return True
        seen = seen.__cause__ or getattr(seen, "orig", None)
    return False

