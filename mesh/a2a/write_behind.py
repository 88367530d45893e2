"""A write-behind SQLite ``TaskStore``: coalesced writes by one writer thread, same rows.

The SDK's ``DatabaseTaskStore`` costs about a millisecond of event-loop time per operation
(SQLAlchemy statement building, the greenlet bridge, a thread hop to aiosqlite) and writes
the whole task on every event. :class:`WriteBehindTaskStore` keeps its rows, its table and
its ``list`` (inherited, so ListTasks paging, filters and owner scoping are the SDK's own)
and changes how rows get there:

* ``save`` snapshots the task (protobuf bytes) into a per-task pending slot and returns;
  a later save of the same task replaces the slot (coalescing), so a task that moves
  through ten working states in 50 ms is written once.
* One flusher coroutine hands the slots that are due to the
  :class:`~mesh.a2a.task_table.TaskTable`, whose one writer thread turns them into
  rows (protobuf JSON, as the SDK does) and commits them in small transactions (WAL,
  ``synchronous=NORMAL``).
* ``get`` is answered from the pending slots, then a bounded cache of recent snapshots,
  then the table's inline primary-key read.

Durability contract (what a caller may rely on when ``save`` returns):

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

"On disk" means committed in WAL mode with ``synchronous=NORMAL``: it survives the process
being killed (SIGKILL included); only an OS crash or power loss can drop the last commits.

This process must be the only writer of the table (the coordinator owns its data dir):
the cache and the pending slots are trusted over the file.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from a2a.server.context import ServerCallContext
from a2a.server.tasks import DatabaseTaskStore
from a2a.types import a2a_pb2 as pb
from sqlalchemy.ext.asyncio import AsyncEngine

from mesh.a2a.task_table import RowWrite, TaskTable

__all__ = ["TaskStoreWriteError", "WriteBehindTaskStore"]

logger = logging.getLogger(__name__)

# States the client acts on: their saves wait for the commit.
_SETTLED_STATES = frozenset(
    {
        pb.TaskState.TASK_STATE_COMPLETED,
        pb.TaskState.TASK_STATE_CANCELED,
        pb.TaskState.TASK_STATE_FAILED,
        pb.TaskState.TASK_STATE_REJECTED,
        pb.TaskState.TASK_STATE_INPUT_REQUIRED,
        pb.TaskState.TASK_STATE_AUTH_REQUIRED,
    }
)


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
    """The SDK's SQLite task store with coalesced, batched writes (see module docstring).

    ``engine`` and ``table`` must address the same SQLite file. ``initialize`` creates the
    table (SDK schema) and opens ``table``; ``aclose`` commits everything pending and
    closes it. ``flush`` waits until every save made before the call is committed.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        table: TaskTable,
        *,
        coalesce_s: float = 0.5,
        cache_size: int = 2048,
        **kwargs: Any,
    ) -> None:
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
        is_urgent = not is_stored or task.status.state in _SETTLED_STATES
        self._remember(task.id, snapshot)
        self._schedule(task.id, snapshot, is_urgent=is_urgent)
        if is_urgent:
            await self._wait_for_commit()

    async def get(self, task_id: str, context: ServerCallContext) -> pb.Task | None:
        await self._ensure_open()
        owner = self.owner_resolver(context)
        snapshot = self._latest(task_id)
        if snapshot is None:
            snapshot = self._read(task_id)
        if snapshot is None or snapshot.data is None or snapshot.owner != owner:
            return None
        task: pb.Task = pb.Task.FromString(snapshot.data)
        return task

    async def list(
        self, params: pb.ListTasksRequest, context: ServerCallContext
    ) -> pb.ListTasksResponse:
        """The SDK's own listing, over a table with nothing pending."""
        await self._ensure_open()
        await self.flush()
        return await super().list(params, context)

    async def delete(self, task_id: str, context: ServerCallContext) -> None:
        """Delete the caller's task (a task of another owner is left alone); durable."""
        await self._ensure_open()
        owner = self.owner_resolver(context)
        latest = self._latest(task_id) or self._read(task_id)
        if latest is None or latest.data is None or latest.owner != owner:
            return
        tombstone = _Snapshot(owner, None)
        self._cache.pop(task_id, None)
        self._schedule(task_id, tombstone, is_urgent=True)
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
        """Make ``snapshot`` the task's pending write (replacing any older one).

        An urgent snapshot is due now; any other keeps the due time of the pending
        snapshot it replaces, so a task saved continuously is still written every
        ``coalesce_s``, and a burst of other tasks' urgent saves does not drag it along.
        """
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
        if row is None or row.owner is None:  # a NULL owner matches no caller (as in the SDK)
            return None
        task = self._from_orm(self.task_model(**row._asdict()))
        snapshot = _Snapshot(row.owner, task.SerializeToString(), is_stored=True)
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
            batch = {
                task_id: snapshot
                for task_id, snapshot in self._pending.items()
                if take_all or snapshot.due <= now
            }
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
