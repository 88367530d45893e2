"""The SDK's tasks table spoken over raw ``sqlite3``: one writer thread, inline point reads.

Rows are exactly what the SDK's ``DatabaseTaskStore`` writes through SQLAlchemy (same
columns, protobuf JSON in the JSON columns, SQLAlchemy's text format for ``last_updated``),
so the SDK's own code can list and read them, and rows written by older versions of the
coordinator read back unchanged.

Threads: :meth:`TaskTable.write` runs on the table's one writer thread, on a connection
that only that thread touches (WAL, ``synchronous=NORMAL``, explicit transactions of at
most ``_ROWS_PER_TRANSACTION`` rows). :meth:`TaskTable.read` runs inline on the caller's
(the event loop's) thread on a read-only connection: a primary-key lookup takes tens of
microseconds, less than a hop to another thread would.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

from a2a.types import a2a_pb2 as pb
from google.protobuf.json_format import MessageToDict

__all__ = ["RowWrite", "StoredRow", "TaskTable"]

_COLUMNS = (
    "id, context_id, kind, owner, last_updated, status, artifacts, history, "
    "protocol_version, metadata"
)
_ROWS_PER_TRANSACTION = 128
_BUSY_TIMEOUT_MS = 30_000


class RowWrite(NamedTuple):
    """One write: the task (serialized ``pb.Task``) as ``owner``'s, or ``None``: delete."""

    task_id: str
    owner: str
    data: bytes | None


class StoredRow(NamedTuple):
    """A row as the SDK's ``TaskModel`` holds it (JSON columns decoded)."""

    id: str
    context_id: str
    kind: str
    owner: str | None
    status: Any
    artifacts: Any
    history: Any
    protocol_version: str | None
    task_metadata: Any


class TaskTable:
    """Raw access to the tasks table in ``db_path`` (the table must exist before ``open``)."""

    def __init__(self, db_path: Path, table: str = "tasks") -> None:
        self.db_path = db_path
        self.table = table
        self._writer: ThreadPoolExecutor | None = None
        self._write_conn: sqlite3.Connection | None = None  # the writer thread's only
        self._read_conn: sqlite3.Connection | None = None  # the opening thread's only
        self._upsert = (
            f"INSERT INTO {table} ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT(id) DO UPDATE SET context_id = excluded.context_id, "
            "kind = excluded.kind, owner = excluded.owner, "
            "last_updated = excluded.last_updated, status = excluded.status, "
            "artifacts = excluded.artifacts, history = excluded.history, "
            "protocol_version = excluded.protocol_version, metadata = excluded.metadata"
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
        """Commit ``writes`` in order on the writer thread; raises what SQLite raised.

        The rows are encoded on the writer thread too. A failure rolls back the
        transaction it happened in; earlier transactions of the call stay committed
        (rewriting them is harmless: every write is a whole row).
        """
        if self._writer is None:
            raise RuntimeError("the task table is not open")
        await asyncio.get_running_loop().run_in_executor(self._writer, self._write, writes)

    def read(self, task_id: str) -> StoredRow | None:
        """The committed row of ``task_id`` (any owner), or ``None``."""
        if self._read_conn is None:
            raise RuntimeError("the task table is not open")
        row = self._read_conn.execute(self._select, (task_id,)).fetchone()
        if row is None:
            return None
        task_id, context_id, kind, owner, _, status, artifacts, history, version, meta = row
        return StoredRow(
            task_id,
            context_id,
            kind,
            owner,
            _json_or_none(status),
            _json_or_none(artifacts),
            _json_or_none(history),
            version,
            _json_or_none(meta),
        )

    # ------------------------------------------------------------------ writer thread

    def _open_writer(self) -> None:
        conn = _connect(self.db_path)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        self._write_conn = conn

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


def _to_row(data: bytes, owner: str) -> tuple[Any, ...]:
    """The SDK's row for a task (``DatabaseTaskStore._to_orm`` as SQLAlchemy stores it)."""
    task = pb.Task.FromString(data)
    last_updated = (
        _sqlite_datetime(task.status.timestamp.ToDatetime())
        if task.status.HasField("timestamp")
        else None
    )
    metadata = MessageToDict(task.metadata) if task.metadata.fields else None
    return (
        task.id,
        task.context_id,
        "task",
        owner,
        last_updated,
        json.dumps(MessageToDict(task.status)),
        json.dumps([MessageToDict(a) for a in task.artifacts]),
        json.dumps([MessageToDict(m) for m in task.history]),
        "1.0",
        json.dumps(metadata),
    )


def _sqlite_datetime(value: datetime) -> str:
    # SQLAlchemy's storage format for DateTime on SQLite; ListTasks compares these strings.
    return value.strftime("%Y-%m-%d %H:%M:%S.") + f"{value.microsecond:06d}"


def _json_or_none(text: str | None) -> Any:
    return None if text is None else json.loads(text)
