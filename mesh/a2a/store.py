"""Task persistence: SQLite stores under the data dir, and the restart sweep.

This module is the embedded default; :mod:`mesh.a2a.postgres` keeps the same things in
PostgreSQL for several coordinators (``--task-store``). Both answer to :class:`TaskStores`,
all the app needs of them.

Tasks live in ``DATA_DIR/tasks.db``, in the SDK's schema: the tasks table is written by
:class:`~mesh.a2a.write_behind.WriteBehindTaskStore` (coalesced writes, terminal
states durable before they are published) and read by it and by the SDK's listing code;
push configs by the SDK's ``DatabasePushNotificationConfigStore``. Every row carries its
owner (the authenticated caller, ``""`` when auth is off), which is how callers are kept
apart: every read is filtered by ``owner_of(context)``.

Invariant kept by :func:`mark_interrupted`: after the coordinator starts (and again when it
shuts down), no task is left in a non-terminal state without a running executor behind it.
Such tasks are marked failed with :data:`INTERRUPTED_REASON`; nothing is deleted.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from a2a.auth.user import User
from a2a.server.context import ServerCallContext
from a2a.server.models import TaskModel
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.tasks import (
    DatabasePushNotificationConfigStore,
    PushNotificationConfigStore,
    PushNotificationSender,
)
from a2a.types import a2a_pb2 as pb
from sqlalchemy import event, select
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from mesh.a2a.task_table import TaskTable
from mesh.a2a.taskboard import ObservedTaskStore, TaskBoard
from mesh.a2a.write_behind import WriteBehindTaskStore

if TYPE_CHECKING:
    from a2a.server.agent_execution import AgentExecutor

    from mesh.a2a.push import PushUrlValidator

__all__ = [
    "INTERRUPTED_REASON",
    "CachedPushConfigStore",
    "OwnerUser",
    "Stores",
    "TaskStores",
    "mark_interrupted",
    "open_stores",
    "owner_context",
    "owner_of",
]

INTERRUPTED_REASON = "interrupted by restart"

# Both spellings: 1.0 rows store enum names, rows written by 0.3 code store short names.
_TERMINAL = frozenset(
    {
        "TASK_STATE_COMPLETED",
        "TASK_STATE_CANCELED",
        "TASK_STATE_FAILED",
        "TASK_STATE_REJECTED",
        "completed",
        "canceled",
        "failed",
        "rejected",
    }
)


class OwnerUser(User):
    """An authenticated A2A user standing for one owner scope (used by sweeps and tests)."""

    def __init__(self, name: str) -> None:
        self._name = name

    @property
    def is_authenticated(self) -> bool:
        return True

    @property
    def user_name(self) -> str:
        return self._name


def owner_of(context: ServerCallContext) -> str:
    """The owner scope of a call: the caller's name when authenticated, else ``""``."""
    user = context.user
    return user.user_name if user.is_authenticated else ""


def owner_context(owner: str) -> ServerCallContext:
    """A call context that reads and writes ``owner``'s tasks."""
    return ServerCallContext(user=OwnerUser(owner))


class CachedPushConfigStore(DatabasePushNotificationConfigStore):
    """The SDK's SQLite push-config store with the dispatch lookup answered from memory.

    The SDK looks up a task's push configs on every event (several per task); this process
    is the only writer, so two in-memory facts stay exact: the ids of the tasks that have
    (or had) a config row, loaded by ``initialize`` and grown by ``set_info`` — any other
    task has none, without a query — and a cache of the configs of recent tasks,
    invalidated by ``set_info``/``delete_info``. Memory: one id per task that ever set a
    push config.
    """

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

    async def set_info(
        self,
        task_id: str,
        notification_config: pb.TaskPushNotificationConfig,
        context: ServerCallContext,
    ) -> pb.TaskPushNotificationConfig:
        await self.initialize()
        if self._with_configs is not None:
            self._with_configs.add(task_id)
        self._dispatch.pop(task_id, None)
        try:
            return await super().set_info(task_id, notification_config, context)
        finally:
            self._dispatch.pop(task_id, None)

    async def delete_info(
        self, task_id: str, context: ServerCallContext, config_id: str | None = None
    ) -> None:
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

    ``initialize`` creates what is missing and connects (``ValueError`` naming the flag
    when the store cannot be reached); ``request_handler`` is the SDK's handler over the
    stores (``board``, the dashboard, sees every save); ``mark_interrupted`` is the
    restart sweep (at start, and with ``is_shutdown`` at shutdown: see
    :func:`mark_interrupted`); ``aclose`` commits what is pending and closes.
    """

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
        """The SDK's handler over these stores (one process: no event stream)."""
        return DefaultRequestHandler(
            executor,
            self.tasks if board is None else ObservedTaskStore(self.tasks, board),
            card,
            push_config_store=self.push_configs,
            push_sender=push_sender,
            push_url_validator=push_url_validator,
        )

    async def mark_interrupted(self, *, is_shutdown: bool = False) -> list[str]:
        """:func:`mark_interrupted`: this process is the file's only writer, so at start
        and at shutdown alike every non-terminal task has no executor behind it."""
        del is_shutdown
        return await mark_interrupted(self)

    async def aclose(self) -> None:
        try:
            await self.tasks.aclose()
        finally:
            await self.engine.dispose()


def _tune_sqlite(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets readers (GetTask, ListTasks) proceed while the executor writes; NORMAL sync
    # is durable across process crashes (only an OS crash can lose the last commits).
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def open_stores(data_dir: str | Path, *, coalesce_s: float = 0.05) -> Stores:
    """Build the stores on ``DATA_DIR/tasks.db``. No I/O until :meth:`Stores.initialize`.

    ``coalesce_s`` bounds how long an intermediate (working) state may wait in memory
    before it is written; first and final states are written before ``save`` returns.
    """
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
    return Stores(
        engine=engine,
        tasks=WriteBehindTaskStore(
            engine, TaskTable(db_path), coalesce_s=coalesce_s, owner_resolver=owner_of
        ),
        push_configs=CachedPushConfigStore(engine, owner_resolver=owner_of),
        db_path=db_path,
    )


async def mark_interrupted(stores: Stores, reason: str = INTERRUPTED_REASON) -> list[str]:
    """Mark every non-terminal task (of every owner) failed with ``reason``.

    Returns the ids it marked. Artifacts and history are kept as they were.
    """
    await stores.tasks.initialize()
    await stores.tasks.flush()  # the scan below reads the table, not the pending writes
    async with stores.engine.connect() as conn:
        rows = (await conn.execute(select(TaskModel.id, TaskModel.owner, TaskModel.status))).all()
    marked: list[str] = []
    for task_id, owner, status in rows:
        state = status.get("state") if isinstance(status, dict) else None
        if state in _TERMINAL:
            continue
        context = owner_context(owner or "")
        task = await stores.tasks.get(task_id, context)
        if task is None:
            continue
        status_message = pb.Message(
            message_id=f"{task_id}-interrupted",
            role=pb.Role.ROLE_AGENT,
            task_id=task_id,
            context_id=task.context_id,
            parts=[pb.Part(text=reason)],
        )
        task.status.CopyFrom(pb.TaskStatus(state=pb.TaskState.TASK_STATE_FAILED))
        task.status.message.CopyFrom(status_message)
        task.status.timestamp.FromDatetime(datetime.now(UTC))
        await stores.tasks.save(task, context)
        marked.append(task_id)
    return marked
