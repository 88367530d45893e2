"""Task persistence on SQLite (``DATA_DIR/tasks.db``): the task table, the write-behind
store over it, the dashboard's task board, and the stores as the app opens them
(:func:`open_stores`). :mod:`mesh.a2a.postgres` keeps the same in PostgreSQL; both answer
to :class:`TaskStores`.

:class:`TaskTable` speaks the SDK's tasks table over raw ``sqlite3``, writing exactly the
rows the SDK's ``DatabaseTaskStore`` writes (so the SDK lists and reads them): writes on one
writer thread and connection (WAL, ``synchronous=NORMAL``), reads inline on a read-only one.
:class:`WriteBehindTaskStore` keeps the SDK's rows and ``list`` but coalesces: ``save``
replaces the task's pending snapshot (ten working states in 50 ms are written once), one
flusher hands due snapshots to the writer, ``get`` answers from the pending snapshots, a
bounded cache, then the table. When ``save`` returns:

====================================  ============================================
save of                               durable when ``save`` returns?
====================================  ============================================
a task's first state (row not known   yes: awaits its commit, so a task id a client
to be in SQLite yet)                  has seen always survives a crash
a terminal or interrupted state       yes: awaits its commit, so the SDK publishes a
(completed, failed, input-required…)  final state only after it is on disk
any other (working) state             no: committed within ``coalesce_s``; a crash
                                      loses at most those intermediate states, and
                                      the restart sweep marks the task failed
====================================  ============================================

"On disk" survives the process being killed (SIGKILL included), not an OS crash. This
process must be the file's only writer: its cache and pending snapshots are trusted over it.

Every row carries its owner (the caller, ``""`` when auth is off); every read is filtered by
``owner_of(context)``. Invariant kept by :meth:`Stores.mark_interrupted`: after the
coordinator starts (and again when it shuts down), no task is left non-terminal without a
running executor; such tasks are marked failed with :data:`INTERRUPTED_REASON`, nothing is
deleted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from a2a.server.context import ServerCallContext
from a2a.server.models import TaskModel
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes.common import StarletteUser
from a2a.server.tasks import (
    DatabasePushNotificationConfigStore,
    DatabaseTaskStore,
    PushNotificationConfigStore,
    PushNotificationSender,
)
from a2a.types import a2a_pb2 as pb
from google.protobuf.json_format import MessageToDict
from sqlalchemy import event, select
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from starlette.authentication import SimpleUser

if TYPE_CHECKING:
    from a2a.server.agent_execution import AgentExecutor

__all__ = [
    "INTERRUPTED_REASON", "SETTLED_STATES", "TERMINAL_NAMES", "TERMINAL_STATES",
    "CachedPushConfigStore", "PushUrlValidator", "RowWrite", "Stores", "TaskBoard",
    "TaskStoreWriteError", "TaskStores", "TaskTable", "WriteBehindTaskStore", "interrupted_status",
    "open_stores", "owner_context", "owner_of",
]

# A push target's check (mesh.a2a.push makes the real one): defined here so push imports
# the store and never the other way round.
PushUrlValidator = Callable[[str], Awaitable[bool]]


# -------------------- the task table ------------------------------------------

_COLUMN_NAMES = ("id", "context_id", "kind", "owner", "last_updated", "status", "artifacts",
                 "history", "protocol_version", "metadata")
_COLUMNS = ", ".join(_COLUMN_NAMES)
_ROWS_PER_TRANSACTION = 128
_BUSY_TIMEOUT_MS = 30_000


class RowWrite(NamedTuple):
    """One write: the task (serialized ``pb.Task``) as ``owner``'s, or ``None``: delete."""

    task_id: str
    owner: str
    data: bytes | None


class TaskTable:
    """Raw access to the tasks table in ``db_path`` (the table must exist before ``open``)."""

    def __init__(self, db_path: Path, table: str = "tasks") -> None:
        self.db_path = db_path
        self.table = table
        self._writer: ThreadPoolExecutor | None = None
        self._write_conn: sqlite3.Connection | None = None  # the writer thread's only
        self._read_conn: sqlite3.Connection | None = None  # the opening thread's only
        self._upsert = (
            f"INSERT INTO {table} ({_COLUMNS}) VALUES ({', '.join('?' * len(_COLUMN_NAMES))}) "
            "ON CONFLICT(id) DO UPDATE SET "
            + ", ".join(f"{c} = excluded.{c}" for c in _COLUMN_NAMES[1:])
        )
        self._delete = f"DELETE FROM {table} WHERE id = ? AND owner = ?"
        self._select = f"SELECT {_COLUMNS} FROM {table} WHERE id = ?"

    async def open(self) -> None:
        """Start the writer thread and open both connections."""
        if self._writer is not None:
            return
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="task-writer")
        await asyncio.get_running_loop().run_in_executor(self._writer, self._open_writer)
        self._read_conn = _connect(self.db_path)
        self._read_conn.execute("PRAGMA query_only=ON")

    async def close(self) -> None:
        """Close both connections and stop the writer thread. Idempotent."""
        if self._writer is not None:
            await asyncio.get_running_loop().run_in_executor(self._writer, self._close_writer)
            self._writer.shutdown(wait=True)
            self._writer = None
        if self._read_conn is not None:
            self._read_conn.close()
            self._read_conn = None

    async def write(self, writes: Sequence[RowWrite]) -> None:
        """Commit ``writes`` in order (encoded, too) on the writer thread; raises what SQLite
        raised. A failure rolls back its transaction; earlier ones of the call stay
        committed (rewriting them is harmless: every write is a whole row)."""
        if self._writer is None:
            raise RuntimeError("the task table is not open")
        await asyncio.get_running_loop().run_in_executor(self._writer, self._write, writes)

    def read(self, task_id: str) -> dict[str, Any] | None:
        """The committed row of ``task_id`` (any owner) as the SDK's ``TaskModel`` keywords
        (JSON columns decoded), or ``None``."""
        if self._read_conn is None:
            raise RuntimeError("the task table is not open")
        row = self._read_conn.execute(self._select, (task_id,)).fetchone()
        if row is None:
            return None
        fields = dict(zip(_COLUMN_NAMES, row, strict=True))
        del fields["last_updated"]
        for key in ("status", "artifacts", "history"):
            fields[key] = _json_or_none(fields[key])
        fields["task_metadata"] = _json_or_none(fields.pop("metadata"))
        return fields

    # ------------------------------------------------------------------ writer thread

    def _open_writer(self) -> None:
        self._write_conn = _connect(self.db_path)
        _tune_sqlite(self._write_conn, None)

    def _close_writer(self) -> None:
        if self._write_conn is not None:
            self._write_conn.close()
            self._write_conn = None

    def _write(self, writes: Sequence[RowWrite]) -> None:
        conn = self._write_conn
        if conn is None:
            raise RuntimeError("the task table's writer connection is closed")
        for start in range(0, len(writes), _ROWS_PER_TRANSACTION):
            try:
                conn.execute("BEGIN IMMEDIATE")
                for write in writes[start : start + _ROWS_PER_TRANSACTION]:
                    if write.data is None:
                        conn.execute(self._delete, (write.task_id, write.owner))
                    else:
                        conn.execute(self._upsert, _to_row(write.data, write.owner))
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise


def _connect(path: Path) -> sqlite3.Connection:
    # Autocommit mode: the writer opens its transactions explicitly.
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=True)
    conn.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
    return conn


def _tune_sqlite(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets readers (GetTask, ListTasks) proceed while the executor writes; NORMAL sync
    # is durable across process crashes (only an OS crash can lose the last commits).
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
    cursor.close()


def _to_row(data: bytes, owner: str) -> tuple[Any, ...]:
    """The SDK's row for a task (``DatabaseTaskStore._to_orm`` as SQLAlchemy stores it)."""
    task = pb.Task.FromString(data)
    last_updated = (_sqlite_datetime(task.status.timestamp.ToDatetime())
                    if task.status.HasField("timestamp") else None)
    metadata = MessageToDict(task.metadata) if task.metadata.fields else None
    return (task.id, task.context_id, "task", owner, last_updated,
            json.dumps(MessageToDict(task.status)),
            json.dumps([MessageToDict(a) for a in task.artifacts]),
            json.dumps([MessageToDict(m) for m in task.history]), "1.0", json.dumps(metadata))


def _sqlite_datetime(value: datetime) -> str:
    # SQLAlchemy's storage format for DateTime on SQLite; ListTasks compares these strings.
    return value.strftime("%Y-%m-%d %H:%M:%S.") + f"{value.microsecond:06d}"


def _json_or_none(text: str | None) -> Any:
    return None if text is None else json.loads(text)

# -------------------- write-behind --------------------------------------------

logger = logging.getLogger(__name__)

#: The final states: no executor runs behind a task in one.
TERMINAL_STATES = frozenset({
    pb.TaskState.TASK_STATE_COMPLETED, pb.TaskState.TASK_STATE_CANCELED,
    pb.TaskState.TASK_STATE_FAILED, pb.TaskState.TASK_STATE_REJECTED,
})
#: The terminal states' names, as rows store them (the status's proto JSON).
TERMINAL_NAMES = frozenset(pb.TaskState.Name(s) for s in TERMINAL_STATES)
#: The states the client acts on (final, or waiting for it): their saves wait for the commit.
SETTLED_STATES = TERMINAL_STATES | {
    pb.TaskState.TASK_STATE_INPUT_REQUIRED, pb.TaskState.TASK_STATE_AUTH_REQUIRED,
}


class TaskStoreWriteError(RuntimeError):
    """A batch of task writes could not be committed (the cause is chained)."""


@dataclass(slots=True)
class _Snapshot:
    """A task as last saved (``data`` is ``None`` for a delete), keyed by task id."""

    owner: str
    data: bytes | None
    is_stored: bool = False  # some state of this task is known to be committed
    due: float = 0.0  # loop time by which a pending snapshot must be handed to the writer


class WriteBehindTaskStore(DatabaseTaskStore):
    """The SDK's SQLite task store with coalesced, batched writes (see module docstring);
    ``engine`` and ``table`` must address the same SQLite file."""

    def __init__(self, engine: AsyncEngine, table: TaskTable, *, coalesce_s: float = 0.5,
                 cache_size: int = 2048, **kwargs: Any) -> None:
        super().__init__(engine, table_name=table.table, **kwargs)
        self._table = table
        self._coalesce_s = coalesce_s
        self._cache_size = cache_size
        # Every save lands in _pending; the flusher moves the snapshots that are due to
        # _inflight while the writer commits them. Reads look in _pending, _inflight,
        # _cache, then the file: each holds a state no older than the ones after it, so a
        # read never sees an older state than the last save.
        self._pending: dict[str, _Snapshot] = {}
        self._inflight: dict[str, _Snapshot] = {}
        self._cache: OrderedDict[str, _Snapshot] = OrderedDict()
        # Waiters of the next batch; every snapshot pending when one was added is due at
        # once (urgent saves) or, with _take_all, every pending snapshot (flush).
        self._waiters: list[asyncio.Future[None]] = []
        self._take_all = False
        self._dirty = asyncio.Event()  # something is pending
        self._urgent = asyncio.Event()  # a waiter is waiting
        self._flusher: asyncio.Task[None] | None = None
        self._is_closed = False
        self._opening = asyncio.Lock()
        self.on_saved: Callable[[pb.Task], None] | None = None  # sees every accepted save

    # ------------------------------------------------------------------ lifecycle

    async def initialize(self) -> None:
        """Create the table (idempotent), open it and start the flusher."""
        async with self._opening:
            if self._is_closed:
                raise RuntimeError("the task store is closed")
            if self._flusher is not None:
                return
            await super().initialize()
            await self._table.open()
            self._flusher = asyncio.create_task(self._run_flusher(), name="task-store-flusher")

    async def aclose(self) -> None:
        """Commit everything pending, then close the table. Idempotent."""
        if self._is_closed:
            return
        try:
            if self._flusher is not None:
                await self.flush()
        finally:
            self._is_closed = True
            if self._flusher is not None:
                self._flusher.cancel()
                with suppress(asyncio.CancelledError):
                    await self._flusher
                self._flusher = None
            await self._table.close()

    async def flush(self) -> None:
        """Wait until every save and delete made before this call is committed."""
        if not self._pending and not self._inflight:
            return
        self._take_all = True
        await self._wait_for_commit()

    # ------------------------------------------------------------------ TaskStore

    async def save(self, task: pb.Task, context: ServerCallContext) -> None:
        """Snapshot ``task``; wait for the commit only where the table above says so."""
        await self._ensure_open()
        owner = self.owner_resolver(context)
        previous = self._latest(task.id)
        is_stored = previous is not None and previous.is_stored and previous.owner == owner
        snapshot = _Snapshot(owner, task.SerializeToString(), is_stored)
        is_urgent = not is_stored or task.status.state in SETTLED_STATES
        self._remember(task.id, snapshot)
        self._schedule(task.id, snapshot, is_urgent=is_urgent)
        if is_urgent:
            await self._wait_for_commit()
        if self.on_saved is not None:
            self.on_saved(task)

    async def get(self, task_id: str, context: ServerCallContext) -> pb.Task | None:
        await self._ensure_open()
        owner = self.owner_resolver(context)
        snapshot = self._latest(task_id) or self._read(task_id)
        if snapshot is None or snapshot.data is None or snapshot.owner != owner:
            return None
        task: pb.Task = pb.Task.FromString(snapshot.data)
        return task

    async def list(self, params: pb.ListTasksRequest,
                   context: ServerCallContext) -> pb.ListTasksResponse:
        """The SDK's own listing, over a table with nothing pending."""
        await self._ensure_open()
        await self.flush()
        return await super().list(params, context)

    async def delete(self, task_id: str, context: ServerCallContext) -> None:
        """Delete the caller's task (a task of another owner is left alone); durable."""
        if await self.get(task_id, context) is None:
            return
        self._cache.pop(task_id, None)
        self._schedule(task_id, _Snapshot(self.owner_resolver(context), None), is_urgent=True)
        await self._wait_for_commit()

    # ------------------------------------------------------------------ event-loop side

    async def _ensure_open(self) -> None:
        if self._flusher is None:
            await self.initialize()

    def _latest(self, task_id: str) -> _Snapshot | None:
        return self._pending.get(task_id) or self._inflight.get(task_id) or self._cache.get(task_id)

    def _remember(self, task_id: str, snapshot: _Snapshot) -> None:
        self._cache[task_id] = snapshot
        self._cache.move_to_end(task_id)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    def _schedule(self, task_id: str, snapshot: _Snapshot, *, is_urgent: bool) -> None:
        """Make ``snapshot`` the task's pending write. An urgent one is due now; any other
        keeps the due time of the one it replaces, so a task saved continuously is still
        written every ``coalesce_s``, whatever other tasks' urgent saves do."""
        if self._is_closed or self._flusher is None:
            raise RuntimeError("the task store is not open")
        previous = self._pending.pop(task_id, None)
        if is_urgent:
            snapshot.due = 0.0
        elif previous is not None:
            snapshot.due = previous.due
        else:
            snapshot.due = asyncio.get_running_loop().time() + self._coalesce_s
        self._pending[task_id] = snapshot
        self._dirty.set()

    async def _wait_for_commit(self) -> None:
        if self._is_closed or self._flusher is None or self._flusher.done():
            raise RuntimeError("the task store is not open")
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._dirty.set()
        self._urgent.set()
        await waiter

    def _read(self, task_id: str) -> _Snapshot | None:
        """The committed state of a task not in memory (decoded by the SDK); cached."""
        row = self._table.read(task_id)
        if row is None or row["owner"] is None:  # a NULL owner matches no caller (as the SDK)
            return None
        task = self._from_orm(self.task_model(**row))
        snapshot = _Snapshot(row["owner"], task.SerializeToString(), is_stored=True)
        self._remember(task_id, snapshot)
        return snapshot

    async def _run_flusher(self) -> None:
        """Hand due snapshots to the table, one batch at a time, in save order."""
        loop = asyncio.get_running_loop()
        while True:
            await self._dirty.wait()
            if not self._waiters and self._pending:
                # Only intermediate states are waiting: let them coalesce until the first
                # is due, unless a save that must be durable arrives first.
                delay = min(s.due for s in self._pending.values()) - loop.time()
                if delay > 0:
                    with suppress(TimeoutError):
                        async with asyncio.timeout(delay):
                            await self._urgent.wait()
            self._dirty.clear()
            self._urgent.clear()
            now = loop.time()
            take_all, self._take_all = self._take_all, False
            batch = {task_id: snapshot for task_id, snapshot in self._pending.items()
                     if take_all or snapshot.due <= now}
            for task_id in batch:
                del self._pending[task_id]
            if self._pending:
                self._dirty.set()  # the rest comes due later
            waiters, self._waiters = self._waiters, []
            self._inflight = batch
            try:
                if batch:
                    await self._table.write(
                        [RowWrite(task_id, s.owner, s.data) for task_id, s in batch.items()]
                    )
            except Exception as e:
                logger.exception("committing %d task write(s) failed", len(batch))
                # Retried after coalesce_s, unless a newer save replaces them first. Their
                # waiters fail now: a caller is never told a failed write is durable.
                retry_at = loop.time() + self._coalesce_s
                for task_id, snapshot in batch.items():
                    if task_id not in self._pending:
                        snapshot.due = retry_at
                        self._pending[task_id] = snapshot
                self._dirty.set()
                error = TaskStoreWriteError(f"committing {len(batch)} task write(s) failed")
                error.__cause__ = e
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_exception(error)
            else:
                for task_id, snapshot in batch.items():
                    if snapshot.data is None:
                        continue
                    snapshot.is_stored = True
                    cached = self._cache.get(task_id)
                    if cached is not None and cached.owner == snapshot.owner:
                        cached.is_stored = True
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_result(None)
            finally:
                self._inflight = {}

# -------------------- the task board ------------------------------------------

_PREFIX = "TASK_STATE_"
_BOARD_TERMINAL = frozenset(name.removeprefix(_PREFIX).lower() for name in TERMINAL_NAMES)
_QUEUED = frozenset({"submitted", "unspecified"})


@dataclass(slots=True)
class _Row:
    id: str
    state: str
    first_seen: float
    last_seen: float

    def as_dict(self, now: float) -> dict[str, Any]:
        terminal = self.state in _BOARD_TERMINAL
        # A finished task's age is how long it ran; a live one's is how long it has existed.
        age = (self.last_seen if terminal else now) - self.first_seen
        return {"id": self.id, "state": self.state, "ageS": round(max(age, 0.0), 3)}


class TaskBoard:
    """The dashboard's view (fed by a task store's ``on_saved``): live tasks (at most
    ``max_live``) and the last ``max_recent`` finished ones."""

    def __init__(self, *, max_live: int = 256, max_recent: int = 20,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_live < 1 or max_recent < 1:
            raise ValueError("TaskBoard needs max_live >= 1 and max_recent >= 1")
        self._max_live = max_live
        self._live: OrderedDict[str, _Row] = OrderedDict()
        self._recent: deque[_Row] = deque(maxlen=max_recent)
        self._clock = clock
        self.finished_total = 0

    def observe(self, task: pb.Task) -> None:
        """Record the state ``task`` was just saved in."""
        self.update(task.id, pb.TaskState.Name(task.status.state).removeprefix(_PREFIX).lower())

    def update(self, task_id: str, state: str) -> None:
        """Record ``task_id`` in ``state`` (a lower-case A2A state name)."""
        now = self._clock()
        row = self._live.get(task_id)
        if state in _BOARD_TERMINAL:
            if row is None:
                if any(r.id == task_id for r in self._recent):
                    return  # a finished task saved again (e.g. an artifact flush)
                row = _Row(task_id, state, now, now)
            else:
                del self._live[task_id]
            row.state, row.last_seen = state, now
            self._recent.append(row)
            self.finished_total += 1
            return
        if row is None:
            self._live[task_id] = _Row(task_id, state, now, now)
            while len(self._live) > self._max_live:
                self._live.popitem(last=False)  # the oldest; bounded whatever happens
        else:
            row.state, row.last_seen = state, now

    def snapshot(self) -> dict[str, Any]:
        """``{running, queued, finishedTotal, live: [...], recent: [...]}``; rows are
        ``{id, state, ageS}``, recent ones newest first."""
        now = self._clock()
        live = list(self._live.values())
        queued = sum(1 for r in live if r.state in _QUEUED)
        return {
            "running": len(live) - queued,
            "queued": queued,
            "finishedTotal": self.finished_total,
            "live": [r.as_dict(now) for r in live],
            "recent": [r.as_dict(now) for r in reversed(self._recent)],
        }


# -------------------- the stores ----------------------------------------------

INTERRUPTED_REASON = "interrupted by restart"


def owner_of(context: ServerCallContext) -> str:
    """The owner scope of a call: the caller's name when authenticated, else ``""``."""
    user = context.user
    return user.user_name if user.is_authenticated else ""


def owner_context(owner: str) -> ServerCallContext:
    """A call context that reads and writes ``owner``'s tasks."""
    return ServerCallContext(user=StarletteUser(SimpleUser(owner)))


class CachedPushConfigStore(DatabasePushNotificationConfigStore):
    """The SDK's SQLite push-config store with the per-event dispatch lookup answered from
    memory. This process is the only writer, so two facts stay exact: the ids of the tasks
    that have (or had) a config row (loaded by ``initialize``, grown by ``set_info``; any
    other task has none) and a cache of recent tasks' configs (invalidated on writes)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._dispatch: dict[str, list[pb.TaskPushNotificationConfig]] = {}
        self._with_configs: set[str] | None = None  # None until initialize() loads it

    async def initialize(self) -> None:
        await super().initialize()
        if self._with_configs is None:
            async with self.engine.connect() as conn:
                rows = await conn.execute(select(self.config_model.task_id).distinct())
                loaded = {task_id for (task_id,) in rows}
            # Merged, not assigned: a concurrent first call may have loaded and grown it.
            self._with_configs = loaded | (self._with_configs or set())

    async def set_info(self, task_id: str, notification_config: pb.TaskPushNotificationConfig,
                       context: ServerCallContext) -> pb.TaskPushNotificationConfig:
        await self.initialize()
        if self._with_configs is not None:
            self._with_configs.add(task_id)
        self._dispatch.pop(task_id, None)
        try:
            return await super().set_info(task_id, notification_config, context)
        finally:
            self._dispatch.pop(task_id, None)

    async def delete_info(self, task_id: str, context: ServerCallContext,
                          config_id: str | None = None) -> None:
        self._dispatch.pop(task_id, None)
        try:
            await super().delete_info(task_id, context, config_id)
        finally:
            self._dispatch.pop(task_id, None)

    async def get_info_for_dispatch(self, task_id: str) -> list[pb.TaskPushNotificationConfig]:
        await self.initialize()
        if self._with_configs is not None and task_id not in self._with_configs:
            return []
        cached = self._dispatch.get(task_id)
        if cached is None:
            cached = list(await super().get_info_for_dispatch(task_id))
            if len(self._dispatch) >= _DISPATCH_CACHE_MAX:
                self._dispatch.pop(next(iter(self._dispatch)))
            self._dispatch[task_id] = cached
        return list(cached)


_DISPATCH_CACHE_MAX = 4096


class TaskStores(Protocol):
    """Where a coordinator keeps tasks, push configs and their owners: what the app needs.
    ``initialize`` creates what is missing and connects (``ValueError`` naming the flag if
    it cannot); ``request_handler`` is the SDK's handler over the stores (``board`` sees
    every save); ``mark_interrupted`` is the restart sweep (at start, and with
    ``is_shutdown`` at shutdown); ``aclose`` commits what is pending and closes."""

    @property
    def push_configs(self) -> PushNotificationConfigStore: ...

    async def initialize(self) -> None: ...

    def request_handler(
        self, executor: AgentExecutor, card: pb.AgentCard, *, board: TaskBoard | None,
        push_sender: PushNotificationSender, push_url_validator: PushUrlValidator,
    ) -> DefaultRequestHandler: ...

    async def mark_interrupted(self, *, is_shutdown: bool = False) -> list[str]: ...

    async def aclose(self) -> None: ...


@dataclass
class Stores:
    """The engine and the two stores on ``db_path``. ``aclose`` flushes and closes them."""

    engine: AsyncEngine
    tasks: WriteBehindTaskStore
    push_configs: CachedPushConfigStore
    db_path: Path

    async def initialize(self) -> None:
        """Create the data dir and the tables (idempotent)."""
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        await self.tasks.initialize()
        await self.push_configs.initialize()

    def request_handler(
        self, executor: AgentExecutor, card: pb.AgentCard, *, board: TaskBoard | None,
        push_sender: PushNotificationSender, push_url_validator: PushUrlValidator,
    ) -> DefaultRequestHandler:
        if board is not None:
            self.tasks.on_saved = board.observe
        return DefaultRequestHandler(executor, self.tasks, card,
                                     push_config_store=self.push_configs,
                                     push_sender=push_sender, push_url_validator=push_url_validator)

    async def mark_interrupted(self, *, is_shutdown: bool = False) -> list[str]:
        """Mark every non-terminal task (of every owner) failed (interrupted), keeping its
        artifacts and history; returns the ids marked. This process is the file's only
        writer: at start and at shutdown alike, no executor runs behind such a task."""
        del is_shutdown
        await self.tasks.initialize()
        await self.tasks.flush()  # the scan below reads the table, not the pending writes
        async with self.engine.connect() as conn:
            rows = (await conn.execute(select(TaskModel.id, TaskModel.owner, TaskModel.status))
                    ).all()
        marked: list[str] = []
        for task_id, owner, status in rows:
            state = status.get("state") if isinstance(status, dict) else None
            if state in TERMINAL_NAMES:
                continue
            context = owner_context(owner or "")
            task = await self.tasks.get(task_id, context)
            if task is None:
                continue
            task.status.CopyFrom(interrupted_status(task))
            await self.tasks.save(task, context)
            marked.append(task_id)
        return marked

    async def aclose(self) -> None:
        try:
            await self.tasks.aclose()
        finally:
            await self.engine.dispose()


def open_stores(data_dir: str | Path, *, coalesce_s: float = 0.05) -> Stores:
    """Build the stores on ``DATA_DIR/tasks.db``; no I/O until :meth:`Stores.initialize`.
    ``coalesce_s`` bounds how long an intermediate (working) state may wait in memory."""
    db_path = Path(data_dir).expanduser().resolve() / "tasks.db"
    # The engine serves the push configs and the task listing; task rows are written by
    # the task store's own writer thread. One connection: SQLite serializes writers
    # anyway, and waiting in the pool's async queue is cheap where SQLITE_BUSY retries
    # sleep (up to 100 ms each) under contention.
    engine = create_async_engine(
        f"sqlite+aiosqlite:///{db_path}",
        pool_size=1,
        max_overflow=0,
        pool_timeout=60,
        # Sessions end their own transactions; the pool's extra rollback is one more
        # thread round-trip per checkout.
        pool_reset_on_return=None,
    )
    event.listen(engine.sync_engine, "connect", _tune_sqlite)
    tasks = WriteBehindTaskStore(engine, TaskTable(db_path), coalesce_s=coalesce_s,
                                 owner_resolver=owner_of)
    return Stores(engine, tasks, CachedPushConfigStore(engine, owner_resolver=owner_of), db_path)


def interrupted_status(task: pb.Task) -> pb.TaskStatus:
    """``task`` failed now with :data:`INTERRUPTED_REASON` (the restart sweeps)."""
    status = pb.TaskStatus(state=pb.TaskState.TASK_STATE_FAILED, message=pb.Message(
        message_id=f"{task.id}-interrupted", role=pb.Role.ROLE_AGENT, task_id=task.id,
        context_id=task.context_id, parts=[pb.Part(text=INTERRUPTED_REASON)]))
    status.timestamp.FromDatetime(datetime.now(UTC))
    return status
